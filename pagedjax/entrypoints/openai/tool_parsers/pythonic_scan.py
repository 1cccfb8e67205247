"""Where each call of a Python list of calls, `[f(a=1, b="x"), g()]`, begins and ends, read
while the text grows (Python's strings, triple-quoted ones included, and bracket nesting). The
streaming pythonic parser sends a call once its ")" closes it; anything that cannot be such a list
(`[1]`, `[Note: ...`) is an error at once, so that the text can go out as content.
"""

from __future__ import annotations

from pagedjax.entrypoints.openai.tool_parsers.json_scan import WHITESPACE

_OPENERS = {"(": ")", "[": "]", "{": "}"}


def _is_name_char(c: str) -> bool:
    return c.isalnum() or c == "_"


class PythonCallListScan:
    """A list starting at `start` (its "["). `calls` holds each complete call's (start, end);
    `end` is set past the "]" that closes the list; `error` when it is no list of calls."""

    def __init__(self, start: int) -> None:
        self.pos = start + 1
        self.state = "before"  # before (a call), name, after_name, args, after (a call)
        self.closers: list[str] = []  # inside a call's arguments
        self.quote: str | None = None  # the open string's quote: ', ", ''' or \"\"\"
        self.escaped = False
        self.call_start = 0
        self.calls: list[tuple[int, int]] = []
        self.end: int | None = None
        self.error = False

    def advance(self, text: str) -> None:
        while self.pos < len(text) and self.end is None and not self.error:
            step = self._read_string(text) if self.quote else self._read(text)
            if step == 0:
                return  # a quote that may be the start of a triple quote: wait
            self.pos += step

    def _read_string(self, text: str) -> int:
        """Reads on in a string literal; the number of characters read."""
        i, quote = self.pos, self.quote
        if self.escaped:
            self.escaped = False
        elif text[i] == "\\":
            self.escaped = True
        elif text.startswith(quote, i):
            self.quote = None
            return len(quote)
        elif len(quote) == 3 and quote.startswith(text[i:]):
            return 0
        return 1

    def _read(self, text: str) -> int:
        i, c = self.pos, text[self.pos]
        if self.state == "args":
            return self._read_argument(text)
        if c in WHITESPACE:
            if self.state == "name":
                self.state = "after_name"
        elif self.state == "before" and (c.isalpha() or c == "_"):
            self.state, self.call_start = "name", i
        elif self.state == "before" and c == "]":
            self.end = i + 1  # "[]" or a trailing comma
        elif self.state == "name" and _is_name_char(c):
            pass
        elif self.state in ("name", "after_name") and c == "(":
            self.state, self.closers = "args", [")"]
        elif self.state == "after" and c in ",]":
            self.state = "before"
            if c == "]":
                self.end = i + 1
        else:
            self.error = True
        return 1

    def _read_argument(self, text: str) -> int:
        i, c = self.pos, text[self.pos]
        if c in "'\"":
            if text.startswith(c * 3, i):
                self.quote = c * 3
                return 3
            if (c * 3).startswith(text[i:]):
                return 0  # "" or '' at the end: an empty string, or a triple quote's start
            self.quote = c
        elif c in _OPENERS:
            self.closers.append(_OPENERS[c])
        elif c in ")]}":
            if self.closers.pop() != c:
                self.error = True
            elif not self.closers:
                self.calls.append((self.call_start, i + 1))
                self.state = "after"
        return 1
