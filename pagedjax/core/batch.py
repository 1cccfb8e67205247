"""SchedulerOutput → the flattened, padded batch every runner executes (NumPy only).

A step's integers live in one int32 buffer and its sampling floats in one float32 buffer, so a
runner uploads two arrays per step (four when a row has penalties, logit_bias or banned tokens:
the logit entries, see logit_entries.py; one more, the token bitmask [S, ceil(V / 32)], when a
row has structured outputs). The step's shape is one of the engine's closed set
(`StepShapes`); `BatchLayout.unpack` slices either buffer back into named fields on the host
(NumPy) or on the device (jax.Array, torch.Tensor).

Fields, with T tokens, S sequences (= logits rows), M blocks per sequence, K drafts:
every field is present in every step of a layout, whatever its requests ask for. What a step
uses is said by `step_flags` (the same bits as `ModelInput.flags` on the host): JAX branches on
them inside the compiled step, torch on the host.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

from pagedjax.core.logit_entries import LogitEntries, build_logit_entries
from pagedjax.core.scheduler_output import SampleSpec, ScheduledSequence, SchedulerOutput
from pagedjax.core.step_shapes import BatchLayout, StepShapes

Array = TypeVar("Array")  # np.ndarray on the host, jax.Array or torch.Tensor on a device

PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", *PENALTY_FIELDS)
# What the samplers read from the buffers (the logit entries come beside them).
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", *PENALTY_FIELDS)


class StepFlag(enum.IntEnum):
    """Index of each feature in `step_flags`: a step computes what its rows ask for only."""

    SAMPLED = 0  # some row samples at random (temperature > 0)
    FILTERS = 1  # some random row uses top-k, top-p or min-p
    LOGPROBS = 2  # some row asks for top logprobs (and ranks)
    PROMPT_LOGPROBS = 3  # some token row scores a prompt token (prompt_logprobs)
    LOGIT_ENTRIES = 4  # some row has penalties, logit_bias or banned tokens
    TOKEN_MASK = 5  # some row samples from a grammar's allowed tokens (structured outputs)


@dataclass(frozen=True)
class StepFlags:
    """The host's copy of `step_flags`."""

    sampled: bool = False
    filters: bool = False
    logprobs: bool = False
    prompt_logprobs: bool = False
    logit_entries: bool = False
    token_mask: bool = False

    def as_array(self) -> list[int]:
        return [int(self.sampled), int(self.filters), int(self.logprobs),
                int(self.prompt_logprobs), int(self.logit_entries), int(self.token_mask)]


