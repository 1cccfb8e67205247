"""Continuous batching with one token budget per step.

There are no prefill and decode phases. Every step each scheduled sequence's
`num_computed_tokens` catches up with its `num_tokens` as far as the budget allows: a new prompt,
a chunk of a long prompt, a decode token and a recompute after preemption are the same thing.
Running sequences go first (oldest first); waiting ones are admitted FCFS after them. When the
block pool is full the latest-arrived running sequence is preempted (its blocks freed, recomputed
later), never the engine.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

import numpy as np

from pagedjax.block_manager import BlockManager
from pagedjax.scheduler_output import SampleSpec, ScheduledSequence, SchedulerOutput
from pagedjax.sequence import Sequence, SequenceStatus

# (sequence, its new token ids) -> finish reason and stop reason, or None to keep going.
StopChecker = Callable[[Sequence, list[int]], tuple[str, int | str | None] | None]


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, stop_checker: StopChecker,
                 eos_token_ids: tuple[int, ...], new_seq_id: Callable[[], int],
                 fork_seed: Callable[[Sequence, int], int]) -> None:
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stop_checker = stop_checker
        self.new_seq_id = new_seq_id
        self.fork_seed = fork_seed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival
        self.seqs: dict[int, Sequence] = {}  # every live sequence, forked children included
        self.num_preemptions_total = 0

    # ---- bookkeeping -------------------------------------------------------------------------

    def add_sequence(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished sequence once its output has been delivered."""
        assert seq.is_finished
        self.seqs.pop(seq.seq_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark seq finished, release its blocks and drop it from the queues."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.block_manager.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)  # latest preempted first, so the front stays oldest
        self.num_preemptions_total += 1

    # ---- schedule ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        copies: list[tuple[int, int]] = []
        preempted: list[int] = []

        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < self.max_num_seqs:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            new_copies = self._allocate_or_preempt(seq, num_new, preempted)
            if new_copies is None:
                break  # seq itself was preempted: nothing after it runs either
            copies += new_copies
            entry = self._scheduled(seq, num_new)
            scheduled.append(entry)
            budget -= num_new
            # Children forked here sit right after seq and sampled with it: skip them this step.
            i += max(1, len(entry.samples))

        while (self.waiting and not preempted and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            hits = self.block_manager.get_computed_blocks(seq.token_ids)
            num_computed = len(hits) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            new_copies = self.block_manager.allocate_slots(seq.seq_id, num_computed, num_new, hits)
            if new_copies is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = num_computed
            seq.num_computed_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            copies += new_copies
            scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new

        return SchedulerOutput(scheduled, copies, preempted,
                               self.max_num_batched_tokens - budget)

    def _allocate_or_preempt(self, seq: Sequence, num_new: int,
                             preempted: list[int]) -> list[tuple[int, int]] | None:
        """Slots for seq's new tokens, preempting the latest arrivals until they fit."""
        while True:
            copies = self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new)
            if copies is not None:
                return copies
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.seq_id)
            if victim is seq:
                return None

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        entry = ScheduledSequence(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids[start : start + num_new],
            start_pos=start,
            block_table=list(self.block_manager.get_block_table(seq.seq_id)),
        )
        if start + num_new == seq.num_tokens:  # caught up: its last position yields a token
            entry.samples = [self._sample_spec(s) for s in [seq, *self._fork_pending(seq)]]
        return entry

    def _fork_pending(self, seq: Sequence) -> list[Sequence]:
        """Siblings of an n > 1 request share the prompt's blocks (copy-on-write later)."""
        children = []
        for k in range(seq.num_pending_forks):
            index = seq.index + 1 + k
            child = seq.fork(self.new_seq_id(), index, self.fork_seed(seq, index))
            self.block_manager.fork(seq.seq_id, child.seq_id)
            self.seqs[child.seq_id] = child
            bisect.insort(self.running, child, key=lambda s: s.arrival)
            children.append(child)
        seq.num_pending_forks = 0
        return children

    def _sample_spec(self, seq: Sequence) -> SampleSpec:
        params = seq.sampling_params
        banned: list[int] = []
        if seq.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned += self.eos_token_ids
        return SampleSpec(seq.seq_id, params, seq.rng_seed, seq.num_output_tokens, banned)

    # ---- update ------------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: list[list[int]],
               logprobs: list[list[dict[int, float]] | None]) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, finish and free what stopped.

        sampled[r] / logprobs[r] belong to the r-th SampleSpec in batch order (a list per spec:
        one token normally, several when speculative tokens were accepted). Returns every
        sequence that received tokens.
        """
        touched: list[Sequence] = []
        row = 0
        for entry in output.scheduled:
            self.seqs[entry.seq_id].num_computed_tokens = entry.kv_len
            for spec in entry.samples:
                seq = self.seqs[spec.seq_id]
                seq.num_computed_tokens = entry.kv_len
                self._append(seq, sampled[row], logprobs[row])
                touched.append(seq)
                row += 1
        for seq in touched:
            if not seq.is_finished:
                self.block_manager.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        return touched

    def _append(self, seq: Sequence, token_ids: list[int],
                logprobs: list[dict[int, float]] | None) -> None:
        for k, token in enumerate(token_ids):
            seq.token_ids.append(token)
            if logprobs is not None:
                seq.cumulative_logprob += logprobs[k][token]
                if seq.logprobs is not None:
                    seq.logprobs.append(logprobs[k])
            stop = self.stop_checker(seq, [token])
            if stop is not None:
                self.finish(seq, *stop)
                return


def sampled_rows(token_ids: np.ndarray) -> list[list[int]]:
    """[L] or [L, k+1] (padded with -1) sampled ids → a list of token lists per row."""
    if token_ids.ndim == 1:
        return [[int(t)] for t in token_ids]
    return [[int(t) for t in row if t >= 0] for row in token_ids]
