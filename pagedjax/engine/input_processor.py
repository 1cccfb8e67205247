"""InputProcessor: a user's prompt and parameters → a validated, tokenized EngineCoreRequest
(vLLM's Processor.process_inputs), in the frontend, before anything reaches the engine core.

Invalid input raises ValueError (or TypeError) naming the value and the fix; nothing is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedjax.core.beam_search import BeamSearchParams
from pagedjax.engine.core_messages import EngineCoreRequest
from pagedjax.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedjax.structured_output.grammar import grammar_key

# A prompt: text, or {"prompt_token_ids": [...]} (optionally with "prompt": text).
PromptType = str | dict[str, Any]


@dataclass(frozen=True)
class EngineLimits:
    """What a request is checked against: the engine core's resolved configuration."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    num_logit_entries: int  # a step's capacity for penalty, logit_bias and min_tokens entries
    eos_token_ids: tuple[int, ...]


class InputProcessor:
    def __init__(self, tokenizer: Any | None, limits: EngineLimits, model: str) -> None:
        self.tokenizer, self.limits, self.model = tokenizer, limits, model

    def process_inputs(self, request_id: str, prompt: PromptType,
                       params: SamplingParams | BeamSearchParams | None = None
                       ) -> tuple[str | None, EngineCoreRequest]:
        """(the prompt's text if any, the request for the engine core)."""
        params = params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        beam_params = params if isinstance(params, BeamSearchParams) else None
        if beam_params is not None:
            params = self._beam_sampling_params(beam_params)
        max_tokens = self._check_lengths(token_ids, params)
        self._check_logit_bias(params)
        self._check_logit_entries(token_ids, params, max_tokens)
        grammar = None  # (BeamSearchParams carry no constraint: beams are never constrained)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer; this model "
                                 "directory ships none.")
            grammar = grammar_key(params.structured_outputs)
        return text, EngineCoreRequest(request_id, token_ids, params, max_tokens, beam_params,
                                       grammar)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model!r} has no tokenizer; pass "
                                 "{'prompt_token_ids': [...]} instead of text.")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            raise TypeError(f"prompt={prompt!r} must be a string or a dict with "
                            "'prompt_token_ids'.")
        if not token_ids:
            raise ValueError(f"prompt={prompt!r} is empty; give at least one token.")
        vocab = self.limits.vocab_size
        bad = [t for t in token_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}); "
                             "tokenize with this model's tokenizer.")
        return text, [int(t) for t in token_ids]

    def _beam_sampling_params(self, params: BeamSearchParams) -> SamplingParams:
        """What the beams of a request sample with; raises ValueError for a width this engine
        cannot serve."""
        limits = self.limits
        if params.beam_width > limits.max_num_seqs:
            raise ValueError(f"BeamSearchParams.beam_width={params.beam_width} exceeds "
                             f"max_num_seqs={limits.max_num_seqs}; lower beam_width or "
                             "raise max_num_seqs.")
        num_candidates = params.num_candidates(len(limits.eos_token_ids))
        limit = min(MAX_LOGPROBS, limits.vocab_size)
        if num_candidates > limit:
            per_beam = num_candidates // params.beam_width
            raise ValueError(f"BeamSearchParams.beam_width={params.beam_width} needs the top "
                             f"{num_candidates} logprobs per beam, over the {limit} a step "
                             f"returns; use beam_width <= {limit // per_beam}.")
        return params.sampling_params(num_candidates)

    def _check_lengths(self, token_ids: list[int], params: SamplingParams) -> int:
        max_len, max_num_seqs = self.limits.max_model_len, self.limits.max_num_seqs
        if params.n > max_num_seqs:
            raise ValueError(f"SamplingParams.n={params.n} exceeds max_num_seqs="
                             f"{max_num_seqs}; lower n or raise max_num_seqs.")
        room = max_len - len(token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room or room < 1:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len={max_len}; shorten the prompt, lower max_tokens or raise "
                "max_model_len.")
        return max_tokens

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab = self.limits.vocab_size
        bad = sorted(t for t in params.logit_bias or () if t >= vocab)
        if bad:
            raise ValueError(f"SamplingParams.logit_bias has token ids {bad[:5]} outside the "
                             f"vocabulary [0, {vocab}); use this model's token ids.")

    def _check_logit_entries(self, token_ids: list[int], params: SamplingParams,
                             max_tokens: int) -> None:
        """The request's rows must fit one step's logit entries (logit_entries.py) even at
        their largest: n rows with their logit_bias, banned tokens and penalties' tokens."""
        per_row = len(params.logit_bias or ()) + len(params.stop_token_ids) + len(
            self.limits.eos_token_ids)
        if params.has_penalties:
            per_row += max_tokens + (len(set(token_ids))
                                     if params.repetition_penalty != 1.0 else 0)
        capacity = self.limits.num_logit_entries
        if params.n * per_row > capacity:
            raise ValueError(
                f"SamplingParams n={params.n} with these penalties, logit_bias and stop tokens "
                f"needs up to {params.n * per_row} logit entries per step, over this engine's "
                f"{capacity} (4 x max_model_len); lower n, max_tokens or the logit_bias, or "
                "raise max_model_len.")