def bitmask_width(vocab_size: int) -> int:
    """Words in a row of a token bitmask: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def int_fields(layout: BatchLayout) -> dict[str, tuple[int, ...]]:
    """Name → shape of every int32 field, in buffer order."""
    return _int_fields(layout)


@functools.lru_cache(maxsize=256)
def _int_fields(layout: BatchLayout) -> dict[str, tuple[int, ...]]:
    t, s, m, k = (layout.num_tokens, layout.num_seqs, layout.max_blocks_per_seq,
                  layout.num_spec_tokens)
    fields = {
        "input_ids": (t,),
        # async scheduling: 1 + the last step's logits row whose sampled token is this row's
        # input (read on the device, the host never saw it); 0 = input_ids
        "input_rows": (t,),
        "positions": (t,),
        "slot_mapping": (t,),  # block_id * block_size + offset; -1 = padding
        "query_start_loc": (s + 1,),
        "kv_lens": (s,),  # context length after this step (0 for padding)
        "block_tables": (s, m),
        "logits_indices": (s, k + 1),  # token rows sampled: the last real one, then drafts
        "top_k": (s,),  # 0 = off
        "rng_seed": (s,),  # uint32 bits: the completion's random stream
        "rng_step": (s,),  # uint32 bits: its counter (tokens generated so far)
        # prompt_logprobs: the token row scoring each prompt token, and that token (T of them
        # at most; padding scores row 0)
        "prompt_logprobs_indices": (t,),
        "prompt_logprobs_token_ids": (t,),
        "step_flags": (len(StepFlag),),
        # how many of the S logits rows, the last ones, sample nothing (padding): a runner may
        # leave their logits at zero instead of computing them
        "num_padding_samples": (1,),
    }
    if layout.draft:
        fields.update({
            # The draft's catch-up pass: what it has not computed up to each sequence's end.
            "draft_input_ids": (t,),
            "draft_positions": (t,),
            "draft_slot_mapping": (t,),
            "draft_query_start_loc": (s + 1,),
            "draft_kv_lens": (s,),  # = end of the real tokens for a sequence that drafts
            "num_drafts": (s,),  # drafts each sequence proposes (<= K)
            "draft_token_index": (s, k),  # row of draft j in the target's tokens; T = none
            "seq_sample_row": (s,),  # logits row whose sampling knobs the draft uses
            "sample_seq": (s,),  # sequence whose drafts logits row l verifies
            "num_draft_tokens": (s,),  # drafts row l verifies (0 for forked siblings)
        })
    return fields


def float_fields(layout: BatchLayout) -> dict[str, tuple[int, ...]]:
    """Name → shape of every float32 field, in buffer order."""
    return {name: (layout.num_seqs,) for name in FLOAT_FIELDS}


@functools.lru_cache(maxsize=256)
def _spans(layout: BatchLayout) -> tuple[list[tuple[str, int, int, int, tuple | None]], int, int]:
    """(name, buffer (0 = ints, 1 = floats), start, stop, shape or None if 1-D) of each field,
    and the two buffers' sizes."""
    spans, sizes = [], []
    for kind, fields in enumerate((int_fields(layout), float_fields(layout))):
        offset = 0
        for name, shape in fields.items():
            size = math.prod(shape)
            spans.append((name, kind, offset, offset + size, shape if len(shape) > 1 else None))
            offset += size
        sizes.append(offset)
    return spans, *sizes


def buffer_sizes(layout: BatchLayout) -> tuple[int, int]:
    """(int32 buffer size, float32 buffer size) of a layout."""
    return _spans(layout)[1:]


def unpack(layout: BatchLayout, ints: Array, floats: Array) -> dict[str, Array]:
    """Named views of the packed buffers (works for NumPy, jax and torch arrays)."""
    buffers = (ints, floats)
    return {name: buffers[kind][start:stop] if shape is None
            else buffers[kind][start:stop].reshape(shape)
            for name, kind, start, stop, shape in _spans(layout)[0]}


@dataclass
class ModelInput:
    """One step for a runner: the packed buffers plus what the host keeps for itself."""

    layout: BatchLayout
    ints: np.ndarray  # [int size] int32
    floats: np.ndarray  # [float size] float32
    flags: StepFlags
    entries: LogitEntries | None  # the rows' penalties, logit_bias and banned tokens, if any
    block_copies: np.ndarray  # [C, 2] int32 (src, dst): copy-on-write before the forward
    seq_ids: list[int]  # the sequence of each real logits row (ModelOutput.seq_ids)
    num_tokens: int  # real T
    num_seqs: int  # real S
    max_query_len: int  # longest real query (drafts included): the torch op's launch bound
    max_draft_query_len: int = 0  # the same for the draft's catch-up pass
    num_spec_tokens: int = 0  # the step's k: no sequence proposes more drafts (= layout K)
    num_draft_tokens: int = 0  # real catch-up tokens of the draft
    # prompt_logprobs rows in order: (seq id, prompt position of its first token scored, count)
    prompt_logprobs_rows: list[tuple[int, int, int]] = field(default_factory=list)
    # [S, W] int32: each row's allowed tokens (bit t % 32 of word t // 32), -1 = all; when a
    # row has structured outputs (flags.token_mask), else None
    token_bitmask: np.ndarray | None = None

    @property
    def num_logits(self) -> int:
        return len(self.seq_ids)

    @property
    def num_prompt_logprobs(self) -> int:
        """Prompt tokens scored this step (real rows of the prompt_logprobs fields)."""
        return sum(count for _, _, count in self.prompt_logprobs_rows)

    def fields(self) -> dict[str, np.ndarray]:
        """Named views into ints / floats (writable: the builder fills them)."""
        return unpack(self.layout, self.ints, self.floats)


