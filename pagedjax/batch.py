"""SchedulerOutput → the flattened, padded batch every runner executes (NumPy only).

Shapes are padded to powers of two so jit / CUDA graphs see a bounded set of them:
T tokens, S sequences, L logits rows (samples), M = max blocks per sequence (fixed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedjax.sampling_params import MAX_LOGPROBS
from pagedjax.scheduler_output import SchedulerOutput

MIN_TOKEN_BUCKET = 16


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


@dataclass
class ModelInput:
    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32, block_id * block_size + offset; -1 = padding
    query_start_loc: np.ndarray  # [S+1] int32
    kv_lens: np.ndarray  # [S] int32, context length after this step (0 for padding)
    block_tables: np.ndarray  # [S, M] int32
    logits_indices: np.ndarray  # [L] int32, token rows whose logits are sampled
    block_copies: np.ndarray  # [C, 2] int32, (src, dst) copy-on-write before the forward
    sampling: SamplingMetadata
    num_tokens: int  # real T
    num_seqs: int  # real S
    num_logits: int  # real L


@dataclass
class ModelOutput:
    """What a runner sends back to the host: token ids and logprobs, nothing else."""

    sampled_token_ids: np.ndarray  # [L] int32
    sampled_logprobs: np.ndarray  # [L] float32, logprob of the sampled token (raw model dist.)
    top_logprob_ids: np.ndarray | None  # [L, K] int32 when requested
    top_logprobs: np.ndarray | None  # [L, K] float32 when requested


def build_model_input(out: SchedulerOutput, *, block_size: int,
                      max_blocks_per_seq: int) -> ModelInput:
    """Flatten the scheduled sequences into padded arrays (see ModelInput)."""
    seqs = out.scheduled
    num_tokens = sum(e.num_new_tokens for e in seqs)
    samples = [(e, s) for e in seqs for s in e.samples]
    t_pad = bucket(num_tokens, MIN_TOKEN_BUCKET)
    s_pad = bucket(len(seqs))
    l_pad = max(s_pad, bucket(len(samples)))

    input_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slot_mapping = np.full(t_pad, -1, np.int32)
    query_start_loc = np.zeros(s_pad + 1, np.int32)
    kv_lens = np.zeros(s_pad, np.int32)
    block_tables = np.zeros((s_pad, max_blocks_per_seq), np.int32)
    last_row = {}
    cursor = 0
    for i, e in enumerate(seqs):
        n = e.num_new_tokens
        pos = np.arange(e.start_pos, e.kv_len, dtype=np.int32)
        table = np.asarray(e.block_table, np.int32)
        input_ids[cursor : cursor + n] = e.token_ids
        positions[cursor : cursor + n] = pos
        slot_mapping[cursor : cursor + n] = table[pos // block_size] * block_size + pos % block_size
        block_tables[i, : len(table)] = table
        kv_lens[i] = e.kv_len
        cursor += n
        query_start_loc[i + 1] = cursor
        last_row[e.seq_id] = cursor - 1
    query_start_loc[len(seqs) + 1 :] = cursor

    logits_indices = np.zeros(l_pad, np.int32)
    logits_indices[: len(samples)] = [last_row[e.seq_id] for e, _ in samples]
    copies = np.asarray(out.block_copies, np.int32).reshape(-1, 2)
    return ModelInput(input_ids, positions, slot_mapping, query_start_loc, kv_lens, block_tables,
                      logits_indices, copies, _sampling_metadata([s for _, s in samples], l_pad),
                      num_tokens, len(seqs), len(samples))


def _sampling_metadata(specs: list, l_pad: int) -> SamplingMetadata:
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
    )
