"""What one scheduler step decided, and what a step's logits rows produced: plain ints, lists
and NumPy, no framework types.

`SchedulerOutput` is the scheduler → persistent batch contract (vLLM V1's SchedulerOutput with
its NewRequestData / CachedRequestData): which sequences compute how many tokens, and what
changed since the last step, so that the batch (input_batch.py) touches only those rows.

`ScheduledBatch` describes a step sequence by sequence, every field spelled out: what the
reference builder (batch.build_model_input) reads. Synthetic steps (warm-up, the speculation
cost table, tests) are written in it, and `describe` rebuilds it from the scheduler's state,
the yardstick the persistent batch is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagedjax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedjax.core.sequence import Sequence


@dataclass
class SchedulerOutput:
    """The scheduler → persistent batch contract for one step.

    A sequence the batch holds no row for (new, resumed after preemption, forked) gets one
    from its Sequence; a row is copied again only where the scheduler says its sequence
    changed on the host.
    """

    # The step's sequences in batch order (running first, then admitted), and for each:
    seq_ids: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before the step: its start
    num_new_tokens: list[int] = field(default_factory=list)  # real tokens it computes
    # Speculative decoding (empty lists where the draft model does not run this step): the
    # draft slots reserved after each sequence's new tokens, the draft's progress and the
    # tokens it catches up on from there (its input: the sequence's own tokens).
    num_spec_tokens_per_seq: list[int] = field(default_factory=list)
    draft_start_pos: list[int] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)
    # Drafts the host proposed (n-gram, suffix; vLLM's scheduled_spec_decode_tokens): each
    # sequence's num_spec_tokens_per_seq tokens, written into its draft slots; empty without.
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # n > 1 (ParallelSampling): seq id → its siblings forked this step, which sample from its
    # last position too
    forks: dict[int, list[int]] = field(default_factory=dict)
    # Async scheduling: the last step's logits row whose sampled token is each sequence's one
    # new token (read on the device: the host has not seen it); None: every input is known.
    input_rows: list[int] | None = None
    # What changed since the last step:
    removed_seq_ids: list[int] = field(default_factory=list)  # finished, preempted, parked
    # tokens or random counter changed on the host (a beam's pick, a grammar's cut): the batch
    # copies their rows again
    changed_seq_ids: list[int] = field(default_factory=list)
    # seq id → (first changed index, its block table from there): appended blocks,
    # copy-on-write replacements, speculative truncation
    block_table_changes: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), first
    preempted_seq_ids: list[int] = field(default_factory=list)  # sent back to waiting
    num_batched_tokens: int = 0  # new tokens and draft slots
    # k: the most drafts a sequence proposes (0: none; the draft model still runs when some
    # sequence has tokens to catch up on)
    num_spec_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seq_ids

    @property
    def num_tokens_ahead(self) -> int:
        """Tokens each sequence has that the host has not seen: 1 with async scheduling."""
        return 0 if self.input_rows is None else 1

    def shift_ahead(self, last: SchedulerOutput, sampled: SampledTokens) -> None:
        """A speculative step scheduled before `last`'s tokens were known (Scheduler.
        schedule_next, as though last had accepted no draft), moved by the drafts last
        accepted for each sequence, a, as the runner moved it on the device: its tokens start a
        later, and the draft catches up on two tokens where all of last's drafts were accepted
        (the last draft, which it never fed, and the bonus token), else on one."""
        kept = dict(zip(sampled.seq_ids, sampled.counts().tolist()))
        drafted = dict(zip(last.seq_ids, last.num_spec_tokens_per_seq))
        for i, seq_id in enumerate(self.seq_ids):
            if seq_id not in kept:
                continue  # finished or removed meanwhile: its outputs are dropped
            accepted = kept[seq_id] - 1
            both = int(0 < accepted == drafted[seq_id])
            self.num_computed_tokens[i] += accepted
            self.draft_start_pos[i] += accepted - both
            self.num_draft_tokens[i] = 1 + both

    def end_positions(self) -> list[int]:
        """Position after each sequence's last real token computed this step."""
        return [c + n for c, n in zip(self.num_computed_tokens, self.num_new_tokens)]


@dataclass
class SampledTokens:
    """A step's sampled tokens as the host keeps them: logits row r, of sequence seq_ids[r],
    keeps token_ids[r, :num_tokens[r]] (its accepted drafts, then a recovered or bonus token).
    A grammar may cut a row short (StructuredOutputManager.accept)."""

    seq_ids: list[int]  # [L]
    token_ids: np.ndarray  # [L, K+1] int32, -1 padded
    num_tokens: np.ndarray | None  # [L] int32; None: one each (K = 0)

    @classmethod
    def from_array(cls, seq_ids: list[int], token_ids: np.ndarray) -> SampledTokens:
        if token_ids.shape[1] == 1:  # no drafts: one token each, none to cut
            return cls(seq_ids, token_ids, None)
        return cls(seq_ids, token_ids, (token_ids >= 0).sum(axis=1, dtype=np.int32))

    def counts(self) -> np.ndarray:
        """[L] tokens each row keeps."""
        if self.num_tokens is None:
            return np.ones(len(self.seq_ids), np.int32)
        return self.num_tokens

    @classmethod
    def from_lists(cls, rows: dict[int, list[int]]) -> SampledTokens:
        """seq id → its tokens (tests, hand-made steps)."""
        width = max((len(t) for t in rows.values()), default=1)
        token_ids = np.full((len(rows), width), -1, np.int32)
        for r, tokens in enumerate(rows.values()):
            token_ids[r, : len(tokens)] = tokens
        return cls.from_array(list(rows), token_ids)

    def tokens(self, r: int) -> list[int]:
        if self.num_tokens is None:
            return self.token_ids[r, :1].tolist()
        return self.token_ids[r, : self.num_tokens[r]].tolist()

    def as_dict(self) -> dict[int, list[int]]:
        return {seq_id: self.tokens(r) for r, seq_id in enumerate(self.seq_ids)}


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


def sample_spec(seq: Sequence, eos_token_ids: tuple[int, ...], ahead: int = 0) -> SampleSpec:
    """How seq's next token is sampled; ahead: tokens it will have that the host has not seen
    yet (async scheduling)."""
    params = seq.sampling_params
    num_output = seq.num_output_tokens + ahead
    banned: list[int] = []
    if num_output < params.min_tokens:
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned += eos_token_ids
    return SampleSpec(seq.seq_id, params, seq.rng_seed, num_output + seq.rng_offset, banned,
                      *seq.penalty_token_ids())


@dataclass
class ScheduledSequence:
    """One sequence's share of a step, spelled out (ScheduledBatch)."""

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
    # the drafts themselves where the host proposed them (num_spec_tokens of them), else []
    spec_token_ids: list[int] = field(default_factory=list)
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
class ScheduledBatch:
    """A step described sequence by sequence (the reference builder's input)."""

    scheduled: list[ScheduledSequence]  # in batch order
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst)
    num_spec_tokens: int = 0  # k (see SchedulerOutput)
