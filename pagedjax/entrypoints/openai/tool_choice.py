"""A chat request's `tools` and `tool_choice` → how it is served (vLLM's rules and 400s):

- "none" (the default without tools): no tools reach the template, nothing is parsed;
- "auto" (the default with tools): the model decides; the server's --tool-call-parser finds
  calls in its text, so it needs --enable-auto-tool-choice;
- "required" and a named function: the output is constrained by the structured-outputs engine
  (a JSON array of {"name", "parameters"} objects, or the named function's arguments object),
  so a call is valid by construction, with any model and any parser.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedjax.entrypoints.openai.errors import OpenAIError
from pagedjax.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
)
from pagedjax.entrypoints.openai.tool_parsers import ToolParser
from pagedjax.entrypoints.openai.tool_parsers.required_tool_parser import (
    NamedToolCallParser,
    RequiredToolCallParser,
)
from pagedjax.sampling_params import StructuredOutputsParams

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How one chat request's tools are served."""

    tools: list[dict[str, Any]] | None  # for the chat template ({"type", "function"} dicts)
    structured_outputs: StructuredOutputsParams | None  # a forced call's constraint
    make_parser: Callable[[], ToolParser] | None  # one per choice; None: no tool parsing
    parallel_tool_calls: bool = True

    @property
    def forced(self) -> bool:
        return self.structured_outputs is not None


def plan_tools(request: Any, tool_parser_cls: type[ToolParser] | None,
               enable_auto_tool_choice: bool, tokenizer: Any) -> ToolPlan:
    """The request's ToolPlan; raises OpenAIError(400) in vLLM's words for bad combinations."""
    tools: list[ChatCompletionToolsParam] | None = request.tools or None
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = request.parallel_tool_calls is not False
    if tools is None:
        if choice != "none":
            raise OpenAIError(400, "When using `tool_choice`, `tools` must be set.",
                              param="tool_choice")
        return ToolPlan(None, None, None, parallel)
    if choice == "none":
        return ToolPlan(None, None, None, parallel)
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice == "auto":
        if not (enable_auto_tool_choice and tool_parser_cls is not None):
            raise OpenAIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                                   "--tool-call-parser to be set; start the server with both, "
                                   'or send tool_choice "required" or a named function.',
                              param="tool_choice")
        return ToolPlan(template_tools, None, lambda: tool_parser_cls(tokenizer), parallel)
    if request.structured_outputs is not None or (
            request.response_format is not None and request.response_format.type != "text"):
        raise OpenAIError(400, f"tool_choice={_shown(choice)} constrains the output to a tool "
                               "call; it cannot be combined with response_format or "
                               "structured_outputs.", param="tool_choice")
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        name = choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise OpenAIError(400, f"Tool '{name}' has not been passed in `tools` (they are "
                                   f"{[t.function.name for t in tools]}).",
                              param="tool_choice")
        schema = tool.function.parameters or EMPTY_PARAMETERS
        return ToolPlan(template_tools, _compact_json(schema),
                        lambda: NamedToolCallParser(name), parallel)
    return ToolPlan(template_tools, _compact_json(required_tool_calls_schema(tools, parallel)),
                    lambda: RequiredToolCallParser(tokenizer), parallel)


def _compact_json(schema: dict[str, Any]) -> StructuredOutputsParams:
    """A forced call's constraint: JSON without free whitespace between tokens, so that a
    call is as short as its content and ends (a model may not pad it until max_tokens)."""
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def required_tool_calls_schema(tools: list[ChatCompletionToolsParam],
                               parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of tool_choice "required"'s output (vLLM's): an array of one call or
    more (exactly one without parallel_tool_calls), each {"name": one of the tools, "parameters":
    that tool's arguments} and nothing else (vLLM's lets other keys in, which a model can
    fill until max_tokens); each tool's `$defs` move to the top, where its `$ref`s point."""
    variants, defs = [], {}
    for tool in tools:
        parameters = copy.deepcopy(tool.function.parameters or EMPTY_PARAMETERS)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise OpenAIError(400, f"tools define $defs['{name}'] twice, differently; give "
                                       "the definitions distinct names.", param="tools")
        variants.append({"properties": {"name": {"type": "string",
                                                 "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def check_tool_schemas(tools: list[ChatCompletionToolsParam] | None) -> None:
    """Each tool's `parameters` must be a JSON schema the structured-outputs engine reads
    (checked whatever tool_choice is: a bad schema is the client's 400, not a later surprise)."""
    from pagedjax.structured_output.grammar import grammar_key

    for i, tool in enumerate(tools or ()):
        if tool.function.parameters is None:
            continue
        try:
            grammar_key(StructuredOutputsParams(json=tool.function.parameters))
        except ValueError as e:
            reason = str(e).removeprefix("StructuredOutputsParams.json is not a valid JSON "
                                         "schema: ")
            raise OpenAIError(400, f"tools[{i}].function.parameters (of '{tool.function.name}')"
                                   f" is not a valid JSON schema: {reason}",
                              param="tools") from None


def tool_messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant `tool_calls` with their arguments as objects (OpenAI sends JSON text; chat
    templates index into them), as vLLM passes them."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not calls:
            out.append(message)
            continue
        parsed = []
        for call in calls:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments)
                except json.JSONDecodeError:
                    raise OpenAIError(400, f"tool_calls arguments {arguments[:80]!r} are not "
                                           "valid JSON; send the arguments the model returned.",
                                      param="messages") from None
            parsed.append({**call, "function": function})
        out.append({**message, "tool_calls": parsed})
    return out


def _shown(choice: Any) -> str:
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return f"{{function: {choice.function.name}}}"
    return repr(choice)
