"""What one scheduler step decided: plain ints and lists, no framework types."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedjax.sampling_params import SamplingParams


@dataclass
class SampleSpec:
    """One completion that samples from the logits of a scheduled sequence's last position(s)."""

    seq_id: int
    params: SamplingParams
    rng_seed: int  # uint32 stream of this completion
    rng_step: int  # the counter of its random numbers: tokens generated so far (+ rng_offset)
    banned_token_ids: list[int]  # EOS / stop ids masked while below min_tokens
    # Penalties (SamplingParams.has_penalties; empty otherwise): what they count.
    penalty_prompt_token_ids: list[int] = field(default_factory=list)  # distinct; repetition only
    output_token_ids: list[int] = field(default_factory=list)  # every output token so far


@dataclass
class ScheduledSequence:
    """One sequence's share of the batch."""

    seq_id: int
    token_ids: list[int]  # tokens whose KV this step computes (num_new_tokens of them)
    start_pos: int  # position of token_ids[0] == num_computed_tokens before the step
    block_table: list[int]  # block ids covering end_pos + num_spec_tokens slots
    # Completions that sample from this sequence's last position: empty while a chunked prefill
    # is still behind, [itself] normally, itself + its siblings on the step a fork happens.
    samples: list[SampleSpec] = field(default_factory=list)
    # Speculative decoding: slots reserved after the real tokens for the drafts the runner
    # proposes on the device, and the tokens the draft model catches up on first (from its own
    # progress, draft_start_pos, to end_pos; empty when the draft does not run for it).
    num_spec_tokens: int = 0
    draft_start_pos: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    # prompt_logprobs: the prompt token after each of the first len(...) new tokens, whose
    # logprob given its prefix this step computes (empty once the prompt is scored).
    prompt_logprob_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: scheduled before the last step's tokens reached the host, the one new
    # token is the one that step sampled in logits row input_row (token_ids holds a
    # placeholder); -1: token_ids are the real tokens.
    input_row: int = -1

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One new token, scoring no prompt token: what a decode-shaped step holds only (any
        other sequence makes the step mixed, step_shapes.py)."""
        return len(self.token_ids) == 1 and not self.prompt_logprob_token_ids

    @property
    def end_pos(self) -> int:
        """Position after the last real token computed this step."""
        return self.start_pos + len(self.token_ids)

    @property
    def draft_end_pos(self) -> int:
        """Position the draft model has computed up to after its catch-up."""
        return self.draft_start_pos + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    """The scheduler → runner contract for one step."""

    scheduled: list[ScheduledSequence]  # in batch order (running first, then admitted)
    block_copies: list[tuple[int, int]]  # (src, dst) copy-on-write block copies, before the forward
    preempted_seq_ids: list[int]  # sequences sent back to waiting (recompute) this step
    num_batched_tokens: int  # sum of num_new_tokens and draft slots
    # k: the most drafts a sequence proposes (0: none; the draft model still runs when some
    # sequence has draft_token_ids to catch up on)
    num_spec_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
