"""POST /v1/responses: OpenAI's Responses API over the chat path. A request becomes a chat
request (input items → messages, flat function tools → chat tools, text.format →
response_format), runs as one, and its completion becomes output items: the reasoning, the
message, the function calls. Streamed as OpenAI's typed events, each with a sequence number.
Responses are not stored: previous_response_id is refused; send the conversation as input."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from pagedjax.entrypoints.openai.choice_parser import ParsedMessage
from pagedjax.entrypoints.openai.errors import OpenAIError
from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest
from pagedjax.entrypoints.openai.serving import event_stream, now, random_id
from pagedjax.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedjax.entrypoints.openai.tool_choice import ToolPlan
from pagedjax.outputs import CompletionOutput, RequestOutput

# Fields OpenAI's clients send that change nothing here, with the values that are honoured.
_ACCEPTED = {"reasoning", "truncation", "include", "background", "service_tier",
             "prompt_cache_key", "safety_identifier", "stream_options"}
_TEXT_PARTS = ("input_text", "output_text", "text")


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(self, request: ResponsesRequest,
                              raw_request: Request) -> Response:
        chat_request = to_chat_request(request)
        prompt, params, plan = await self.chat.prepare_async(chat_request)
        response_id = random_id("resp")
        (generator,) = self.chat.start(chat_request, [response_id], [prompt], [params])
        builder = _ResponseBuilder(self.chat, request, chat_request, plan, response_id,
                                   prompt["prompt_token_ids"])
        if request.stream:
            return event_stream(builder.events(generator, raw_request))
        async with self.chat.abort_on_disconnect(raw_request, [response_id]):
            final = [output async for output in generator][-1]
        return JSONResponse(builder.response(final))


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request runs as; OpenAIError(400) naming what this server
    cannot do."""
    given = set(request.model_fields_set) | set(request.model_extra or {})
    unknown = sorted(given - set(ResponsesRequest.model_fields) - _ACCEPTED)
    if unknown:
        raise OpenAIError(400, f"{unknown[0]}={getattr(request, unknown[0])!r} is not supported"
                               f" by this server; remove '{unknown[0]}' from the request.",
                          param=unknown[0])
    if request.previous_response_id is not None:
        raise OpenAIError(400, "previous_response_id is not supported: this server does not "
                               "store responses; send the whole conversation as input.",
                          param="previous_response_id")
    fields: dict[str, Any] = {"messages": _messages(request), "stream": request.stream}
    for name in ("model", "temperature", "top_p", "top_k", "seed", "parallel_tool_calls",
                 "user"):
        if name in request.model_fields_set:
            fields[name] = getattr(request, name)
    if request.max_output_tokens is not None:
        fields["max_completion_tokens"] = request.max_output_tokens
    if request.tools:
        fields["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        fields["tool_choice"] = _chat_tool_choice(request.tool_choice)
    response_format = _response_format(request.text)
    if response_format is not None:
        fields["response_format"] = response_format
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise OpenAIError(400, f"{where} is invalid: {first.get('msg')}") from None


def _messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        return [*messages, {"role": "user", "content": request.input}]
    for i, item in enumerate(request.input):
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(400, f"input[{i}].role={role!r} is invalid; use user, system, "
                                       "developer or assistant.", param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(i, item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(i, item.get("output"))})
        elif kind == "reasoning":
            continue  # earlier reasoning: chat templates leave it out
        else:
            raise OpenAIError(400, f"input[{i}] of type {kind!r} is not supported; this server "
                                   "takes message, function_call and function_call_output "
                                   "items.", param="input")
    if not messages:
        raise OpenAIError(400, "input is empty; send text or at least one message.",
                          param="input")
    return messages


def _text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise OpenAIError(400, f"input[{i}] content {json.dumps(content)[:100]} is not supported; "
                           "this server takes text: a string or input_text parts.",
                      param="input")


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise OpenAIError(400, f"tools[{i}].type={tool.get('type')!r} is not supported; this "
                               "server runs function tools only.", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(400, f"tool_choice={json.dumps(choice)} is not supported; use none, auto, "
                           'required or {"type": "function", "name": ...}.',
                      param="tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    form = (text or {}).get("format")
    if form is None or form.get("type") == "text":
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema":
        return {"type": "json_schema",
                "json_schema": {"name": form.get("name", "output"), "schema": form.get("schema"),
                                "strict": form.get("strict")}}
    raise OpenAIError(400, f"text.format={json.dumps(form)[:100]} is not supported; use text, "
                           "json_object or json_schema.", param="text")


class _ResponseBuilder:
    """One response's body, and its events while it streams."""

    def __init__(self, chat: OpenAIServingChat, request: ResponsesRequest,
                 chat_request: ChatCompletionRequest, plan: ToolPlan, response_id: str,
                 prompt_token_ids: list[int]) -> None:
        self.chat, self.request, self.chat_request = chat, request, chat_request
        self.plan, self.id, self.created = plan, response_id, now()
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens, self.num_cached_tokens = len(prompt_token_ids), 0
        self.sequence_number = 0

    # ---- the body ------------------------------------------------------------------------

    def body(self, status: str, output: list[dict[str, Any]],
             completion: CompletionOutput | None = None) -> dict[str, Any]:
        request = self.request
        incomplete = (completion is not None and completion.finish_reason == "length")
        body = {"id": self.id, "object": "response", "created_at": self.created,
                "status": "incomplete" if incomplete and status == "completed" else status,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "error": None, "model": self.chat.model_name,
                "instructions": request.instructions, "output": output,
                "parallel_tool_calls": request.parallel_tool_calls is not False,
                "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
                "tools": request.tools or [], "temperature": request.temperature,
                "top_p": request.top_p, "max_output_tokens": request.max_output_tokens,
                "text": request.text or {"format": {"type": "text"}},
                "metadata": request.metadata or {}, "previous_response_id": None,
                "store": False, "usage": None}
        if completion is not None:
            num_output = len(completion.token_ids)
            body["usage"] = {
                "input_tokens": self.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.num_cached_tokens},
                "output_tokens": num_output,
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(
                    completion, any(item["type"] == "reasoning" for item in output))},
                "total_tokens": self.num_prompt_tokens + num_output}
        return body

    def _reasoning_tokens(self, completion: CompletionOutput, reasoned: bool) -> int:
        """Output tokens up to and including the reasoning's end marker."""
        if not reasoned:
            return 0
        end_id = self.chat.reasoning_parser_cls(self.chat.tokenizer).end_token_id
        ids = list(completion.token_ids)
        return ids.index(end_id) + 1 if end_id in ids else len(ids)

    def response(self, output: RequestOutput) -> dict[str, Any]:
        self.num_cached_tokens = output.num_cached_tokens
        (completion,) = output.outputs
        parser = self.chat.choice_parser(self.chat_request, self.plan, self.prompt_token_ids)
        parsed = parser.parse(completion.text)
        return self.body("completed", _output_items(parsed), completion)

    # ---- events --------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def events(self, generator: AsyncIterator[RequestOutput],
                     raw_request: Request) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.body("in_progress", []))
        yield self.event("response.in_progress", response=self.body("in_progress", []))
        parser = self.chat.choice_parser(self.chat_request, self.plan, self.prompt_token_ids)
        items = _StreamedItems(self)
        completion = None
        async with self.chat.abort_on_disconnect(raw_request, [self.id]):
            async for output in generator:
                self.num_cached_tokens = output.num_cached_tokens
                (completion,) = output.outputs
                for delta in (parser.delta(completion.text, completion.token_ids),
                              parser.finish() if completion.finish_reason else None):
                    for event in items.add(delta):
                        yield event
        for event in items.close_all():
            yield event
        yield self.event("response.completed",
                         response=self.body("completed", items.output, completion))