class StepOutput(NamedTuple):
    """A runner's device step result (jax.Array or torch.Tensor; None where not computed)."""

    tokens: Any  # [L, K+1] int32, -1 padded
    logprobs: Any  # [L, K+1] float32: each token's logprob under the raw model
    top_ids: Any = None  # [L, K+1, N] int32 when the step asks for top logprobs
    top_logprobs: Any = None  # [L, K+1, N] float32
    ranks: Any = None  # [L, K+1] int32: each token's rank in the vocabulary (1 = most likely)
    prompt_logprobs: Any = None  # [Pl] float32: each scored prompt token given its prefix
    prompt_top_ids: Any = None  # [Pl, N] int32
    prompt_top_logprobs: Any = None  # [Pl, N] float32
    prompt_ranks: Any = None  # [Pl] int32

    def wanted(self, flags: StepFlags) -> StepOutput:
        """The fields the host reads, the rest None: a step whose rows asked for no logprobs
        fetches none from the device."""
        keep = (True, True, *(flags.logprobs,) * 3, *(flags.prompt_logprobs,) * 4)
        return StepOutput(*(x if wanted else None for x, wanted in zip(self, keep)))

    def cut(self, model_input: ModelInput) -> StepOutput:
        """Each field without its padding rows (any array type)."""
        sizes = (model_input.num_logits,) * 5 + (model_input.num_prompt_logprobs,) * 4
        return StepOutput(*(None if x is None else x[:n] for x, n in zip(self, sizes)))


@dataclass
class PromptLogprobsOutput:
    """The step's scored prompt tokens, one row each."""

    rows: list[tuple[int, int, int]]  # ModelInput.prompt_logprobs_rows: (seq id, position, n)
    logprobs: np.ndarray  # [n] float32: the prompt token given its prefix
    top_ids: np.ndarray  # [n, N] int32: the most likely tokens at its position
    top_logprobs: np.ndarray  # [n, N] float32
    ranks: np.ndarray  # [n] int32: its rank in the vocabulary


@dataclass
class ModelOutput:
    """What a runner sends back to the host: token ids and logprobs, nothing else.

    Row r belongs to sequence seq_ids[r]; each row holds its accepted drafts, then one sampled
    (recovered or bonus) token, then -1 padding: [L, K+1] with K = 0 without drafts.
    """

    seq_ids: list[int]  # [L]
    sampled_token_ids: np.ndarray  # [L, K+1] int32, -1 padded
    sampled_logprobs: np.ndarray  # [L, K+1] float32: logprob of each token under the raw model
    top_logprob_ids: np.ndarray | None  # [L, K+1, N] int32 when requested
    top_logprobs: np.ndarray | None  # [L, K+1, N] float32 when requested
    sampled_ranks: np.ndarray | None = None  # [L, K+1] int32 rank of each token, when requested
    prompt_logprobs: PromptLogprobsOutput | None = None  # when prompt_logprobs_rows has any

    @classmethod
    def from_step(cls, model_input: ModelInput, out: StepOutput) -> ModelOutput:
        """The host copy (NumPy) of a step's output, cut to the real rows and to the fields
        the step's rows asked for (StepOutput.wanted)."""
        out = StepOutput(*(None if x is None else np.asarray(x)
                           for x in out.wanted(model_input.flags).cut(model_input)))
        prompt = None
        if model_input.prompt_logprobs_rows:
            prompt = PromptLogprobsOutput(model_input.prompt_logprobs_rows, *out[5:])
        return cls(model_input.seq_ids, *out[:5], prompt)

    def token_lists(self) -> list[list[int]]:
        """Each row's tokens without the padding."""
        return [[t for t in row if t >= 0] for row in self.sampled_token_ids.tolist()]


