"""Pythonic tool calls (Llama 3.2 / 4, ToolACE; vLLM's "pythonic"): the output is a Python list
of calls with keyword arguments of literal values,

    [get_weather(city="Paris", days=3), get_time()]

optionally wrapped in <|python_start|> ... <|python_end|> (Llama 4). It is read with `ast`, never
evaluated; arguments become json.dumps of the keyword dict. An output that is not such a list is
content; with calls there is no content. A stream sends each call (name and arguments in one
delta) once its ")" closes it.
"""

from __future__ import annotations

import ast
import json
from typing import TYPE_CHECKING, Any

from pagedjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    ToolParserManager,
    make_tool_call_id,
)
from pagedjax.entrypoints.openai.tool_parsers.json_scan import skip_whitespace
from pagedjax.entrypoints.openai.tool_parsers.pythonic_scan import PythonCallListScan
from pagedjax.entrypoints.openai.tool_parsers.streaming import Deltas, StreamingToolParser

if TYPE_CHECKING:
    from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


def function_call(node: ast.expr) -> FunctionCall | None:
    """`name(key=literal, ...)` as a call; None for anything else (positional arguments,
    attributes, non-literal values, values JSON cannot hold)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        return FunctionCall(node.func.id, json.dumps(arguments, ensure_ascii=False))
    except (TypeError, ValueError):
        return None


def _list_start(text: str) -> int | None:
    """Where the list's "[" is; -1 when the output is content; None while undecided."""
    i = skip_whitespace(text, 0)
    if PYTHON_START.startswith(text[i:]):
        return None
    if text.startswith(PYTHON_START, i):
        i = skip_whitespace(text, i + len(PYTHON_START))
        if i == len(text):
            return None
    return i if text[i] == "[" else -1


def _whole_calls(text: str) -> list[ToolCall] | None:
    start = _list_start(text)
    if start is None or start < 0:
        return None
    body = text[start:].rstrip().removesuffix(PYTHON_END)
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = [function_call(node) for node in tree.body.elts]
    if any(call is None for call in calls):
        return None
    return [ToolCall(make_tool_call_id(), call) for call in calls]


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(StreamingToolParser):

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._scan: PythonCallListScan | None = None

    def extract_tool_calls(self, model_output: str,
                           request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        calls = _whole_calls(model_output)
        if calls is None:
            return ExtractedToolCallInformation(False, [], model_output)
        return ExtractedToolCallInformation(True, calls, None)

    def _read_start(self, text: str, deltas: Deltas) -> str | None:
        start = _list_start(text)
        if start is None:
            return None
        if start < 0:
            return self._end_calls()
        self._read, self._scan = self._read_list, PythonCallListScan(start)
        return ""

    def _read_list(self, text: str, deltas: Deltas) -> str | None:
        scan = self._scan
        scan.advance(text)
        for index in range(self._calls.num_started, len(scan.calls)):
            start, end = scan.calls[index]
            call = _parse_call(text[start:end])
            if call is None:
                return self._end_calls()
            deltas.append(self._calls.update(index, call.name, call.arguments))
        if scan.error or scan.end is not None:
            return self._end_calls()
        return None


def _parse_call(source: str) -> FunctionCall | None:
    try:
        return function_call(ast.parse(source, mode="eval").body)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
