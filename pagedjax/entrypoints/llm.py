"""LLM: the offline API (vLLM's names)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedjax import envs
from pagedjax.core.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedjax.engine.core_client import SyncMPClient
from pagedjax.engine.llm_engine import LLMEngine, PromptType
from pagedjax.engine_args import EngineArgs
from pagedjax.entrypoints.chat_utils import ChatMessage, apply_chat_template, load_chat_template
from pagedjax.model_loader.tokenizer import default_sampling_kwargs
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Generate for a batch of prompts with continuous batching over a paged KV cache.

    >>> llm = LLM(model="path/to/hf_checkpoint", backend="jax")
    >>> outs = llm.generate(["def fib(n):"], SamplingParams(max_tokens=32, temperature=0))
    >>> print(outs[0].outputs[0].text)
    """

    def __init__(self, model: str, *, multiprocess: bool | None = None, **kwargs: Any) -> None:
        """kwargs: EngineArgs' options under vLLM's names (backend, dtype, max_model_len,
        gpu_memory_utilization, max_num_seqs, speculative_config, ...). multiprocess: the
        engine core in a process of its own, as the server's (vLLM V1's default), so that text
        and outputs are built while it steps; default: in this process, or as
        PAGEDJAX_ENGINE_CORE_PROCESS says."""
        engine_args = EngineArgs.from_kwargs(model, **kwargs)
        if multiprocess is None:
            multiprocess = bool(envs.PAGEDJAX_ENGINE_CORE_PROCESS)
        self.engine: LLMEngine | SyncMPClient = (
            SyncMPClient(engine_args.create_engine_config()) if multiprocess
            else LLMEngine(engine_args.create_engine_config()))
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (temperature,
        top_p, top_k, min_p, max_new_tokens), as vLLM's."""
        return SamplingParams(**default_sampling_kwargs(self.engine.config.model))

    def shutdown(self) -> None:
        """Free this LLM's device memory now (also done by `del llm` and at exit)."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def __del__(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.shutdown()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in input order. Invalid prompts raise before anything is queued."""
        if self.engine is None:
            raise RuntimeError("this LLM was shut down; make a new one")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} "
                             "prompts; pass one, or one per prompt.")
        # One output per request, at its end: nothing is rebuilt step after step.
        sampling_params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                           for p in sampling_params]
        return self._run(self._add(prompts, sampling_params), use_tqdm)

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam-search each prompt (vLLM's API): its beams run inside the engine, batched with
        each other and sharing their common blocks; scores and stopping follow HF's
        generate(num_beams=...). Prompts: text, {"prompt": text} or {"prompt_token_ids": [...]}.
        Returns, per prompt, its beam_width beams best first, each with the prompt's tokens."""
        if self.engine is None:
            raise RuntimeError("this LLM was shut down; make a new one")
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params={params!r} must be a BeamSearchParams.")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = [p["prompt"] if isinstance(p, dict) and "prompt_token_ids" not in p
                   and "prompt" in p else p for p in prompts]
        outputs = self._run(self._add(prompts, [params] * len(prompts)), use_tqdm)
        return [BeamSearchOutput([
            BeamSearchSequence(tokens=out.prompt_token_ids + c.token_ids, logprobs=c.logprobs,
                               cum_logprob=c.cumulative_logprob, text=c.text,
                               finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for c in out.outputs]) for out in outputs]

    def _add(self, prompts: Sequence[PromptType],
             params: Sequence[SamplingParams | BeamSearchParams]) -> list[str]:
        """Queue one request per prompt; if one is invalid, none stays queued."""
        ids = [f"gen-{next(self._request_ids)}" for _ in prompts]
        added = []
        try:
            for request_id, prompt, request_params in zip(ids, prompts, params):
                self.engine.add_request(request_id, prompt, request_params)
                added.append(request_id)
        except Exception:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        return ids

    def chat(self, messages: list[ChatMessage] | list[list[ChatMessage]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, each rendered by the
        tokenizer's chat template (or `chat_template`: a Jinja template, a file path, or a
        shipped template's name), with `tools` (OpenAI's function tools) passed to it. With a
        reasoning parser, each completion's text is also split into `reasoning_content` and
        `content`."""
        if self.engine is None:
            raise RuntimeError("this LLM was shut down; make a new one")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        template = load_chat_template(chat_template)
        if tools is not None:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        prompts = [apply_chat_template(self.engine.tokenizer, conversation,
                                       chat_template=template,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       chat_template_kwargs=chat_template_kwargs)
                   for conversation in conversations]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        name = self.engine.config.reasoning_parser
        if name is not None:
            from pagedjax.reasoning import ReasoningParserManager

            parser = ReasoningParserManager.get_reasoning_parser(name)(self.engine.tokenizer)
            for completion in (c for output in outputs for c in output.outputs):
                completion.reasoning_content, completion.content = (
                    parser.extract_reasoning_content(completion.text, None))
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        engine = self.engine
        start, start_tokens = time.perf_counter(), engine.num_generation_tokens
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
            elapsed = time.perf_counter() - start
            rate = (engine.num_generation_tokens - start_tokens) / max(elapsed, 1e-9)
            bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        bar.close()
        return [finished[i] for i in ids]

    def get_metrics(self) -> dict[str, int]:
        return self.engine.get_metrics()
