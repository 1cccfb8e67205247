"""A request body → SamplingParams, generically: every body field named like a SamplingParams
field passes through (so fields SamplingParams gains later work at once), fields the endpoints
read themselves are skipped, and any other field with an effect is a 400 that names it.
Constraints come from OpenAI's response_format or vLLM's structured_outputs (not both)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedjax.entrypoints.openai.errors import OpenAIError, bad_request
from pagedjax.entrypoints.openai.protocol import (
    ENDPOINT_FIELDS,
    SamplingFields,
    sampling_param_names,
)
from pagedjax.sampling_params import SamplingParams, StructuredOutputsParams

# Values that change nothing, accepted whether or not SamplingParams has the field yet.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({},), "prompt_logprobs": (None,),
}
_STRUCTURED_FIELDS = frozenset(f.name for f in dataclasses.fields(StructuredOutputsParams))


def _convert(name: str, value: Any) -> Any:
    """OpenAI's wire format → SamplingParams' (logit_bias keys are token ids as strings)."""
    if name == "logit_bias" and isinstance(value, dict):
        try:
            return {int(k): float(v) for k, v in value.items()}
        except ValueError:
            raise OpenAIError(400, f"logit_bias={value!r}: keys must be token ids",
                              param="logit_bias") from None
    return value


def to_sampling_params(request: SamplingFields, *, max_tokens: int | None,
                       logprobs: int | None, defaults: dict[str, Any],
                       structured_outputs: StructuredOutputsParams | None = None
                       ) -> SamplingParams:
    """SamplingParams for the request; `defaults` (the model's generation_config) fill what the
    request leaves out; `structured_outputs` (a forced tool call's) over the request's own.
    Raises OpenAIError(400) naming a bad or unsupported field."""
    supported = sampling_param_names()
    kwargs = {k: v for k, v in defaults.items() if k != "max_tokens"}
    given = set(request.model_fields_set) | set(request.model_extra or {})
    for name in sorted(given - ENDPOINT_FIELDS):
        value = getattr(request, name)
        if name in supported:
            if value is not None:  # null: the default
                kwargs[name] = _convert(name, value)
        elif value not in _NEUTRAL.get(name, (None,)):
            raise OpenAIError(400, f"{name}={value!r} is not supported by this server; remove "
                                   f"'{name}' from the request.", param=name)
    if request.best_of not in (None, request.n):
        raise OpenAIError(400, f"best_of={request.best_of} is not supported; leave it out or "
                               "set it to n.", param="best_of")
    kwargs.update(max_tokens=max_tokens, logprobs=logprobs,
                  structured_outputs=structured_outputs or structured_outputs_params(request))
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise bad_request(e) from None


def structured_outputs_params(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint: response_format {"type": "json_object"} or {"type":
    "json_schema", "json_schema": {"schema": ...}} (OpenAI's), or structured_outputs {"json",
    "regex", "choice", "grammar", "json_object", ...} (vLLM's); None for none or "text".
    Raises OpenAIError(400) naming the field that is wrong."""
    response_format, fields = request.response_format, request.structured_outputs
    if response_format is not None and response_format.type != "text":
        if fields is not None:
            raise OpenAIError(400, "give response_format or structured_outputs, not both.",
                              param="response_format")
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = response_format.json_schema and response_format.json_schema.json_schema
        if schema is None:
            raise OpenAIError(400, 'response_format of type "json_schema" needs '
                                   "json_schema.schema, the JSON schema of the output.",
                              param="response_format")
        return StructuredOutputsParams(json=schema)
    if fields is None:
        return None
    unknown = sorted(set(fields) - _STRUCTURED_FIELDS)
    if unknown:
        raise OpenAIError(400, f"structured_outputs has unknown keys {unknown}; it takes "
                               f"{sorted(_STRUCTURED_FIELDS)}.", param="structured_outputs")
    for name in ("json_object", "disable_any_whitespace"):
        if not isinstance(fields.get(name, False), (bool, type(None))):
            raise OpenAIError(400, f"structured_outputs.{name}={fields[name]!r} is invalid: "
                                   "expected true or false.", param="structured_outputs")
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as e:
        raise OpenAIError(400, str(e), param="structured_outputs") from None
