"""Sequence: one completion's token ids and progress. Only ints, lists and plain objects."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedjax.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False)
class Sequence:
    """One of a request's n completions.

    There are no prefill and decode phases: each step `num_computed_tokens` catches up with
    `num_tokens`. Chunked prefill, prefix-cache hits and preemption (recompute) only move it.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    arrival: tuple[int, int]  # (request arrival counter, index): FCFS order; latest preempted first
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    sampling_params: SamplingParams
    max_tokens: int  # sampling_params.max_tokens, or what max_model_len leaves
    rng_seed: int  # uint32 stream of this completion's random numbers
    # Sequences its request policy will fork off it later (n > 1 siblings, beams): they hold
    # seats among max_num_seqs already, and it proposes no drafts meanwhile.
    num_pending_forks: int = 0
    # Its request policy picks its next token on the host (beam search): the scheduler appends
    # no sampled token to it and gives it no draft slots.
    policy_picks_tokens: bool = False
    # Its request wants its tokens every step (it streams, or the frontend checks stop strings
    # or keeps logprobs), not only when it finishes; output tokens sent to the frontend so far.
    outputs_every_step: bool = False
    num_output_tokens_sent: int = 0
    num_computed_tokens: int = 0
    num_draft_computed_tokens: int = 0  # the draft model's KV progress (speculative decoding)
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache at admission
    # its full blocks offered to the prefix cache so far (Scheduler: a step offers the rest)
    num_full_blocks_cached: int = 0
    # Added to its random counter (rng_step = output tokens + rng_offset): moved past a step's
    # counters when tokens drawn with them are dropped (structured outputs), so the tokens
    # drawn again use fresh random numbers.
    rng_offset: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # Set by the scheduler when it starts tracking the sequence, so that a step checks each
    # sequence in a few attribute reads: the tokens that may stop it (EOS and stop ids; the
    # StopChecker decides), the length that stops it, and whether its sampling carries logit
    # entries (logit_entries.py: penalties, logit_bias, min_tokens).
    stop_token_set: frozenset[int] = frozenset()
    max_num_tokens: int = 1 << 62
    uses_logit_entries: bool = False
    _distinct_prompt_token_ids: list[int] | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """prompt_logprobs asked for and the prompt not scored yet (no output so far)."""
        return self.sampling_params.prompt_logprobs is not None and not self.num_output_tokens

    def prompt_logprob_token_ids(self, start: int, end: int) -> list[int]:
        """The prompt tokens that positions [start, end) score (each the token after it), while
        the prompt's logprobs are still due."""
        if not self.needs_prompt_logprobs:
            return []
        return self.token_ids[start + 1 : min(end + 1, self.num_prompt_tokens)]

    def num_logit_entries(self, num_eos_token_ids: int) -> int:
        """At most how many logit entries (logit_entries.py) a row of it carries this step:
        banned tokens while below min_tokens, its logit_bias, and what its penalties count."""
        params = self.sampling_params
        n = len(params.logit_bias or ())
        if self.num_output_tokens < params.min_tokens:
            n += len(params.stop_token_ids) + (0 if params.ignore_eos else num_eos_token_ids)
        prompt, output = self.penalty_token_ids()
        return n + len(prompt) + len(output)

    def penalty_token_ids(self) -> tuple[list[int], list[int]]:
        """(distinct prompt tokens, output tokens with repeats): what the penalties count. Both
        empty without penalties; the prompt's only matter to repetition_penalty."""
        params = self.sampling_params
        if not params.has_penalties:
            return [], []
        prompt = []
        if params.repetition_penalty != 1.0:
            if self._distinct_prompt_token_ids is None:  # the prompt never changes: once
                self._distinct_prompt_token_ids = sorted(set(
                    self.token_ids[: self.num_prompt_tokens]))
            prompt = self._distinct_prompt_token_ids
        return prompt, self.token_ids[self.num_prompt_tokens :]

    def fork(self, seq_id: int, index: int, rng_seed: int) -> Sequence:
        """A sibling completion that shares everything computed so far."""
        return Sequence(
            seq_id=seq_id,
            request_id=self.request_id,
            index=index,
            arrival=(self.arrival[0], index),
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            sampling_params=self.sampling_params,
            max_tokens=self.max_tokens,
            rng_seed=rng_seed,
            num_computed_tokens=self.num_computed_tokens,
            num_draft_computed_tokens=self.num_draft_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_full_blocks_cached=self.num_full_blocks_cached,
            rng_offset=self.rng_offset,
            status=self.status,
            _distinct_prompt_token_ids=self._distinct_prompt_token_ids,
            policy_picks_tokens=self.policy_picks_tokens,
            outputs_every_step=self.outputs_every_step,
        )
