"""When a completion stops: EOS, stop token ids, stop strings, max_tokens, max_model_len."""

from __future__ import annotations

from pagedjax.detokenizer import find_stop_string
from pagedjax.sequence import Sequence


class StopChecker:
    """Detokenizes a completion's new tokens and says whether (and why) it finished."""

    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def __call__(self, seq: Sequence,
                 new_token_ids: list[int]) -> tuple[str, int | str | None] | None:
        params = seq.sampling_params
        delta = seq.detokenizer.append(new_token_ids)
        token = new_token_ids[-1]
        if seq.num_output_tokens > params.min_tokens:  # stop ids were masked before that
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
            if params.stop_strings and delta:
                hit = find_stop_string(seq.detokenizer.output_text, len(delta),
                                       params.stop_strings, params.include_stop_str_in_output)
                if hit is not None:
                    seq.detokenizer.output_text = seq.detokenizer.output_text[: hit[1]]
                    return "stop", hit[0]
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None
