"""Ragged paged attention in plain jnp, tiled for XLA on CPU (the JAX backend's CPU path).

Semantics: `reference.ragged_paged_attention_reference`, which stays the oracle. Where the
reference gathers every query row's own KV block by block, this gathers KV once per *tile* of
query rows of one sequence, `chunk_blocks` blocks per loop iteration:

- decode (static `decode=True`: one query per sequence, T == S): a tile is one sequence's token;
- otherwise: tiles of `rows_per_tile` consecutive query rows of one sequence (at most
  ceil(T / rows) + S tiles, a static bound).

The loop runs to the longest context in the batch with an online softmax in float32; rows past
each sequence's queries and padding rows come out as zeros.

Which implementation serves which shape is the JAX backend's choice, not this file's:
`pagedjax.backends.jax.attention.ragged_paged_attention_cpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.kernels_pallas.reference import from_cache

# The products accumulate in float32 or wider: full precision, never TF32 on an NVIDIA GPU (a GPU
# runs this path only where a caller asks for it; the first H100 run read 1e-3 errors with TF32).
_HIGHEST = jax.lax.Precision.HIGHEST

_MASK_VALUE = -1e30  # finite, so a fully masked chunk never produces NaN


def _tile_map(query_start_loc: jax.Array, num_tokens: int, num_seqs: int, rows: int,
              decode: bool) -> tuple[jax.Array, jax.Array]:
    """(sequence of each tile [N], first query row of each tile [N])."""
    if decode:
        return jnp.arange(num_seqs, dtype=jnp.int32), query_start_loc[:-1]
    num_tiles = -(-num_tokens // rows) + num_seqs
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    tiles_per_seq = (q_lens + rows - 1) // rows
    ends = jnp.cumsum(tiles_per_seq)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, tile, side="right"), num_seqs - 1).astype(jnp.int32)
    first = query_start_loc[seq] + (tile - (ends[seq] - tiles_per_seq[seq])) * rows
    return seq, first


def ragged_paged_attention_tiled(
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
    rows_per_tile: int = 16,
    chunk_blocks: int = 8,
    k_scale: float = 1.0,  # an fp8 cache reads as cache * scale (reference.from_cache)
    v_scale: float = 1.0,
) -> jax.Array:  # [T, Hq, D]
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    acc_dtype = jnp.promote_types(q.dtype, jnp.float32)
    if decode and num_tokens != num_seqs:
        raise ValueError(f"decode=True needs one query row per sequence, got q {q.shape} for "
                         f"{num_seqs} sequences")
    rows = 1 if decode else rows_per_tile
    tile_seq, tile_first = _tile_map(query_start_loc, num_tokens, num_seqs, rows, decode)
    num_tiles = tile_seq.shape[0]

    if decode:  # tile s is query row s: no gather of q, no scatter of the output
        row = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]  # [N, 1]
    else:
        row = tile_first[:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :]  # [N, R]
    valid = (row >= tile_first[:, None]) & (row < query_start_loc[tile_seq + 1][:, None])
    first_row = query_start_loc[tile_seq]  # [N]
    context_start = kv_lens[tile_seq] - (query_start_loc[tile_seq + 1] - first_row)  # [N]
    position = context_start[:, None] + row - first_row[:, None]
    position = jnp.where(valid, position, -1)  # [N, R]; -1 sees no key
    qt = q if decode else q[jnp.clip(row, 0, num_tokens - 1)]  # [N, R, Hq, D] ([T, Hq, D])
    qt = qt.astype(acc_dtype).reshape(num_tiles, rows, num_kv_heads, group, head_dim) * sm_scale

    chunk = chunk_blocks * block_size
    tables = jnp.pad(block_tables, ((0, 0), (0, -max_blocks % chunk_blocks)))[tile_seq]
    num_chunks = (jnp.max(position) + chunk) // chunk

    def gather(cache: jax.Array, blocks: jax.Array, scale: float) -> jax.Array:
        """cache[blocks [N, C]] → [N, Hkv, C * bs, D] in acc_dtype."""
        kv = from_cache(cache[blocks], scale, acc_dtype).transpose(0, 2, 1, 3, 4)
        return kv.reshape(num_tiles, num_kv_heads, chunk, head_dim)

    def body(carry: tuple) -> tuple:
        j, m, denom, acc = carry
        blocks = jax.lax.dynamic_slice_in_dim(tables, j * chunk_blocks, chunk_blocks, axis=1)
        s = jnp.einsum("nrhgd,nhkd->nrhgk", qt, gather(k_cache, blocks, k_scale),
                       precision=_HIGHEST)  # [N, R, Hkv, G, C]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = j * chunk + jnp.arange(chunk)
        visible = key_pos[None, None, :] <= position[:, :, None]  # [N, R, C]
        if sliding_window is not None:
            visible &= position[:, :, None] - key_pos[None, None, :] < sliding_window
        visible = visible[:, :, None, None, :]
        s = jnp.where(visible, s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("nrhgk,nhkd->nrhgd", p, gather(v_cache, blocks, v_scale),
                        precision=_HIGHEST)
        acc = alpha[..., None] * acc + pv
        return j + 1, m_new, alpha * denom + p.sum(-1), acc

    shape = (num_tiles, rows, num_kv_heads, group)
    init = (jnp.int32(0), jnp.full(shape, _MASK_VALUE, acc_dtype), jnp.zeros(shape, acc_dtype),
            jnp.zeros((*shape, head_dim), acc_dtype))
    _, _, denom, acc = jax.lax.while_loop(lambda c: c[0] < num_chunks, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [N, R, Hkv, G, D]
    out = jnp.where(valid[:, :, None, None, None], out, 0.0).reshape(-1, num_q_heads, head_dim)
    if decode:
        return out.astype(q.dtype)
    target = jnp.where(valid, row, num_tokens).reshape(-1)  # out of range: dropped
    result = jnp.zeros((num_tokens, num_q_heads, head_dim), acc_dtype)
    return result.at[target].set(out, mode="drop").astype(q.dtype)

