"""POST /v1/chat/completions: messages through the chat template, n replies, streamed or not;
tool calls (tool_choice.py) and reasoning split from the answer (choice_parser.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from pagedjax.engine.async_llm import AsyncLLM
from pagedjax.entrypoints.chat_utils import apply_chat_template
from pagedjax.entrypoints.openai.choice_parser import ChoiceParser
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
from pagedjax.entrypoints.openai.tool_choice import (
    ToolPlan,
    check_tool_schemas,
    plan_tools,
    tool_messages_for_template,
)
from pagedjax.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.reasoning import ReasoningParser, ReasoningParserManager
from pagedjax.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, served_model_names: list[str],
                 chat_template: str | None = None,
                 trust_request_chat_template: bool = False,
                 enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None) -> None:
        super().__init__(engine, served_model_names)
        self.chat_template = chat_template  # the server's --chat-template, over the tokenizer's
        self.trust_request_chat_template = trust_request_chat_template
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_parser_cls: type[ToolParser] | None = (
            ToolParserManager.get_tool_parser(tool_call_parser) if tool_call_parser else None)
        name = engine.config.reasoning_parser  # the engine's: it also gates structured outputs
        self.reasoning_parser_cls: type[ReasoningParser] | None = (
            ReasoningParserManager.get_reasoning_parser(name) if name else None)

    def tool_plan(self, request: ChatCompletionRequest) -> ToolPlan:
        check_tool_schemas(request.tools)
        plan = plan_tools(request, self.tool_parser_cls, self.enable_auto_tool_choice,
                          self.tokenizer)
        if plan.make_parser is not None:
            plan.make_parser().adjust_request(request)  # e.g. keep the parser's special tokens
        return plan

    def choice_parser(self, request: Any, plan: ToolPlan,
                      prompt_token_ids: list[int]) -> ChoiceParser:
        """A parser for one choice: no reasoning parser where the prompt closed the reasoning
        itself (a template with thinking off), as the engine's grammar then starts at once."""
        reasoning = None
        if self.reasoning_parser_cls is not None:
            reasoning = self.reasoning_parser_cls(self.tokenizer, request.chat_template_kwargs)
            if reasoning.is_reasoning_end(prompt_token_ids):
                reasoning = None
        tools = plan.make_parser() if plan.make_parser is not None else None
        return ChoiceParser(request, reasoning, tools, plan.parallel_tool_calls)

    def render(self, messages: list[dict[str, Any]], *, chat_template: str | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               chat_template_kwargs: dict[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The messages as a prompt; a template problem is the client's 400. A request's own
        chat_template runs only on a server started with --trust-request-chat-template."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIError(400, "chat_template in a request needs the server started with "
                                   "--trust-request-chat-template.", param="chat_template")
        if tools is not None:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        try:
            return apply_chat_template(
                self.tokenizer, tool_messages_for_template(messages),
                chat_template=chat_template or self.chat_template,
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

    async def prepare_async(self, request: ChatCompletionRequest
                            ) -> tuple[dict[str, Any], SamplingParams, ToolPlan]:
        """prepare() on the tokenizer's thread, after the character bound: a long conversation
        never holds the event loop."""
        self.check_prompt_chars(message_chars(request.messages), "messages")
        return await self.in_tokenizer_thread(self.prepare, request)

    def prepare(self, request: ChatCompletionRequest
                ) -> tuple[dict[str, Any], SamplingParams, ToolPlan]:
        """(prompt, sampling params, tool plan) of a chat request (the Responses API's too);
        raises OpenAIError(400) naming what is wrong."""
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        plan = self.tool_plan(request)
        prompt = self.render(request.messages, chat_template=request.chat_template,
                             add_generation_prompt=request.add_generation_prompt,
                             continue_final_message=request.continue_final_message,
                             chat_template_kwargs=request.chat_template_kwargs,
                             tools=plan.tools)
        max_tokens = (request.max_completion_tokens if request.max_completion_tokens is not None
                      else request.max_tokens)
        params = self.sampling_params(
            request, logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            max_tokens=self.max_tokens_for(len(prompt["prompt_token_ids"]), max_tokens,
                                           "messages"),
            structured_outputs=plan.structured_outputs)
        return prompt, params, plan

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        prompt, params, plan = await self.prepare_async(request)
        request_id = random_id("chatcmpl")
        (generator,) = self.start(request, [request_id], [prompt], [params])
        stream = _ChatStream(self, request, request_id, prompt["prompt_token_ids"], plan)
        if request.stream:
            return event_stream(stream.events(generator, raw_request))
        async with self.abort_on_disconnect(raw_request, [request_id]):
            final = [output async for output in generator][-1]
        return JSONResponse(stream.response(final))


class _ChatStream:
    """Builds one chat request's chunks and final body."""

    def __init__(self, serving: OpenAIServing, request: ChatCompletionRequest, request_id: str,
                 prompt_token_ids: list[int], plan: ToolPlan) -> None:
        self.serving, self.request, self.id = serving, request, request_id
        self.created, self.prompt_token_ids = now(), prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_completion_tokens = 0
        self.num_top = request.top_logprobs or 0
        self.plan = plan
        self.with_reasoning = serving.reasoning_parser_cls is not None
        self.parsers: dict[int, ChoiceParser] = {}  # choice index → its parser (streaming)

    def _parser(self, index: int) -> ChoiceParser:
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = self.serving.choice_parser(
                self.request, self.plan, self.prompt_token_ids)
        return parser

    def _logprobs(self, completion: CompletionOutput) -> dict[str, Any] | None:
        if not self.request.logprobs or completion.logprobs is None:
            return None
        return chat_logprobs(completion.token_ids, completion.logprobs, self.num_top)

    def response(self, output: RequestOutput) -> dict[str, Any]:
        choices = []
        for completion in output.outputs:
            self.num_completion_tokens += len(completion.token_ids)
            parsed = self._parser(completion.index).parse(completion.text)
            choices.append({"index": completion.index,
                            "message": parsed.message(self.with_reasoning),
                            "logprobs": self._logprobs(completion),
                            "finish_reason": _finish_reason(completion.finish_reason,
                                                            bool(parsed.tool_calls)),
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

    def _choice_chunk(self, completion: CompletionOutput, delta: dict[str, Any] | None,
                      logprobs: dict[str, Any] | None, continuous: bool,
                      finish_reason: str | None = None) -> str:
        choice = {"index": completion.index, "delta": delta or {}, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = completion.stop_reason
        chunk = self._chunk([choice])
        if continuous:
            chunk["usage"] = usage(self.num_prompt_tokens, self.num_completion_tokens)
        return sse(chunk)

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
                    parser = self._parser(completion.index)
                    delta = parser.delta(completion.text, completion.token_ids)
                    logprobs = self._logprobs(completion)
                    if completion.finish_reason is None:
                        if delta is not None or logprobs is not None:  # else held back
                            yield self._choice_chunk(completion, delta, logprobs, continuous)
                        continue
                    rest = parser.finish()  # what the whole-text parse adds
                    if delta is not None and rest is not None:
                        yield self._choice_chunk(completion, delta, logprobs, continuous)
                        logprobs = None
                    yield self._choice_chunk(completion, rest or delta, logprobs, continuous,
                                             _finish_reason(completion.finish_reason,
                                                            parser.tools_called))
        if include_usage:
            yield sse({**self._chunk([]),
                       "usage": usage(self.num_prompt_tokens, self.num_completion_tokens)})
        yield SSE_DONE


def _finish_reason(finish_reason: str | None, tools_called: bool) -> str | None:
    """"tool_calls" for a completion that ended on its own with calls, as OpenAI reports it."""
    return "tool_calls" if tools_called and finish_reason == "stop" else finish_reason

