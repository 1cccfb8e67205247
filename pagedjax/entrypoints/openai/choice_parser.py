"""One completion's text → an assistant message's parts: the reasoning (the server's
--reasoning-parser), then tool calls in the answer after it (the request's tool parser), and the
content left. Whole (`parse`) or streamed (`delta` per engine output, `finish` at the end).

Streaming parsers may hold text back (a partial `</think>` or `<tool_call>`). At the end of a
stream the whole text is parsed once more, and whatever the deltas have not sent yet is sent
(vLLM's serving_chat does the same for tool arguments): the deltas of a stream always add up to
the whole-text answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pagedjax.entrypoints.openai.tool_parsers import ToolParser
from pagedjax.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    ExtractedToolCallInformation,
    ToolCall,
)
from pagedjax.reasoning import ReasoningParser

logger = logging.getLogger("pagedjax")


@dataclass
class ParsedMessage:
    """The parts of one whole completion."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def message(self, with_reasoning: bool) -> dict[str, Any]:
        """The chat completion's `message` (OpenAI's shape; vLLM's reasoning_content)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if with_reasoning:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        return out


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""


class ChoiceParser:
    """Parses one choice of one request (stateful while streaming: one per choice)."""

    def __init__(self, request: Any, reasoning_parser: ReasoningParser | None,
                 tool_parser: ToolParser | None, parallel_tool_calls: bool = True) -> None:
        self.request = request
        self.reasoning_parser, self.tool_parser = reasoning_parser, tool_parser
        self.parallel_tool_calls = parallel_tool_calls
        self.text, self.token_ids = "", []  # the whole completion so far
        self.answer_text, self.answer_token_ids = "", []  # after the reasoning
        self.sent_reasoning, self.sent_content = "", ""
        self.sent_calls: dict[int, _SentCall] = {}

    # ---- whole ---------------------------------------------------------------------------

    def parse(self, text: str) -> ParsedMessage:
        reasoning, answer = None, text
        if self.reasoning_parser is not None:
            reasoning, answer = self.reasoning_parser.extract_reasoning_content(
                text, self.request)
        if self.tool_parser is None:
            return ParsedMessage(answer, reasoning)
        info = self._tool_calls(answer or "")
        if not info.tools_called:
            return ParsedMessage(answer, reasoning)
        return ParsedMessage(info.content, reasoning, info.tool_calls)

    def _tool_calls(self, answer: str) -> ExtractedToolCallInformation:
        info = self.tool_parser.extract_tool_calls(answer, self.request)
        if not self.parallel_tool_calls and len(info.tool_calls) > 1:
            info.tool_calls = info.tool_calls[:1]
        return info

    # ---- streamed ------------------------------------------------------------------------

    @property
    def tools_called(self) -> bool:
        return bool(self.sent_calls)

    def delta(self, delta_text: str, delta_token_ids: list[int]) -> dict[str, Any] | None:
        """The chunk `delta` for one engine output's new text (None: nothing to send yet)."""
        previous_text, previous_ids = self.text, self.token_ids
        self.text = previous_text + delta_text
        self.token_ids = previous_ids + list(delta_token_ids)
        reasoning, answer = None, delta_text
        if self.reasoning_parser is not None:
            message = self.reasoning_parser.extract_reasoning_content_streaming(
                previous_text, self.text, delta_text, previous_ids, self.token_ids,
                delta_token_ids)
            reasoning, answer = ((message.reasoning_content, message.content)
                                 if message is not None else (None, None))
        message = DeltaMessage(reasoning_content=reasoning)
        if answer:
            self._answer_delta(answer, delta_token_ids, message)
        return self._record(message)

    def _answer_delta(self, answer: str, delta_token_ids: list[int],
                      message: DeltaMessage) -> None:
        previous, previous_ids = self.answer_text, self.answer_token_ids
        self.answer_text = previous + answer
        self.answer_token_ids = previous_ids + list(delta_token_ids)
        if self.tool_parser is None:
            message.content = answer
            return
        parsed = self.tool_parser.extract_tool_calls_streaming(
            previous, self.answer_text, answer, previous_ids, self.answer_token_ids,
            delta_token_ids, self.request)
        if parsed is not None:
            message.content = parsed.content
            message.tool_calls = [call for call in parsed.tool_calls
                                  if self.parallel_tool_calls or call.index == 0]

    def _record(self, message: DeltaMessage) -> dict[str, Any] | None:
        """Note what the delta sends; its wire form, or None if it sends nothing."""
        out: dict[str, Any] = {}
        if message.reasoning_content:
            self.sent_reasoning += message.reasoning_content
            out["reasoning_content"] = message.reasoning_content
        if message.content:
            self.sent_content += message.content
            out["content"] = message.content
        calls = []
        for call in message.tool_calls:
            function = call.function
            sent = self.sent_calls.get(call.index)
            if sent is None:
                if function is None or not function.name:
                    continue  # a parser's arguments before its name: never sent alone
                sent = self.sent_calls[call.index] = _SentCall(call.id or "", function.name)
            if function is not None and function.arguments:
                sent.arguments += function.arguments
            calls.append(call.to_dict())
        if calls:
            out["tool_calls"] = calls
        return out or None

    def finish(self) -> dict[str, Any] | None:
        """At the end of the stream: what the deltas have not sent of the whole-text parse."""
        whole = self.parse(self.text)
        out: dict[str, Any] = {}
        reasoning = _remainder(whole.reasoning_content or "", self.sent_reasoning, "reasoning")
        if reasoning:
            out["reasoning_content"] = reasoning
        content = _remainder(whole.content or "", self.sent_content, "content")
        if content:
            out["content"] = content
        calls = []
        for index, call in enumerate(whole.tool_calls):
            sent = self.sent_calls.get(index)
            if sent is None:
                self.sent_calls[index] = _SentCall(call.id, call.function.name,
                                                   call.function.arguments)
                calls.append({"index": index, "id": call.id, "type": "function",
                              "function": {"name": call.function.name,
                                           "arguments": call.function.arguments}})
                continue
            rest = _remainder(call.function.arguments, sent.arguments,
                              f"tool call {index}'s arguments")
            if rest:
                sent.arguments += rest
                calls.append({"index": index, "function": {"arguments": rest}})
        if calls:
            out["tool_calls"] = calls
        return out or None


def _remainder(whole: str, sent: str, what: str) -> str:
    """What of `whole` is still to send after `sent`."""
    if whole.startswith(sent):
        return whole[len(sent):]
    logger.warning("the streamed %s (%r) is not a prefix of the whole-text parse (%r)", what,
                   sent[:80], whole[:80])
    return ""
