"""Continuous batching with one token budget per step.

There are no prefill and decode phases. Every step each scheduled sequence's
`num_computed_tokens` catches up with its `num_tokens` as far as the budget allows: a new prompt,
a chunk of a long prompt, a decode token and a recompute after preemption are the same thing.
Running sequences go first (oldest first); waiting ones are admitted FCFS after them. When the
block pool is full the latest-arrived running sequence is preempted (its blocks freed, recomputed
later), never the engine.

With a draft model the engine asks for up to k drafts per sequence each step: the scheduler
reserves their slots, lets the draft catch up on what it has not computed (within its own token
budget), and after verification rolls rejected drafts back by bookkeeping. With drafts the host
proposed (n-gram, suffix decoding) it reserves slots for each sequence's proposals and hands them
to the batch (SchedulerOutput.spec_token_ids); rejected ones roll back the same way.

Request-level behaviour (n > 1 siblings, beams) lives in request policies (request_policy.py):
they fork and drop sequences through the block manager and hand forks over with `add_fork`. A
sequence with nothing left to compute (a beam waiting for its policy's token) is not scheduled,
and when preempted it is parked, holding no blocks and queued nowhere, until tokens come.

Its output says what changed since the last step (removed sequences, tables, sequences whose
tokens changed on the host), so that the persistent batch (input_batch.py) updates those rows
only. The common step (every sequence decodes) is one pass of attribute reads over the running
sequences; allocation, drafts and logit entries cost only where a sequence needs them.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping
from operator import attrgetter

import numpy as np

from pagedjax.core.block_manager import BlockManager
from pagedjax.core.scheduler_output import SampledTokens, SchedulerOutput
from pagedjax.core.sequence import Sequence, SequenceStatus
from pagedjax.core.stopping import StopChecker

_num_computed = attrgetter("num_computed_tokens")
_num_draft_computed = attrgetter("num_draft_computed_tokens")
_token_ids = attrgetter("token_ids")
_uses_entries = attrgetter("uses_logit_entries")
_seq_id = attrgetter("seq_id")


class Scheduler:
    SENTINEL_EVERY = 8  # one sequence in this many keeps its draft current while none drafts

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, stop_checker: StopChecker,
                 has_draft: bool = False, host_drafts: bool = False,
                 max_logit_entries: int | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # The step's capacity for penalty, logit_bias and min_tokens entries (StepShapes)
        self.max_logit_entries = max_logit_entries
        self.stop_checker = stop_checker
        self.has_draft = has_draft  # a draft model shares the pool: track its KV progress
        self.host_drafts = host_drafts  # drafts come from the host's proposer (schedule())
        self.speculates = has_draft or host_drafts
        self._proposals: Mapping[int, list[int]] = {}
        self._prefill_drafts = True  # schedule()'s
        self._keep_slots = False  # update()'s: a speculative step in flight writes past ends
        self.waiting: deque[Sequence] = deque()
        self.parked: dict[int, Sequence] = {}  # preempted with nothing to compute, by seq id
        self.running: list[Sequence] = []  # sorted by arrival
        self.seqs: dict[int, Sequence] = {}  # every live sequence, forked children included
        self.num_preemptions_total = 0
        self.num_generation_tokens_total = 0
        # since the last schedule(): sequences that left the batch, and sequences whose tokens
        # or random counter changed on the host (SchedulerOutput)
        self._removed: list[int] = []
        self._changed: set[int] = set()

    # ---- bookkeeping -------------------------------------------------------------------------

    def add_sequence(self, seq: Sequence) -> None:
        self._track(seq)
        self.waiting.append(seq)

    def add_fork(self, seq: Sequence) -> None:
        """Track a sequence a request policy forked: it joins its parent's queue (running, in
        arrival order; or waiting at the front, as the preempted do)."""
        self._track(seq)
        if seq.status is SequenceStatus.RUNNING:
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
        else:
            self.waiting.appendleft(seq)

    def _track(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        params = seq.sampling_params
        seq.stop_token_set = frozenset(params.stop_token_ids).union(
            self.stop_checker.eos_token_ids)
        seq.max_num_tokens = min(seq.num_prompt_tokens + seq.max_tokens,
                                 self.stop_checker.max_model_len)
        seq.uses_logit_entries = bool(params.logit_bias or params.has_penalties
                                      or params.min_tokens)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished sequence once its output has been delivered."""
        assert seq.is_finished
        self.seqs.pop(seq.seq_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def mark_changed(self, seq: Sequence) -> None:
        """seq's tokens or random counter changed outside update() (a grammar's cut)."""
        self._changed.add(seq.seq_id)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None,
               num_output_tokens: int | None = None) -> None:
        """Mark seq finished, release its blocks and drop it from the queues; with
        num_output_tokens, drop the tokens after that many (a stop string ended it there)."""
        if num_output_tokens is not None:
            excess = seq.num_output_tokens - num_output_tokens
            del seq.token_ids[seq.num_prompt_tokens + num_output_tokens :]
            self.num_generation_tokens_total -= excess
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.block_manager.free(seq.seq_id)
        self._removed.append(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.parked.pop(seq.seq_id, None)

    def _preempt(self, seq: Sequence) -> None:
        idle = seq.num_computed_tokens == seq.num_tokens  # a beam whose row is in
        self.block_manager.free(seq.seq_id)
        seq.num_full_blocks_cached = 0
        self._removed.append(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = seq.num_draft_computed_tokens = 0
        if idle:
            self.parked[seq.seq_id] = seq  # recomputing it before it has a new token is useless
        else:
            self.waiting.appendleft(seq)  # latest preempted first, so the front stays oldest
        self.num_preemptions_total += 1

    # ---- schedule ----------------------------------------------------------------------------

    def schedule(self, num_spec_tokens: int = 0,
                 proposals: Mapping[int, list[int]] | None = None,
                 prefill_drafts: bool = True) -> SchedulerOutput:
        """This step's batch; with num_spec_tokens k > 0, up to k draft slots per sequence.
        proposals (host drafts): seq id → the drafts the host proposes for it (its slots are
        the first min(k, len) of them). prefill_drafts=False (a draft model, while drafting does
        not pay): the draft catches up on no new prompt but a sentinel's (`_catches_up`)."""
        assert not num_spec_tokens or self.speculates
        step = SchedulerOutput(num_spec_tokens=num_spec_tokens)
        self._proposals = proposals or {}
        self._prefill_drafts = prefill_drafts
        self._draft_budget = self.max_num_batched_tokens if self.has_draft else 0
        self._entries_budget = self.max_logit_entries
        self._scores_prompt = False  # some sequence scores prompt tokens (prompt_logprobs)
        if not self._schedule_decodes(step):
            self._schedule_running(step)
        if not step.preempted_seq_ids:
            self._schedule_waiting(step)
        if self.has_draft:
            self._fit_drafts(step)
        elif self.host_drafts:
            self._fit_host_drafts(step)
        return self._with_changes(step)

    def take_changes(self) -> SchedulerOutput:
        """An empty step carrying what changed since the last one (the persistent batch frees
        the rows of what finished when nothing runs)."""
        return self._with_changes(SchedulerOutput())

    def _with_changes(self, step: SchedulerOutput) -> SchedulerOutput:
        """step, with what changed since the last step (SchedulerOutput)."""
        step.removed_seq_ids, self._removed = self._removed, []
        if self._changed:
            step.changed_seq_ids, self._changed = sorted(self._changed), set()
        step.block_table_changes = self.block_manager.take_table_changes()
        return step

    def schedule_next(self, last: SchedulerOutput, num_spec_tokens: int = 0,
                      proposals: Mapping[int, list[int]] | None = None
                      ) -> SchedulerOutput | None:
        """Async scheduling: the decode step after `last`, scheduled while `last` runs. Each
        sequence computes the token `last` samples for it (read on the device: `input_rows`)
        and samples the one after, with no drafts. None unless `last` decodes every running
        sequence with no drafts and no draft model's work, nobody waits, none uses penalties
        (they count tokens the host has not seen) or forks, and the pool has the slots without
        preempting anyone. A sequence that `last` finishes computes one more row, which
        update() drops (its slot is freed before any reuse).

        With a draft model, num_spec_tokens k > 0 after a `last` in which every sequence
        drafted k (async speculation): each sequence computes its last token and k drafts, as
        though `last` had accepted none of its drafts; the runner moves it on the device by
        those it did accept, a (shift_ahead), and `shift_ahead` here moves the step's record
        once `last`'s tokens are known. Slots cover the most any a can need (2k + 1 from the
        token `last` samples first); update() leaves the ones past a sequence's end until no
        step is in flight.

        With drafts the host proposes (proposals, after a `last` with none; k: the most a
        sequence takes), each sequence computes the token `last` samples and its proposal,
        made from the tokens before that one (HostDrafter.propose(lag=True)); one without a
        proposal, or near max_tokens, max_model_len or below min_tokens, computes only its
        token. Nothing moves: `last` yields one token a sequence."""
        spec = num_spec_tokens
        host = proposals is not None
        moves = bool(spec) and not host  # a draft model's step, moved by what `last` accepts
        if moves:  # every sequence of `last` drafted k
            last_fits = self.has_draft and last.num_spec_tokens == spec and all(
                n == spec for n in last.num_spec_tokens_per_seq)
        else:  # `last` decoded one token each, no draft model's work
            last_fits = not (last.num_spec_tokens or any(last.num_draft_tokens)
                             or last.num_batched_tokens != len(last.seq_ids))
        if (self.waiting or self.parked or last.forks or not last_fits
                or len(last.seq_ids) != len(self.running)):
            return None
        step = SchedulerOutput(input_rows=list(range(len(last.seq_ids))))
        max_model_len = self.stop_checker.max_model_len
        for seq_id, start, new in zip(last.seq_ids, last.num_computed_tokens,
                                      last.num_new_tokens):
            seq = self.seqs.get(seq_id)
            if (seq is None or seq.is_finished or new != 1
                    or start + 1 != seq.num_tokens  # not sampling
                    or seq.num_pending_forks or seq.policy_picks_tokens
                    or seq.sampling_params.has_penalties
                    or seq.num_tokens + (2 * spec if moves else 0) >= max_model_len
                    or (moves and (self._drafts_left(seq) < 2 * spec + 1  # past max_tokens
                                   or seq.num_output_tokens < seq.sampling_params.min_tokens))):
                return None
            position = seq.num_tokens  # of the token `last` samples (its first, with drafts)
            num_slots = 1 + (2 * spec if moves else 0)
            if host:  # its proposal, where it fits beside the token `last` samples
                drafts = proposals.get(seq_id, [])[: max(0, min(
                    spec, self._drafts_left(seq) - 1, max_model_len - position - 2))]
                if seq.num_output_tokens + 1 < seq.sampling_params.min_tokens:
                    drafts = []
                step.num_spec_tokens_per_seq.append(len(drafts))
                step.spec_token_ids.append(drafts)
                num_slots = 1 + len(drafts)
            copies = self.block_manager.allocate_slots(seq_id, position, num_slots)
            if copies is None:
                return None
            step.seq_ids.append(seq_id)
            step.num_computed_tokens.append(position)
            step.block_copies += copies
        n = len(step.seq_ids)
        step.num_new_tokens = [1] * n
        if host:
            step.num_batched_tokens = n + sum(step.num_spec_tokens_per_seq)
            step.num_spec_tokens = max(step.num_spec_tokens_per_seq, default=0)
            if not step.num_spec_tokens:  # nobody proposed: a decode step
                step.num_spec_tokens_per_seq, step.spec_token_ids = [], []
            return self._with_changes(step)
        step.num_batched_tokens = n * (1 + spec)
        if spec:
            step.num_spec_tokens = spec
            step.num_spec_tokens_per_seq = [spec] * n
            step.draft_start_pos = list(step.num_computed_tokens)
            step.num_draft_tokens = [1] * n  # the draft catches up on the step's first token
        return self._with_changes(step)

    def _fit_drafts(self, step: SchedulerOutput) -> None:
        """The draft's work fits the step's shape (step_shapes.py): a step where a sequence
        computes several tokens proposes no drafts (the draft only catches up); in a decode
        step the draft runs only with k > 0, catching up on at most k + 1 tokens a sequence.
        The step's k is then the most drafts a sequence proposes.

        A decode step offered k > 0 once drafting pays again (prefill_drafts), where most
        sequences' drafts are more than k + 1 tokens behind (the draft prefilled no prompt but
        the sentinels' while it did not pay), catches them all up at once instead, drafting
        nothing (a mixed step where it exceeds every speculative shape: batch.choose_layout).
        k + 1 tokens a step, a batch of 8 whose prompts the draft never saw drafted in no step
        but the sentinels' for ~35 steps of a speculative shape's cost (the demo pair on jax,
        code at batch 8: 0.82x no speculation)."""
        k = step.num_spec_tokens
        decode = not self._scores_prompt and all(n == 1 for n in step.num_new_tokens)
        spec, catch_up = step.num_spec_tokens_per_seq, step.num_draft_tokens
        behind = bool(decode and k and self._prefill_drafts
                      and 2 * sum(c > k + 1 for c in catch_up) > len(catch_up))
        for i, num_spec in enumerate(spec):
            if not decode or catch_up[i] > k + 1 or behind:
                step.num_batched_tokens -= num_spec
                spec[i] = 0
            if decode and not behind:
                catch_up[i] = min(catch_up[i], k + 1) if k else 0
        step.num_spec_tokens = max(spec, default=0)

    def _fit_host_drafts(self, step: SchedulerOutput) -> None:
        """Host drafts ride decode steps only (a mixed step proposes none: step_shapes.py); the
        step's k is then the most drafts a sequence proposes. Slots reserved for drafts that do
        not run go back at once."""
        spec = step.num_spec_tokens_per_seq
        if self._scores_prompt or any(n != 1 for n in step.num_new_tokens):
            ends = step.end_positions()
            for i in np.flatnonzero(spec).tolist():
                self.block_manager.truncate(step.seq_ids[i], ends[i])
            step.num_batched_tokens -= sum(spec)
            step.num_spec_tokens_per_seq = [0] * len(spec)
            step.spec_token_ids = [[] for _ in spec]
        step.num_spec_tokens = max(step.num_spec_tokens_per_seq, default=0)
        if not step.num_spec_tokens:
            step.num_spec_tokens_per_seq, step.spec_token_ids = [], []

    def _budget(self, step: SchedulerOutput) -> int:
        return self.max_num_batched_tokens - step.num_batched_tokens

    def _add(self, step: SchedulerOutput, seq: Sequence, num_computed: int, num_new: int,
             num_spec: int, copies: list[tuple[int, int]]) -> None:
        """Schedule num_new of seq's tokens from num_computed, and num_spec draft slots."""
        step.seq_ids.append(seq.seq_id)
        step.num_computed_tokens.append(num_computed)
        step.num_new_tokens.append(num_new)
        if copies:
            step.block_copies += copies
        step.num_batched_tokens += num_new + num_spec
        if self.has_draft:
            self._add_draft(step, seq, num_computed + num_new, num_spec)
        elif self.host_drafts:
            step.num_spec_tokens_per_seq.append(num_spec)
            step.spec_token_ids.append(self._proposals[seq.seq_id][:num_spec] if num_spec
                                       else [])
        if seq.needs_prompt_logprobs and num_computed + 1 < seq.num_prompt_tokens:
            self._scores_prompt = True

    def _add_draft(self, step: SchedulerOutput, seq: Sequence, end: int, num_spec: int) -> None:
        """The draft's share of the step: its slots, and what it catches up on (where seq may
        still draft)."""
        step.num_spec_tokens_per_seq.append(num_spec)
        draft_start = seq.num_draft_computed_tokens
        step.draft_start_pos.append(draft_start)
        num_catch_up = 0
        if self._draft_budget and self._drafts_left(seq) > 0 and self._catches_up(seq):
            num_catch_up = min(end - draft_start, self._draft_budget)
            self._draft_budget -= num_catch_up
        step.num_draft_tokens.append(num_catch_up)

    def _catches_up(self, seq: Sequence) -> bool:
        """Whether the draft computes seq's tokens this step. While drafting does not pay
        (schedule's prefill_drafts=False) a prompt's draft prefill would buy nothing: only
        sentinels (every SENTINEL_EVERY-th sequence) and drafts past their prompt catch up,
        so that the policy's probes still find current drafts to measure acceptance on. The
        others catch up once drafting pays again (k + 1 tokens a decode step, or all at once
        where most lag: _fit_drafts)."""
        return (self._prefill_drafts or seq.seq_id % self.SENTINEL_EVERY == 0
                or seq.num_draft_computed_tokens >= seq.num_prompt_tokens)

    def _schedule_decodes(self, step: SchedulerOutput) -> bool:
        """The common step in bulk: every running sequence computes its one new token, none
        drafts or carries logit entries, and all fit; only those that fill their last block (or
        share one since a fork) go to the block manager. False otherwise (or the pool is
        short): _schedule_running decides, taking the same blocks in the same order. With a
        draft model, only while nothing waits: a prompt admitted beside them would make the
        step mixed, where the running sequences' drafts catch up (_add_draft); in a decode step
        with k = 0 no draft runs (_fit_drafts)."""
        running, n = self.running, len(self.running)
        if (not n or step.num_spec_tokens or (self.has_draft and self.waiting)
                or n > self.max_num_seqs or n > self.max_num_batched_tokens):
            return False
        computed = list(map(_num_computed, running))
        if (list(map(len, map(_token_ids, running))) != [c + 1 for c in computed]
                or (self._entries_budget is not None and any(map(_uses_entries, running)))):
            return False
        bm, seq_ids = self.block_manager, list(map(_seq_id, running))
        # those that fill their last block: one new block each, in one go
        full = np.flatnonzero(np.asarray(computed) % bm.block_size == 0).tolist()
        forked, tables, bs = bm.forked, bm.tables, bm.block_size
        new_block = [seq_ids[i] for i in full if seq_ids[i] not in forked
                     and len(tables[seq_ids[i]]) * bs == computed[i]]
        if not bm.append_blocks(new_block):
            return False
        if forked:  # a block shared since a fork is copied before it is written
            for i in (i for i, seq_id in enumerate(seq_ids) if seq_id in forked):
                copies = bm.allocate_slots(seq_ids[i], computed[i], 1)
                if copies is None:
                    return False
                step.block_copies += copies
        step.seq_ids = seq_ids
        step.num_computed_tokens = computed
        step.num_new_tokens = [1] * n
        step.num_batched_tokens = n
        if self.has_draft:  # its progress, and nothing to catch up on or propose
            step.num_spec_tokens_per_seq = [0] * n
            step.draft_start_pos = list(map(_num_draft_computed, running))
            step.num_draft_tokens = [0] * n
        return True

    def _schedule_running(self, step: SchedulerOutput) -> None:
        i = 0
        running, max_num_seqs = self.running, self.max_num_seqs
        allocate = self.block_manager.allocate_slots
        k, budget, entries = step.num_spec_tokens, self.max_num_batched_tokens, self._entries_budget
        while i < len(running) and budget > 0 and len(step.seq_ids) < max_num_seqs:
            seq = running[i]
            i += 1
            num_computed = seq.num_computed_tokens
            num_new = min(len(seq.token_ids) - num_computed, budget)
            if num_new <= 0:
                continue  # waits for its request policy's next token (a beam)
            if entries is not None and seq.uses_logit_entries and not self._take_logit_entries(
                    seq, num_computed + num_new):
                break
            num_spec = (self._num_spec_tokens(step, seq, num_computed, num_new) if k else 0)
            copies = None if num_spec else allocate(seq.seq_id, num_computed, num_new)
            if copies is None:  # drafts, or the pool is short
                allocated = self._allocate_or_preempt(seq, num_new, num_spec,
                                                      step.preempted_seq_ids)
                if allocated is None:
                    break  # seq itself was preempted: nothing after it runs either
                num_spec, copies = allocated
            self._add(step, seq, num_computed, num_new, num_spec, copies)
            budget -= num_new + num_spec
            if i > len(running) or running[i - 1] is not seq:
                i = running.index(seq) + 1  # an earlier, idle sequence was parked

    def _num_seats(self) -> int:
        """Running sequences plus the forks their policies will add (n > 1 siblings, beams)."""
        return sum(1 + s.num_pending_forks for s in self.running)

    def _schedule_waiting(self, step: SchedulerOutput) -> None:
        seats = self._num_seats()
        while self.waiting and self._budget(step) > 0:
            seq = self.waiting[0]
            if seats + 1 + seq.num_pending_forks > self.max_num_seqs:
                break  # FCFS: a request takes a seat for each sequence it will fork into
            # A prompt whose logprobs are due is computed whole, as vLLM does: no cache hits.
            hits = ([] if seq.needs_prompt_logprobs
                    else self.block_manager.get_computed_blocks(seq.token_ids))
            num_computed = len(hits) * self.block_manager.block_size
            # the draft's KV is in the leading hits its catch-up computed too (the rest: again)
            num_draft_computed = (self.block_manager.num_draft_computed_blocks(hits)
                                  * self.block_manager.block_size if self.has_draft else 0)
            num_new = min(seq.num_tokens - num_computed, self._budget(step))
            if not self._take_logit_entries(seq, num_computed + num_new):
                break
            num_spec = self._num_spec_tokens(step, seq, num_computed, num_new, num_draft_computed)
            allocated = self._allocate_with_drafts(seq, num_computed, num_new, num_spec, hits)
            while allocated is None and self._park_idle(step.preempted_seq_ids):
                allocated = self._allocate_with_drafts(seq, num_computed, num_new, num_spec,
                                                       hits)
            if allocated is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = num_computed
            seq.num_computed_tokens, seq.num_draft_computed_tokens = (num_computed,
                                                                      num_draft_computed)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            seats += 1 + seq.num_pending_forks
            self._add(step, seq, num_computed, num_new, *allocated)

    def _take_logit_entries(self, seq: Sequence, end_pos: int) -> bool:
        """Whether the rows seq samples this step (itself and the forks it makes) fit what is
        left of the step's logit entries (taking them); rows that do not sample take none."""
        if self._entries_budget is None or end_pos < seq.num_tokens or not seq.uses_logit_entries:
            return True
        need = (seq.num_logit_entries(len(self.stop_checker.eos_token_ids))
                * (1 + seq.num_pending_forks))
        if need > self._entries_budget:
            return False
        self._entries_budget -= need
        return True

    def _park_idle(self, preempted: list[int]) -> bool:
        """Preempt (park) the latest running sequence with nothing to compute (a beam whose row
        is in, waiting for a sibling's): it needs no blocks this step, and the sequences that
        do (that sibling, maybe) must progress. False if there is none."""
        for i in range(len(self.running) - 1, -1, -1):
            seq = self.running[i]
            if seq.num_computed_tokens == seq.num_tokens:
                del self.running[i]
                self._preempt(seq)
                preempted.append(seq.seq_id)
                return True
        return False

    def _num_spec_tokens(self, step: SchedulerOutput, seq: Sequence, num_computed: int,
                         num_new: int, num_draft_computed: int | None = None) -> int:
        """Draft slots for seq this step: only once its last real token is computed and the
        draft can catch up to it on at most k + 1 tokens, within the budget and `_drafts_left`,
        and never while forking or below min_tokens."""
        end_pos = num_computed + num_new
        if num_draft_computed is None:
            num_draft_computed = seq.num_draft_computed_tokens
        if (not step.num_spec_tokens or end_pos < seq.num_tokens or seq.num_pending_forks
                or seq.num_output_tokens < seq.sampling_params.min_tokens):
            return 0
        k = step.num_spec_tokens
        if self.host_drafts:
            k = min(k, len(self._proposals.get(seq.seq_id, ())))
        elif end_pos - num_draft_computed > min(self._draft_budget, k + 1):
            return 0
        return max(0, min(k, self._budget(step) - num_new, self._drafts_left(seq)))

    @staticmethod
    def _drafts_left(seq: Sequence) -> int:
        """The most drafts seq may still propose in one step: max_tokens leaves room for
        them beside the token its target pass yields; 0 for good where drafting cannot serve
        it (penalties and logit_bias change the target's distribution per position: counts
        grow with each accepted draft; a policy that picks the tokens, beams, takes none)."""
        params = seq.sampling_params
        if params.has_penalties or params.logit_bias or seq.policy_picks_tokens:
            return 0
        return seq.max_tokens - seq.num_output_tokens - 1

    def _allocate_with_drafts(self, seq: Sequence, num_computed: int, num_new: int,
                              num_spec: int, hits: list[int] | tuple = ()
                              ) -> tuple[int, list[tuple[int, int]]] | None:
        """Slots for the new tokens and the draft slots; when the pool is short, drafts go
        first (fewer or none are proposed) rather than anybody being preempted for them."""
        for spec in (num_spec, 0) if num_spec else (0,):
            copies = self.block_manager.allocate_slots(seq.seq_id, num_computed, num_new + spec,
                                                       hits)
            if copies is not None:
                return spec, copies
        return None

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, num_spec: int,
                             preempted: list[int]) -> tuple[int, list[tuple[int, int]]] | None:
        """Slots for seq's new tokens, preempting idle sequences, then the latest arrivals,
        until they fit."""
        while True:
            allocated = self._allocate_with_drafts(seq, seq.num_computed_tokens, num_new, num_spec)
            if allocated is not None:
                return allocated
            if self._park_idle(preempted):
                continue
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.seq_id)
            if victim is seq:
                return None

    # ---- update ------------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: SampledTokens,
               ahead: SchedulerOutput | None = None) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, finish and free what stopped.

        sampled: the tokens each logits row produced (one normally; its accepted drafts and a
        recovered or bonus token with speculation). A sequence whose request policy picks its
        tokens (a beam) gets none here, and neither does one finished (or removed) since it was
        scheduled: the engine found its stop string in the last step's outputs meanwhile.
        ahead: the step launched after this one, in flight (async scheduling): a speculative
        one is moved by the drafts this one accepted (SchedulerOutput.shift_ahead), and the
        slots past each sequence's end stay its own until no step is in flight.
        Returns every sequence that got tokens.
        """
        self._keep_slots = ahead is not None and bool(ahead.num_spec_tokens)
        if self._keep_slots and output.num_spec_tokens:  # (host drafts follow a plain step)
            ahead.shift_ahead(output, sampled)
        seqs, finished = self.seqs, SequenceStatus.FINISHED
        ends = output.end_positions()
        if (sampled.token_ids.shape[1] == 1 and not output.forks
                and not any(output.num_draft_tokens) and sampled.seq_ids == output.seq_ids):
            return self._update_decodes(output.seq_ids, ends, sampled.token_ids[:, 0].tolist())
        for seq_id, end in zip(output.seq_ids, ends):
            seq = seqs.get(seq_id)
            if seq is not None and seq.status is not finished:
                seq.num_computed_tokens = end
        if output.num_draft_tokens:
            self._advance_drafts(output, ends)
        end_of = dict(zip(output.seq_ids, ends))
        for parent, children in output.forks.items():
            end_of.update((child, end_of[parent]) for child in children)
        touched: list[Sequence] = []
        for r, seq_id in enumerate(sampled.seq_ids):
            seq = seqs.get(seq_id)
            if seq is None or seq.status is finished or seq.policy_picks_tokens:
                continue
            tokens = sampled.tokens(r)
            # Drafts kept; the last token is recovered or bonus. Rejected: rolled back.
            seq.num_computed_tokens = end_of[seq_id] + len(tokens) - 1
            for token in tokens:
                if self._append(seq, token):
                    break
            touched.append(seq)
        if self.speculates or self.block_manager.enable_prefix_caching:
            for seq in touched:
                if seq.status is not finished:
                    self._release_rejected_slots(seq)
        return touched

    def _update_decodes(self, seq_ids: list[int], ends: list[int], tokens: list[int]
                        ) -> list[Sequence]:
        """update() of a step where each sequence samples one token from its last position,
        with no drafts and no forks: one pass, a few attribute reads and an append each."""
        seqs, finished, touched = self.seqs, SequenceStatus.FINISHED, []
        for seq_id, end, token in zip(seq_ids, ends, tokens):
            seq = seqs.get(seq_id)
            if seq is None or seq.status is finished:
                continue
            seq.num_computed_tokens = end
            if seq.policy_picks_tokens:
                continue
            token_ids = seq.token_ids
            token_ids.append(token)
            touched.append(seq)
            if token in seq.stop_token_set or len(token_ids) >= seq.max_num_tokens:
                stop = self.stop_checker(seq, token)
                if stop is not None:
                    self.finish(seq, *stop)
        self.num_generation_tokens_total += len(touched)
        if self.block_manager.enable_prefix_caching:  # blocks full and not in the cache yet
            bs = self.block_manager.block_size
            for seq in touched:
                if (seq.num_computed_tokens // bs > seq.num_full_blocks_cached
                        and seq.status is not finished):
                    self._release_rejected_slots(seq)
        return touched

    def _advance_drafts(self, output: SchedulerOutput, ends: list[int]) -> None:
        """The draft computed its catch-up and drafts 1..k-1."""
        seqs = self.seqs
        for i, seq_id in enumerate(output.seq_ids):
            seq = seqs.get(seq_id)
            if seq is None or seq.is_finished or not output.num_draft_tokens[i]:
                continue
            seq.num_draft_computed_tokens = (output.draft_start_pos[i]
                                             + output.num_draft_tokens[i]
                                             + max(output.num_spec_tokens_per_seq[i] - 1, 0))

    def _release_rejected_slots(self, seq: Sequence) -> None:
        """Blocks past the new length go back to the pool; full blocks whose KV the target
        computed enter the prefix cache."""
        computed = seq.num_computed_tokens
        if self.has_draft:
            seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, computed)
        if self.speculates and not self._keep_slots:
            self.block_manager.truncate(seq.seq_id, seq.num_tokens)
        self.block_manager.cache_blocks(seq.seq_id, seq.token_ids, computed)
        seq.num_full_blocks_cached = computed // self.block_manager.block_size
        if self.has_draft:  # (num_draft_computed_tokens <= computed, as just set)
            self.block_manager.cache_draft_blocks(seq.seq_id, seq.num_draft_computed_tokens)

    def append_tokens(self, seq: Sequence, token_ids: list[int]) -> None:
        """Append tokens a request policy picked to seq, finishing it at the first token-level
        stop; a parked sequence queues again."""
        if self.parked.pop(seq.seq_id, None) is not None:
            self.waiting.appendleft(seq)
        self._changed.add(seq.seq_id)
        for token in token_ids:
            if self._append(seq, token):
                return

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append one token; finish seq if it stops there (returns True then)."""
        seq.token_ids.append(token)
        self.num_generation_tokens_total += 1
        if token in seq.stop_token_set or len(seq.token_ids) >= seq.max_num_tokens:
            stop = self.stop_checker(seq, token)
            if stop is not None:
                self.finish(seq, *stop)
                return True
        return False
