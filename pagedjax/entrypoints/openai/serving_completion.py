"""POST /v1/completions: one prompt or several, n completions each, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from pagedjax.entrypoints.openai.errors import OpenAIError
from pagedjax.entrypoints.openai.logprobs import completion_logprobs, prompt_logprobs_json
from pagedjax.entrypoints.openai.protocol import CompletionRequest
from pagedjax.entrypoints.openai.serving import (
    SSE_DONE,
    OpenAIServing,
    event_stream,
    merge_async_iterators,
    now,
    random_id,
    sse,
    usage,
)
from pagedjax.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest,
                                raw_request: Request) -> Response:
        self.check_model(request.model)
        if request.suffix is not None:
            raise OpenAIError(400, "suffix is not supported; leave it out.", param="suffix")
        if request.echo and request.logprobs is not None:
            raise OpenAIError(400, "echo with logprobs needs prompt logprobs, which this server "
                                   "does not return; drop one of them.", param="echo")
        prompts = await self._prompts(request.prompt)
        params = [self.sampling_params(
            request, logprobs=request.logprobs,
            max_tokens=self.max_tokens_for(len(p["prompt_token_ids"]), request.max_tokens,
                                           "prompt")) for p in prompts]
        base_id = random_id("cmpl")
        request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        generators = self.start(request, request_ids, prompts, params)
        stream = _CompletionStream(self, request, base_id, prompts)
        if request.stream:
            return event_stream(stream.events(generators, raw_request, request_ids))
        finals: list[RequestOutput] = [None] * len(prompts)  # FINAL_ONLY: one output each
        async with self.abort_on_disconnect(raw_request, request_ids):
            async for prompt_index, output in merge_async_iterators(*generators):
                finals[prompt_index] = output
        return JSONResponse(stream.response(finals))

    async def _prompts(self, prompt: Any) -> list[dict[str, Any]]:
        """Each prompt as {"prompt": text or None, "prompt_token_ids": ids}, the texts tokenized
        on the tokenizer's thread."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError(400, "prompt=[] is empty; give at least one prompt.",
                              param="prompt")
        return [{"prompt": p, "prompt_token_ids": await self.encode_async(p)}
                if isinstance(p, str) else {"prompt": None, "prompt_token_ids": p}
                for p in prompt]


class _CompletionStream:
    """Builds one completion request's chunks and final body; choices are numbered
    prompt_index * n + completion index."""

    def __init__(self, serving: OpenAIServing, request: CompletionRequest, request_id: str,
                 prompts: list[dict[str, Any]]) -> None:
        self.serving, self.request, self.id = serving, request, request_id
        self.prompts, self.created = prompts, now()
        self.num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        self.num_completion_tokens = 0
        self.text_offsets: dict[int, int] = {}
        self.echoed: set[int] = set()

    def _choice(self, prompt_index: int, completion: CompletionOutput) -> dict[str, Any] | None:
        index = prompt_index * self.request.n + completion.index
        text = completion.text
        if self.request.echo and index not in self.echoed:
            self.echoed.add(index)
            text = (self.prompts[prompt_index]["prompt"] or self.serving.tokenizer.decode(
                self.prompts[prompt_index]["prompt_token_ids"])) + text
        if not text and not completion.token_ids and completion.finish_reason is None:
            return None
        self.num_completion_tokens += len(completion.token_ids)
        logprobs = None
        if self.request.logprobs is not None and completion.logprobs is not None:
            offset = self.text_offsets.get(index, 0)
            logprobs = completion_logprobs(completion.token_ids, completion.logprobs,
                                           self.request.logprobs, offset)
            self.text_offsets[index] = offset + sum(map(len, logprobs["tokens"]))
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason}

    def _body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.serving.model_name, "choices": choices}

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for prompt_index, output in enumerate(finals):
            for completion in output.outputs:
                choice = self._choice(prompt_index, completion)
                prompt_logprobs = getattr(output, "prompt_logprobs", None)
                if prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs)
                choices.append(choice)
        choices.sort(key=lambda c: c["index"])
        return {**self._body(choices),
                "usage": usage(self.num_prompt_tokens, self.num_completion_tokens)}

    async def events(self, generators: list[AsyncIterator[RequestOutput]], raw_request: Request,
                     request_ids: list[str]) -> AsyncIterator[str]:
        options = self.request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)
        async with self.serving.abort_on_disconnect(raw_request, request_ids):
            async for prompt_index, output in merge_async_iterators(*generators):
                for completion in output.outputs:
                    choice = self._choice(prompt_index, completion)
                    if choice is None:
                        continue
                    chunk = self._body([choice])
                    if continuous:
                        chunk["usage"] = usage(self.num_prompt_tokens,
                                               self.num_completion_tokens)
                    yield sse(chunk)
        if include_usage:
            yield sse({**self._body([]),
                       "usage": usage(self.num_prompt_tokens, self.num_completion_tokens)})
        yield SSE_DONE
