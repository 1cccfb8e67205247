"""POST /v1/chat/completions: messages through the chat template, n replies, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from pagedjax.engine.async_llm import AsyncLLM
from pagedjax.entrypoints.chat_utils import apply_chat_template
from pagedjax.entrypoints.openai.errors import OpenAIError, bad_request
from pagedjax.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
from pagedjax.entrypoints.openai.prompt_limits import message_chars
from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest
from pagedjax.entrypoints.openai.serving import (
    SSE_DONE,
    OpenAIServing,
    event_stream,
    now,
    random_id,
    sse,
    usage,
)
from pagedjax.outputs import CompletionOutput, RequestOutput


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, served_model_names: list[str],
                 chat_template: str | None = None,
                 trust_request_chat_template: bool = False) -> None:
        super().__init__(engine, served_model_names)
        self.chat_template = chat_template  # the server's --chat-template, over the tokenizer's
        self.trust_request_chat_template = trust_request_chat_template

    def render(self, messages: list[dict[str, Any]], *, chat_template: str | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """The messages as a prompt; a template problem is the client's 400. A request's own
        chat_template runs only on a server started with --trust-request-chat-template."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIError(400, "chat_template in a request needs the server started with "
                                   "--trust-request-chat-template.", param="chat_template")
        try:
            return apply_chat_template(
                self.tokenizer, messages, chat_template=chat_template or self.chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs)
        except ValueError as e:
            raise bad_request(e) from None

    async def render_async(self, messages: list[dict[str, Any]], **kwargs: Any
                           ) -> dict[str, Any]:
        """render() on the tokenizer's thread, after the character bound (serving.py)."""
        self.check_prompt_chars(message_chars(messages), "messages")
        return await self.in_tokenizer_thread(self.render, messages, **kwargs)

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        prompt = await self.render_async(
            request.messages, chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs)
        max_tokens = (request.max_completion_tokens if request.max_completion_tokens is not None
                      else request.max_tokens)
        params = self.sampling_params(
            request, logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            max_tokens=self.max_tokens_for(len(prompt["prompt_token_ids"]), max_tokens,
                                           "messages"))
        request_id = random_id("chatcmpl")
        (generator,) = self.start(request, [request_id], [prompt], [params])
        stream = _ChatStream(self, request, request_id, len(prompt["prompt_token_ids"]))
        if request.stream:
            return event_stream(stream.events(generator, raw_request))
        async with self.abort_on_disconnect(raw_request, [request_id]):
            final = [output async for output in generator][-1]
        return JSONResponse(stream.response(final))


class _ChatStream:
    """Builds one chat request's chunks and final body."""

    def __init__(self, serving: OpenAIServing, request: ChatCompletionRequest, request_id: str,
                 num_prompt_tokens: int) -> None:
        self.serving, self.request, self.id = serving, request, request_id
        self.created, self.num_prompt_tokens = now(), num_prompt_tokens
        self.num_completion_tokens = 0
        self.num_top = request.top_logprobs or 0

    def _logprobs(self, completion: CompletionOutput) -> dict[str, Any] | None:
        if not self.request.logprobs or completion.logprobs is None:
            return None
        return chat_logprobs(completion.token_ids, completion.logprobs, self.num_top)

    def response(self, output: RequestOutput) -> dict[str, Any]:
        choices = []
        for completion in output.outputs:
            self.num_completion_tokens += len(completion.token_ids)
            choices.append({"index": completion.index,
                            "message": {"role": "assistant", "content": completion.text},
                            "logprobs": self._logprobs(completion),
                            "finish_reason": completion.finish_reason,
                            "stop_reason": completion.stop_reason})
        body = {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.serving.model_name, "choices": choices,
                "usage": usage(self.num_prompt_tokens, self.num_completion_tokens)}
        prompt_logprobs = getattr(output, "prompt_logprobs", None)
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs)
        return body

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.serving.model_name, "choices": choices}

    async def events(self, generator: AsyncIterator[RequestOutput],
                     raw_request: Request) -> AsyncIterator[str]:
        options = self.request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)
        started: set[int] = set()
        async with self.serving.abort_on_disconnect(raw_request, [self.id]):
            async for output in generator:
                for completion in output.outputs:
                    if completion.index not in started:  # the role first, as OpenAI sends it
                        started.add(completion.index)
                        yield sse(self._chunk([{"index": completion.index,
                                                "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]))
                    if not (completion.text or completion.token_ids
                            or completion.finish_reason):
                        continue
                    self.num_completion_tokens += len(completion.token_ids)
                    delta = {"content": completion.text} if completion.text else {}
                    chunk = self._chunk([{"index": completion.index, "delta": delta,
                                          "logprobs": self._logprobs(completion),
                                          "finish_reason": completion.finish_reason,
                                          "stop_reason": completion.stop_reason}])
                    if continuous:
                        chunk["usage"] = usage(self.num_prompt_tokens, self.num_completion_tokens)
                    yield sse(chunk)
        if include_usage:
            yield sse({**self._chunk([]),
                       "usage": usage(self.num_prompt_tokens, self.num_completion_tokens)})
        yield SSE_DONE
