"""One tool call written as a JSON object, {"name": "f", "arguments": {...}}, read whole or while
it grows. hermes, llama3_json and tool_choice="required" write calls this way.

The arguments are the verbatim text of their JSON value, as the model wrote it (not json.dumps of
it): a stream can then send that text as it arrives, and it adds up to the whole-text result.
"""

from __future__ import annotations

import json
from typing import Any

from pagedjax.entrypoints.openai.tool_parsers.abstract_tool_parser import FunctionCall
from pagedjax.entrypoints.openai.tool_parsers.json_scan import JsonObjectScan


class JsonCallScan:
    """A call object starting at `start` (its "{"). The arguments' key is the first of
    `argument_keys` present; without one the arguments are "{}", or, with `arguments_required`,
    the object is no call (and its name is not reported before its arguments begin)."""

    def __init__(self, start: int, argument_keys: tuple[str, ...] = ("arguments",),
                 arguments_required: bool = False) -> None:
        self.object = JsonObjectScan(start)
        self.argument_keys = argument_keys
        self.arguments_required = arguments_required
        self._name: str | None = None
        self._bad_name = False

    @property
    def error(self) -> bool:
        return self.object.error or self._bad_name

    @property
    def done(self) -> bool:
        return self.object.done

    @property
    def end(self) -> int | None:
        return self.object.end

    def advance(self, text: str) -> None:
        self.object.advance(text)
        span = self.object.members.get("name")
        if self._name is None and span is not None and span[1] is not None:
            name = _loads(text[span[0]:span[1]])
            self._name = name if isinstance(name, str) else None
            self._bad_name = self._name is None

    def _arguments_key(self) -> str | None:
        return next((key for key in self.object.members if key in self.argument_keys), None)

    def name(self) -> str | None:
        """The name once known (with `arguments_required`: once the arguments have begun)."""
        if self.arguments_required and self._arguments_key() is None:
            return None
        return self._name

    def arguments(self, text: str) -> str | None:
        """The arguments' text read so far (None before they begin)."""
        key = self._arguments_key()
        if key is None:
            return None
        start, end = self.object.members[key]
        return text[start:end if end is not None else self.object.pos]

    def finish(self, text: str) -> FunctionCall | None:
        """The call, once the object is complete; None when it is not a valid call."""
        if not self.done or self.error or self._name is None:
            return None
        if not isinstance(_loads(text[self.object.start:self.object.end]), dict):
            return None
        arguments = self.arguments(text)
        if arguments is None and self.arguments_required:
            return None
        return FunctionCall(self._name, arguments if arguments is not None else "{}")


_INVALID = object()


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _INVALID
