"""A decode step's attention and KV write as one Pallas kernel per layer (Triton lowering on
NVIDIA GPUs, interpret on CPU).

Semantics: `reference.write_kv_reference` then `reference.ragged_paged_attention_reference`,
for the engine's decode layout: T == S, the first sequences one query each at row s (query
row s is sequence s's), the rest none (padding, whose rows come out as zeros). What it drops
against the general kernel (ragged_paged_attention.py) at small batch, where a step is a chain
of small launches: the tile map, q's gather into 16-row tiles and the output's scatter back (q
is read as [S, Hkv, G, D], its own layout padded with zero rows, and the output written in it),
and the KV write's two scatters.

- **Grid** (sequence, KV head, KV split). A program reads its sequence's G query heads of one KV
  head, padded with zero rows to the general kernel's row count (16 at least on GPU, for
  tl.dot), walks the cached keys [start, kv_len - 1) of its split in chunks with an online
  softmax (base 2), and the last split adds the new token from its registers, so that no
  program reads the slot split 0 writes: split 0 stores the new key and value in their slot
  (slot -1: no store).
- **Tiling** as the general kernel's decode tiling (`_make_tiling`): rows, keys per chunk,
  splits. A first version summed broadcast products over 32-key chunks instead of tl.dot: on an
  H200 it took 44-200 µs a call against the general kernel's 11-36 (RESULTS.md, stop 78).
- **Splits**: partial (acc, max, sum) merged by log-sum-exp in jnp where there are several,
  else the kernel writes the output.
- **Limits** (`supports`): head_dim a power of two (the cache's block is stored whole); other
  models take the general kernel and the XLA write.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pagedjax.kernels_pallas.ragged_paged_attention import (
    _LOG2E,
    _MASK_VALUE,
    _check_inputs,
    _dot_precision,
    _load_kv_chunk,
    _make_tiling,
    _merge_splits,
    _output_specs,
    _prepare_block_tables,
    _TritonParams,
    _write_outputs,
)
from pagedjax.kernels_pallas.reference import store
from pagedjax.kernels_pallas.tile_map import cdiv


def supports(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the fused kernel takes this model's attention (else the general kernel)."""
    return num_q_heads % num_kv_heads == 0 and head_dim > 0 and head_dim & (head_dim - 1) == 0


