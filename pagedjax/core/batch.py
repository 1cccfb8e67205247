"""SchedulerOutput → the flattened, padded batch every runner executes (NumPy only).

A step's integers live in one int32 buffer and its sampling floats in one float32 buffer, so a
runner uploads two arrays per step. `BatchLayout` is the static part (padded shapes and flags):
a jit static argument for JAX and a CUDA-graph key for torch. `BatchLayout.unpack` slices either
buffer back into named fields on the host (NumPy) or on the device (jax.Array, torch.Tensor).

Shapes are padded to powers of two so compilers see a bounded set of them:
T tokens, S sequences, L logits rows (samples), M = max blocks per sequence (fixed),
K draft slots per sequence, Td draft catch-up tokens.
Features that only some requests use add their fields only to steps that have such rows (0 in
the layout = absent), so a plain step's shapes and compiled code do not change:
P banned (row, token) pairs (min_tokens), Q penalty (row, token) pairs, B logit_bias entries,
Pl prompt positions scored (prompt_logprobs).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

from pagedjax.core.scheduler_output import SampleSpec, ScheduledSequence, SchedulerOutput
from pagedjax.sampling_params import MAX_LOGPROBS

Array = TypeVar("Array")  # np.ndarray on the host, jax.Array or torch.Tensor on a device

_FLOAT_FIELDS = ("temperature", "top_p", "min_p")
# Q grows with every output token of a penalised row: starting at 16 saves the first four
# recompiles of a new request.
_MIN_PENALTY_TOKENS = 16
PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty")
# What the samplers read: every field of these a layout has.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "banned_rows", "banned_token_ids",
                   "penalty_rows", "penalty_token_ids", "penalty_counts", *PENALTY_FIELDS,
                   "bias_rows", "bias_token_ids", "logit_bias")


def bucket(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


@dataclass(frozen=True)
class BatchLayout:
    """The static shape of one step (hashable)."""

    num_tokens: int  # T
    num_seqs: int  # S
    num_logits: int  # L
    max_blocks_per_seq: int  # M
    # K: the most draft slots per sequence (the engine's maximum, whatever k a step chose, so
    # choosing k recompiles nothing); 0 = the draft model does not run this step.
    num_spec_tokens: int = 0
    num_draft_tokens: int = 0  # Td: tokens the draft catches up on (0 when K == 0)
    num_banned: int = 0  # P: (row, token) pairs min_tokens bans; 0 = none
    decode: bool = False  # every sequence has one query token and T == S
    num_top_logprobs: int = 0  # 0, or MAX_LOGPROBS when a row asks for logprobs
    all_greedy: bool = True  # no row samples: skip the random path
    use_filters: bool = False  # some random row uses top-k / top-p / min-p
    num_penalty_tokens: int = 0  # Q: (row, token) pairs penalties count; 0 = no penalties
    num_logit_bias: int = 0  # B: (row, token, bias) entries; 0 = no logit_bias
    num_prompt_logprobs: int = 0  # Pl: prompt tokens scored (prompt_logprobs); 0 = none

    @property
    def int_fields(self) -> dict[str, tuple[int, ...]]:
        """Name → shape of every int32 field, in buffer order."""
        return _int_fields(self)

    @property
    def float_fields(self) -> dict[str, tuple[int, ...]]:
        """Name → shape of every float32 field, in buffer order."""
        return _float_fields(self)

    @property
    def int_size(self) -> int:
        return _spans(self)[1]

    @property
    def float_size(self) -> int:
        return _spans(self)[2]

    def unpack(self, ints: Array, floats: Array) -> dict[str, Array]:
        """Named views of the packed buffers (works for NumPy, jax and torch arrays)."""
        buffers = (ints, floats)
        return {name: buffers[kind][start:stop] if shape is None
                else buffers[kind][start:stop].reshape(shape)
                for name, kind, start, stop, shape in _spans(self)[0]}


@functools.lru_cache(maxsize=1024)
def _int_fields(layout: BatchLayout) -> dict[str, tuple[int, ...]]:
    t, s, l_, m, k = (layout.num_tokens, layout.num_seqs, layout.num_logits,
                      layout.max_blocks_per_seq, layout.num_spec_tokens)
    fields = {
        "input_ids": (t,),
        "positions": (t,),
        "slot_mapping": (t,),  # block_id * block_size + offset; -1 = padding
        "query_start_loc": (s + 1,),
        "kv_lens": (s,),  # context length after this step (0 for padding)
        "block_tables": (s, m),
        "logits_indices": (l_, k + 1),  # token rows sampled: the last real one, then drafts
        "top_k": (l_,),  # 0 = off
        "rng_seed": (l_,),  # uint32 bits: the completion's random stream
        "rng_step": (l_,),  # uint32 bits: its counter (tokens generated so far)
    }
    if layout.num_banned:
        fields.update({"banned_rows": (layout.num_banned,),  # masked to -inf; -1 = padding
                       "banned_token_ids": (layout.num_banned,)})
    if k:
        fields.update({
            # The draft's catch-up pass: what it has not computed up to each sequence's end.
            "draft_input_ids": (layout.num_draft_tokens,),
            "draft_positions": (layout.num_draft_tokens,),
            "draft_slot_mapping": (layout.num_draft_tokens,),
            "draft_query_start_loc": (s + 1,),
            "draft_kv_lens": (s,),  # = end of the real tokens for a sequence that drafts
            "num_drafts": (s,),  # drafts each sequence proposes (<= K)
            "draft_token_index": (s, k),  # row of draft j in the target's tokens; T = none
            "seq_sample_row": (s,),  # logits row whose sampling knobs the draft uses
            "sample_seq": (l_,),  # sequence whose drafts logits row l verifies
            "num_draft_tokens": (l_,),  # drafts row l verifies (0 for forked siblings)
        })
    if layout.num_penalty_tokens:
        q = (layout.num_penalty_tokens,)
        fields.update({
            "penalty_rows": q,  # -1 = padding
            "penalty_token_ids": q,
            "penalty_counts": q,  # 1: an output token (one per occurrence); 0: a prompt token
        })
    if layout.num_logit_bias:
        fields.update({"bias_rows": (layout.num_logit_bias,),  # -1 = padding
                       "bias_token_ids": (layout.num_logit_bias,)})
    if layout.num_prompt_logprobs:
        fields.update({
            "prompt_logprobs_indices": (layout.num_prompt_logprobs,),  # token row scoring it
            "prompt_logprobs_token_ids": (layout.num_prompt_logprobs,),  # the prompt token
        })
    return fields


@functools.lru_cache(maxsize=1024)
def _float_fields(layout: BatchLayout) -> dict[str, tuple[int, ...]]:
    fields = {name: (layout.num_logits,) for name in _FLOAT_FIELDS}
    if layout.num_penalty_tokens:
        fields.update((name, (layout.num_logits,)) for name in PENALTY_FIELDS)
    if layout.num_logit_bias:
        fields["logit_bias"] = (layout.num_logit_bias,)  # of bias_rows / bias_token_ids
    return fields


@functools.lru_cache(maxsize=1024)
def _spans(layout: BatchLayout) -> tuple[list[tuple[str, int, int, int, tuple | None]], int, int]:
    """(name, buffer (0 = ints, 1 = floats), start, stop, shape or None if 1-D) of each field,
    and the two buffers' sizes."""
    spans, sizes = [], []
    for kind, fields in enumerate((_int_fields(layout), _float_fields(layout))):
        offset = 0
        for name, shape in fields.items():
            size = math.prod(shape)
            spans.append((name, kind, offset, offset + size, shape if len(shape) > 1 else None))
            offset += size
        sizes.append(offset)
    return spans, *sizes


