"""Incremental detokenization and stop-string matching.

Decoding a growing id list one token at a time is wrong for byte-level BPE: one character can span
several tokens, and a lone token decodes to U+FFFD. We decode a short window ending at the new
tokens and emit text only once it no longer ends in U+FFFD (vLLM's prefix/read offsets).
"""

from __future__ import annotations

import copy
from typing import Any

_INCOMPLETE = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, so leading spaces come out right


class IncrementalDetokenizer:
    """Turns appended token ids into appended text, exactly as a full decode would."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""

    def append(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they completed (possibly empty) and extend output_text."""
        self.token_ids.extend(new_token_ids)
        if self.tokenizer is None:
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset],
                        skip_special_tokens=self.skip_special_tokens)
        full = decode(self.token_ids[self.prefix_offset :],
                      skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def fork(self) -> IncrementalDetokenizer:
        clone = copy.copy(self)
        clone.token_ids = list(self.token_ids)
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
