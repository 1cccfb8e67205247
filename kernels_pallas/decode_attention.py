"""A decode step's attention and KV write as one Pallas kernel per layer (Triton lowering on
NVIDIA GPUs, interpret on CPU).

Semantics: `reference.write_kv_reference` then `reference.ragged_paged_attention_reference`,
for the engine's decode layout: T == S, the first sequences one query each at row s (query
row s is sequence s's), the rest none (padding, whose rows come out as zeros). What it drops
against the general kernel (ragged_paged_attention.py) at small batch, where a step is a chain
of small launches: the tile map, q's gather into 16-row tiles and the output's scatter back (q
is read as [S, Hkv, G, D], its own layout, and the output written in it), and the KV write's
two scatters.

- **Grid** (sequence, KV head, KV split). A program reads its sequence's G query heads of one KV
  head, walks the cached keys [start, kv_len - 1) of its split in chunks with an online softmax
  (base 2), and the last split adds the new token from its registers, so that no program reads
  the slot split 0 writes: split 0 stores the new key and value in their slot (slot -1: no
  store).
- **Products without tl.dot.** G rows are too few for tl.dot (16 at least): q . k and p . v are
  broadcast products summed in float32 (float64 inputs: float64) over [G, keys, D] (a decode
  step reads each key once, so it is bound by memory, not by these multiplies). Keys per chunk
  are chosen so that the product stays in registers.
- **Splits** as the general kernel's (`_default_num_splits`): partial (acc, max, sum) merged by
  log-sum-exp in jnp where there are several, else the kernel writes the output.
- **Limits** (`supports`): G and D powers of two (Triton's block shapes); other models take
  the general kernel and the XLA write.
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
    _default_num_splits,
    _load_kv_chunk,
    _merge_splits,
    _prepare_block_tables,
    _TritonParams,
    _write_outputs,
)
from pagedjax.kernels_pallas.reference import store
from pagedjax.kernels_pallas.tile_map import cdiv

_MAX_PRODUCT = 8 * 1024  # G * keys * D elements of a chunk's broadcast product: 64 a thread
_MAX_GROUP = 16  # more query heads per KV head than this: the general kernel's tl.dot pays


def supports(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the fused kernel takes this model's attention (else the general kernel)."""
    group = num_q_heads // num_kv_heads
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return pow2(group) and group <= _MAX_GROUP and pow2(head_dim)


