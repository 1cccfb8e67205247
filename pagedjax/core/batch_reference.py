"""The reference batch builder: a step described sequence by sequence (ScheduledBatch) →
the packed ModelInput, every field filled from scratch; and `describe`, which rebuilds that
description from the scheduler's state.

The engine builds its steps with the persistent batch (input_batch.py), which must give the
same buffers; this builder is the readable definition it is tested against, and what synthetic
steps (warm-up, the speculation cost table, tests) are built with.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pagedjax.core.batch import (
    ModelInput,
    StepFlags,
    buffer_sizes,
    choose_layout,
    draft_token_index,
    ragged_positions,
)
from pagedjax.core.logit_entries import build_logit_entries
from pagedjax.core.scheduler_output import (
    SampleSpec,
    ScheduledBatch,
    ScheduledSequence,
    SchedulerOutput,
    sample_spec,
)
from pagedjax.core.step_shapes import StepShapes

if TYPE_CHECKING:
    from pagedjax.core.block_manager import BlockManager
    from pagedjax.core.sequence import Sequence as Seq


def describe(out: SchedulerOutput, seqs: Mapping[int, Seq], block_manager: BlockManager,
             eos_token_ids: tuple[int, ...]) -> ScheduledBatch:
    """The step `out` spelled out from the scheduler's state, as it stands between scheduling
    it (and the request policies' forks) and its update."""
    ahead = out.num_tokens_ahead
    spec = out.num_spec_tokens_per_seq
    scheduled = []
    for i, (seq_id, start, num_new) in enumerate(zip(out.seq_ids, out.num_computed_tokens,
                                                     out.num_new_tokens)):
        seq, end = seqs[seq_id], start + num_new
        entry = ScheduledSequence(
            seq_id=seq_id, token_ids=[0] if ahead else seq.token_ids[start:end],
            start_pos=start, block_table=list(block_manager.get_block_table(seq_id)),
            num_spec_tokens=spec[i] if spec else 0,
            prompt_logprob_token_ids=seq.prompt_logprob_token_ids(start, end),
            input_row=out.input_rows[i] if ahead else -1)
        if out.spec_token_ids:
            entry.spec_token_ids = list(out.spec_token_ids[i])
        if out.num_draft_tokens:
            entry.draft_start_pos = out.draft_start_pos[i]
            entry.draft_token_ids = [0] * out.num_draft_tokens[i] if ahead else seq.token_ids[
                entry.draft_start_pos : entry.draft_start_pos + out.num_draft_tokens[i]]
        if end == seq.num_tokens + ahead:  # caught up: its last position yields a token
            first = sample_spec(seq, eos_token_ids, ahead)
            entry.samples = [first] + [
                SampleSpec(child, first.params, seqs[child].rng_seed, first.rng_step,
                           first.banned_token_ids, first.penalty_prompt_token_ids,
                           first.output_token_ids)
                for child in out.forks.get(seq_id, ())]
        scheduled.append(entry)
    return ScheduledBatch(scheduled, list(out.block_copies), out.num_spec_tokens)


def build_model_input(out: ScheduledBatch, shapes: StepShapes, *, block_size: int,
                      token_bitmask: np.ndarray | None = None) -> ModelInput:
    """Flatten the scheduled sequences into the smallest of the engine's shapes that holds
    them (batch.choose_layout).

    token_bitmask [sample rows, W] int32: the allowed tokens of each sample row in order
    (StructuredOutputManager.bitmask), or None when no row has structured outputs.
    """
    entries = out.scheduled
    samples = [(i, s) for i, e in enumerate(entries) for s in e.samples]
    q_lens = [e.num_new_tokens + e.num_spec_tokens for e in entries]
    draft_lens = [len(e.draft_token_ids) for e in entries]
    num_tokens, num_draft = sum(q_lens), sum(draft_lens)
    layout = choose_layout(shapes, num_seqs=len(entries), num_samples=len(samples),
                           num_tokens=num_tokens, num_draft_tokens=num_draft,
                           decode=all(e.is_decode for e in entries),
                           max_drafts=max((e.num_spec_tokens for e in entries), default=0))
    params = [s.params for _, s in samples]
    sampled = [p for p in params if not p.is_greedy]
    prompt_rows = [(i, e) for i, e in enumerate(entries) if e.prompt_logprob_token_ids]
    logit_entries = build_logit_entries([s for _, s in samples], shapes.num_logit_entries)
    flags = StepFlags(
        sampled=bool(sampled),
        filters=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in sampled),
        logprobs=any(p.logprobs is not None for p in params),
        prompt_logprobs=bool(prompt_rows), logit_entries=logit_entries is not None,
        token_mask=False)
    int_size, float_size = buffer_sizes(layout)
    model_input = ModelInput(
        layout, np.zeros(int_size, np.int32), np.zeros(float_size, np.float32), flags,
        logit_entries, np.asarray(out.block_copies, np.int32).reshape(-1, 2),
        [s.seq_id for _, s in samples], num_tokens, len(entries), max(q_lens, default=0),
        max(draft_lens, default=0), layout.num_spec_tokens, num_draft)
    f = model_input.fields()
    f["step_flags"][:] = flags.as_array()
    f["num_padding_samples"][0] = layout.num_seqs - len(samples)
    ends = _fill_tokens(f, entries, q_lens, block_size)
    _fill_samples(f, entries, samples, ends, layout.num_spec_tokens)
    if prompt_rows:
        model_input.prompt_logprobs_rows = _fill_prompt_logprobs(f, prompt_rows, q_lens, ends)
    if layout.draft:
        _fill_catch_up(f, entries, draft_lens, block_size)
    if layout.draft or layout.num_spec_tokens:
        _fill_verification(f, entries, samples, ends)
    if token_bitmask is not None:
        model_input.set_token_bitmask(token_bitmask)
    return model_input


