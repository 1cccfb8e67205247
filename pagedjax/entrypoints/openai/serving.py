"""What the completion and chat endpoints share: the model check, prompt lengths against the
context, tokenizing off the event loop, starting generations, aborting them when the client goes
away, and SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
from fastapi.responses import StreamingResponse
from starlette.requests import Request

from pagedjax.engine.async_llm import AsyncLLM, EngineDeadError
from pagedjax.entrypoints.openai.errors import (
    ENGINE_FAILED,
    OpenAIError,
    bad_request,
    error_body,
)
from pagedjax.entrypoints.openai.prompt_limits import max_prompt_chars
from pagedjax.entrypoints.openai.protocol import SamplingFields
from pagedjax.entrypoints.openai.sampling import to_sampling_params
from pagedjax.model_loader.tokenizer import default_sampling_kwargs
from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

T = TypeVar("T")
logger = logging.getLogger("pagedjax")


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str]) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.defaults = default_sampling_kwargs(engine.config.model)
        # longer text cannot fit the context: refused without tokenizing (None: no bound)
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)
        # one thread, so that the event loop never waits on a long prompt's tokenization
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedjax-tokenize")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                                   f"{self.served_model_names}.", param="model",
                              code="model_not_found")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer: send the prompt as token ids.",
                              param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode() on the tokenizer's thread, after the character bound."""
        self.check_prompt_chars(len(text), "prompt")
        return await self.in_tokenizer_thread(self.encode, text, add_special_tokens)

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the tokenizer's thread (tokenization, chat templates)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_thread, functools.partial(fn, *args, **kwargs))

    def check_prompt_chars(self, num_chars: int, what: str) -> None:
        """A 400 for text too long to fit the context whatever its tokens, before tokenizing
        it (prompt_limits.py)."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            limit = self.max_model_len
            raise OpenAIError(
                400, f"This model's maximum context length is {limit} tokens. However, your "
                     f"{what} has {num_chars} characters, more than any text of {limit} tokens "
                     f"has ({self.max_prompt_chars}). Please reduce the length of the {what}.",
                param="messages" if what == "messages" else "prompt",
                code="context_length_exceeded")

    def max_tokens_for(self, num_prompt_tokens: int, max_tokens: int | None,
                       what: str) -> int:
        """max_tokens checked against the context (None: what the context leaves, capped by
        the model's generation_config), with OpenAI's message when it does not fit."""
        limit, param = self.max_model_len, "messages" if what == "messages" else "prompt"
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise OpenAIError(
                    400, f"This model's maximum context length is {limit} tokens. However, "
                         f"your request has {num_prompt_tokens} input tokens. Please reduce the "
                         f"length of the {what}.", param=param, code="context_length_exceeded")
            return min(limit - num_prompt_tokens, self.defaults.get("max_tokens", limit))
        if isinstance(max_tokens, int) and num_prompt_tokens + max_tokens > limit:
            raise OpenAIError(
                400, f"This model's maximum context length is {limit} tokens. However, you "
                     f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                     f"the {what}, {max_tokens} in the completion). Please reduce the length of "
                     f"the {what} or completion.", param=param, code="context_length_exceeded")
        return max_tokens

    def sampling_params(self, request: SamplingFields, *, max_tokens: int,
                        logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(400, "Stream options can only be defined when `stream=True`.",
                              param="stream_options")
        params = to_sampling_params(request, max_tokens=max_tokens, logprobs=logprobs,
                                    defaults=self.defaults,
                                    structured_outputs=structured_outputs)
        params.output_kind = (RequestOutputKind.DELTA if request.stream
                              else RequestOutputKind.FINAL_ONLY)
        return params

    def start(self, request: SamplingFields, request_ids: list[str],
              prompts: list[dict[str, Any]],
              params: list[SamplingParams]) -> list[AsyncIterator[RequestOutput]]:
        """Queue every prompt, or none: a prompt the engine rejects aborts those before it."""
        generators = []
        try:
            for request_id, prompt, p in zip(request_ids, prompts, params):
                generators.append(self.engine.generate(prompt, p, request_id))
        except (ValueError, TypeError) as e:
            for request_id in request_ids[: len(generators)]:
                self.engine.abort_request(request_id)
            error = bad_request(e)
            if error.param == "structured_outputs" and request.structured_outputs is None:
                error.param = "response_format"  # the schema came from there
            raise error from None
        return generators

    @contextlib.asynccontextmanager
    async def abort_on_disconnect(self, raw_request: Request, request_ids: list[str]):
        """Abort the requests as soon as the client disconnects (within one engine step), and
        whenever the code inside stops early: a stream closed or cancelled (Starlette's own
        disconnect listener cancels a streaming response, and may do so before this watcher
        sees the disconnect) or an error. An engine that fails meanwhile fails them with a 500
        whose message names no internals (the log has the engine's error)."""

        async def watch() -> None:
            while (await raw_request.receive())["type"] != "http.disconnect":
                pass
            await self.engine.abort(request_ids)

        watcher = asyncio.create_task(watch())
        try:
            yield
        except EngineDeadError:
            raise OpenAIError(500, ENGINE_FAILED) from None
        except BaseException:
            for request_id in request_ids:  # no await: this may run while being cancelled
                self.engine.abort_request(request_id)
            raise
        finally:
            watcher.cancel()


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """SSE of `events`; a failure after the headers went out (a dead engine) ends the stream
    with an error event in OpenAI's shape and [DONE], never a traceback nor an internal
    message."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(events):  # closed with guarded(): aborts its requests
                async for event in events:
                    yield event
        except OpenAIError as e:
            yield sse(error_body(e.status, e.message, e.param, e.code))
            yield SSE_DONE
        except EngineDeadError:
            yield sse(error_body(500, ENGINE_FAILED))
            yield SSE_DONE
        except Exception as e:
            logger.exception("internal error while streaming")
            yield sse(error_body(500, f"internal server error ({type(e).__name__}); see the "
                                      "server log"))
            yield SSE_DONE

    return ClosingStreamingResponse(guarded(), media_type="text/event-stream")


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body however the stream ends. When a client goes
    away, Starlette cancels the response wherever it waits (often in `send`, between two of the
    body's items) and leaves the body's generator suspended for the garbage collector, which
    can take long to finalise it (a reference cycle through the cancellation's traceback):
    the requests inside would run on for a client that is gone."""

    async def stream_response(self, send: Callable[..., Any]) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):  # runs inside the cancelled task
                await self.body_iterator.aclose()


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index.
    Closing this closes them all (which aborts unfinished generations)."""
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            with contextlib.suppress(Exception):
                await it.aclose()
