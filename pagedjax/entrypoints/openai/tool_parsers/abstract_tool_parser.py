"""The tool-call parser interface (vLLM's ToolParser), its registry, and the pieces of an OpenAI
message it produces: whole tool calls, and the deltas of a stream.

A parser finds calls in a completion's text, whole (`extract_tool_calls`) or while it streams
(`extract_tool_calls_streaming`, one parser per request: it keeps state). The server relies on:
the streamed content fragments add up to a prefix of the whole-text `content`, and for each call
index the name is sent once (with its id and type "function"), then argument fragments that add
up to a prefix of the whole-text `arguments`. What a stream holds back, the server sends at the
end from the whole-text parse.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedjax.utils.registry import Registry

if TYPE_CHECKING:
    from pagedjax.entrypoints.openai.protocol import ChatCompletionRequest


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _without_none(**fields: Any) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if value is not None}


@dataclass
class FunctionCall:
    name: str
    arguments: str  # JSON text of an object

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "function": self.function.to_dict()}


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # the text that is not a call (None: none)


@dataclass
class DeltaFunctionCall:
    name: str | None = None
    arguments: str | None = None  # the next piece of the arguments' JSON text

    def to_dict(self) -> dict[str, Any]:
        return _without_none(name=self.name, arguments=self.arguments)


@dataclass
class DeltaToolCall:
    index: int  # which call of the message (0, 1, ...)
    id: str | None = None  # with the name, once
    type: str | None = None
    function: DeltaFunctionCall | None = None

    def to_dict(self) -> dict[str, Any]:
        out = _without_none(index=self.index, id=self.id, type=self.type)
        if self.function is not None:
            out["function"] = self.function.to_dict()
        return out


@dataclass
class DeltaMessage:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = _without_none(content=self.content, reasoning_content=self.reasoning_content)
        if self.tool_calls:
            out["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        return out


def keep_special_tokens(request: Any) -> Any:
    """A request with tools keeps special tokens in its text: parsers look for markers such as
    <tool_call> or <|python_tag|>, which tokenizers often hold as special tokens."""
    if getattr(request, "tools", None) and getattr(request, "tool_choice", None) != "none":
        request.skip_special_tokens = False
    return request


class ToolParser:
    """Finds tool calls in a completion's text. Parsers work on text alone: the tokenizer (None
    or an HF tokenizer) is for subclasses that want it, never required."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.model_tokenizer = tokenizer

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """The request as this parser needs it (e.g. special tokens kept in the text)."""
        return request

    def extract_tool_calls(self, model_output: str,
                           request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        """The calls in a whole completion."""
        raise NotImplementedError

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: ChatCompletionRequest,
    ) -> DeltaMessage | None:
        """What to send for the new text `delta_text` (current_text = previous_text +
        delta_text); None when nothing is ready yet."""
        raise NotImplementedError


class _ToolParsers(Registry[type[ToolParser]]):
    """Tool parsers by the name `--tool-call-parser` gives (vLLM's ToolParserManager)."""

    def get_tool_parser(self, name: str) -> type[ToolParser]:
        return self.get(name)


ToolParserManager = _ToolParsers("tool call parser")
