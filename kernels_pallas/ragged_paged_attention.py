"""Ragged paged attention as one Pallas kernel (Triton lowering on NVIDIA GPUs, interpret on CPU).

Semantics: `reference.ragged_paged_attention_reference`. Design:

- **Rows.** GQA is packed: a program serves one KV head and a tile of `rows` query rows, where a
  row is one (token, query head) pair of that KV head's group. Rows are the pairs of one sequence
  laid out token-major (row = token * G + head), so a tile holds several tokens of a small group
  and no group is padded to 16 heads; only the tile's tail (and decode tiles, see below) pads.
- **Tile map.** The wrapper computes with jnp, on device, which sequence and rows each tile
  serves (`tile_map.py`), gathers q into tiles and scatters the output back. The kernel reads the
  map and the block tables as plain int32 inputs (no scalar prefetch: that is TPU-only).
- **KV loop.** Each program walks the KV pages of its sequence in chunks of `pages_per_chunk`
  pages with an online softmax in float32, from the first page inside the sliding window to the
  page holding the tile's last position (causal skip).
- **Paths.** Decode (`decode=True`: the caller guarantees T == S and every q_len <= 1): one tile
  per sequence, rows = the G heads of its single token (padded to 16 rows for `tl.dot` on GPU).
  Multi-token (`decode=False`; prefill chunks over a cached prefix, speculative verification,
  mixed batches, and decode batches too): tiles of `rows_per_tile` rows. The choice is static,
  made on the host by the batch builder: a device-side check would sync every layer.
- **Precision.** float32 inputs multiply at `Precision.HIGHEST` (IEEE float32): the default
  lowers to TF32 on NVIDIA GPUs, which breaks float32 parity with HF.
- **FP8 KV cache.** float8_e4m3fn pages (kv_cache_dtype="fp8") are loaded as bytes and converted
  to q's dtype in the kernel (exact: e4m3 fits bf16/fp16/f32); k_scale folds into the logits'
  scale and v_scale into the output, so no element is scaled. Triton converts e4m3 natively
  from sm_89 (Hopper: H100/H200).
- **Split-K.** A third grid axis splits each tile's KV range into `num_splits` parts balanced
  over the sequence's *actual* length; partial (acc, max, sum) are merged by log-sum-exp in jnp.
  The default fills the GPU about twice for small batches of long contexts.

Portability: the kernel body uses only refs, `pl.program_id`, `lax.fori_loop` and jnp ops; the
one Triton-specific call is the masked page load for head dims that are not powers of two
(`_load_kv_chunk`), so a Mosaic GPU variant can reuse the body and swap that helper.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pagedjax.kernels_pallas.tile_map import (
    TileMap,
    cdiv,
    decode_tiles,
    multi_token_tiles,
    num_multi_token_tiles,
)

try:  # The Triton flavour of Pallas; only needed when compiling for a GPU.
    from jax.experimental.pallas import triton as plgpu

    # CompilerParams in jax 0.10 and 0.11; older releases named it TritonCompilerParams.
    _TritonParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
except (ImportError, AttributeError):  # pragma: no cover - builds without Pallas Triton
    plgpu = _TritonParams = None

# The custom call a compiled pallas_call lowers to: jaxlib 0.10.2 and 0.11 embed the Triton IR
# (`__gpu$xla.gpu.triton`); jaxlib builds that compile to PTX while lowering emit the other.
TRITON_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")
_MASK_VALUE = -1e30  # finite: a fully masked chunk never produces inf - inf
_LOG2E = math.log2(math.e)  # logits are kept in base 2 so the kernel uses exp2
_MIN_CHUNKS_PER_SPLIT = 4  # a KV split below ~4 chunks costs more in merging than it gains
_TRITON_MIN_DIM = 16  # tl.dot needs M, N, K >= 16
_KV_CHUNK_BYTES = 64 * 1024  # H100 has 228 KiB of shared memory per SM


def _dot_precision(dtype) -> lax.Precision | None:
    """HIGHEST for float32 (IEEE, not TF32 on NVIDIA GPUs); the default for other dtypes."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