@dataclass
class ModelInput:
    """One step for a runner: the packed buffers plus what the host keeps for itself."""

    layout: BatchLayout
    ints: np.ndarray  # [layout.int_size] int32
    floats: np.ndarray  # [layout.float_size] float32
    block_copies: np.ndarray  # [C, 2] int32 (src, dst): copy-on-write before the forward
    seq_ids: list[int]  # the sequence of each real logits row (ModelOutput.seq_ids)
    num_tokens: int  # real T
    num_seqs: int  # real S
    max_query_len: int  # longest real query (drafts included): the torch op's launch bound
    max_draft_query_len: int = 0  # the same for the draft's catch-up pass
    num_spec_tokens: int = 0  # the step's k: no sequence proposes more drafts (<= layout K)
    num_draft_tokens: int = 0  # real Td: the draft's catch-up tokens
    # prompt_logprobs rows in order: (seq id, prompt position of its first token scored, count)
    prompt_logprobs_rows: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_logits(self) -> int:
        return len(self.seq_ids)

    @property
    def num_prompt_logprobs(self) -> int:
        """Prompt tokens scored this step (real rows of the Pl fields)."""
        return sum(count for _, _, count in self.prompt_logprobs_rows)

    def fields(self) -> dict[str, np.ndarray]:
        """Named views into ints / floats (writable: the builder fills them)."""
        return self.layout.unpack(self.ints, self.floats)