def _fill_tokens(f: dict[str, np.ndarray], entries: Sequence[ScheduledSequence],
                 q_lens: list[int], block_size: int) -> np.ndarray:
    """The target's tokens (each sequence's new tokens, then its draft slots); returns each
    sequence's token-row end [S]."""
    n, s = sum(q_lens), len(entries)
    ends = np.cumsum(q_lens, dtype=np.int32)
    f["query_start_loc"][1 : s + 1] = ends
    f["query_start_loc"][s + 1 :] = n
    f["kv_lens"][:s] = [e.start_pos + q for e, q in zip(entries, q_lens)]
    _fill_block_tables(f["block_tables"], [e.block_table for e in entries])
    # Draft slots carry the host's proposals, or token 0 where the draft model proposes them
    # (the runner writes them in).
    f["input_ids"][:n] = list(itertools.chain.from_iterable(
        e.token_ids + (e.spec_token_ids or [0] * e.num_spec_tokens) for e in entries))
    if any(e.input_row >= 0 for e in entries):  # each one's first token: the last step's
        f["input_rows"][ends - np.asarray(q_lens)] = [e.input_row + 1 for e in entries]
    positions = ragged_positions([e.start_pos for e in entries], q_lens)
    f["positions"][:n] = positions
    f["slot_mapping"][:] = -1
    f["slot_mapping"][:n] = _slots(f["block_tables"], np.repeat(np.arange(s), q_lens), positions,
                                   block_size)
    return ends


def _fill_samples(f: dict[str, np.ndarray], entries: Sequence[ScheduledSequence],
                  samples: list[tuple[int, SampleSpec]], ends: np.ndarray, k: int) -> None:
    """Logits rows and sampling knobs; row r samples from its sequence's last real token and,
    when it verifies drafts, from each draft slot after it (padding repeats row 0)."""
    num = len(samples)
    seq_index = np.asarray([i for i, _ in samples], np.int64)
    num_spec = np.asarray([entries[i].num_spec_tokens for i, _ in samples], np.int64)
    last_real = ends[seq_index] - 1 - num_spec if num else np.zeros(0, np.int64)
    offsets = np.minimum(np.arange(k + 1)[None, :], num_spec[:, None])  # [num, K+1]
    f["logits_indices"][:num] = last_real[:, None] + offsets
    params = [s.params for _, s in samples]
    f["temperature"][:num] = [0.0 if p.is_greedy else p.temperature for p in params]
    f["top_p"][:] = 1.0
    f["top_p"][:num] = [p.top_p for p in params]
    f["min_p"][:num] = [p.min_p for p in params]
    f["top_k"][:num] = [p.top_k for p in params]
    f["repetition_penalty"][:] = 1.0
    f["repetition_penalty"][:num] = [p.repetition_penalty for p in params]
    f["frequency_penalty"][:num] = [p.frequency_penalty for p in params]
    f["presence_penalty"][:num] = [p.presence_penalty for p in params]
    f["rng_seed"][:num] = np.asarray([s.rng_seed for _, s in samples], np.uint32).view(np.int32)
    f["rng_step"][:num] = np.asarray([s.rng_step for _, s in samples], np.uint32).view(np.int32)


