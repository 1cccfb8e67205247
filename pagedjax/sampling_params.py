"""SamplingParams: vLLM's names, validated on construction."""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5  # temperatures below this sample greedily, as in vLLM
MAX_LOGPROBS = 20  # most top logprobs a request may ask for per token
MAX_LOGIT_BIAS = 100.0  # logit_bias values are clamped to [-100, 100], as OpenAI's and vLLM's


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")  # exactly one is given


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): exactly one of

    - json: a JSON schema (a dict or its JSON text); json_object=True: any JSON object;
    - regex: the output fully matches it (Rust regex syntax, as llguidance reads it);
    - choice: the output is one of these strings;
    - grammar: a context-free grammar in EBNF/GBNF (llama.cpp's) or Lark syntax.

    whitespace_pattern (json and json_object only) is the regex JSON's whitespace must match;
    disable_any_whitespace=True allows none (compact JSON). Each token a completion samples is
    drawn from the tokens the constraint allows next (a mask on the device), so the output
    always parses; a finished grammar ends the completion (finish_reason "stop").
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams takes exactly one of json, json_object, "
                             f"regex, choice and grammar; got {given or 'none'}.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"StructuredOutputsParams.json={self.json!r} is invalid: expected "
                             "a JSON schema as a dict or a JSON string.")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name}={value!r} is invalid: "
                                 "expected a non-empty string.")
        if self.choice is not None:
            choice = self.choice
            if (not isinstance(choice, (list, tuple)) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise ValueError(f"StructuredOutputsParams.choice={choice!r} is invalid: "
                                 "expected a non-empty list of non-empty strings.")
            self.choice = list(choice)
        if self.whitespace_pattern is not None and self.json is None and not self.json_object:
            raise ValueError("StructuredOutputsParams.whitespace_pattern applies to json and "
                             "json_object only.")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        return self._given()[0]

    def _given(self) -> list[str]:
        """The constraints set, in _CONSTRAINTS' order."""
        return [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a running request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    temperature 0 is greedy; top_k 0 or -1 disables top-k; top_p 1.0 and min_p 0.0 are off.
    `logprobs=N` returns the N most likely tokens (plus the sampled one, with its rank) per
    generated token; `prompt_logprobs=N` the same for each prompt token given its prefix.
    presence_penalty and frequency_penalty count output tokens (OpenAI's definition);
    repetition_penalty divides positive logits and multiplies negative ones of every token seen
    in the prompt or the output (HF's). logit_bias {token id: bias} is added to the logits first.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    _stop: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop = (self.stop,)
        else:
            self._stop = tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "a float >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "a float in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "an integer >= 1, or 0 / -1 to disable")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "a float in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2.0 <= value <= 2.0, name, value, "a float in [-2, 2]")
        _check(_is_real(self.repetition_penalty) and self.repetition_penalty > 0.0,
               "repetition_penalty", self.repetition_penalty, "a float > 0 (1.0 disables it)")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed,
               "an integer or None")
        max_tokens_ok = self.max_tokens is None or (
            isinstance(self.max_tokens, int) and self.max_tokens >= 1)
        _check(max_tokens_ok, "max_tokens", self.max_tokens, "an integer >= 1 or None")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               self.min_tokens, "an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        _check(all(isinstance(s, str) and s for s in self._stop), "stop", self.stop,
               "a non-empty string or a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "a list of non-negative token ids")
        _check(self.logprobs is None or (isinstance(self.logprobs, int)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", self.logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", self.prompt_logprobs,
               f"None or an integer in [0, {MAX_LOGPROBS}]")
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind", self.output_kind,
               "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs,
               "None or a StructuredOutputsParams")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop

    @property
    def has_penalties(self) -> bool:
        """Whether presence, frequency or repetition penalties change the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _is_real(value: object) -> bool:
    """A real number, not a bool, not NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


def _normalize_logit_bias(logit_bias: object) -> dict[int, float] | None:
    """{token id: bias} with int ids (JSON gives strings) and biases clamped to [-100, 100]."""
    if logit_bias is None:
        return None
    expected = "a dict {token id: bias} with token ids >= 0 and finite biases"
    _check(isinstance(logit_bias, dict), "logit_bias", logit_bias, expected)
    out = {}
    for token, bias in logit_bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            token_id = -1
        _check(token_id >= 0 and not isinstance(token, (bool, float)) and _is_real(bias)
               and abs(bias) != float("inf"), "logit_bias", {token: bias}, expected)
        out[token_id] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(bias)))
    return out


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {expected}.")