def _kernel(
    seq_info_ref,  # [S, 2] int32: (kv_len, slot); kv_len 0: no query (padding)
    block_tables_ref,  # [S, M'] int32
    q_ref,  # [G, D]
    k_new_ref,  # [D]
    v_new_ref,  # [D]
    k_cache_ref,  # [N, bs, D] (one KV head; aliased to k_out_ref)
    v_cache_ref,  # [N, bs, D]
    k_out_ref,  # [N, bs, D]
    v_out_ref,  # [N, bs, D]
    *out_refs,  # o [G, D]  |  acc [G, D], m [G], row_sum [G] when split
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
    block_size = k_cache_ref.shape[1]
    cache_dtype = k_cache_ref.dtype
    k_new = store(k_new_ref[...], cache_dtype, k_scale)  # [D], as the cache holds it
    v_new = store(v_new_ref[...], cache_dtype, v_scale)

    @pl.when((split == 0) & (kv_len > 0) & (slot >= 0))
    def _():
        block, offset = slot // block_size, slot % block_size
        k_out_ref[block, offset, :] = k_new
        v_out_ref[block, offset, :] = v_new

    acc_dtype = jnp.promote_types(q_ref.dtype, jnp.float32)  # float64 in the oracle tests
    q = q_ref[...].astype(acc_dtype)  # [G, D]

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
        k = _load_kv_chunk(k_cache_ref, pages, k_cache_ref.shape[2], False)  # [block_k, D]
        v = _load_kv_chunk(v_cache_ref, pages, v_cache_ref.shape[2], False)
        key_pos = chunk * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        visible = (key_pos >= start) & (key_pos < position)  # [block_k]
        s = scaled((q[:, None, :] * k.astype(acc_dtype)[None, :, :]).sum(axis=-1))
        s = jnp.where(visible[None, :], s, _MASK_VALUE)  # [G, block_k]
        m_next = jnp.maximum(m_prev, s.max(axis=1))  # [G]
        p = jnp.where(visible[None, :], jnp.exp2(s - m_next[:, None]), 0.0)
        alpha = jnp.exp2(m_prev - m_next)
        # Slots past the context may hold stale or non-finite data: 0 * NaN would leak.
        v = jnp.where(visible[:, None], v.astype(acc_dtype), 0.0)
        pv = (p[:, :, None] * v[None, :, :]).sum(axis=1)  # [G, D]
        return m_next, alpha * sum_prev + p.sum(axis=1), alpha[:, None] * acc_prev + pv

    group, head_dim = q.shape
    init = (jnp.full((group,), _MASK_VALUE, acc_dtype), jnp.zeros((group,), acc_dtype),
            jnp.zeros((group, head_dim), acc_dtype))
    m, row_sum, acc = lax.fori_loop(lo, hi, body, init)
    # the new token, from registers (as stored: an fp8 cache's rounding included)
    sees_new = (split == num_splits - 1) & (kv_len > 0)
    s_new = scaled((q * k_new.astype(acc_dtype)[None, :]).sum(axis=-1))  # [G]
    m_next = jnp.where(sees_new, jnp.maximum(m, s_new), m)
    p_new = jnp.where(sees_new, jnp.exp2(s_new - m_next), 0.0)  # [G]
    alpha = jnp.exp2(m - m_next)
    row_sum = alpha * row_sum + p_new
    acc = alpha[:, None] * acc + p_new[:, None] * v_new.astype(acc_dtype)[None, :]
    _write_outputs(out_refs, acc, m_next, row_sum, v_scale)


def _chunk_pages(group: int, head_dim: int, block_size: int, knob: int | None) -> int:
    """KV pages per chunk: the broadcast product [G, keys, D] within _MAX_PRODUCT elements."""
    if knob is not None:
        if knob & (knob - 1):
            raise ValueError(f"num_kv_pages_per_chunk must be a power of two, got {knob}")
        return knob
    return max(1, _MAX_PRODUCT // (group * head_dim) // block_size)  # powers of two


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
        raise ValueError(f"{num_q_heads} query heads over {num_kv_heads} KV heads of "
                         f"{head_dim}: the fused decode kernel needs a power-of-two group "
                         f"<= {_MAX_GROUP} and head_dim; use ragged_paged_attention")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    group = num_q_heads // num_kv_heads
    pages = _chunk_pages(group, head_dim, block_size, num_kv_pages_per_chunk)
    tables = _prepare_block_tables(block_tables, kv_lens, num_blocks, block_size, pages)
    max_chunks = pl.cdiv(tables.shape[1], pages)
    splits = num_splits or _default_num_splits(num_seqs * num_kv_heads, max_chunks, interpret)
    has_query = query_start_loc[1:] - query_start_loc[:-1] == 1  # [S]
    seq_info = jnp.stack([jnp.where(has_query, kv_lens, 0), slot_mapping],
                         axis=1).astype(jnp.int32)  # [S, 2]

    q4 = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    full = lambda x: pl.BlockSpec(x.shape, lambda s, h, j: (0,) * x.ndim)  # noqa: E731
    cache_spec = pl.BlockSpec((num_blocks, None, block_size, head_dim),
                              lambda s, h, j: (0, h, 0, 0))
    q_spec = pl.BlockSpec((None, None, group, head_dim), lambda s, h, j: (s, h, 0, 0))
    new_spec = pl.BlockSpec((None, None, head_dim), lambda s, h, j: (s, h, 0))
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct(q4.shape, q.dtype)]
        out_specs = [q_spec]
    else:
        stats = (num_seqs, num_kv_heads, splits, group)
        acc_dtype = jnp.promote_types(q.dtype, jnp.float32)
        out_shape = [jax.ShapeDtypeStruct((*stats, head_dim), acc_dtype),
                     jax.ShapeDtypeStruct(stats, acc_dtype), jax.ShapeDtypeStruct(stats, acc_dtype)]
        stats_spec = pl.BlockSpec((None, None, None, group), lambda s, h, j: (s, h, j, 0))
        out_specs = [pl.BlockSpec((None, None, None, group, head_dim),
                                  lambda s, h, j: (s, h, j, 0, 0)), stats_spec, stats_spec]
    kernel = functools.partial(
        _kernel, pages_per_chunk=pages, num_splits=splits, sm_scale=sm_scale * k_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
    compiler_params = None if interpret else _TritonParams(
        num_warps=num_warps or 4, num_stages=num_stages or 2)
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
        name=f"decode_attention_with_kv_write_p{pages}_s{splits}",
    )(seq_info, tables, q4, k, v, k_cache, v_cache)
    out = outs[0] if splits == 1 else _merge_splits(*outs).astype(q.dtype)
    return out.reshape(num_seqs, num_q_heads, head_dim), k_out, v_out
