"""Pure-jnp reference of ragged paged attention and of the KV write.

These are the semantics every implementation (Pallas, CUDA, C++ CPU) is tested against, and the
JAX backend's attention on CPU. Layout (per layer):

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]

Sequence s owns the queries q[query_start_loc[s]:query_start_loc[s+1]] (its last q_len tokens);
its context after this step is kv_lens[s] tokens, stored in the blocks block_tables[s, :].
Query i of sequence s sits at position p = kv_lens[s] - q_len + i and sees key j when
j <= p (causal) and, with a sliding window w, p - j < w. The score of key j is
s = (q . k_j) * sm_scale, soft-capped (Gemma 2's attn_logit_softcapping) to
soft_cap * tanh(s / soft_cap) when soft_cap is given, before the mask and the softmax. Rows past
query_start_loc[-1] are padding and come out as zeros.

An FP8 KV cache (kv_cache_dtype="fp8", vLLM's semantics) is float8_e4m3fn: write_kv stores
k / k_scale and v / v_scale rounded to nearest even and saturated to +-448 (`to_fp8`), and
attention reads cache * scale (`from_cache`), with one float32 k_scale, v_scale per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_MAX = 448.0  # the largest finite float8 e4m3fn value
_MASK_VALUE = -1e30  # finite, so a fully masked block never produces NaN
_HIGHEST = jax.lax.Precision.HIGHEST  # float32 products in float32, never TF32


def to_fp8(x: jax.Array, scale: float) -> jax.Array:
    """x / scale as an fp8 cache stores it: nearest even, saturated to +-448 (XLA's own cast
    makes NaN of what overflows)."""
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def from_cache(x: jax.Array, scale: float, dtype: jnp.dtype) -> jax.Array:
    """Cached keys or values as attention reads them, in `dtype`: an fp8 cache's times its
    scale, any other cast."""
    if x.dtype == jnp.float8_e4m3fn:
        return x.astype(dtype) * jnp.asarray(scale, dtype)
    return x.astype(dtype)


def store(x: jax.Array, cache_dtype: jnp.dtype, scale: float) -> jax.Array:
    """x as a cache of cache_dtype stores it: to_fp8 for an fp8 cache, else a cast."""
    return to_fp8(x, scale) if cache_dtype == jnp.float8_e4m3fn else x.astype(cache_dtype)


def token_positions(
    query_start_loc: jax.Array,  # [S+1] int32
    kv_lens: jax.Array,  # [S] int32
    num_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query row: (sequence id [T], absolute position [T], valid [T])."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_ids = jnp.searchsorted(query_start_loc[1:], rows, side="right").astype(jnp.int32)
    valid = rows < query_start_loc[-1]
    seq_ids = jnp.where(valid, seq_ids, 0)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    positions = kv_lens[seq_ids] - q_lens[seq_ids] + (rows - query_start_loc[seq_ids])
    return seq_ids, positions, valid


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [N, Hkv, bs, D]
    v_cache: jax.Array,  # [N, Hkv, bs, D]
    kv_lens: jax.Array,  # [S] int32
    block_tables: jax.Array,  # [S, M] int32
    query_start_loc: jax.Array,  # [S+1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    decode: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> jax.Array:  # [T, Hq, D]
    """Online-softmax loop over KV blocks; each query row gathers its own sequence's blocks.
    An fp8 cache reads as cache * k_scale (keys), cache * v_scale (values).

    The loop runs to the longest context in the batch, so short decode batches do not pay for
    max_model_len. float32 (or float64) accumulation, HIGHEST-precision products (not TF32 on
    GPU). `decode` is ignored (always correct): it swaps with the kernel at one call site.
    """
    del decode
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    acc_dtype = jnp.promote_types(q.dtype, jnp.float32)

    seq_ids, positions, valid = token_positions(query_start_loc, kv_lens, num_tokens)
    tables = block_tables[seq_ids]  # [T, M]
    qg = q.astype(acc_dtype).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    num_kv_blocks = (jnp.max(jnp.where(valid, positions, 0)) + block_size) // block_size

    def body(carry):
        j, m, denom, acc = carry
        kb = from_cache(k_cache[tables[:, j]], k_scale, acc_dtype)  # [T, Hkv, bs, D]
        vb = from_cache(v_cache[tables[:, j]], v_scale, acc_dtype)  # [T, Hkv, bs, D]
        s = jnp.einsum("thgd,thkd->thgk", qg, kb, precision=_HIGHEST)  # [T, Hkv, G, bs]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = j * block_size + jnp.arange(block_size)  # [bs]
        visible = key_pos[None, :] <= positions[:, None]  # [T, bs]
        if sliding_window is not None:
            visible &= positions[:, None] - key_pos[None, :] < sliding_window
        s = jnp.where(visible[:, None, None, :], s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))  # [T, Hkv, G]
        p = jnp.where(visible[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        denom_new = alpha * denom + p.sum(-1)
        acc_new = alpha[..., None] * acc + jnp.einsum("thgk,thkd->thgd", p, vb,
                                                      precision=_HIGHEST)
        return j + 1, m_new, denom_new, acc_new

    init = (
        jnp.int32(0),
        jnp.full((num_tokens, num_kv_heads, group), _MASK_VALUE, acc_dtype),
        jnp.zeros((num_tokens, num_kv_heads, group), acc_dtype),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), acc_dtype),
    )
    _, _, denom, acc = jax.lax.while_loop(lambda c: c[0] < num_kv_blocks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def write_kv_reference(
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    k_cache: jax.Array,  # [N, Hkv, bs, D]
    v_cache: jax.Array,  # [N, Hkv, bs, D]
    slot_mapping: jax.Array,  # [T] int32, block_id * block_size + offset; -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new keys/values into their slots; rows with slot -1 are dropped. An fp8 cache
    stores k / k_scale and v / v_scale (to_fp8)."""
    num_blocks, _, block_size, _ = k_cache.shape
    # An out-of-range block index makes the scatter drop the row (mode="drop").
    block = jnp.where(slot_mapping >= 0, slot_mapping // block_size, num_blocks)
    offset = jnp.where(slot_mapping >= 0, slot_mapping % block_size, 0)
    k_cache = k_cache.at[block, :, offset].set(store(k, k_cache.dtype, k_scale), mode="drop")
    v_cache = v_cache.at[block, :, offset].set(store(v, v_cache.dtype, v_scale), mode="drop")
    return k_cache, v_cache