class StepOutput(NamedTuple):
    """A runner's device step result (jax.Array or torch.Tensor; None where not computed)."""

    tokens: Any  # [L, K+1] int32, -1 padded
    logprobs: Any  # [L, K+1] float32: each token's logprob under the raw model
    top_ids: Any = None  # [L, K+1, N] int32 when the layout asks for top logprobs
    top_logprobs: Any = None  # [L, K+1, N] float32
    ranks: Any = None  # [L, K+1] int32: each token's rank in the vocabulary (1 = most likely)
    prompt_logprobs: Any = None  # [Pl] float32: each scored prompt token given its prefix
    prompt_top_ids: Any = None  # [Pl, N] int32
    prompt_top_logprobs: Any = None  # [Pl, N] float32
    prompt_ranks: Any = None  # [Pl] int32

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
        """The host copy (NumPy) of a step's output on the host, cut to the real rows."""
        out = StepOutput(*(None if x is None else np.asarray(x) for x in out.cut(model_input)))
        prompt = None
        if model_input.prompt_logprobs_rows:
            prompt = PromptLogprobsOutput(model_input.prompt_logprobs_rows, *out[5:])
        return cls(model_input.seq_ids, *out[:5], prompt)

    def token_lists(self) -> list[list[int]]:
        """Each row's tokens without the padding."""
        return [[t for t in row if t >= 0] for row in self.sampled_token_ids.tolist()]


def build_model_input(out: SchedulerOutput, *, block_size: int, max_blocks_per_seq: int,
                      max_spec_tokens: int = 0) -> ModelInput:
    """Flatten the scheduled sequences into the packed buffers (see BatchLayout).

    max_spec_tokens: the engine's most drafts per sequence, the layout's K when the draft runs.
    """
    entries = out.scheduled
    samples = [(i, s) for i, e in enumerate(entries) for s in e.samples]
    assert out.num_spec_tokens <= max_spec_tokens
    k = max_spec_tokens if out.num_spec_tokens else 0
    q_lens = [e.num_new_tokens + e.num_spec_tokens for e in entries]
    num_tokens = sum(q_lens)
    decode = k == 0 and all(n == 1 for n in q_lens)
    s_pad = bucket(len(entries))
    t_pad = s_pad if decode else bucket(num_tokens)
    params = [s.params for _, s in samples]
    sampled = [p for p in params if not p.is_greedy]
    banned = [(r, t) for r, (_, s) in enumerate(samples) for t in s.banned_token_ids]
    draft_lens = [len(e.draft_token_ids) for e in entries] if k else []
    penalised = [(r, s) for r, (_, s) in enumerate(samples) if s.params.has_penalties]
    num_penalty = sum(len(s.penalty_prompt_token_ids) + len(s.output_token_ids)
                      for _, s in penalised)
    biased = [(r, p.logit_bias) for r, p in enumerate(params) if p.logit_bias]
    num_bias = sum(len(bias) for _, bias in biased)
    prompt_rows = [(i, e) for i, e in enumerate(entries) if e.prompt_logprob_token_ids]
    num_prompt = sum(len(e.prompt_logprob_token_ids) for _, e in prompt_rows)
    layout = BatchLayout(
        num_tokens=t_pad, num_seqs=s_pad, num_logits=max(s_pad, bucket(len(samples))),
        max_blocks_per_seq=max_blocks_per_seq, num_spec_tokens=k,
        num_draft_tokens=bucket(sum(draft_lens)) if k else 0,
        num_banned=bucket(len(banned)) if banned else 0, decode=decode,
        num_top_logprobs=MAX_LOGPROBS if any(p.logprobs is not None for p in params) else 0,
        all_greedy=not sampled,
        use_filters=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in sampled),
        num_penalty_tokens=bucket(max(num_penalty, _MIN_PENALTY_TOKENS)) if num_penalty else 0,
        num_logit_bias=bucket(num_bias) if num_bias else 0,
        num_prompt_logprobs=bucket(num_prompt) if num_prompt else 0)
    model_input = ModelInput(
        layout, np.zeros(layout.int_size, np.int32), np.zeros(layout.float_size, np.float32),
        np.asarray(out.block_copies, np.int32).reshape(-1, 2), [s.seq_id for _, s in samples],
        num_tokens, len(entries), max(q_lens, default=0), max(draft_lens, default=0),
        out.num_spec_tokens, sum(draft_lens))
    f = model_input.fields()
    ends = _fill_tokens(f, entries, q_lens, block_size)
    _fill_samples(f, entries, samples, ends, k)
    _fill_banned(f, banned)
    if num_penalty:
        _fill_penalties(f, penalised)
    if num_bias:
        _fill_logit_bias(f, biased)
    if num_prompt:
        model_input.prompt_logprobs_rows = _fill_prompt_logprobs(f, prompt_rows, q_lens, ends)
    if k:
        _fill_drafts(f, entries, samples, draft_lens, ends, block_size)
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
    # Draft slots carry token 0 here: the runner writes the proposed drafts in.
    f["input_ids"][:n] = list(itertools.chain.from_iterable(
        e.token_ids + [0] * e.num_spec_tokens for e in entries))
    positions = _ragged_positions([e.start_pos for e in entries], q_lens)
    f["positions"][:n] = positions
    f["slot_mapping"][:] = -1
    f["slot_mapping"][:n] = _slots(f["block_tables"], np.repeat(np.arange(s), q_lens), positions,
                                   block_size)
    return ends


