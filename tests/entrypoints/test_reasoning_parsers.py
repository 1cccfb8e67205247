"""Reasoning parsers on recorded outputs: the whole-text split is vLLM's, and a stream cut
anywhere (one character per delta, and every split in two) sends reasoning and content fragments
that add up to it (or to a prefix, where the stream must wait for the end to decide)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pagedjax.reasoning import ReasoningParser, ReasoningParserManager

# (parser, chat_template_kwargs, model output, (reasoning, content), whether a stream sends it
# all before the end)
CASES: list[tuple[str, dict[str, Any] | None, str, tuple[str | None, str | None], bool]] = [
    # DeepSeek-R1: <think> written by the model, or by the template in the prompt
    ("deepseek_r1", None, "<think>\nLet me add: 2 + 2 = 4.\n</think>\n\nThe answer is 4.",
     ("\nLet me add: 2 + 2 = 4.\n", "\n\nThe answer is 4."), True),
    ("deepseek_r1", None, "Let me add.\n</think>\n\n4", ("Let me add.\n", "\n\n4"), True),
    ("deepseek_r1", None, "Still thinking about it", ("Still thinking about it", None), True),
    ("deepseek_r1", None, "<think>done</think>", ("done", None), True),
    ("deepseek_r1", None, "<think>Is 3 < 4? Use <b>, not </thought>.</think>Yes: 3 < 4 ✓.",
     ("Is 3 < 4? Use <b>, not </thought>.", "Yes: 3 < 4 ✓."), True),
    ("deepseek_r1", None, "<think></think>Hi", ("", "Hi"), True),
    ("deepseek_r1", None, "\n<think>r</think>c", ("r", "c"), True),
    ("deepseek_r1", None, "<thinking is hard</think>ok", ("<thinking is hard", "ok"), True),
    # Qwen3: the model writes <think>; without </think> thinking was off: all content
    ("qwen3", None, "<think>\nI should greet.\n</think>\n\nHello!",
     ("\nI should greet.\n", "\n\nHello!"), True),
    ("qwen3", None, "<think>\n\n</think>\n\nAnswer", ("\n\n", "\n\nAnswer"), True),
    ("qwen3", None, "reasoning here</think>\n\nanswer", ("reasoning here", "\n\nanswer"), True),
    ("qwen3", None, "Hello! How can I help?", (None, "Hello! How can I help?"), False),
    ("qwen3", None, "<think>\nstopped while thi", ("\nstopped while thi", None), True),
    ("qwen3", {"enable_thinking": False}, "Hello! How can I help?",
     (None, "Hello! How can I help?"), True),
]


def _case_id(case: tuple) -> str:
    return f"{case[0]}:{case[2][:25]!r}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_whole_text(case: tuple) -> None:
    name, kwargs, text, expected, _ = case
    parser = ReasoningParserManager.get_reasoning_parser(name)(None, kwargs)
    assert parser.extract_reasoning_content(text, None) == expected


def _cuts(text: str) -> Iterator[list[str]]:
    yield list(text)
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content, previous = "", "", ""
    for piece in pieces:
        current = previous + piece
        delta = parser.extract_reasoning_content_streaming(previous, current, piece, [], [], [])
        previous = current
        if delta is not None:
            assert delta.reasoning_content or delta.content, "an empty message"
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
    return reasoning, content


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_streaming_adds_up_to_the_whole_text(case: tuple) -> None:
    name, kwargs, text, (reasoning, content), sends_all = case
    parser_cls = ReasoningParserManager.get_reasoning_parser(name)
    for pieces in _cuts(text):
        sent_reasoning, sent_content = _stream(parser_cls(None, kwargs), pieces)
        if sends_all:
            assert (sent_reasoning, sent_content) == (reasoning or "", content or ""), pieces
        else:
            assert (reasoning or "").startswith(sent_reasoning), pieces
            assert (content or "").startswith(sent_content), pieces


def test_partial_end_marker_is_held_back() -> None:
    parser = ReasoningParserManager.get_reasoning_parser("deepseek_r1")()
    assert _stream(parser, ["<think>abc</thi"]) == ("abc", "")
    delta = parser.extract_reasoning_content_streaming("<think>abc</thi", "<think>abc</think>x",
                                                       "nk>x", [], [], [])
    assert (delta.reasoning_content, delta.content) == (None, "x")


class MarkerTokenizer:
    """<think> and </think> are single tokens (5 and 6); other text is one token a char."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return {"<think>": [5], "</think>": [6]}.get(text, [ord(c) for c in text])


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_marker_ids_and_is_reasoning_end(name: str) -> None:
    parser = ReasoningParserManager.get_reasoning_parser(name)(MarkerTokenizer())
    assert (parser.start_token, parser.end_token) == ("<think>", "</think>")
    assert (parser.start_token_id, parser.end_token_id) == (5, 6)
    assert parser.is_reasoning_end([1, 5, 2, 6, 3])
    assert not parser.is_reasoning_end([1, 6, 5, 2])  # a later <think> reopens it
    assert not parser.is_reasoning_end([1, 2])
    no_tokenizer = ReasoningParserManager.get_reasoning_parser(name)(None)
    assert (no_tokenizer.start_token_id, no_tokenizer.end_token_id) == (None, None)
    assert not no_tokenizer.is_reasoning_end([1, 5, 2, 6, 3])


def test_manager_names_the_known_parsers() -> None:
    assert {"deepseek_r1", "qwen3"} <= set(ReasoningParserManager.names())
    with pytest.raises(ValueError, match=r"'nope'.*deepseek_r1.*qwen3"):
        ReasoningParserManager.get_reasoning_parser("nope")