class _Tiling(NamedTuple):
    """Static shape of one pallas_call."""

    rows: int  # query rows (token, head pairs) per program, a power of two
    pages_per_chunk: int  # KV pages loaded per inner-loop step, a power of two
    num_splits: int  # KV splits per tile, merged by log-sum-exp
    head_dim_padded: int  # head_dim rounded up to a power of two
    num_warps: int
    num_stages: int
    interpret: bool


def _load_kv_chunk(
    ref,  # [N, bs, Dp] ref: the cache of one KV head
    pages: jax.Array,  # [P] int32
    head_dim: int,
    masked_load: bool,
) -> jax.Array:  # [P * bs, Dp]
    """Gather P pages; columns past head_dim (pow2 padding) come out as zeros."""
    _, block_size, head_dim_padded = ref.shape
    shape = (pages.shape[0], block_size, head_dim_padded)
    in_head = jnp.broadcast_to(jnp.arange(head_dim_padded) < head_dim, shape)
    if masked_load:  # Triton: never read past the real head_dim
        chunk = plgpu.load(ref.at[pages], mask=in_head, other=0.0)
    else:
        chunk = ref[pages]
        if head_dim_padded != head_dim:  # interpret mode pads blocks with NaN
            chunk = jnp.where(in_head, chunk, 0)
    return chunk.reshape(shape[0] * block_size, head_dim_padded)


