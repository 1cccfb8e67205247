"""LLMEngine: add requests, step the scheduler and a backend's runner, stream outputs."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagedjax.batch import ModelOutput, build_model_input
from pagedjax.block_manager import BlockManager
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.detokenizer import IncrementalDetokenizer
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.random import derive_seed
from pagedjax.sampling_params import SamplingParams
from pagedjax.scheduler import Scheduler, sampled_rows
from pagedjax.sequence import Sequence
from pagedjax.spec_decode import DraftProposer, SpeculativeConfig
from pagedjax.stopping import StopChecker
from pagedjax.tokenizer import load_eos_token_ids, load_tokenizer

# A prompt: text, or {"prompt_token_ids": [...]} (optionally with "prompt": text).
PromptType = str | dict[str, Any]


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if not Path(config.model).is_dir():
            raise ValueError(f"model={config.model!r} is not a directory; pass a Hugging Face "
                             "checkpoint directory (config.json, *.safetensors, tokenizer files).")
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        config.validate(self.model_config)
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = load_eos_token_ids(config.model, self.tokenizer)
        self.spec_config = None
        if config.speculative_config is not None:
            self.spec_config = SpeculativeConfig.from_dict(config.speculative_config)
        self.runner, self.proposer = self._make_runners()
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            stop_checker=StopChecker(self.eos_token_ids, config.max_model_len),
            eos_token_ids=self.eos_token_ids, new_seq_id=lambda: next(self._seq_ids),
            fork_seed=self._rng_seed, num_speculative_tokens=self.num_speculative_tokens)
        self.requests: dict[str, _Request] = {}
        self.prompt_tokens_total = 0

    @property
    def num_speculative_tokens(self) -> int:
        return self.spec_config.num_speculative_tokens if self.spec_config else 0

    def _make_runners(self) -> tuple[Any, DraftProposer | None]:
        """The target runner, and a proposer whose draft runner uses the same block ids.

        With a draft, one block holds the target's and the draft's KV, so the pool is sized for
        both: bytes per block = target + draft.
        """
        from pagedjax.backends import get_runner_cls

        runner_cls, config = get_runner_cls(self.config.backend), self.config
        if self.spec_config is None:
            return runner_cls(config.model, self.model_config, config), None
        draft_dir = self.spec_config.model
        draft_model_config = ModelConfig.from_pretrained(draft_dir)
        self.spec_config.check_vocabulary(config.model, self.tokenizer, load_tokenizer(draft_dir),
                                          self.model_config.vocab_size,
                                          draft_model_config.vocab_size)
        if draft_model_config.max_position_embeddings < config.max_model_len:
            raise ValueError(f"draft max_position_embeddings="
                             f"{draft_model_config.max_position_embeddings} is below "
                             f"max_model_len={config.max_model_len}; lower max_model_len.")
        draft_bytes = draft_model_config.kv_bytes_per_block(config.block_size, config.dtype_bytes)
        runner = runner_cls(config.model, self.model_config, config,
                            extra_bytes_per_block=draft_bytes)
        draft_config = dataclasses.replace(config, model=draft_dir, speculative_config=None,
                                           num_kv_blocks=runner.num_kv_blocks)
        proposer = DraftProposer(runner_cls(draft_dir, draft_model_config, draft_config),
                                 block_size=config.block_size,
                                 max_blocks_per_seq=config.max_blocks_per_seq)
        return runner, proposer

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None) -> None:
        """Queue a request. Invalid input raises ValueError and leaves the engine untouched."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use; pick a unique id.")
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(token_ids, params)
        arrival = next(self._arrivals)
        seq = Sequence(
            seq_id=next(self._seq_ids), request_id=request_id, index=0, arrival=(arrival, 0),
            token_ids=list(token_ids), num_prompt_tokens=len(token_ids), sampling_params=params,
            max_tokens=max_tokens, rng_seed=0, num_pending_forks=params.n - 1,
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids,
                                               params.skip_special_tokens),
            logprobs=[] if params.logprobs is not None else None)
        seq.rng_seed = self._rng_seed(seq, 0)
        self.requests[request_id] = _Request(text, list(token_ids), [seq])
        self.scheduler.add_sequence(seq)
        self.prompt_tokens_total += len(token_ids)

    def _rng_seed(self, seq: Sequence, index: int) -> int:
        seed = seq.sampling_params.seed
        if seed is not None:  # reproducible whatever else is in flight
            return derive_seed(seed, index)
        return derive_seed(self.config.seed, seq.arrival[0], index)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model!r} has no tokenizer; pass "
                                 "{'prompt_token_ids': [...]} instead of text.")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            raise TypeError(f"prompt={prompt!r} must be a string or a dict with "
                            "'prompt_token_ids'.")
        if not token_ids:
            raise ValueError(f"prompt={prompt!r} is empty; give at least one token.")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}); "
                             "tokenize with this model's tokenizer.")
        return text, [int(t) for t in token_ids]

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        max_len = self.config.max_model_len
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"SamplingParams.n={params.n} exceeds max_num_seqs="
                             f"{self.config.max_num_seqs}; lower n or raise max_num_seqs.")
        room = max_len - len(token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room or room < 1:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len={max_len}; shorten the prompt, lower max_tokens or raise "
                "max_model_len.")
        return max_tokens

    def abort_request(self, request_id: str) -> None:
        """Finish a request now (finish_reason "abort") and free its blocks. Unknown ids: no-op."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
            self.scheduler.remove(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward; outputs of the requests that progressed."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        draft_probs, draft_rows = None, None
        if self.proposer is not None:
            draft_probs, draft_rows = self.proposer.propose(out, self.scheduler.seqs)
        model_input = build_model_input(out, block_size=self.config.block_size,
                                        max_blocks_per_seq=self.config.max_blocks_per_seq,
                                        num_speculative_tokens=self.num_speculative_tokens,
                                        draft_rows=draft_rows)
        model_output = self.runner.execute(model_input, draft_probs=draft_probs)
        specs = [s for e in out.scheduled for s in e.samples]
        logprobs = _logprob_rows(model_output, [s.params.logprobs for s in specs])
        touched = self.scheduler.update(out, sampled_rows(model_output.sampled_token_ids),
                                        logprobs)
        return self._request_outputs(touched)

    def _request_outputs(self, touched: list[Sequence]) -> list[RequestOutput]:
        outputs = []
        for request_id in dict.fromkeys(s.request_id for s in touched):
            request = self.requests[request_id]
            for seq in touched:
                if seq.request_id == request_id and seq not in request.seqs:
                    request.seqs.append(seq)
            output = RequestOutput(
                request_id, request.prompt, request.prompt_token_ids,
                outputs=[_completion(s) for s in sorted(request.seqs, key=lambda s: s.index)],
                num_cached_tokens=request.seqs[0].num_cached_tokens)
            output.finished = (len(request.seqs) == request.seqs[0].sampling_params.n
                               and all(s.is_finished for s in request.seqs))
            if output.finished:
                del self.requests[request_id]
                for seq in request.seqs:
                    self.scheduler.remove(seq)
            outputs.append(output)
        return outputs

    # ---- metrics -----------------------------------------------------------------------------

    def get_metrics(self) -> dict[str, int]:
        bm, sched = self.block_manager, self.scheduler
        return {
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "num_requests_running": len({s.request_id for s in sched.running}),
            "num_requests_waiting": len({s.request_id for s in sched.waiting}
                                        - {s.request_id for s in sched.running}),
            "num_preemptions_total": sched.num_preemptions_total,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": sched.num_generation_tokens_total,
            **(sched.spec_metrics.as_dict() if self.spec_config else {}),
        }


def _logprob_rows(output: ModelOutput, wanted: list[int | None]) -> list[list[dict[int, float]]]:
    """Per sample row, per generated token: {sampled token: logprob, top-N: logprobs}."""
    ids, lps = output.sampled_token_ids, output.sampled_logprobs
    top_ids, top_lps = output.top_logprob_ids, output.top_logprobs
    if ids.ndim == 1:  # one token per row: view as [L, 1]
        ids, lps = ids[:, None], lps[:, None]
        top_ids = None if top_ids is None else top_ids[:, None]
        top_lps = None if top_lps is None else top_lps[:, None]
    rows = []
    for r, n in enumerate(wanted):
        entries = []
        for k in range(ids.shape[1]):
            if ids[r, k] < 0:
                break
            entry = {int(ids[r, k]): float(lps[r, k])}
            if n and top_ids is not None:
                for token, lp in zip(top_ids[r, k, :n], top_lps[r, k, :n]):
                    entry.setdefault(int(token), float(lp))
            entries.append(entry)
        rows.append(entries)
    return rows


def _completion(seq: Sequence) -> CompletionOutput:
    return CompletionOutput(
        index=seq.index, text=seq.detokenizer.output_text, token_ids=seq.output_token_ids,
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=None if seq.logprobs is None else list(seq.logprobs),
        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
