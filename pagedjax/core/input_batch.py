"""The persistent batch: a row of NumPy arrays per running sequence, kept across steps and
updated by what the scheduler says changed (vLLM V1's InputBatch).

A row holds its sequence's token ids, block table and sampling parameters. Each step the batch
frees the rows of removed sequences, fills rows for sequences it meets first (new, resumed,
forked), applies the block-table changes and copies the rows whose sequence changed on the host
(a beam's pick, a grammar's cut); it then builds the step's packed ModelInput with a few
vectorized gathers over the scheduled rows, and after the step appends the sampled tokens to
their rows in one scatter. A decode step in which every sequence gets one token touches its
rows in NumPy only; Python work is proportional to the rows that changed, and to the rows whose
sampling reads their history (penalties, logit_bias, min_tokens: logit_entries.py).

batch_reference.build_model_input is the definition: the same step built from scratch, sequence
by sequence. Both give the same buffers (tests/core/test_input_batch.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import numpy as np

from pagedjax.core.batch import (
    FLOAT_FIELDS,
    ModelInput,
    StepFlags,
    buffer_sizes,
    choose_layout,
    draft_token_index,
    ragged_positions,
    unpack,
)
from pagedjax.core.logit_entries import LogitEntries, build_logit_entries
from pagedjax.core.scheduler_output import SampledTokens, SchedulerOutput, sample_spec
from pagedjax.core.sequence import Sequence
from pagedjax.core.step_shapes import BatchLayout, StepShapes


class InputBatch:
    """Rows of the running sequences (at most the largest sequence bucket of them)."""

    def __init__(self, shapes: StepShapes, *, block_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        n, m = shapes.max_num_seqs, shapes.max_blocks_per_seq
        self.shapes, self.block_size = shapes, block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.seq_ids = np.full(n, -1, np.int64)  # -1: a free row
        self.seqs: list[Sequence | None] = [None] * n
        self.row_of: dict[int, int] = {}
        self._free_rows = list(range(n - 1, -1, -1))  # pop() takes the lowest
        self.token_ids = np.zeros((n, max_model_len), np.int32)  # [R, max_model_len]
        self.num_tokens = np.zeros(n, np.int64)  # tokens the host has (prompt + output)
        self.num_prompt_tokens = np.zeros(n, np.int64)
        self.block_table = np.zeros((n, m), np.int32)  # [R, M], 0 past num_blocks
        self.num_blocks = np.zeros(n, np.int64)
        # sampling parameters of each row; the float ones are rows of one array, in the order
        # of a step's float buffer (FLOAT_FIELDS), so that a step gathers them at once
        self.float_params = np.zeros((len(FLOAT_FIELDS), n), np.float32)  # [F, R]
        params = dict(zip(FLOAT_FIELDS, self.float_params))
        self.temperature = params["temperature"]  # 0: greedy
        self.top_p = params["top_p"]
        self.min_p = params["min_p"]
        self.presence_penalty = params["presence_penalty"]
        self.frequency_penalty = params["frequency_penalty"]
        self.repetition_penalty = params["repetition_penalty"]
        self.top_p[:] = self.repetition_penalty[:] = 1.0
        # [F, 1] what a padding row's float parameters are
        self._float_padding = np.array([[1.0 if name in ("top_p", "repetition_penalty") else 0.0]
                                        for name in FLOAT_FIELDS], np.float32)
        self.top_k = np.zeros(n, np.int32)
        self.filters = np.zeros(n, bool)  # top-k, top-p or min-p (of a sampled row)
        self.logprobs = np.zeros(n, bool)
        self.prompt_logprobs = np.zeros(n, bool)
        self.rng_seed = np.zeros(n, np.uint32)
        self.rng_offset = np.zeros(n, np.int64)
        # rows whose sampling may carry logit entries (penalties, logit_bias, min_tokens)
        self.has_entries = np.zeros(n, bool)
        self.appends_sampled = np.zeros(n, bool)  # False: its policy picks its tokens (beams)
        # rows with prompt_logprobs asked for, and rows that may carry logit entries: a step
        # looks for them only while some row has them (and so for the step's flags)
        self._num_prompt_logprobs_rows = self._num_entry_rows = 0
        self._num_sampled_rows = self._num_filter_rows = self._num_logprobs_rows = 0
        # layout → its staging buffers (ints, floats) and their named views
        self._staging: dict[BatchLayout, tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]] = {}
        self._ones = np.ones(n, np.int64)  # [R] one new token each (a decode step), read only
        self._counting = np.arange(1, n + 1, dtype=np.int64)  # [R] its token ends, read only
        self._ones.flags.writeable = self._counting.flags.writeable = False
        self._num_policy_rows = 0  # rows whose policy picks their tokens (beams)
        self._version = 0  # changes whenever a row is given to another sequence

    @property
    def num_rows(self) -> int:
        return len(self.row_of)

    # ---- rows --------------------------------------------------------------------------------

    def add(self, seq: Sequence, block_table: list[int]) -> int:
        """A row for seq, filled from it; returns the row."""
        if not self._free_rows:
            raise RuntimeError(f"the persistent batch's {len(self.seq_ids)} rows are taken")
        row = self._free_rows.pop()
        self.row_of[seq.seq_id] = row
        self.seq_ids[row], self.seqs[row] = seq.seq_id, seq
        self.num_prompt_tokens[row] = seq.num_prompt_tokens
        self._copy_tokens(row, seq)
        self._set_table(row, 0, block_table)
        params = seq.sampling_params
        sampled = not params.is_greedy
        self.temperature[row] = params.temperature if sampled else 0.0
        self.top_p[row], self.top_k[row], self.min_p[row] = params.top_p, params.top_k, params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.filters[row] = sampled and (params.top_k > 0 or params.top_p < 1.0
                                         or params.min_p > 0.0)
        self.logprobs[row] = params.logprobs is not None
        self.prompt_logprobs[row] = params.prompt_logprobs is not None
        self.rng_seed[row] = seq.rng_seed
        self.has_entries[row] = bool(params.logit_bias or params.has_penalties
                                     or params.min_tokens)
        self.appends_sampled[row] = not seq.policy_picks_tokens
        self._num_policy_rows += int(seq.policy_picks_tokens)
        self._version += 1
        self._count_rows(row, 1)
        return row

    def _count_rows(self, row: int, sign: int) -> None:
        """Add (sign 1) or take (-1) the row to / from the counts of rows asking for things."""
        self._num_prompt_logprobs_rows += sign * int(self.prompt_logprobs[row])
        self._num_entry_rows += sign * int(self.has_entries[row])
        self._num_sampled_rows += sign * int(self.temperature[row] > 0)
        self._num_filter_rows += sign * int(self.filters[row])
        self._num_logprobs_rows += sign * int(self.logprobs[row])

    def remove(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is None:
            return
        self.seq_ids[row], self.seqs[row] = -1, None
        self._set_table(row, 0, [])
        self._count_rows(row, -1)
        self._num_policy_rows -= int(not self.appends_sampled[row])
        self.prompt_logprobs[row] = self.has_entries[row] = self.appends_sampled[row] = False
        self._free_rows.append(row)

    def _copy_tokens(self, row: int, seq: Sequence) -> None:
        """The row's tokens and random counter from its sequence."""
        n = seq.num_tokens
        self.token_ids[row, :n] = seq.token_ids
        self.num_tokens[row] = n
        self.rng_offset[row] = seq.rng_offset

    def _set_table(self, row: int, first: int, block_ids: list[int]) -> None:
        """The row's block table from index `first` on is block_ids (zeros after)."""
        end, old = first + len(block_ids), int(self.num_blocks[row])
        self.block_table[row, first:end] = block_ids
        if end < old:
            self.block_table[row, end:old] = 0
        self.num_blocks[row] = end

    def apply(self, out: SchedulerOutput, seqs: Mapping[int, Sequence],
              block_tables: Mapping[int, list[int]]) -> None:
        """Bring the rows up to date with what the scheduler says changed; sequences met for
        the first time get rows (with their tables from block_tables: seq id → table)."""
        for seq_id in out.removed_seq_ids:
            self.remove(seq_id)
        row_of = self.row_of
        for seq_id, (first, block_ids) in out.block_table_changes.items():
            row = row_of.get(seq_id)
            if row is not None:
                self._set_table(row, first, block_ids)
        for seq_id in out.changed_seq_ids:
            row = row_of.get(seq_id)
            if row is not None:
                self._copy_tokens(row, seqs[seq_id])
        if len(row_of) < len(out.seq_ids) or not row_of.keys() >= set(out.seq_ids):
            for seq_id in sorted(set(out.seq_ids).difference(row_of)):
                self.add(seqs[seq_id], block_tables[seq_id])

    def append_sampled(self, sampled: SampledTokens, model_input: ModelInput) -> None:
        """The step's kept tokens onto their rows (model_input: the step they came from), as
        the scheduler appended them, except to rows whose policy picks their tokens. A row
        whose sequence stopped mid-way gets them all: it is removed before it is read."""
        rows = model_input.sample_rows
        if rows is None or not len(rows):
            return
        tokens, counts = sampled.token_ids, sampled.num_tokens
        if model_input.rows_version != self._version:
            # rows of this step's sequences still, that append (a fork's -1 row holds another
            # sequence; a beam's tokens come from its policy)
            ok = (self.seq_ids[rows] == np.asarray(sampled.seq_ids)) & self.appends_sampled[rows]
            rows, tokens = rows[ok], tokens[ok]
            counts = None if counts is None else counts[ok]
        capacity = self.token_ids.shape[1]
        starts = self.num_tokens[rows]
        if counts is None:  # one token a row
            self.token_ids[rows, np.minimum(starts, capacity - 1)] = tokens[:, 0]
            self.num_tokens[rows] = np.minimum(starts + 1, capacity)
            return
        # each row's first counts[r] tokens, those that fit: one scatter (no loop over K)
        ends = np.minimum(starts + counts, capacity)
        kept = np.arange(tokens.shape[1]) < (ends - starts)[:, None]  # [L, K+1]
        r, j = np.nonzero(kept)
        self.token_ids[rows[r], starts[r] + j] = tokens[r, j]
        self.num_tokens[rows] = ends

    # ---- the step ----------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput, seqs: Mapping[int, Sequence],
                block_tables: Mapping[int, list[int]]) -> ModelInput:
        """The step's packed ModelInput (the same buffers as build_model_input(describe(out)))."""
        self.apply(out, seqs, block_tables)
        s = len(out.seq_ids)
        rows = np.fromiter(map(self.row_of.__getitem__, out.seq_ids), np.int64, s)  # [S]
        start = np.asarray(out.num_computed_tokens, np.int64)
        one_each = out.num_batched_tokens == s  # one new token each, no draft slots
        if one_each:
            num_new = q_lens = self._ones[:s]
            ends, num_spec = self._counting[:s], None
        else:
            num_new = np.asarray(out.num_new_tokens, np.int64)
            num_spec = (np.asarray(out.num_spec_tokens_per_seq, np.int64)
                        if out.num_spec_tokens_per_seq else None)
            q_lens = num_new if num_spec is None else num_new + num_spec
            ends = np.cumsum(q_lens)
        num_tokens = int(ends[-1])
        end_real = start + num_new
        prompt_counts = self._prompt_counts(rows, start, end_real)
        samples = _Samples(self, out, seqs, rows, end_real)
        draft_lens = (np.asarray(out.num_draft_tokens, np.int64) if any(out.num_draft_tokens)
                      else None)
        num_draft = 0 if draft_lens is None else int(draft_lens.sum())
        max_drafts = 0 if num_spec is None else int(num_spec.max())
        num_slots = 0 if num_spec is None else int(num_spec.sum())  # draft slots
        layout = choose_layout(
            self.shapes, num_seqs=s, num_samples=samples.num, num_tokens=num_tokens,
            num_draft_tokens=num_draft,
            decode=num_tokens - num_slots == s and prompt_counts is None, max_drafts=max_drafts)
        if num_spec is None:
            num_spec = np.zeros(s, np.int64)
        entries = samples.logit_entries(self.shapes.num_logit_entries)
        flags = samples.flags(prompt_logprobs=prompt_counts is not None,
                              logit_entries=entries is not None)
        ints, floats, f = self._buffers(layout)
        f["step_flags"][:] = flags.as_array()
        f["num_padding_samples"][0] = layout.num_seqs - samples.num
        self._fill_tokens(f, out, rows, start, num_new, q_lens, ends)
        samples.fill(f, floats, ends, num_spec, layout.num_spec_tokens)
        prompt_logprobs_rows = []
        if prompt_counts is not None:
            prompt_logprobs_rows = self._fill_prompt_logprobs(
                f, out, rows, start, prompt_counts, ends - q_lens)
        if layout.draft:
            self._fill_catch_up(f, out, rows,
                                np.zeros(s, np.int64) if draft_lens is None else draft_lens)
        if layout.draft or layout.num_spec_tokens:
            self._fill_verification(f, num_spec, ends, samples)
        return ModelInput(
            layout, ints.copy(), floats.copy(), flags, entries,
            np.asarray(out.block_copies, np.int32).reshape(-1, 2),
            self.seq_ids[samples.own_rows].tolist() if not out.forks else samples.seq_ids,
            num_tokens, s, 1 if one_each else int(q_lens.max()),
            0 if draft_lens is None else int(draft_lens.max()), layout.num_spec_tokens,
            num_draft, prompt_logprobs_rows, sample_rows=samples.own_rows,
            rows_version=-1 if out.forks or self._num_policy_rows else self._version)

    def _buffers(self, layout: BatchLayout) -> tuple[np.ndarray, np.ndarray,
                                                     dict[str, np.ndarray]]:
        """The layout's staging buffers, zeroed, and their named views: kept across steps (a
        step's ModelInput takes a copy, which no later step writes into)."""
        staged = self._staging.get(layout)
        if staged is None:
            int_size, float_size = buffer_sizes(layout)
            ints, floats = np.zeros(int_size, np.int32), np.zeros(float_size, np.float32)
            staged = self._staging[layout] = (ints, floats, unpack(layout, ints, floats))
        else:
            staged[0].fill(0)
            staged[1].fill(0)
        return staged

    def _prompt_counts(self, rows: np.ndarray, start: np.ndarray, end_real: np.ndarray
                       ) -> np.ndarray | None:
        """[S] prompt tokens each sequence scores this step (prompt_logprobs, while due): the
        prompt token after each of its first new tokens; None where no sequence scores any."""
        if not self._num_prompt_logprobs_rows:
            return None
        num_prompt = self.num_prompt_tokens[rows]
        due = (self.prompt_logprobs[rows] & (self.num_tokens[rows] == num_prompt)
               & (start + 1 < num_prompt))
        counts = np.where(due, np.minimum(end_real + 1, num_prompt) - start - 1, 0)
        return counts if counts.any() else None

    def _slots(self, block_tables: np.ndarray, seq_index: np.ndarray,
               positions: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return block_tables[seq_index, positions // bs] * bs + positions % bs

    def _fill_tokens(self, f: dict[str, np.ndarray], out: SchedulerOutput, rows: np.ndarray,
                     start: np.ndarray, num_new: np.ndarray, q_lens: np.ndarray,
                     ends: np.ndarray) -> None:
        """The target's tokens: each sequence's new tokens, then its draft slots (the host's
        proposals, or token 0: the runner writes the draft model's in)."""
        s, n = len(rows), int(ends[-1])
        f["query_start_loc"][1 : s + 1] = ends
        f["query_start_loc"][s + 1 :] = n
        f["kv_lens"][:s] = start + q_lens
        f["block_tables"][:s] = self.block_table[rows]
        if n == s:  # one token each (a decode step)
            seq_index, positions = np.arange(s), start
        else:
            seq_index = np.repeat(np.arange(s), q_lens)
            positions = ragged_positions(start, q_lens)
        last = self.token_ids.shape[1] - 1
        if out.input_rows is not None:  # each one's first token is the last step's, on the
            f["input_rows"][ends - q_lens] = np.asarray(out.input_rows) + 1  # device
            # (and 0 here; the draft slots too, which the draft model fills, or the host's
            # drafts after it)
            if out.spec_token_ids:
                f["input_ids"][np.flatnonzero(positions > start[seq_index])] = np.fromiter(
                    itertools.chain.from_iterable(out.spec_token_ids), np.int32)
        elif n == s:  # each one's token is its last one
            f["input_ids"][:n] = self.token_ids[rows, np.minimum(start, last)]
        else:
            real = positions < (start + num_new)[seq_index]
            f["input_ids"][:n] = np.where(
                real, self.token_ids[rows[seq_index], np.minimum(positions, last)], 0)
            if out.spec_token_ids:  # the host's drafts, after each sequence's new tokens
                f["input_ids"][np.flatnonzero(~real)] = np.fromiter(
                    itertools.chain.from_iterable(out.spec_token_ids), np.int32)
        f["positions"][:n] = positions
        f["slot_mapping"][:] = -1
        f["slot_mapping"][:n] = self._slots(f["block_tables"], seq_index, positions)

    def _fill_prompt_logprobs(self, f: dict[str, np.ndarray], out: SchedulerOutput,
                              rows: np.ndarray, start: np.ndarray, counts: np.ndarray,
                              firsts: np.ndarray) -> list[tuple[int, int, int]]:
        """The token rows that score a prompt token (the first new tokens of each such
        sequence) and those tokens; returns ModelInput.prompt_logprobs_rows."""
        which = np.flatnonzero(counts)
        n = int(counts.sum())
        f["prompt_logprobs_indices"][:n] = ragged_positions(firsts[which], counts[which])
        positions = ragged_positions(start[which] + 1, counts[which])
        f["prompt_logprobs_token_ids"][:n] = self.token_ids[
            np.repeat(rows[which], counts[which]), positions]
        return [(out.seq_ids[i], int(start[i]) + 1, int(counts[i])) for i in which]

    def _fill_catch_up(self, f: dict[str, np.ndarray], out: SchedulerOutput, rows: np.ndarray,
                       draft_lens: np.ndarray) -> None:
        """The draft model's catch-up pass."""
        s, n = len(rows), int(draft_lens.sum())
        draft_start = (np.asarray(out.draft_start_pos, np.int64) if out.draft_start_pos
                       else np.zeros(s, np.int64))
        draft_ends = np.cumsum(draft_lens)
        f["draft_query_start_loc"][1 : s + 1] = draft_ends
        f["draft_query_start_loc"][s + 1 :] = n
        f["draft_kv_lens"][:s] = draft_start + draft_lens
        seq_index = np.repeat(np.arange(s), draft_lens)
        positions = ragged_positions(draft_start, draft_lens)
        if out.input_rows is None:  # else the last step's token, found on the device
            f["draft_input_ids"][:n] = self.token_ids[rows[seq_index], positions]
        f["draft_positions"][:n] = positions
        f["draft_slot_mapping"][:] = -1
        f["draft_slot_mapping"][:n] = self._slots(f["block_tables"], seq_index, positions)

    @staticmethod
    def _fill_verification(f: dict[str, np.ndarray], num_spec: np.ndarray, ends: np.ndarray,
                           samples: _Samples) -> None:
        """Where each sequence's k drafts sit in the target's tokens, and which logits rows
        verify them."""
        s = len(num_spec)
        f["num_drafts"][:s] = num_spec
        draft_token_index(f, ends, num_spec)
        num = samples.num
        f["sample_seq"][:num] = samples.seq_index
        f["num_draft_tokens"][:num] = np.where(samples.is_fork, 0, num_spec[samples.seq_index])
        first_row = np.zeros(s, np.int64)  # each sequence's first logits row (0: none)
        first_row[samples.seq_index[::-1]] = np.arange(num)[::-1]
        f["seq_sample_row"][:s] = first_row


class _Samples:
    """A step's logits rows: one per scheduled sequence that has caught up with its tokens,
    followed by its siblings forked this step (n > 1), who sample from its last position."""

    def __init__(self, batch: InputBatch, out: SchedulerOutput, seqs: Mapping[int, Sequence],
                 rows: np.ndarray, end_real: np.ndarray) -> None:
        self.batch, self.out, self.seqs, self.rows = batch, out, seqs, rows
        ahead = out.num_tokens_ahead
        # [num] index of each logits row's sequence in the step
        self.seq_index = np.flatnonzero(end_real == batch.num_tokens[rows] + ahead)
        self.param_rows = rows[self.seq_index]  # [num] the row whose parameters it samples by
        self.own_rows = self.param_rows  # [num] its own row (-1: a sibling forked this step)
        self.is_fork = np.zeros(len(self.seq_index), bool)
        self.rng_seed = batch.rng_seed[self.param_rows]
        self.seq_ids: list[int] = []
        if out.forks:
            self._add_forks()
        self.num = len(self.seq_index)

    def _add_forks(self) -> None:
        out, seq_ids = self.out, self.out.seq_ids
        index, own, seeds, ids = [], [], [], []
        for i, row in zip(self.seq_index.tolist(), self.param_rows.tolist()):
            index.append(i), own.append(row), ids.append(seq_ids[i])
            seeds.append(self.batch.rng_seed[row])
            for child in out.forks.get(seq_ids[i], ()):
                index.append(i), own.append(-1), ids.append(child)
                seeds.append(self.seqs[child].rng_seed)
        self.seq_index = np.asarray(index, np.int64)
        self.own_rows = np.asarray(own, np.int64)
        self.param_rows = self.rows[self.seq_index]
        self.is_fork = self.own_rows < 0
        self.rng_seed = np.asarray(seeds, np.uint32)
        self.seq_ids = ids

    def flags(self, *, prompt_logprobs: bool, logit_entries: bool) -> StepFlags:
        b, rows = self.batch, self.param_rows
        return StepFlags(
            sampled=bool(b._num_sampled_rows) and bool((b.temperature[rows] > 0).any()),
            filters=bool(b._num_filter_rows) and bool(b.filters[rows].any()),
            logprobs=bool(b._num_logprobs_rows) and bool(b.logprobs[rows].any()),
            prompt_logprobs=prompt_logprobs, logit_entries=logit_entries)

    def logit_entries(self, capacity: int) -> LogitEntries | None:
        """The penalties, logit_bias and min_tokens entries of the rows that may have any."""
        if not self.batch._num_entry_rows:
            return None
        which = np.flatnonzero(self.batch.has_entries[self.param_rows])
        if not len(which):
            return None
        ahead, eos = self.out.num_tokens_ahead, self.batch.eos_token_ids
        specs = [sample_spec(self.batch.seqs[self.param_rows[r]], eos, ahead)
                 for r in which.tolist()]
        return build_logit_entries(specs, capacity, which.tolist())

    def fill(self, f: dict[str, np.ndarray], floats: np.ndarray, ends: np.ndarray,
             num_spec: np.ndarray, k: int) -> None:
        """Logits rows and sampling knobs (floats: the step's float buffer, FLOAT_FIELDS);
        row r samples from its sequence's last real token and, when it verifies drafts, from
        each draft slot after it (padding repeats row 0)."""
        b, rows, num = self.batch, self.param_rows, self.num
        spec = num_spec[self.seq_index]
        last_real = ends[self.seq_index] - 1 - spec
        if k:
            f["logits_indices"][:num] = last_real[:, None] + np.minimum(
                np.arange(k + 1)[None, :], spec[:, None])
        else:
            f["logits_indices"][:num, 0] = last_real
        grid = floats.reshape(len(FLOAT_FIELDS), -1)  # [F, S]
        grid[:, :num] = b.float_params[:, rows]
        grid[:, num:] = b._float_padding
        f["top_k"][:num] = b.top_k[rows]
        f["rng_seed"][:num] = self.rng_seed.view(np.int32)
        rng_step = (b.num_tokens[rows] + self.out.num_tokens_ahead - b.num_prompt_tokens[rows]
                    + b.rng_offset[rows])
        f["rng_step"][:num] = rng_step.astype(np.uint32).view(np.int32)