def _fill_prompt_logprobs(f: dict[str, np.ndarray],
                          prompt_rows: list[tuple[int, ScheduledSequence]], q_lens: list[int],
                          ends: np.ndarray) -> list[tuple[int, int, int]]:
    """The token rows that score a prompt token (the first new tokens of each such sequence)
    and those tokens; returns ModelInput.prompt_logprobs_rows. Padding scores row 0."""
    counts = [len(e.prompt_logprob_token_ids) for _, e in prompt_rows]
    firsts = [int(ends[i]) - q_lens[i] for i, _ in prompt_rows]
    n = sum(counts)
    f["prompt_logprobs_indices"][:n] = ragged_positions(firsts, counts)
    f["prompt_logprobs_token_ids"][:n] = list(itertools.chain.from_iterable(
        e.prompt_logprob_token_ids for _, e in prompt_rows))
    return [(e.seq_id, e.start_pos + 1, count) for (_, e), count in zip(prompt_rows, counts)]


def _fill_catch_up(f: dict[str, np.ndarray], entries: Sequence[ScheduledSequence],
                   draft_lens: list[int], block_size: int) -> None:
    """The draft model's catch-up pass."""
    s, n = len(entries), sum(draft_lens)
    draft_ends = np.cumsum(draft_lens, dtype=np.int32)
    f["draft_query_start_loc"][1 : s + 1] = draft_ends
    f["draft_query_start_loc"][s + 1 :] = n
    starts = [e.draft_start_pos for e in entries]
    f["draft_kv_lens"][:s] = [a + b for a, b in zip(starts, draft_lens)]
    f["draft_input_ids"][:n] = list(itertools.chain.from_iterable(
        e.draft_token_ids for e in entries))
    positions = ragged_positions(starts, draft_lens)
    f["draft_positions"][:n] = positions
    f["draft_slot_mapping"][:] = -1
    f["draft_slot_mapping"][:n] = _slots(f["block_tables"], np.repeat(np.arange(s), draft_lens),
                                         positions, block_size)


def _fill_verification(f: dict[str, np.ndarray], entries: Sequence[ScheduledSequence],
                       samples: list[tuple[int, SampleSpec]], ends: np.ndarray) -> None:
    """Where each sequence's k drafts sit in the target's tokens, and which rows verify them."""
    s = len(entries)
    num_drafts = np.asarray([e.num_spec_tokens for e in entries], np.int32)
    f["num_drafts"][:s] = num_drafts
    draft_token_index(f, ends, num_drafts)
    first_row: dict[int, int] = {}
    for row, (i, spec) in enumerate(samples):
        first_row.setdefault(i, row)
        f["sample_seq"][row] = i
        if spec.seq_id == entries[i].seq_id:  # forked siblings never carry drafts
            f["num_draft_tokens"][row] = num_drafts[i]
    f["seq_sample_row"][:s] = [first_row.get(i, 0) for i in range(s)]


def _slots(block_tables: np.ndarray, seq_index: np.ndarray, positions: np.ndarray,
           block_size: int) -> np.ndarray:
    """KV slot of each (sequence, position): block_id * block_size + offset."""
    return block_tables[seq_index, positions // block_size] * block_size + positions % block_size


def _fill_block_tables(block_tables: np.ndarray, tables: list[list[int]]) -> None:
    lengths = [len(t) for t in tables]
    rows = np.repeat(np.arange(len(tables)), lengths)
    cols = np.arange(sum(lengths)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    block_tables[rows, cols] = list(itertools.chain.from_iterable(tables))
