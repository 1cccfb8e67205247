"""SchedulerOutput → the flattened, padded batch every runner executes (NumPy only).

Shapes are padded to powers of two so jit / CUDA graphs see a bounded set of them:
T tokens, S sequences, L logits rows (samples), M = max blocks per sequence (fixed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedjax.sampling_params import MAX_LOGPROBS
from pagedjax.scheduler_output import SchedulerOutput

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8  # padding sequences cost nothing (kv_len 0); fewer shapes to compile


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


@dataclass
class SamplingMetadata:
    """Per logits row; padding rows are greedy and discarded."""

    temperature: np.ndarray  # [L] float32, 0 = greedy
    top_k: np.ndarray  # [L] int32, 0 = off
    top_p: np.ndarray  # [L] float32, 1 = off
    min_p: np.ndarray  # [L] float32, 0 = off
    rng_seed: np.ndarray  # [L] uint32, the completion's random stream
    rng_step: np.ndarray  # [L] uint32, its counter (tokens generated so far)
    banned_rows: np.ndarray  # [P] int32, rows of (row, token) pairs masked to -inf; -1 = padding
    banned_token_ids: np.ndarray  # [P] int32
    num_top_logprobs: int  # static: 0, or MAX_LOGPROBS when any row asks for logprobs
    all_greedy: bool  # static: skip the random path
    use_filters: bool  # static: some row uses top-k / top-p / min-p
    return_probs: bool = False  # static: also return the sampling distribution (draft's q)


@dataclass
class SpecDecodeMetadata:
    """Verification of K draft slots per sample (speculative decoding)."""

    draft_token_ids: np.ndarray  # [L, K] int32, -1 past num_draft_tokens
    num_draft_tokens: np.ndarray  # [L] int32
    draft_rows: np.ndarray  # [L, K] int32: row of draft j's q in the draft's pass-j probs


@dataclass
class ModelInput:
    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32, block_id * block_size + offset; -1 = padding
    query_start_loc: np.ndarray  # [S+1] int32
    kv_lens: np.ndarray  # [S] int32, context length after this step (0 for padding)
    block_tables: np.ndarray  # [S, M] int32
    logits_indices: np.ndarray  # [L] or [L, K+1] (speculative) int32, token rows to sample
    block_copies: np.ndarray  # [C, 2] int32, (src, dst) copy-on-write before the forward
    sampling: SamplingMetadata
    num_tokens: int  # real T
    num_seqs: int  # real S
    num_logits: int  # real L
    spec: SpecDecodeMetadata | None = None


@dataclass
class ModelOutput:
    """What a runner sends back to the host: token ids and logprobs, nothing else."""

    sampled_token_ids: np.ndarray  # [L] int32; [L, K+1] with -1 padding when speculative
    sampled_logprobs: np.ndarray  # like sampled_token_ids: logprobs of the raw model dist.
    top_logprob_ids: np.ndarray | None  # [L, N] / [L, K+1, N] int32 when requested
    top_logprobs: np.ndarray | None  # [L, N] / [L, K+1, N] float32 when requested
    probs: Any = None  # the draft's q [L, V], left on the device (return_probs only)


def build_model_input(out: SchedulerOutput, *, block_size: int, max_blocks_per_seq: int,
                      num_speculative_tokens: int = 0, return_probs: bool = False,
                      draft_rows: dict[int, list[int]] | None = None) -> ModelInput:
    """Flatten the scheduled sequences into padded arrays (see ModelInput).

    With num_speculative_tokens K > 0 every sample gets K+1 logits rows (its last real token and
    its drafts, the last one repeated as padding) and `spec` describes the drafts to verify.
    """
    seqs = out.scheduled
    tokens = [e.token_ids + e.spec_token_ids for e in seqs]
    num_tokens = sum(map(len, tokens))
    samples = [(e, s) for e in seqs for s in e.samples]
    t_pad = bucket(num_tokens, MIN_TOKEN_BUCKET)
    s_pad = bucket(len(seqs), MIN_SEQ_BUCKET)
    l_pad = max(s_pad, bucket(len(samples)))

    input_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slot_mapping = np.full(t_pad, -1, np.int32)
    query_start_loc = np.zeros(s_pad + 1, np.int32)
    kv_lens = np.zeros(s_pad, np.int32)
    block_tables = np.zeros((s_pad, max_blocks_per_seq), np.int32)
    sample_rows: dict[int, list[int]] = {}  # seq id -> rows of its last real token and drafts
    cursor = 0
    for i, (e, ids) in enumerate(zip(seqs, tokens)):
        n = len(ids)
        pos = np.arange(e.start_pos, e.start_pos + n, dtype=np.int32)
        table = np.asarray(e.block_table, np.int32)
        input_ids[cursor : cursor + n] = ids
        positions[cursor : cursor + n] = pos
        slot_mapping[cursor : cursor + n] = table[pos // block_size] * block_size + pos % block_size
        block_tables[i, : len(table)] = table
        kv_lens[i] = e.start_pos + n
        cursor += n
        query_start_loc[i + 1] = cursor
        sample_rows[e.seq_id] = list(range(cursor - 1 - len(e.spec_token_ids), cursor))
    query_start_loc[len(seqs) + 1 :] = cursor

    k = num_speculative_tokens
    logits_indices = np.zeros((l_pad, k + 1) if k else l_pad, np.int32)
    for row, (e, _) in enumerate(samples):
        rows = sample_rows[e.seq_id]
        logits_indices[row] = (rows + rows[-1:] * (k + 1 - len(rows))) if k else rows[-1]
    spec = _spec_metadata(samples, l_pad, k, draft_rows or {}) if k else None
    copies = np.asarray(out.block_copies, np.int32).reshape(-1, 2)
    sampling = _sampling_metadata([s for _, s in samples], l_pad, return_probs)
    return ModelInput(input_ids, positions, slot_mapping, query_start_loc, kv_lens, block_tables,
                      logits_indices, copies, sampling, num_tokens, len(seqs), len(samples), spec)


def _spec_metadata(samples: list, l_pad: int, k: int,
                   draft_rows: dict[int, list[int]]) -> SpecDecodeMetadata:
    draft_token_ids = np.full((l_pad, k), -1, np.int32)
    num_draft_tokens = np.zeros(l_pad, np.int32)
    rows = np.zeros((l_pad, k), np.int32)
    for row, (e, s) in enumerate(samples):
        if s.seq_id != e.seq_id or not e.spec_token_ids:
            continue  # forked siblings never carry drafts
        n = len(e.spec_token_ids)
        draft_token_ids[row, :n] = e.spec_token_ids
        num_draft_tokens[row] = n
        rows[row, :n] = draft_rows[e.seq_id]
    return SpecDecodeMetadata(draft_token_ids, num_draft_tokens, rows)


def _sampling_metadata(specs: list, l_pad: int, return_probs: bool) -> SamplingMetadata:
    def column(values: list, fill, dtype) -> np.ndarray:
        arr = np.full(l_pad, fill, dtype)
        arr[: len(values)] = values
        return arr

    params = [s.params for s in specs]
    temperature = column([0.0 if p.is_greedy else p.temperature for p in params], 0.0, np.float32)
    top_k = column([p.top_k for p in params], 0, np.int32)
    top_p = column([p.top_p for p in params], 1.0, np.float32)
    min_p = column([p.min_p for p in params], 0.0, np.float32)
    banned = [(r, t) for r, s in enumerate(specs) for t in s.banned_token_ids]
    p_pad = bucket(len(banned)) if banned else 1
    banned_rows = np.full(p_pad, -1, np.int32)
    banned_ids = np.zeros(p_pad, np.int32)
    if banned:
        banned_rows[: len(banned)], banned_ids[: len(banned)] = zip(*banned)
    sampled = [p for p in params if not p.is_greedy]
    return SamplingMetadata(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        rng_seed=column([s.rng_seed for s in specs], 0, np.uint32),
        rng_step=column([s.rng_step for s in specs], 0, np.uint32),
        banned_rows=banned_rows, banned_token_ids=banned_ids,
        num_top_logprobs=MAX_LOGPROBS if any(p.logprobs for p in params) else 0,
        all_greedy=not sampled,
        use_filters=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in sampled),
        return_probs=return_probs,
    )
