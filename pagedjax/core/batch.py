"""The flattened, padded batch every runner executes (NumPy only): its fields and shapes.

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

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

from pagedjax.core.logit_entries import LogitEntries
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
        })
    if layout.draft or k:  # drafts to verify (from the draft model, or the host's proposals)
        fields.update({
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


@functools.lru_cache(maxsize=256)
def _spans_of(layout: BatchLayout, names: tuple[str, ...]
              ) -> list[tuple[str, int, int, int, tuple | None]]:
    """The spans (as _spans) of the fields named, in buffer order."""
    return [span for span in _spans(layout)[0] if span[0] in names]


def unpack(layout: BatchLayout, ints: Array, floats: Array,
           names: tuple[str, ...] | None = None) -> dict[str, Array]:
    """Named views of the packed buffers (works for NumPy, jax and torch arrays): every field,
    or only those named (each view is an op of its framework's: a step that reads five fields
    need not pay for thirty)."""
    buffers = (ints, floats)
    spans = _spans(layout)[0] if names is None else _spans_of(layout, names)
    return {name: buffers[kind][start:stop] if shape is None
            else buffers[kind][start:stop].reshape(shape)
            for name, kind, start, stop, shape in spans}


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
    # [L] int64: the persistent batch's row of each real logits row's sequence (-1: a sibling
    # forked this step, which has none yet); None when built by the reference builder
    sample_rows: np.ndarray | None = None
    # the persistent batch's row assignment these rows were read under, when each of them is a
    # row the sampled tokens append to (no fork, no beam); -1 otherwise (InputBatch)
    rows_version: int = -1

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

    def set_token_bitmask(self, token_bitmask: np.ndarray) -> None:
        """The allowed tokens of the real logits rows [L, W] (StructuredOutputManager.bitmask);
        padding rows allow every token."""
        mask = np.full((self.layout.num_seqs, token_bitmask.shape[1]), -1, np.int32)
        mask[: len(token_bitmask)] = token_bitmask
        self.token_bitmask = mask
        self.flags = dataclasses.replace(self.flags, token_mask=True)
        self.fields()["step_flags"][:] = self.flags.as_array()


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
    if "draft_token_index" in f:
        f["draft_token_index"][:] = layout.num_tokens  # out of range: dropped
    return model_input




def choose_layout(shapes: StepShapes, *, num_seqs: int, num_samples: int, num_tokens: int,
                  num_draft_tokens: int, decode: bool, max_drafts: int) -> BatchLayout:
    """The smallest of the engine's shapes that holds a step. A step where every sequence
    computes one token (decode) is a decode step, or a speculative decode step when the draft
    model runs or the host proposed drafts (K = the smallest compiled k that holds its drafts
    and the draft's catch-up); any other step is mixed, and proposes no drafts (the scheduler
    saw to it)."""
    rows = max(num_seqs, num_samples)
    if not decode:
        assert not max_drafts, "mixed steps propose no drafts"
        return shapes.mixed_layout(max(num_tokens, num_draft_tokens, num_samples))
    if not (num_draft_tokens or max_drafts):
        return shapes.decode_layout(rows)
    s = shapes.seq_bucket(rows)
    k = max(max_drafts, -(-num_draft_tokens // s) - 1, 1)
    if not max_drafts and k > max(shapes.spec_ks):  # the draft catches up alone, on more
        return shapes.mixed_layout(max(num_tokens, num_draft_tokens, num_samples))  # rows
    return shapes.spec_layout(s, k)


def ragged_positions(starts: np.ndarray | list[int], lengths: np.ndarray | list[int]
                     ) -> np.ndarray:
    """Concatenated ranges [start, start + length) for each sequence [sum(lengths)] int64."""
    lengths_arr = np.asarray(lengths, np.int64)
    firsts = np.cumsum(lengths_arr) - lengths_arr
    offsets = np.arange(int(lengths_arr.sum())) - np.repeat(firsts, lengths_arr)
    return np.repeat(np.asarray(starts, np.int64), lengths_arr) + offsets


def draft_token_index(f: dict[str, np.ndarray], ends: np.ndarray, num_drafts: np.ndarray
                      ) -> None:
    """draft_token_index [S, K]: the token row of each sequence's draft j (T: none)."""
    k, t = f["draft_token_index"].shape[1], len(f["input_ids"])
    s = len(num_drafts)
    index = ends[:, None] - num_drafts[:, None] + np.arange(k)[None, :]  # [s, K]
    f["draft_token_index"][:] = t  # out of range: dropped
    f["draft_token_index"][:s] = np.where(np.arange(k)[None, :] < num_drafts[:, None], index, t)
