"""Qwen3: "<think>\n...\n</think>\n\nanswer", the <think> written by the model (or by the chat
template, for templates that open it in the prompt). An output without </think> is the answer
alone (thinking was disabled), unless it opened with <think> itself: then it stopped while
thinking and is all reasoning. With chat_template_kwargs {"enable_thinking": False}, everything is
content from the first token (nothing waits for a </think> that will not come)."""

from __future__ import annotations

from typing import Any

from pagedjax.reasoning.abs_reasoning_parsers import ReasoningParserManager
from pagedjax.reasoning.basic_parsers import BaseThinkingReasoningParser


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    think_in_prompt = False

    def __init__(self, tokenizer: Any = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self.thinking_enabled = self.chat_template_kwargs.get("enable_thinking", True) is not False
        if not self.thinking_enabled:
            self._state = "content"

    def extract_reasoning_content(self, model_output: str,
                                  request: Any) -> tuple[str | None, str | None]:
        if not self.thinking_enabled:
            return None, model_output
        return super().extract_reasoning_content(model_output, request)
