"""Reasoning inside <think> ... </think> (DeepSeek-R1, Qwen3 and their kin): the shared split,
whole and streamed. Subclasses say whether text without an opening <think> is still reasoning
(`think_in_prompt`: the chat template opened it in the prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedjax.entrypoints.openai.tool_parsers.abstract_tool_parser import DeltaMessage
from pagedjax.entrypoints.openai.tool_parsers.streaming import partial_marker_len
from pagedjax.reasoning.abs_reasoning_parsers import ReasoningParser


class BaseThinkingReasoningParser(ReasoningParser):
    """An output that opens with <think> (after whitespace) reasons until </think>, or to its
    end if it stops first. Any other output reasons until </think> too; without one, it is all
    reasoning if `think_in_prompt`, else all content. Content after </think> is kept as is
    (None when empty)."""

    start_token = "<think>"
    end_token = "</think>"
    think_in_prompt = True

    def __init__(self, tokenizer: Any = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self._state = "start"  # start, reasoning, content
        self._live = True  # reasoning streams as it comes (else it waits for </think>)
        self._sent = 0  # text[:_sent] is out (or skipped: the opening <think>)
        self._searched = 0  # no </think> starts before this (while not live)

    def _opened(self, text: str) -> bool | None:
        """Whether text opens with <think> after whitespace; None while it may still."""
        head = text.lstrip()
        if len(head) < len(self.start_token) and self.start_token.startswith(head):
            return None
        return head.startswith(self.start_token)

    def extract_reasoning_content(self, model_output: str,
                                  request: Any) -> tuple[str | None, str | None]:
        opened = bool(self._opened(model_output))
        body = model_output.lstrip()[len(self.start_token):] if opened else model_output
        reasoning, end, content = body.partition(self.end_token)
        if end:
            return reasoning, content or None
        if opened or self.think_in_prompt:
            return body, None
        return None, model_output

    def extract_reasoning_content_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        text = current_text
        if self._state == "start" and not self._begin(text):
            return None
        reasoning = ""
        if self._state == "reasoning":
            reasoning = self._reasoning(text)
        content = ""
        if self._state == "content":
            content, self._sent = text[self._sent:], len(text)
        if not reasoning and not content:
            return None
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None)

    def _begin(self, text: str) -> bool:
        """Decides how the output starts; False while it cannot yet."""
        opened = self._opened(text)
        if opened is None:
            return False
        if opened:
            self._sent = len(text) - len(text.lstrip()) + len(self.start_token)
        self._live = opened or self.think_in_prompt
        self._state = "reasoning"
        return True

    def _reasoning(self, text: str) -> str:
        """The reasoning to send; moves to content past </think>."""
        end = text.find(self.end_token, self._sent if self._live else self._searched)
        if end >= 0:
            reasoning = text[self._sent:end]
            self._state, self._sent = "content", end + len(self.end_token)
            return reasoning
        if not self._live:
            self._searched = max(0, len(text) - len(self.end_token) + 1)
            return ""
        upto = len(text) - partial_marker_len(text[self._sent:], self.end_token)
        reasoning, self._sent = text[self._sent:upto], upto
        return reasoning
