"""SamplingParams: vLLM's names, validated on construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5  # temperatures below this sample greedily, as in vLLM
MAX_LOGPROBS = 20  # most top logprobs a request may ask for per token


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a running request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes, then everything


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    temperature 0 is greedy; top_k 0 or -1 disables top-k; top_p 1.0 and min_p 0.0 are off.
    `logprobs=N` returns the N most likely tokens (plus the sampled one) per generated token.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    _stop: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop = (self.stop,)
        else:
            self._stop = tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "a float >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "a float in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "an integer >= 1, or 0 / -1 to disable")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "a float in [0, 1]")
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
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind", self.output_kind,
               "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {expected}.")