def _kernel(
    seq_info_ref,  # [S, 2] int32: (kv_len, slot); kv_len 0: no query (padding)
    block_tables_ref,  # [S, M'] int32
    q_ref,  # [R, D]: the G query heads of one KV head, then zero rows
    k_new_ref,  # [D]
    v_new_ref,  # [D]
    k_cache_ref,  # [N, bs, D] (one KV head; aliased to k_out_ref)
    v_cache_ref,  # [N, bs, D]
    k_out_ref,  # [N, bs, D]
    v_out_ref,  # [N, bs, D]
    *out_refs,  # o [R, D]  |  acc [R, D], m [R], row_sum [R] when split
    pages_per_chunk: int,
    num_splits: int,
    sm_scale: float,  # times an fp8 cache's k_scale
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: float,
    v_scale: float,
):
    """Store the new token (split 0), then attend: the cached keys of this split, and the new
    token in the last split."""
    seq, split = pl.program_id(0), pl.program_id(2)
    kv_len, slot = seq_info_ref[seq, 0], seq_info_ref[seq, 1]
    _, block_size, head_dim = k_cache_ref.shape
    cache_dtype = k_cache_ref.dtype
    k_new = store(k_new_ref[...], cache_dtype, k_scale)  # [D], as the cache holds it
    v_new = store(v_new_ref[...], cache_dtype, v_scale)

    @pl.when((split == 0) & (kv_len > 0) & (slot >= 0))
    def _():
        block, offset = slot // block_size, slot % block_size
        k_out_ref[block, offset, :] = k_new
        v_out_ref[block, offset, :] = v_new

    acc_dtype = jnp.promote_types(q_ref.dtype, jnp.float32)  # float64 in the oracle tests
    q = q_ref[...]  # [R, D]

    def scaled(s: jax.Array) -> jax.Array:  # q . k → the logit in base 2, soft-capped
        if soft_cap is None:
            return s * (sm_scale * _LOG2E)
        return (soft_cap * _LOG2E) * jnp.tanh(s * (sm_scale / soft_cap))

    position = kv_len - 1  # the new token's; the cache holds keys [0, position)
    block_k = pages_per_chunk * block_size
    start = jnp.int32(0)
    if sliding_window is not None:
        start = jnp.maximum(position - sliding_window + 1, 0)
    chunk_lo, chunk_hi = start // block_k, cdiv(jnp.maximum(position, 0), block_k)
    per_split = cdiv(chunk_hi - chunk_lo, num_splits)
    lo = chunk_lo + split * per_split
    hi = jnp.minimum(lo + per_split, chunk_hi)

    def body(chunk, carry):
        m_prev, sum_prev, acc_prev = carry
        pages = block_tables_ref[seq, pl.ds(chunk * pages_per_chunk, pages_per_chunk)]  # [P]
        k = _load_kv_chunk(k_cache_ref, pages, head_dim, False)  # [block_k, D]
        v = _load_kv_chunk(v_cache_ref, pages, head_dim, False)
        k, v = k.astype(q.dtype), v.astype(q.dtype)  # fp8 codes, exact; else unchanged
        key_pos = chunk * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        visible = (key_pos >= start) & (key_pos < position)  # [block_k]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_dot_precision(q.dtype),
                            preferred_element_type=acc_dtype)  # [R, block_k]
        s = jnp.where(visible[None, :], scaled(s), _MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))  # [R]
        p = jnp.where(visible[None, :], jnp.exp2(s - m_next[:, None]), 0.0)
        alpha = jnp.exp2(m_prev - m_next)
        # Slots past the context may hold stale or non-finite data: 0 * NaN would leak.
        v = jnp.where(visible[:, None], v, 0)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=_dot_precision(v.dtype), preferred_element_type=acc_dtype)
        return m_next, alpha * sum_prev + p.sum(axis=1), alpha[:, None] * acc_prev + pv

    rows = q.shape[0]
    init = (jnp.full((rows,), _MASK_VALUE, acc_dtype), jnp.zeros((rows,), acc_dtype),
            jnp.zeros((rows, head_dim), acc_dtype))
    m, row_sum, acc = lax.fori_loop(lo, hi, body, init)
    # the new token, from registers (as stored: an fp8 cache's rounding included)
    sees_new = (split == num_splits - 1) & (kv_len > 0)
    s_new = scaled((q.astype(acc_dtype) * k_new.astype(acc_dtype)[None, :]).sum(axis=-1))  # [R]
    m_next = jnp.where(sees_new, jnp.maximum(m, s_new), m)
    p_new = jnp.where(sees_new, jnp.exp2(s_new - m_next), 0.0)  # [R]
    alpha = jnp.exp2(m - m_next)
    row_sum = alpha * row_sum + p_new
    acc = alpha[:, None] * acc + p_new[:, None] * v_new.astype(acc_dtype)[None, :]
    _write_outputs(out_refs, acc, m_next, row_sum, v_scale)