def _fill_samples(f: dict[str, np.ndarray], entries: Sequence[ScheduledSequence],
                  samples: list[tuple[int, SampleSpec]], ends: np.ndarray, k: int) -> None:
    """Logits rows and sampling knobs; row r samples from its sequence's last real token and,
    when it verifies drafts, from each draft slot after it (padding repeats the last row)."""
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
    f["rng_seed"][:num] = np.asarray([s.rng_seed for _, s in samples], np.uint32).view(np.int32)
    f["rng_step"][:num] = np.asarray([s.rng_step for _, s in samples], np.uint32).view(np.int32)


def _fill_banned(f: dict[str, np.ndarray], banned: list[tuple[int, int]]) -> None:
    if banned:
        f["banned_rows"][:] = -1
        rows, tokens = zip(*banned)
        f["banned_rows"][: len(rows)] = rows
        f["banned_token_ids"][: len(tokens)] = tokens


def _fill_penalties(f: dict[str, np.ndarray], penalised: list[tuple[int, SampleSpec]]) -> None:
    """Each penalised row's knobs and the tokens its penalties count, as (row, token, count)
    triples: a prompt token once with count 0, each output token occurrence with count 1. The
    device sums them into per-row counts (O(tokens) here, never O(vocabulary))."""
    f["repetition_penalty"][:] = 1.0
    rows = [r for r, _ in penalised]
    specs = [s for _, s in penalised]
    f["presence_penalty"][rows] = [s.params.presence_penalty for s in specs]
    f["frequency_penalty"][rows] = [s.params.frequency_penalty for s in specs]
    f["repetition_penalty"][rows] = [s.params.repetition_penalty for s in specs]
    # Lengths of the prompt part and the output part of each row, interleaved.
    lengths = [n for s in specs for n in (len(s.penalty_prompt_token_ids),
                                          len(s.output_token_ids))]
    n = sum(lengths)
    f["penalty_rows"][:] = -1
    f["penalty_rows"][:n] = np.repeat(np.repeat(rows, 2), lengths)
    f["penalty_token_ids"][:n] = list(itertools.chain.from_iterable(
        itertools.chain(s.penalty_prompt_token_ids, s.output_token_ids) for s in specs))
    f["penalty_counts"][:n] = np.repeat(np.tile([0, 1], len(specs)), lengths)


def _fill_logit_bias(f: dict[str, np.ndarray], biased: list[tuple[int, dict[int, float]]]) -> None:
    """(row, token, bias) entries of every row with a logit_bias."""
    n = sum(len(bias) for _, bias in biased)
    f["bias_rows"][:] = -1
    f["bias_rows"][:n] = np.repeat([r for r, _ in biased], [len(bias) for _, bias in biased])
    f["bias_token_ids"][:n] = list(itertools.chain.from_iterable(b for _, b in biased))
    f["logit_bias"][:n] = list(itertools.chain.from_iterable(b.values() for _, b in biased))


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
