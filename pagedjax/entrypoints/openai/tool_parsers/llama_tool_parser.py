"""Llama 3.1 / 3.2 / 4 JSON tool calls (vLLM's "llama3_json"): the output, after an optional
<|python_tag|>, is one or more JSON objects separated by ";",

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

Only an output that starts with "{" (after the tag and whitespace) holds calls; any other is
content. With calls there is no content: text after the last call is dropped, as vLLM does. An
object needs "name" and "parameters" (or "arguments") to be a call: plain JSON the model writes
for the user is content. Calls are the objects up to the first one that is not a valid call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    ToolCall,
    ToolParserManager,
    keep_special_tokens,
    make_tool_call_id,
)
from pagedjax.entrypoints.openai.tool_parsers.json_call import JsonCallScan
from pagedjax.entrypoints.openai.tool_parsers.json_scan import skip_whitespace
from pagedjax.entrypoints.openai.tool_parsers.streaming import Deltas, StreamingToolParser

if TYPE_CHECKING:
    from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest

BOT_TOKEN = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


def _first_call_start(text: str) -> int | None:
    """Where the first call's "{" is; -1 when the output is content; None while undecided (only
    whitespace, or the start of <|python_tag|>, so far)."""
    i = skip_whitespace(text, 0)
    if BOT_TOKEN.startswith(text[i:]):
        return None
    if text.startswith(BOT_TOKEN, i):
        i = skip_whitespace(text, i + len(BOT_TOKEN))
        if i == len(text):
            return None
    return i if text[i] == "{" else -1


def _next_call_start(text: str, pos: int) -> int | None:
    """Where the next call's "{" is after a call ending at pos: -1 when none follows; None
    while undecided."""
    i = skip_whitespace(text, pos)
    if i == len(text):
        return None
    if text[i] != ";":
        return -1
    i = skip_whitespace(text, i + 1)
    if i == len(text):
        return None
    return i if text[i] == "{" else -1


def _scan(start: int) -> JsonCallScan:
    return JsonCallScan(start, ARGUMENT_KEYS, arguments_required=True)


@ToolParserManager.register_module("llama3_json")
@ToolParserManager.register_module("llama4_json")
class Llama3JsonToolParser(StreamingToolParser):

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        return keep_special_tokens(request)

    def extract_tool_calls(self, model_output: str,
                           request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        calls: list[ToolCall] = []
        start = _first_call_start(model_output)
        while start is not None and start >= 0:
            scan = _scan(start)
            scan.advance(model_output)
            call = scan.finish(model_output)
            if call is None:
                break
            calls.append(ToolCall(make_tool_call_id(), call))
            start = _next_call_start(model_output, scan.end)
        if not calls:
            return ExtractedToolCallInformation(False, [], model_output)
        return ExtractedToolCallInformation(True, calls, None)

    def _read_start(self, text: str, deltas: Deltas) -> str | None:
        start = _first_call_start(text)
        if start is None:
            return None
        if start < 0:
            return self._end_calls()
        return self._begin_call(_scan(start), self._read_separator)

    def _read_separator(self, text: str, deltas: Deltas) -> str | None:
        start = _next_call_start(text, self._pos)
        if start is None:
            return None
        if start < 0:
            return self._end_calls()
        return self._begin_call(_scan(start), self._read_separator)