def build_model_input(out: SchedulerOutput, shapes: StepShapes, *, block_size: int,
                      token_bitmask: np.ndarray | None = None) -> ModelInput:
    """Flatten the scheduled sequences into the smallest of the engine's shapes that holds them.

    token_bitmask [sample rows, W] int32: the allowed tokens of each sample row in order
    (StructuredOutputManager.bitmask), or None when no row has structured outputs.

    A step where every sequence computes one token is a decode step, or a speculative decode
    step when the draft runs (K = the smallest compiled k that holds its drafts and the draft's
    catch-up); any other step is mixed, and proposes no drafts (the scheduler saw to it).
    """
    entries = out.scheduled
    samples = [(i, s) for i, e in enumerate(entries) for s in e.samples]
    q_lens = [e.num_new_tokens + e.num_spec_tokens for e in entries]
    draft_lens = [len(e.draft_token_ids) for e in entries]
    num_tokens, num_draft = sum(q_lens), sum(draft_lens)
    layout = _layout(shapes, entries, len(samples), num_tokens, num_draft)
    params = [s.params for _, s in samples]
    sampled = [p for p in params if not p.is_greedy]
    prompt_rows = [(i, e) for i, e in enumerate(entries) if e.prompt_logprob_token_ids]
    logit_entries = build_logit_entries([s for _, s in samples], shapes.num_logit_entries)
    flags = StepFlags(
        sampled=bool(sampled),
        filters=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in sampled),
        logprobs=any(p.logprobs is not None for p in params),
        prompt_logprobs=bool(prompt_rows), logit_entries=logit_entries is not None,
        token_mask=token_bitmask is not None)
    int_size, float_size = buffer_sizes(layout)
    model_input = ModelInput(
        layout, np.zeros(int_size, np.int32), np.zeros(float_size, np.float32), flags,
        logit_entries, np.asarray(out.block_copies, np.int32).reshape(-1, 2),
        [s.seq_id for _, s in samples], num_tokens, len(entries), max(q_lens, default=0),
        max(draft_lens, default=0), layout.num_spec_tokens, num_draft)
    if token_bitmask is not None:  # padding rows allow every token
        model_input.token_bitmask = np.full((layout.num_seqs, token_bitmask.shape[1]), -1,
                                            np.int32)
        model_input.token_bitmask[: len(token_bitmask)] = token_bitmask
    f = model_input.fields()
    f["step_flags"][:] = flags.as_array()
    f["num_padding_samples"][0] = layout.num_seqs - len(samples)
    ends = _fill_tokens(f, entries, q_lens, block_size)
    _fill_samples(f, entries, samples, ends, layout.num_spec_tokens)
    if prompt_rows:
        model_input.prompt_logprobs_rows = _fill_prompt_logprobs(f, prompt_rows, q_lens, ends)
    if layout.draft:
        _fill_drafts(f, entries, samples, draft_lens, ends, block_size)
    return model_input


def padding_input(layout: BatchLayout, flags: StepFlags = StepFlags()) -> ModelInput:
    """A step of this shape that holds only padding: it writes no KV and samples no row (what
    a CUDA graph is captured on)."""
    int_size, float_size = buffer_sizes(layout)
    model_input = ModelInput(layout, np.zeros(int_size, np.int32),
                             np.zeros(float_size, np.float32), flags, None,
                             np.zeros((0, 2), np.int32), [], 0, 0, 0)
    f = model_input.fields()
    f["step_flags"][:] = flags.as_array()
    f["slot_mapping"][:] = -1
    if layout.draft:
        f["draft_slot_mapping"][:] = -1
        f["draft_token_index"][:] = layout.num_tokens  # out of range: dropped
    return model_input


