"""The reasoning parser interface (vLLM's ReasoningParser) and its registry.

A reasoning parser splits a completion's text into its reasoning and the answer after it, whole
(`extract_reasoning_content`) or while it streams (`extract_reasoning_content_streaming`, one
parser per request: it keeps state). The streamed reasoning fragments add up to a prefix of the
whole-text reasoning, and the content fragments to a prefix of the whole-text content; the server
sends what a stream held back at its end, from the whole-text split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedjax.entrypoints.openai.tool_parsers.abstract_tool_parser import DeltaMessage
from pagedjax.utils.registry import Registry


def single_token_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` if the tokenizer holds it as one token; else None."""
    if tokenizer is None or not token:
        return None
    ids = tokenizer.encode(token, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class ReasoningParser:
    """Reasoning between `start_token` and `end_token` markers. Parsers work on text; the
    markers' ids (None where the tokenizer, which may be None, has no single token for them)
    serve `is_reasoning_end`, which the engine uses to start structured outputs after the
    reasoning. `chat_template_kwargs` are the request's (e.g. enable_thinking)."""

    start_token: str = ""
    end_token: str = ""

    def __init__(self, tokenizer: Any = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.model_tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.start_token_id: int | None = single_token_id(tokenizer, self.start_token)
        self.end_token_id: int | None = single_token_id(tokenizer, self.end_token)

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether token_ids (a prompt, or output so far) end past the reasoning: their last
        end marker follows their last start marker. False without an end marker id."""
        if self.end_token_id is None:
            return False
        for token_id in reversed(token_ids):
            if token_id == self.end_token_id:
                return True
            if token_id == self.start_token_id:
                return False
        return False

    def extract_reasoning_content(self, model_output: str,
                                  request: Any) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole completion; None for a part it lacks."""
        raise NotImplementedError

    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        """What to send for the new text (reasoning_content and/or content); None when
        nothing is ready yet."""
        raise NotImplementedError


class _ReasoningParsers(Registry[type[ReasoningParser]]):
    """Reasoning parsers by the name `--reasoning-parser` gives (vLLM's
    ReasoningParserManager)."""

    def get_reasoning_parser(self, name: str) -> type[ReasoningParser]:
        return self.get(name)


ReasoningParserManager = _ReasoningParsers("reasoning parser")
