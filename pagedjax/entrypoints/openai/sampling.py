"""A request body → SamplingParams, generically: every body field named like a SamplingParams
field passes through (so fields SamplingParams gains later work at once), fields the endpoints
read themselves are skipped, and any other field with an effect is a 400 that names it."""

from __future__ import annotations

from typing import Any

from pagedjax.entrypoints.openai.errors import OpenAIError, bad_request
from pagedjax.entrypoints.openai.protocol import (
    ENDPOINT_FIELDS,
    SamplingFields,
    sampling_param_names,
)
from pagedjax.sampling_params import SamplingParams

# Values that change nothing, accepted whether or not SamplingParams has the field yet.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({},), "prompt_logprobs": (None,), "tools": (None, []),
    "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
}


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
                       logprobs: int | None, defaults: dict[str, Any]) -> SamplingParams:
    """SamplingParams for the request; `defaults` (the model's generation_config) fill what the
    request leaves out. Raises OpenAIError(400) naming a bad or unsupported field."""
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
    kwargs.update(max_tokens=max_tokens, logprobs=logprobs)
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise bad_request(e) from None
