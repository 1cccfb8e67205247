"""Which attention, KV-write and linear implementations the JAX model uses, decided once: the
choice between the kernels (kernels_pallas/ holds them, this file picks one per device, dtype
and shape)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pagedjax.backends.jax import cpu_ffi
from pagedjax.backends.jax.model import AttentionFn, DecodeAttentionFn, WriteKVFn
from pagedjax.kernels_pallas.reference import (
    ragged_paged_attention_reference,
    write_kv_reference,
)
from pagedjax.kernels_pallas.tiled_attention import ragged_paged_attention_tiled

ATTENTION_IMPLS = ("auto", "pallas", "pallas_fused", "cpu", "tiled", "reference")
PALLAS_IMPLS = ("pallas", "pallas_fused")
_MIN_TILED_TOKENS = 128  # below this many query rows the reference's loop is faster on CPU


def ragged_paged_attention_cpu(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [N, Hkv, bs, D]
    v_cache: jax.Array,  # [N, Hkv, bs, D]
    kv_lens: jax.Array,  # [S] int32
    block_tables: jax.Array,  # [S, M] int32
    query_start_loc: jax.Array,  # [S+1] int32
    *,
    decode: bool = False,
    **kwargs,  # sm_scale, sliding_window, soft_cap, k_scale, v_scale
) -> jax.Array:  # [T, Hq, D]
    """The JAX backend's attention on CPU: the fastest correct one for this (static) shape, as
    `benchmarks/probes/cpu_attention.py` measured (RESULTS.md). In float32 the torch backend's C++
    kernel through XLA's FFI (`cpu_ffi`; 2.2-5.3x faster than the jnp choice); otherwise, or
    where it cannot be built, the reference's loop for decode and short queries (T < 128), where
    its per-row gathers are small, and the tiled version (16 rows, 4 blocks per chunk) for
    prefill and mixed batches, where it is ~1.8x faster."""
    args = (k_cache, v_cache, kv_lens, block_tables, query_start_loc)
    if (q.dtype == jnp.float32 and cpu_ffi.supported_cache(k_cache, v_cache)
            and cpu_ffi.available()):
        return cpu_ffi.ragged_paged_attention(q, *args, **kwargs)
    if decode or q.shape[0] < _MIN_TILED_TOKENS:
        return ragged_paged_attention_reference(q, *args, **kwargs)
    return ragged_paged_attention_tiled(q, *args, rows_per_tile=16, chunk_blocks=4, **kwargs)


class AttentionImpl(NamedTuple):
    """The model's attention: its functions and the resolved name."""

    attention_fn: AttentionFn
    write_kv_fn: WriteKVFn
    name: str
    # a decode step's KV write and attention in one call (models the kernel supports), or None
    decode_fn: DecodeAttentionFn | None = None


def resolve_attention(attention_impl: str) -> AttentionImpl:
    """"auto" is the Pallas kernel on GPU and "cpu" on CPU (interpret mode is slow): the C++
    kernel through XLA's FFI in float32; otherwise the jnp reference for decode and short
    queries, the tiled jnp version for long ones, whichever benchmarks/probes/cpu_attention.py
    measured faster (`ragged_paged_attention_cpu`). "pallas_fused" is "pallas" with a decode
    step's KV write and attention in one kernel per layer
    (kernels_pallas/decode_attention.py); not "auto"'s choice until a GPU has measured it.
    """
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={attention_impl!r} is unknown; use one of "
                         f"{ATTENTION_IMPLS}.")
    if attention_impl == "auto":
        attention_impl = "cpu" if jax.default_backend() == "cpu" else "pallas"
    if attention_impl == "cpu":
        return AttentionImpl(ragged_paged_attention_cpu, write_kv_reference, "cpu")
    if attention_impl == "tiled":
        return AttentionImpl(ragged_paged_attention_tiled, write_kv_reference, "tiled")
    if attention_impl == "reference":
        return AttentionImpl(ragged_paged_attention_reference, write_kv_reference, "reference")
    from pagedjax.kernels_pallas import ragged_paged_attention, write_kv
    from pagedjax.kernels_pallas.decode_attention import decode_attention_with_kv_write

    decode_fn = decode_attention_with_kv_write if attention_impl == "pallas_fused" else None
    return AttentionImpl(ragged_paged_attention, write_kv, attention_impl, decode_fn)


def uses_cpu_linear(attention_impl: str, dtype: jnp.dtype, mesh: Mesh | None) -> bool:
    """The linear layers on the C++ kernel through XLA's FFI: with the C++ CPU attention
    ("cpu"), in float32, on one device (packed kernels have no tensor-parallel layout)."""
    if attention_impl != "cpu" or dtype != jnp.float32 or mesh is not None:
        return False
    return cpu_ffi.available()
