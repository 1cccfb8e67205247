"""Where a JSON value ends, read while its text still grows (strings, escapes, {} and [] nesting),
and where each member of a JSON object lies. Streaming tool parsers send an arguments value's text
verbatim as it arrives and need to know when it is complete; the whole-text parsers use the same
scans, so both paths cut the text at the same places.

Both scans are resumable: call `advance(text)` each time the text grows (the same text, longer);
they read only the new characters. They check structure only; a complete value is checked with
json.loads by whoever uses it.
"""

from __future__ import annotations

import json

WHITESPACE = " \t\r\n"
# characters of a number or of true / false / null
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")


def skip_whitespace(text: str, pos: int) -> int:
    """The index of the first non-whitespace character at or after pos (len(text) if none)."""
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


class JsonValueScan:
    """One JSON value starting at `start` (its first character, never whitespace)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start  # the next character to read
        self.closers: list[str] = []  # "}" / "]" expected, innermost last
        self.in_string = False
        self.escaped = False
        self.end: int | None = None  # just past the value, once complete
        self.error = False

    @property
    def done(self) -> bool:
        return self.end is not None

    def advance(self, text: str) -> None:
        i = self.pos
        while i < len(text) and self.end is None and not self.error:
            self._read(text[i], i)
            i += 1
        self.pos = self.end if self.end is not None else i

    def _read(self, c: str, i: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if not self.closers:
                    self.end = i + 1
        elif not self.closers and i > self.start:  # in a number or literal at the top
            if c not in _SCALAR_CHARS:
                self.end = i  # c is not part of it
        elif c == '"':
            self.in_string = True
        elif c == "{" or c == "[":
            self.closers.append("}" if c == "{" else "]")
        elif c == "}" or c == "]":
            if not self.closers or self.closers.pop() != c:
                self.error = True
            elif not self.closers:
                self.end = i + 1
        elif not self.closers and c not in _SCALAR_CHARS:
            self.error = True  # no value starts so


class JsonObjectScan:
    """A JSON object starting at `start` (its "{"), noting where each top-level member's value
    lies: `members[key] = (value start, value end or None while incomplete)`, in text order."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start + 1
        self.state = "first_key"  # first_key, key, colon, value, comma_or_close
        self.members: dict[str, tuple[int, int | None]] = {}
        self._key: str | None = None
        self._scan: JsonValueScan | None = None  # the key or value being read
        self.end: int | None = None
        self.error = False

    @property
    def done(self) -> bool:
        return self.end is not None

    def advance(self, text: str) -> None:
        while self.end is None and not self.error:
            if self._scan is not None:
                if not self._advance_scan(text):
                    return
                continue
            i = skip_whitespace(text, self.pos)
            if i == len(text):
                self.pos = i
                return
            self._read(text, i)

    def _read(self, text: str, i: int) -> None:
        """One structural character at i (not inside a key or value)."""
        c = text[i]
        self.pos = i + 1
        if self.state in ("first_key", "key"):
            if c == '"':
                self._scan = JsonValueScan(i)
            elif c == "}" and self.state == "first_key":
                self.end = i + 1
            else:
                self.error = True
        elif self.state == "colon":
            self.error = c != ":"
            self.state = "value"
        elif self.state == "value":
            self._scan = JsonValueScan(i)
            if self._key is not None:
                self.members[self._key] = (i, None)
            self.pos = i
        elif c == ",":  # comma_or_close
            self.state = "key"
        elif c == "}":
            self.end = i + 1
        else:
            self.error = True

    def _advance_scan(self, text: str) -> bool:
        """Reads on in the key or value; False while it is incomplete."""
        scan = self._scan
        scan.advance(text)
        self.pos = scan.pos
        if scan.error:
            self.error = True
            return False
        if not scan.done:
            return False
        self._scan = None
        if self.state == "value":
            if self._key is not None:
                self.members[self._key] = (scan.start, scan.end)
            self.state = "comma_or_close"
        else:
            key = _json_string(text[scan.start:scan.end])
            self.error = not isinstance(key, str)
            # a repeated key's later value is not noted: what was read of the first stays so
            self._key = key if key not in self.members else None
            self.state = "colon"
        return True


def _json_string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:  # an invalid escape
        return None