def _kv_chunk_range(
    tile_info_ref,  # [num_tiles, 4] int32 ref
    tile: jax.Array,  # this program's tile
    split: jax.Array,  # this program's KV split
    rows: int,
    block_k: int,
    group: int,
    sliding_window: int | None,
    num_splits: int,
) -> tuple[jax.Array, ...]:
    """Per tile: (sequence, row positions [rows], end of keys to read, chunk range of the split)."""
    seq = tile_info_ref[tile, 0]
    num_rows = tile_info_ref[tile, 1]
    first_pair = tile_info_ref[tile, 2]
    first_pos = tile_info_ref[tile, 3]
    row_pos = first_pos + (first_pair + jnp.arange(rows, dtype=jnp.int32)) // group  # [rows]
    # Causal skip: no row of the tile sees past its last valid row's position.
    kv_end = jnp.where(num_rows > 0, first_pos + (first_pair + num_rows - 1) // group + 1, 0)
    kv_start = jnp.int32(0)
    if sliding_window is not None:  # the tile's first row sees the furthest back
        kv_start = jnp.maximum(first_pos + first_pair // group - sliding_window + 1, 0)
    chunk_lo, chunk_hi = kv_start // block_k, cdiv(kv_end, block_k)
    per_split = cdiv(chunk_hi - chunk_lo, num_splits)  # balanced over the actual length
    lo = chunk_lo + split * per_split
    return seq, row_pos, kv_end, lo, jnp.minimum(lo + per_split, chunk_hi)


def _masked_logits(
    q: jax.Array,  # [rows, Dp]
    k: jax.Array,  # [block_k, Dp]
    row_pos: jax.Array,  # [rows] int32
    key_pos: jax.Array,  # [block_k] int32
    acc_dtype,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> tuple[jax.Array, jax.Array]:  # base-2 logits [rows, block_k], visible [rows, block_k]
    """Scaled, soft-capped logits in base 2 (for exp2), masked causally and by the window."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_dot_precision(q.dtype),
                        preferred_element_type=acc_dtype)
    if soft_cap is None:
        s = s * (sm_scale * _LOG2E)
    else:
        s = (soft_cap * _LOG2E) * jnp.tanh(s * (sm_scale / soft_cap))
    visible = key_pos[None, :] <= row_pos[:, None]
    if sliding_window is not None:
        visible &= row_pos[:, None] - key_pos[None, :] < sliding_window
    return jnp.where(visible, s, _MASK_VALUE), visible


def _kernel(
    tile_info_ref,  # [num_tiles, 4] int32
    block_tables_ref,  # [S, M'] int32, M' a multiple of pages_per_chunk
    q_ref,  # [rows, Dp]
    k_ref,  # [N, bs, Dp]
    v_ref,  # [N, bs, Dp]
    *out_refs,  # o [rows, Dp]  |  acc [rows, Dp], m [rows], row_sum [rows] when split
    group: int,
    head_dim: int,
    pages_per_chunk: int,
    num_splits: int,
    masked_load: bool,
    v_scale: float,  # an fp8 cache's values are code * v_scale (1.0 otherwise)
    **semantics,  # sm_scale (times an fp8 cache's k_scale), sliding_window, soft_cap
):
    """Online softmax (base 2) of one query tile over one KV split of one KV head."""
    rows, head_dim_padded = q_ref.shape
    block_k = pages_per_chunk * k_ref.shape[1]
    acc_dtype = jnp.promote_types(q_ref.dtype, jnp.float32)
    seq, row_pos, kv_end, lo, hi = _kv_chunk_range(
        tile_info_ref, pl.program_id(0), pl.program_id(2), rows, block_k, group,
        semantics["sliding_window"], num_splits)
    q = q_ref[...]

    def body(chunk, carry):
        m_prev, sum_prev, acc_prev = carry
        pages = block_tables_ref[seq, pl.ds(chunk * pages_per_chunk, pages_per_chunk)]  # [P]
        k = _load_kv_chunk(k_ref, pages, head_dim, masked_load)  # [block_k, Dp]
        v = _load_kv_chunk(v_ref, pages, head_dim, masked_load)  # [block_k, Dp]
        k, v = k.astype(q.dtype), v.astype(q.dtype)  # fp8 codes, exact; else unchanged
        key_pos = chunk * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        s, visible = _masked_logits(q, k, row_pos, key_pos, acc_dtype, **semantics)
        m_next = jnp.maximum(m_prev, s.max(axis=1))  # [rows]
        p = jnp.where(visible, jnp.exp2(s - m_next[:, None]), 0.0)  # [rows, block_k]
        alpha = jnp.exp2(m_prev - m_next)
        # Slots past the context may hold stale or non-finite data: 0 * NaN would leak.
        v = jnp.where((key_pos < kv_end)[:, None], v, 0)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=_dot_precision(v.dtype), preferred_element_type=acc_dtype)
        return m_next, alpha * sum_prev + p.sum(axis=1), alpha[:, None] * acc_prev + pv

    init = (jnp.full((rows,), _MASK_VALUE, acc_dtype), jnp.zeros((rows,), acc_dtype),
            jnp.zeros((rows, head_dim_padded), acc_dtype))
    m, row_sum, acc = lax.fori_loop(lo, hi, body, init)
    _write_outputs(out_refs, acc, m, row_sum, v_scale)


def _write_outputs(out_refs, acc: jax.Array, m: jax.Array, row_sum: jax.Array,
                   v_scale: float) -> None:
    """A program's epilogue: with one KV split (one output ref) the normalised output, else
    the split's partial (acc, m, row_sum) for _merge_splits; acc scaled by an fp8 cache's
    v_scale (it is linear in the values: once, not per element)."""
    if v_scale != 1.0:
        acc = acc * v_scale
    if len(out_refs) == 1:
        (o_ref,) = out_refs
        o_ref[...] = (acc / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]).astype(o_ref.dtype)
    else:
        for ref, value in zip(out_refs, (acc, m, row_sum), strict=True):
            ref[...] = value


def _output_specs(
    q_tiles: jax.Array, num_splits: int
) -> tuple[list[jax.ShapeDtypeStruct], list[pl.BlockSpec]]:
    """o [num_tiles, Hkv, rows, Dp] in q's dtype, or float32 (acc, m, row_sum) per KV split."""
    num_tiles, num_kv_heads, rows, head_dim_padded = q_tiles.shape
    if num_splits == 1:
        spec = pl.BlockSpec((None, None, rows, head_dim_padded), lambda t, h, s: (t, h, 0, 0))
        return [jax.ShapeDtypeStruct(q_tiles.shape, q_tiles.dtype)], [spec]
    acc_dtype = jnp.promote_types(q_tiles.dtype, jnp.float32)
    stats = (num_tiles, num_kv_heads, num_splits, rows)
    stats_spec = pl.BlockSpec((None, None, None, rows), lambda t, h, s: (t, h, s, 0))
    acc_spec = pl.BlockSpec((None, None, None, rows, head_dim_padded),
                            lambda t, h, s: (t, h, s, 0, 0))
    shapes = [jax.ShapeDtypeStruct((*stats, head_dim_padded), acc_dtype),
              jax.ShapeDtypeStruct(stats, acc_dtype), jax.ShapeDtypeStruct(stats, acc_dtype)]
    return shapes, [acc_spec, stats_spec, stats_spec]


def _pallas_attention(
    tiles: TileMap,
    block_tables: jax.Array,  # [S, M'] int32
    q_tiles: jax.Array,  # [num_tiles, Hkv, rows, Dp]
    k_cache: jax.Array,  # [N, Hkv, bs, D]
    v_cache: jax.Array,  # [N, Hkv, bs, D]
    tiling: _Tiling,
    **static,
) -> list[jax.Array]:  # see _output_specs
    """One pallas_call over the grid (tile, KV head, KV split)."""
    num_tiles, num_kv_heads, rows, head_dim_padded = q_tiles.shape
    num_blocks, _, block_size, head_dim = k_cache.shape
    # Whole int32 tables (no scalar prefetch on GPU); the caches of one KV head, D padded.
    full = lambda x: pl.BlockSpec(x.shape, lambda t, h, s: (0,) * x.ndim)  # noqa: E731
    cache_spec = pl.BlockSpec((num_blocks, None, block_size, head_dim_padded),
                              lambda t, h, s: (0, h, 0, 0))
    q_spec = pl.BlockSpec((None, None, rows, head_dim_padded), lambda t, h, s: (t, h, 0, 0))
    out_shape, out_specs = _output_specs(q_tiles, tiling.num_splits)
    kernel = functools.partial(
        _kernel, head_dim=head_dim, pages_per_chunk=tiling.pages_per_chunk,
        num_splits=tiling.num_splits,
        masked_load=not tiling.interpret and head_dim != head_dim_padded, **static)
    compiler_params = None if tiling.interpret else _TritonParams(
        num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads, tiling.num_splits),
        in_specs=[full(tiles.info), full(block_tables), q_spec, cache_spec, cache_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params,
        interpret=tiling.interpret,
        name=f"ragged_paged_attention_r{rows}_p{tiling.pages_per_chunk}_s{tiling.num_splits}",
    )(tiles.info, block_tables, q_tiles, k_cache, v_cache)


def _merge_splits(
    acc: jax.Array,  # [num_tiles, Hkv, splits, rows, Dp]
    m: jax.Array,  # [num_tiles, Hkv, splits, rows], base-2 running max
    row_sum: jax.Array,  # [num_tiles, Hkv, splits, rows]
) -> jax.Array:  # [num_tiles, Hkv, rows, Dp]
    """Log-sum-exp merge of the KV splits; rows that saw no key come out as zeros."""
    weight = jnp.exp2(m - m.max(axis=2, keepdims=True))  # [num_tiles, Hkv, splits, rows]
    total = (weight * row_sum).sum(axis=2)
    out = (weight[..., None] * acc).sum(axis=2)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def _attend(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [N, Hkv, bs, D]
    v_cache: jax.Array,  # [N, Hkv, bs, D]
    block_tables: jax.Array,  # [S, M'] int32, sanitised
    tiles: TileMap,
    tiling: _Tiling,
    **static,
) -> jax.Array:  # [T, Hq, D]
    """Gather q into tiles, run the kernel, merge splits, scatter rows back."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    kv_head = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]  # [1, Hkv, 1]
    token = tiles.token[:, None, :]  # [num_tiles, 1, rows]
    head = tiles.head[:, None, :]  # [num_tiles, 1, rows]
    q_tiles = q4[jnp.maximum(token, 0), kv_head, head]  # [num_tiles, Hkv, rows, D]
    pad = tiling.head_dim_padded - head_dim
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, 0), (0, pad)))
    outs = _pallas_attention(tiles, block_tables, q_tiles, k_cache, v_cache, tiling, **static)
    out_tiles = outs[0] if tiling.num_splits == 1 else _merge_splits(*outs)
    out_tiles = out_tiles[..., :head_dim].astype(q.dtype)  # [num_tiles, Hkv, rows, D]
    # Unused rows point past the end and are dropped; rows no tile covers (padding) stay zero.
    token = jnp.where(token < 0, num_tokens, token)
    out = jnp.zeros_like(q4).at[token, kv_head, head].set(out_tiles, mode="drop")
    return out.reshape(num_tokens, num_q_heads, head_dim)


def _prepare_block_tables(
    block_tables: jax.Array,  # [S, M] int32
    kv_lens: jax.Array,  # [S] int32
    num_blocks: int,
    block_size: int,
    pages_per_chunk: int,
) -> jax.Array:  # [S, M'] int32
    """Pad to whole chunks; pages past a sequence's end read block 0, never out of bounds."""
    num_pages = block_tables.shape[1]
    padded = pl.cdiv(num_pages, pages_per_chunk) * pages_per_chunk
    tables = jnp.pad(block_tables, ((0, 0), (0, padded - num_pages)))
    used = jnp.arange(padded)[None, :] < cdiv(kv_lens, block_size)[:, None]
    return jnp.where(used, jnp.clip(tables, 0, num_blocks - 1), 0).astype(jnp.int32)


def _default_num_splits(num_programs: int, max_chunks: int, interpret: bool) -> int:
    """As many KV splits as fit in one wave of about two programs per SM (never a partial
    second wave), each at least a few chunks long. On an H100 at batch 8, context 8192 (64
    programs): 4 splits ran in 137 µs where 5 (rounding up) took 193."""
    if interpret:  # the interpreter runs programs one after another: splitting only adds work
        return 1
    num_cores = getattr(jax.devices()[0], "core_count", None) or 132
    wanted = (2 * num_cores) // num_programs
    return max(1, min(wanted, max_chunks // _MIN_CHUNKS_PER_SPLIT))


def _make_tiling(
    decode: bool,
    q_shape: tuple[int, int, int],  # (T, Hq, D)
    cache_shape: tuple[int, int, int, int],  # (N, Hkv, bs, D)
    table_shape: tuple[int, int],  # (S, M)
    itemsize: int,  # bytes per cache element
    interpret: bool,
    knobs: dict[str, int | None],  # the public function's tuning knobs, None = choose
) -> _Tiling:
    """Pick the static tiling; on GPU every tl.dot dimension is a power of two >= 16."""
    num_tokens, num_q_heads, head_dim = q_shape
    _, num_kv_heads, block_size, _ = cache_shape
    num_seqs, max_pages = table_shape
    min_dim = 1 if interpret else _TRITON_MIN_DIM
    group = num_q_heads // num_kv_heads
    head_dim_padded = max(pl.next_power_of_2(head_dim), min_dim)  # tl.dot's K of q.k^T
    # K + V of one chunk within _KV_CHUNK_BYTES, so two pipeline stages fit in shared memory.
    max_keys = max(min_dim, _KV_CHUNK_BYTES // (2 * head_dim_padded * itemsize))
    # 64 keys per chunk: at head_dim 128 in bf16 a pipeline stage is 32 KiB, so several
    # programs share an SM and keep more loads in flight. On an H100, decode at batch 64,
    # context 8192 ran in 925 µs with 64-key chunks and 1080 with 128 (826 vs 927 in a
    # second run); at batch 8, 153 vs 193.
    target_keys = min(64, max_keys)
    if decode:  # the G heads of one token, padded to 16 rows for tl.dot on GPU
        rows = max(pl.next_power_of_2(group), min_dim)
        num_tiles = num_seqs
    else:  # a [rows, Dp] float32 accumulator stays in registers
        rows = knobs["rows_per_tile"] or (32 if interpret or head_dim_padded > 128 else 64)
        num_tiles = num_multi_token_tiles(num_tokens, num_seqs, group, rows)
    pages = knobs["num_kv_pages_per_chunk"] or max(1, max(target_keys, min_dim) // block_size)
    for name, value in (("rows_per_tile", rows), ("num_kv_pages_per_chunk", pages)):
        if value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if rows < min_dim or pages * block_size < min_dim:
        raise ValueError(
            f"Triton needs >= {min_dim} query rows and keys per chunk; got rows={rows}, "
            f"{pages} pages of {block_size}: raise rows_per_tile or num_kv_pages_per_chunk"
        )
    max_chunks = pl.cdiv(max_pages, pages)
    splits = knobs["num_splits"] or _default_num_splits(num_tiles * num_kv_heads, max_chunks,
                                                     interpret)
    return _Tiling(rows, pages, splits, head_dim_padded, knobs["num_warps"] or 4,
                   knobs["num_stages"] or 2, interpret)


def _check_inputs(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc) -> None:
    """ValueError for shapes and dtypes a caller can get wrong."""
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [T, Hq, D] and k/v caches [N, Hkv, bs, D] of one shape, got "
            f"{q.shape}, {k_cache.shape}, {v_cache.shape}"
        )
    _, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, cache_head_dim = k_cache.shape
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, jnp.float8_e4m3fn):
        raise ValueError(f"the caches must both be q's dtype {q.dtype} or float8_e4m3fn, got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    if head_dim != cache_head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q has {num_q_heads} heads of {head_dim}, caches {num_kv_heads} heads of "
            f"{cache_head_dim}: head dims must match and Hq be a multiple of Hkv"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    num_seqs = kv_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"kv_lens {kv_lens.shape}, block_tables {block_tables.shape} and query_start_loc "
            f"{query_start_loc.shape} must be [S], [S, M] and [S+1]"
        )
    for name, x in dict(kv_lens=kv_lens, block_tables=block_tables,
                        query_start_loc=query_start_loc).items():
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}: cast with .astype(jnp.int32)")


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "sliding_window", "soft_cap", "decode", "interpret", "rows_per_tile",
        "num_kv_pages_per_chunk", "num_splits", "num_warps", "num_stages", "k_scale", "v_scale",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [N, Hkv, bs, D]
    v_cache: jax.Array,  # [N, Hkv, bs, D]
    kv_lens: jax.Array,  # [S] int32, context length after this step
    block_tables: jax.Array,  # [S, M] int32
    query_start_loc: jax.Array,  # [S+1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    decode: bool = False,
    interpret: bool | None = None,
    rows_per_tile: int | None = None,
    num_kv_pages_per_chunk: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> jax.Array:  # [T, Hq, D] in q.dtype, padding rows zero
    """Ragged paged attention (semantics: `ragged_paged_attention_reference`). The caches are
    q's dtype, or float8_e4m3fn (an FP8 KV cache, read as cache * k_scale / v_scale).

    decode=True selects the decode path: the caller guarantees T == S (padded shapes) and at most
    one query token per sequence (a sequence with more gets zeros). decode=False is correct for
    any batch. interpret=None interprets on CPU and compiles (Triton) elsewhere. Knobs:
    `rows_per_tile` (token, head) rows per program of the multi-token path;
    `num_kv_pages_per_chunk` KV pages per inner-loop step; `num_splits` KV splits per tile
    (None: fill the GPU); `num_warps`, `num_stages` for Triton.
    """
    _check_inputs(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc)
    if (sliding_window is not None and sliding_window < 1) or (soft_cap or 1) <= 0:
        raise ValueError(f"need sliding_window >= 1 and soft_cap > 0 (or None), got "
                         f"{sliding_window}, {soft_cap}")
    num_tokens, num_q_heads, _ = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    if decode and num_tokens != kv_lens.shape[0]:
        raise ValueError(
            f"decode=True needs one query row per sequence (T == S), got q {q.shape} and "
            f"kv_lens {kv_lens.shape}: pad the batch to T == S, or pass decode=False"
        )
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    knobs = dict(rows_per_tile=rows_per_tile, num_kv_pages_per_chunk=num_kv_pages_per_chunk,
                 num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    group = num_q_heads // num_kv_heads
    # an fp8 chunk is converted to q's dtype: size chunks by the wider of the two
    itemsize = max(k_cache.dtype.itemsize, q.dtype.itemsize)
    tiling = _make_tiling(decode, q.shape, k_cache.shape, block_tables.shape, itemsize,
                          interpret, knobs)
    tables = _prepare_block_tables(block_tables, kv_lens, num_blocks, block_size,
                                   tiling.pages_per_chunk)
    if decode:
        tiles = decode_tiles(query_start_loc, kv_lens, group, tiling.rows)
    else:
        tiles = multi_token_tiles(query_start_loc, kv_lens, num_tokens, group, tiling.rows)
    return _attend(q, k_cache, v_cache, tables, tiles, tiling, sm_scale=sm_scale * k_scale,
                   sliding_window=sliding_window, soft_cap=soft_cap, group=group,
                   v_scale=v_scale)
