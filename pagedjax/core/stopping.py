"""Token-level stops, decided by the scheduler: EOS, stop token ids, max_tokens, max_model_len.

Stop strings need text, so the engine's output processor checks those (see output_processor.py).
"""

from __future__ import annotations

from pagedjax.core.sequence import Sequence


class StopChecker:
    """Says whether (and why) a completion finished with the token just appended to it."""

    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self._eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def __call__(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
        params = seq.sampling_params
        if seq.num_output_tokens > params.min_tokens:  # stop ids were masked before that
            if not params.ignore_eos and token in self._eos:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None
