"""Calls whose form the server forced with a constraint, so no model format is involved:

- tool_choice="required": a JSON array of calls, [{"name": "f", "parameters": {...}}, ...]
  (vLLM's format; RequiredToolCallParser);
- a named function: the output is that function's arguments object (NamedToolCallParser).

Neither is registered under a --tool-call-parser name: the server picks them by tool_choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    ToolParser,
    make_tool_call_id,
)
from pagedjax.entrypoints.openai.tool_parsers.json_call import JsonCallScan
from pagedjax.entrypoints.openai.tool_parsers.json_scan import skip_whitespace
from pagedjax.entrypoints.openai.tool_parsers.streaming import (
    Deltas,
    StreamingToolParser,
    ToolCallStreamer,
    delta_message,
)

if TYPE_CHECKING:
    from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest

ARGUMENT_KEYS = ("parameters", "arguments")


def _element_start(text: str, pos: int, first: bool) -> int | None:
    """Where the array's next call ("{") is, reading from pos (past "[" when `first`, else past
    a call): -1 when no call follows; None while undecided."""
    i = skip_whitespace(text, pos)
    if i < len(text) and not first:
        if text[i] != ",":
            return -1
        i = skip_whitespace(text, i + 1)
    if i == len(text):
        return None
    return i if text[i] == "{" else -1


def _array_start(text: str) -> int | None:
    """Past the "[" that opens the output; -1 when it does not; None while only whitespace."""
    i = skip_whitespace(text, 0)
    if i == len(text):
        return None
    return i + 1 if text[i] == "[" else -1


class RequiredToolCallParser(StreamingToolParser):
    """tool_choice="required": the calls are the array's elements, each with the verbatim text
    of its "parameters" as arguments ("{}" without), up to the first element that is not a
    valid call (a truncated output keeps its complete calls). No call: the output is content."""

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)

    def extract_tool_calls(self, model_output: str,
                           request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        calls: list[ToolCall] = []
        start = _array_start(model_output)
        if start is not None and start >= 0:
            start = _element_start(model_output, start, first=True)
        while start is not None and start >= 0:
            scan = JsonCallScan(start, ARGUMENT_KEYS)
            scan.advance(model_output)
            call = scan.finish(model_output)
            if call is None:
                break
            calls.append(ToolCall(make_tool_call_id(), call))
            start = _element_start(model_output, scan.end, first=False)
        if not calls:
            return ExtractedToolCallInformation(False, [], model_output)
        return ExtractedToolCallInformation(True, calls, None)

    def _read_start(self, text: str, deltas: Deltas) -> str | None:
        start = _array_start(text)
        if start is None:
            return None
        if start < 0:
            return self._end_calls()
        self._read, self._pos = self._read_element, start
        return ""

    def _read_element(self, text: str, deltas: Deltas) -> str | None:
        start = _element_start(text, self._pos, first=self._index < 0)
        if start is None:
            return None
        if start < 0:
            return self._end_calls()
        return self._begin_call(JsonCallScan(start, ARGUMENT_KEYS), self._read_element)


class NamedToolCallParser(ToolParser):
    """tool_choice naming a function: the whole output (stripped) is its arguments. A stream
    sends the name first, then the text as argument fragments, never content."""

    def __init__(self, name: str, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self.name = name
        self._calls = ToolCallStreamer()

    def extract_tool_calls(self, model_output: str,
                           request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        call = FunctionCall(self.name, model_output.strip() or "{}")
        return ExtractedToolCallInformation(True, [ToolCall(make_tool_call_id(), call)], None)

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: ChatCompletionRequest,
    ) -> DeltaMessage | None:
        # trailing whitespace waits: the whole-text arguments are stripped
        arguments = current_text.strip()
        return delta_message("", [self._calls.update(0, self.name, arguments)])
