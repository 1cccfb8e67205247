"""Request bodies of the OpenAI-compatible API, as pydantic models (OpenAI's names, plus vLLM's
extra sampling fields), and which fields are whose. Unknown fields are kept (`extra="allow"`):
sampling.py passes those that SamplingParams has and rejects the rest by name."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedjax.sampling_params import SamplingParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    # "schema" on the wire (the name would shadow BaseModel.schema)
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatCompletionToolsParam(BaseModel):
    """One of `tools`: {"type": "function", "function": {"name", "description", "parameters"}}."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(BaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(BaseModel):
    """tool_choice naming a function: {"type": "function", "function": {"name": ...}}."""

    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


class SamplingFields(OpenAIBaseModel):
    """What both endpoints take besides the prompt: OpenAI's fields, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    # StructuredOutputsParams' fields: json, regex, choice, grammar, json_object, ... (sampling.py)
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    # text, texts, token ids, or lists of token ids (one prompt each)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None  # OpenAI's older name for max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # tool calling (OpenAI's): tool_choice defaults to "auto" with tools, "none" without
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses (OpenAI's Responses API): what this server reads of it. `input` is
    text or a list of items (messages, function_call, function_call_output); `tools` are flat
    {"type": "function", "name", "parameters"}; `text.format` is response_format's twin."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    stream: bool | None = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # accepted; responses are not stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extras that pass to sampling
    top_k: int | None = None
    seed: int | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


# Read by the endpoints, not sampling parameters as they are (or metadata with no effect: user).
ENDPOINT_FIELDS = frozenset({
    "model", "prompt", "messages", "stream", "stream_options", "echo", "user", "max_tokens",
    "max_completion_tokens", "logprobs", "top_logprobs", "best_of", "add_generation_prompt",
    "continue_final_message", "chat_template", "chat_template_kwargs", "suffix",
    "response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls",
})


def request_field_names() -> frozenset[str]:
    """Every field a request may name (to point an error's `param` at it)."""
    return ENDPOINT_FIELDS | sampling_param_names()


def sampling_param_names() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(SamplingParams)
                     if f.init and not f.name.startswith("_") and f.name != "output_kind")
