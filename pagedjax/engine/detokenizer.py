"""Incremental detokenization and stop-string matching.

Decoding a growing id list one token at a time is wrong for byte-level BPE: one character can span
several tokens, and a lone token decodes to U+FFFD. We decode a short window ending at the new
tokens and emit text only once it no longer ends in U+FFFD (vLLM's prefix/read offsets).
Text is kept as a list of pieces, so a long completion grows in O(1) per token.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

_INCOMPLETE = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, so leading spaces come out right
# Text that transformers' clean-up of tokenization spaces would change (" ." -> ".", " 's" ...).
_CLEAN_UP_PROBE = "Hi , it 's a test . Is n't it ? I 'm , we 're , they 've ! Do not ' quote"

Decode = Callable[[list[int], bool], str]  # (token ids, skip_special_tokens) -> text


def token_decoder(tokenizer: Any) -> Decode | None:
    """The tokenizer's decode as (ids, skip_special_tokens) -> text: the Rust tokenizer's own
    where it gives the same text as transformers' decode (no clean-up of spaces), a third of
    the cost of a call through transformers' wrapper, which the output of every sequence pays
    twice a token."""
    if tokenizer is None:
        return None
    import tokenizers  # loaded with the tokenizer already; the core imports no framework

    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        ids = tokenizer.encode(_CLEAN_UP_PROBE, add_special_tokens=False)
        if all(backend.decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)
               for skip in (True, False)):
            return backend.decode
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    """Turns appended token ids into appended text, exactly as a full decode would."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, decode: Decode | None = None) -> None:
        """decode: token_decoder(tokenizer), when the caller has it (it encodes a probe)."""
        self.decode = decode or token_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self._pieces: list[str] = []
        self.num_chars = 0

    @property
    def output_text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def append(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they completed (possibly empty) and extend the text.
        Several tokens at once give the text token-at-a-time appends would have: up to the
        last of them after which the text does not end inside a character."""
        self.token_ids.extend(new_token_ids)
        decode, skip = self.decode, self.skip_special_tokens
        if decode is None:
            return ""
        ids, end = self.token_ids, len(self.token_ids)
        prefix = decode(ids[self.prefix_offset : self.read_offset], skip)
        full = decode(ids[self.prefix_offset :], skip)
        while full.endswith(_INCOMPLETE) and end > self.read_offset + 1:
            end -= 1  # held back: the text up to an earlier token boundary
            full = decode(ids[self.prefix_offset : end], skip)
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = end
        self._pieces.append(delta)
        self.num_chars += len(delta)
        return delta

    def tail(self, num_chars: int) -> str:
        """The last num_chars characters of the text (fewer if it is shorter)."""
        parts, size = [], 0
        for piece in reversed(self._pieces):
            if size >= num_chars:
                break
            parts.append(piece)
            size += len(piece)
        return "".join(reversed(parts))[-num_chars:] if num_chars else ""

    def truncate(self, num_chars: int) -> None:
        """Keep the first num_chars characters of the text."""
        self._pieces = [self.output_text[:num_chars]]
        self.num_chars = num_chars

    def fork(self) -> IncrementalDetokenizer:
        clone = copy.copy(self)
        clone.token_ids = list(self.token_ids)
        clone._pieces = list(self._pieces)
        return clone


def find_stop_string(text: str, num_new_chars: int, stop: tuple[str, ...],
                     include_stop_str_in_output: bool) -> tuple[str, int] | None:
    """First stop string that ends inside the last num_new_chars of text.

    Returns (stop string, length to truncate text to), or None.
    """
    hits = []
    for s in stop:
        pos = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if pos >= 0:
            hits.append((pos, s))
    if not hits:
        return None
    pos, s = min(hits)
    return s, pos + len(s) if include_stop_str_in_output else pos