@functools.partial(
    jax.jit,
    donate_argnames=("k_cache", "v_cache"),
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "k_scale", "v_scale",
                     "interpret", "num_kv_pages_per_chunk", "num_splits", "num_warps",
                     "num_stages"),
)
def decode_attention_with_kv_write(
    q: jax.Array,  # [S, Hq, D]
    k: jax.Array,  # [S, Hkv, D], the new tokens' keys
    v: jax.Array,  # [S, Hkv, D]
    k_cache: jax.Array,  # [N, Hkv, bs, D], donated
    v_cache: jax.Array,  # [N, Hkv, bs, D], donated
    slot_mapping: jax.Array,  # [S] int32, block_id * block_size + offset; -1 = no store
    kv_lens: jax.Array,  # [S] int32, context length after this step
    block_tables: jax.Array,  # [S, M] int32
    query_start_loc: jax.Array,  # [S+1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    interpret: bool | None = None,
    num_kv_pages_per_chunk: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # out [S, Hq, D] in q.dtype, k_cache, v_cache
    """write_kv then ragged_paged_attention(decode=True) in one kernel, for the engine's decode
    layout (module docstring): sequence s's query is row s, or it has none. An fp8 cache
    (float8_e4m3fn) stores k / k_scale and v / v_scale and reads cache * scale."""
    _check_inputs(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc)
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    if k.shape != (num_seqs, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k and v must be [S, Hkv, D] = {(num_seqs, num_kv_heads, head_dim)}, "
                         f"got {k.shape} and {v.shape}")
    if kv_lens.shape[0] != num_seqs or slot_mapping.shape != (num_seqs,):
        raise ValueError(f"the decode layout has one query row per sequence (T == S): q "
                         f"{q.shape}, kv_lens {kv_lens.shape}, slot_mapping "
                         f"{slot_mapping.shape}")
    if not supports(num_q_heads, num_kv_heads, head_dim):
        raise ValueError(f"head_dim {head_dim}: the fused decode kernel needs a power of two; "
                         f"use ragged_paged_attention")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    group = num_q_heads // num_kv_heads
    knobs = dict(rows_per_tile=None, num_kv_pages_per_chunk=num_kv_pages_per_chunk,
                 num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    itemsize = max(k_cache.dtype.itemsize, q.dtype.itemsize)  # fp8 chunks widen to q's dtype
    tiling = _make_tiling(True, q.shape, k_cache.shape, block_tables.shape, itemsize,
                          interpret, knobs)
    if tiling.head_dim_padded != head_dim:
        raise ValueError(f"head_dim {head_dim} is under tl.dot's 16: use ragged_paged_attention")
    rows, pages, splits = tiling.rows, tiling.pages_per_chunk, tiling.num_splits
    tables = _prepare_block_tables(block_tables, kv_lens, num_blocks, block_size, pages)
    has_query = query_start_loc[1:] - query_start_loc[:-1] == 1  # [S]
    seq_info = jnp.stack([jnp.where(has_query, kv_lens, 0), slot_mapping],
                         axis=1).astype(jnp.int32)  # [S, 2]

    q4 = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, rows - group), (0, 0)))  # [S, Hkv, R, D]
    full = lambda x: pl.BlockSpec(x.shape, lambda s, h, j: (0,) * x.ndim)  # noqa: E731
    cache_spec = pl.BlockSpec((num_blocks, None, block_size, head_dim),
                              lambda s, h, j: (0, h, 0, 0))
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda s, h, j: (s, h, 0, 0))
    new_spec = pl.BlockSpec((None, None, head_dim), lambda s, h, j: (s, h, 0))
    out_shape, out_specs = _output_specs(q4, splits)
    kernel = functools.partial(
        _kernel, pages_per_chunk=pages, num_splits=splits, sm_scale=sm_scale * k_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
    compiler_params = None if interpret else _TritonParams(
        num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    k_out, v_out, *outs = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, splits),
        in_specs=[full(seq_info), full(tables), q_spec, new_spec, new_spec, cache_spec,
                  cache_spec],
        out_specs=[cache_spec, cache_spec, *out_specs],
        out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype), *out_shape],
        input_output_aliases={5: 0, 6: 1},
        compiler_params=compiler_params,
        interpret=interpret,
        name=f"decode_attention_with_kv_write_r{rows}_p{pages}_s{splits}",
    )(seq_info, tables, q4, k, v, k_cache, v_cache)
    out = outs[0] if splits == 1 else _merge_splits(*outs).astype(q.dtype)
    return out[:, :, :group].reshape(num_seqs, num_q_heads, head_dim), k_out, v_out
