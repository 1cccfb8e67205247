"""Hermes-2-Pro / Qwen2.5 / Qwen3 tool calls: blocks of one JSON object each,

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The content is the text before the first block (None if only whitespace); text between and after
blocks is dropped, as vLLM does. A block that is not a valid call makes the whole output content.
Blocks end where their JSON object ends (so a "</tool_call>" inside a string does not end one); a
last block without its "</tool_call>" (the model stopped) still counts.
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
from pagedjax.entrypoints.openai.tool_parsers.streaming import (
    Deltas,
    StreamingToolParser,
    partial_marker_len,
)

if TYPE_CHECKING:
    from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest

START, END = "<tool_call>", "</tool_call>"


def _after_call(text: str, pos: int) -> tuple[str, int]:
    """What follows a call object ending at pos: ("end", len) at the end of the text, ("closed",
    past "</tool_call>"), ("partial", pos) for a partial "</tool_call>", else ("invalid", pos)."""
    i = skip_whitespace(text, pos)
    if i == len(text):
        return "end", i
    if text.startswith(END, i):
        return "closed", i + len(END)
    if END.startswith(text[i:]):
        return "partial", i
    return "invalid", i


def _whole_calls(text: str, start: int) -> list[ToolCall] | None:
    """The calls of the blocks from the first "<tool_call>" (at start); None if one is invalid."""
    calls = []
    while start >= 0:
        i = skip_whitespace(text, start + len(START))
        if text[i:i + 1] != "{":
            return None
        scan = JsonCallScan(i)
        scan.advance(text)
        call = scan.finish(text)
        if call is None:
            return None
        calls.append(ToolCall(make_tool_call_id(), call))
        after, i = _after_call(text, scan.end)
        if after in ("end", "partial"):  # the model stopped (maybe inside "</tool_call>")
            return calls
        if after == "invalid":
            return None
        start = text.find(START, i)
    return calls


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(StreamingToolParser):

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        return keep_special_tokens(request)

    def extract_tool_calls(self, model_output: str,
                           request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        first = model_output.find(START)
        calls = _whole_calls(model_output, first) if first >= 0 else None
        if calls is None:
            return ExtractedToolCallInformation(False, [], model_output)
        content = model_output[:first]
        return ExtractedToolCallInformation(True, calls, content if content.strip() else None)

    def _read_start(self, text: str, deltas: Deltas) -> str | None:
        """Content, up to the first "<tool_call>"."""
        first = text.find(START)
        if first < 0:
            return self._content.upto(text, len(text) - partial_marker_len(text, START)) or None
        self._read, self._pos = self._read_block, first + len(START)
        return self._content.upto(text, first)

    def _read_block(self, text: str, deltas: Deltas) -> str | None:
        i = skip_whitespace(text, self._pos)
        if i == len(text):
            return None
        if text[i] != "{":
            return self._end_calls()
        return self._begin_call(JsonCallScan(i), self._read_after_call)

    def _read_after_call(self, text: str, deltas: Deltas) -> str | None:
        after, i = _after_call(text, self._pos)
        if after == "invalid":
            self._read = self._read_stopped
        elif after == "closed":
            self._read, self._pos = self._read_between, i
            return ""
        return None

    def _read_between(self, text: str, deltas: Deltas) -> str | None:
        """Text between blocks is dropped; the next block may follow."""
        i = text.find(START, self._pos)
        if i < 0:
            return None
        self._read, self._pos = self._read_block, i + len(START)
        return ""