def _layout(shapes: StepShapes, entries: Sequence[ScheduledSequence], num_samples: int,
            num_tokens: int, num_draft: int) -> BatchLayout:
    """The step's shape (see build_model_input)."""
    num_seqs = max(len(entries), num_samples)
    if not all(e.is_decode for e in entries):
        assert not any(e.num_spec_tokens for e in entries), "mixed steps propose no drafts"
        return shapes.mixed_layout(max(num_tokens, num_draft, num_samples))
    if not num_draft:
        return shapes.decode_layout(num_seqs)
    s = shapes.seq_bucket(num_seqs)
    drafts = max(e.num_spec_tokens for e in entries)
    return shapes.spec_layout(s, max(drafts, -(-num_draft // s) - 1, 1))


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
    # Draft slots carry token 0 here: the runner writes the proposed drafts in.
    f["input_ids"][:n] = list(itertools.chain.from_iterable(
        e.token_ids + [0] * e.num_spec_tokens for e in entries))
    if any(e.input_row >= 0 for e in entries):  # decode rows: one token each
        f["input_rows"][:s] = [e.input_row + 1 for e in entries]
    positions = _ragged_positions([e.start_pos for e in entries], q_lens)
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
    f["prompt_logprobs_indices"][:n] = _ragged_positions(firsts, counts)
    f["prompt_logprobs_token_ids"][:n] = list(itertools.chain.from_iterable(
        e.prompt_logprob_token_ids for _, e in prompt_rows))
    return [(e.seq_id, e.start_pos + 1, count) for (_, e), count in zip(prompt_rows, counts)]


def _fill_drafts(f: dict[str, np.ndarray], entries: Sequence[ScheduledSequence],
                 samples: list[tuple[int, SampleSpec]], draft_lens: list[int], ends: np.ndarray,
                 block_size: int) -> None:
    """The draft's catch-up pass and where its k proposals go in the target's tokens."""
    s, n = len(entries), sum(draft_lens)
    draft_ends = np.cumsum(draft_lens, dtype=np.int32)
    f["draft_query_start_loc"][1 : s + 1] = draft_ends
    f["draft_query_start_loc"][s + 1 :] = n
    starts = [e.draft_start_pos for e in entries]
    f["draft_kv_lens"][:s] = [a + b for a, b in zip(starts, draft_lens)]
    f["draft_input_ids"][:n] = list(itertools.chain.from_iterable(
        e.draft_token_ids for e in entries))
    positions = _ragged_positions(starts, draft_lens)
    f["draft_positions"][:n] = positions
    f["draft_slot_mapping"][:] = -1
    f["draft_slot_mapping"][:n] = _slots(f["block_tables"], np.repeat(np.arange(s), draft_lens),
                                         positions, block_size)
    num_drafts = np.asarray([e.num_spec_tokens for e in entries], np.int32)
    f["num_drafts"][:s] = num_drafts
    k = f["draft_token_index"].shape[1]
    index = ends[:, None] - num_drafts[:, None] + np.arange(k)[None, :]  # [s, K]
    f["draft_token_index"][:] = len(f["input_ids"])  # out of range: dropped
    f["draft_token_index"][:s] = np.where(np.arange(k)[None, :] < num_drafts[:, None], index,
                                          len(f["input_ids"]))
    first_row: dict[int, int] = {}
    for row, (i, spec) in enumerate(samples):
        first_row.setdefault(i, row)
        f["sample_seq"][row] = i
        if spec.seq_id == entries[i].seq_id:  # forked siblings never carry drafts
            f["num_draft_tokens"][row] = num_drafts[i]
    f["seq_sample_row"][:s] = [first_row.get(i, 0) for i in range(s)]


def _ragged_positions(starts: list[int], lengths: list[int]) -> np.ndarray:
    """Concatenated ranges [start, start + length) for each sequence."""
    lengths_arr = np.asarray(lengths, np.int64)
    firsts = np.cumsum(lengths_arr) - lengths_arr
    offsets = np.arange(int(lengths_arr.sum())) - np.repeat(firsts, lengths_arr)
    return (np.repeat(np.asarray(starts, np.int64), lengths_arr) + offsets).astype(np.int32)


def _slots(block_tables: np.ndarray, seq_index: np.ndarray, positions: np.ndarray,
           block_size: int) -> np.ndarray:
    """KV slot of each (sequence, position): block_id * block_size + offset."""
    return block_tables[seq_index, positions // block_size] * block_size + positions % block_size


def _fill_block_tables(block_tables: np.ndarray, tables: list[list[int]]) -> None:
    lengths = [len(t) for t in tables]
    rows = np.repeat(np.arange(len(tables)), lengths)
    cols = np.arange(sum(lengths)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    block_tables[rows, cols] = list(itertools.chain.from_iterable(tables))