def _output_items(parsed: ParsedMessage) -> list[dict[str, Any]]:
    items = []
    if parsed.reasoning_content:
        items.append(_reasoning_item(random_id("rs"), parsed.reasoning_content, "completed"))
    if parsed.content or not parsed.tool_calls:
        items.append(_message_item(random_id("msg"), parsed.content or "", "completed"))
    for call in parsed.tool_calls:
        items.append(_call_item(random_id("fc"), call.id, call.function.name,
                                call.function.arguments, "completed"))
    return items


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = ([] if text is None
               else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class _StreamedItems:
    """Output items as a stream opens and closes them: one open at a time (reasoning, then
    the message, then each call); a delta for another kind closes the open one."""

    def __init__(self, builder: _ResponseBuilder) -> None:
        self.builder = builder
        self.output: list[dict[str, Any]] = []  # closed items, in order
        self.open: dict[str, Any] | None = None  # {"kind", "key", "index", "item", "text"}

    def add(self, delta: dict[str, Any] | None) -> list[str]:
        if not delta:
            return []
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", []):
            events += self._call(call)
        return events

    def _open(self, kind: str, item: dict[str, Any], key: Any = None) -> list[str]:
        events = self.close()
        self.open = {"kind": kind, "key": key, "index": len(self.output), "item": item,
                     "text": ""}
        event = self.builder.event
        events.append(event("response.output_item.added", output_index=self.open["index"],
                            item=item))
        if kind == "message":
            events.append(event("response.content_part.added", item_id=item["id"],
                                output_index=self.open["index"], content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _text(self, kind: str, text: str) -> list[str]:
        events = []
        if self.open is None or self.open["kind"] != kind:
            item = (_reasoning_item(random_id("rs"), "", "in_progress") if kind == "reasoning"
                    else _message_item(random_id("msg"), None, "in_progress"))
            events += self._open(kind, item)
        self.open["text"] += text
        name = ("response.reasoning_text.delta" if kind == "reasoning"
                else "response.output_text.delta")
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.builder.event(name, item_id=self.open["item"]["id"],
                                         output_index=self.open["index"], content_index=0,
                                         delta=text, **extra))
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events, function = [], call.get("function") or {}
        if self.open is None or self.open["key"] != ("call", call["index"]):
            name = function.get("name")
            if name is None:  # arguments of a call already closed: not sent by the parsers
                return events
            item = _call_item(random_id("fc"), call.get("id") or random_id("call"), name, "",
                              "in_progress")
            events += self._open("call", item, ("call", call["index"]))
        arguments = function.get("arguments")
        if arguments:
            self.open["text"] += arguments
            events.append(self.builder.event("response.function_call_arguments.delta",
                                             item_id=self.open["item"]["id"],
                                             output_index=self.open["index"], delta=arguments))
        return events

    def close(self) -> list[str]:
        """Close the open item: its done events, and the item joins the output."""
        if self.open is None:
            return []
        state, self.open, event = self.open, None, self.builder.event
        item, index, text = state["item"], state["index"], state["text"]
        events = []
        if state["kind"] == "reasoning":
            events.append(event("response.reasoning_text.done", item_id=item["id"],
                                output_index=index, content_index=0, text=text))
            item = _reasoning_item(item["id"], text, "completed")
        elif state["kind"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            events.append(event("response.output_text.done", item_id=item["id"],
                                output_index=index, content_index=0, text=text, logprobs=[]))
            events.append(event("response.content_part.done", item_id=item["id"],
                                output_index=index, content_index=0, part=part))
            item = _message_item(item["id"], text, "completed")
        else:
            events.append(event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, name=item["name"], arguments=text))
            item = _call_item(item["id"], item["call_id"], item["name"], text, "completed")
        events.append(event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events

    def close_all(self) -> list[str]:
        events = self.close()
        if not self.output:  # nothing was said: an empty message, as the whole body has
            events += self._open("message", _message_item(random_id("msg"), None,
                                                          "in_progress"))
            events += self.close()
        return events
