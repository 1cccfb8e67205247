"""How big a request can be before the server reads or tokenizes it: the request body's byte
limit, and the character bound a prompt of at most max_model_len tokens cannot pass.

The character bound: a token covers at most as many characters of the text as its vocabulary
string is long (a byte-level token's string has one character per byte, and a character is at
least one byte), so a text of more than `longest token × max_model_len` characters has more than
max_model_len tokens, and is refused without tokenizing it. That holds when the tokenizer keeps
every character: a normalizer that composes characters (NFC, NFKC: at most 3 into 1) widens the
bound; one that can drop characters (strip, accents, control characters, a regex replace), a
pre-tokenizer that removes separators, or a model that folds a run of unknown characters into
one token leaves the server without a bound (None), and such prompts are tokenized to count.
"""

from __future__ import annotations

import json
import math
from typing import Any

BODY_BYTES_PER_TOKEN = 256  # a JSON-escaped CJK token is about 12 bytes: room for batches
MIN_BODY_BYTES = 8 * 2**20

_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_COMPOSING_NORMALIZERS = {"NFC": 3, "NFKC": 3}  # Hangul L+V+T → one syllable
_GROWING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}


def default_max_request_body_bytes(max_model_len: int) -> int:
    """A generous body limit for a context of max_model_len tokens."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """The most characters a text of max_model_len tokens can have, or None if this tokenizer
    gives no such bound (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if (shrink is None or not _keeps_every_char(spec.get("pre_tokenizer"))
            or not _covers_every_char(spec["model"], spec.get("pre_tokenizer"))):
        return None
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    return longest * shrink * max_model_len


def message_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of the messages' content (a string or text parts), which the chat
    template writes into the prompt."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return total


def _normalizer_shrink(node: dict[str, Any] | None) -> int | None:
    """By how much the normalizer can shorten a text at most; None: without limit."""
    if node is None:
        return 1
    kind = node["type"]
    if kind == "Sequence":
        factors = [_normalizer_shrink(n) for n in node["normalizers"]]
        return None if None in factors else math.prod(factors)
    if kind in _COMPOSING_NORMALIZERS:
        return _COMPOSING_NORMALIZERS[kind]
    if kind in _GROWING_NORMALIZERS:
        return 1
    if kind == "Replace" and "String" in node.get("pattern", {}) and node.get("content"):
        return max(1, math.ceil(len(node["pattern"]["String"]) / len(node["content"])))
    return None


def _keeps_every_char(node: dict[str, Any] | None) -> bool:
    if node is None:
        return True
    kind = node["type"]
    if kind == "Sequence":
        return all(_keeps_every_char(n) for n in node["pretokenizers"])
    if kind in ("Split", "Punctuation"):
        return str(node.get("behavior", "")).lower() != "removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _covers_every_char(model: dict[str, Any], pre_tokenizer: dict[str, Any] | None) -> bool:
    """Every character becomes at least part of a token: bytes, byte fallback, or one unknown
    token per unknown character."""
    if model.get("byte_fallback") or _is_byte_level(pre_tokenizer):
        return True
    return model["type"] == "BPE" and bool(model.get("unk_token")) and not model.get("fuse_unk")


def _is_byte_level(node: dict[str, Any] | None) -> bool:
    if node is None:
        return False
    if node["type"] == "Sequence":
        return any(_is_byte_level(n) for n in node["pretokenizers"])
    return node["type"] == "ByteLevel"
