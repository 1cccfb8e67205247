"""What a streaming tool parser has sent so far: content up to some index of the text, and of
each call its name (once, with a new id) and the part of its arguments' text already out. Parsers
say what is known; these send only the new part of it. And the base of parsers that stream as a
machine of states."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ToolParser,
    make_tool_call_id,
)
from pagedjax.entrypoints.openai.tool_parsers.json_call import JsonCallScan

Deltas = list[DeltaToolCall | None]


def partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `marker`: text to hold
    back, since it may be the marker's start."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ContentStreamer:
    """Content sent up to an index of the text. Leading whitespace waits for a non-whitespace
    character: the whole-text parsers give content None when only whitespace precedes a call."""

    def __init__(self) -> None:
        self.sent = 0  # text[:sent] is out
        self._visible = False  # a non-whitespace character was sent

    def upto(self, text: str, end: int) -> str:
        """The content to send so that text[:end] is out."""
        if end <= self.sent:
            return ""
        if not self._visible:
            if not text[:end].strip():
                return ""
            self._visible = True
        out, self.sent = text[self.sent:end], end
        return out


class ToolCallStreamer:
    """Each call's name goes once, with a new id and type "function"; then its arguments go as
    the new part of their text. A call's arguments wait until its name is known."""

    def __init__(self) -> None:
        self.sent_arguments: list[str] = []  # per call whose name is out

    @property
    def num_started(self) -> int:
        return len(self.sent_arguments)

    def update(self, index: int, name: str | None, arguments: str | None) -> DeltaToolCall | None:
        """The delta for call `index`, given its name (None while unknown) and its arguments'
        text so far (a prefix of their final text)."""
        if name is None:
            return None
        arguments = arguments or ""
        if index == len(self.sent_arguments):
            self.sent_arguments.append(arguments)
            return DeltaToolCall(index, make_tool_call_id(), "function",
                                 DeltaFunctionCall(name, arguments or None))
        sent = self.sent_arguments[index]
        assert arguments.startswith(sent), (index, sent, arguments)
        if len(arguments) == len(sent):
            return None
        self.sent_arguments[index] = arguments
        return DeltaToolCall(index, function=DeltaFunctionCall(arguments=arguments[len(sent):]))


def delta_message(content: str, tool_calls: list[DeltaToolCall | None]) -> DeltaMessage | None:
    """The message for one step; None when it sends nothing."""
    calls = [call for call in tool_calls if call is not None]
    if not content and not calls:
        return None
    return DeltaMessage(content=content or None, tool_calls=calls)


class StreamingToolParser(ToolParser):
    """A parser whose stream is a machine of states. The state is the method `self._read`: it
    reads on in the text and returns the content to send (maybe "") after moving to the next
    state, or None when it needs more text; it appends tool-call deltas to `deltas`. The first
    state is `_read_start`."""

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._content = ContentStreamer()
        self._calls = ToolCallStreamer()
        self._read: Callable[[str, Deltas], str | None] = self._read_start
        self._pos = 0  # where the state reads on
        self._scan: JsonCallScan | None = None  # the JSON call being read
        self._index = -1  # its index
        self._after_call: Callable[[str, Deltas], str | None] = self._read_stopped

    def _read_start(self, text: str, deltas: Deltas) -> str | None:
        raise NotImplementedError

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        content, deltas = "", []
        while (step := self._read(current_text, deltas)) is not None:
            content += step
        return delta_message(content, deltas)

    def _begin_call(self, scan: JsonCallScan,
                    then: Callable[[str, Deltas], str | None]) -> str:
        """Read the next call with `scan` (its name, then its arguments as they come); state
        `then` reads on from where it ends (`self._pos`)."""
        self._read, self._scan, self._after_call = self._read_call, scan, then
        self._index += 1
        return ""

    def _read_call(self, text: str, deltas: Deltas) -> str | None:
        scan, index = self._scan, self._index
        scan.advance(text)
        if scan.error:
            return self._end_calls()
        if not scan.done:
            deltas.append(self._calls.update(index, scan.name(), scan.arguments(text)))
            return None
        call = scan.finish(text)
        if call is None:
            return self._end_calls()
        deltas.append(self._calls.update(index, call.name, call.arguments))
        self._read, self._pos = self._after_call, scan.end
        return ""

    def _end_calls(self) -> str:
        """No (more) calls follow, or the text is no call after all: all of it is content if
        no call went out yet (as the whole-text parse will say); else nothing more is sent."""
        self._read = self._read_stopped if self._calls.num_started else self._read_fallback
        return ""

    def _read_fallback(self, text: str, deltas: Deltas) -> str | None:
        return self._content.upto(text, len(text)) or None

    def _read_stopped(self, text: str, deltas: Deltas) -> str | None:
        return None
