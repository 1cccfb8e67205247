"""Store new keys/values in the paged caches."""

from __future__ import annotations

import functools

import jax

from pagedjax.kernels_pallas.reference import write_kv_reference


@functools.partial(jax.jit, donate_argnames=("k_cache", "v_cache"),
                   static_argnames=("k_scale", "v_scale"))
def write_kv(
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    k_cache: jax.Array,  # [N, Hkv, bs, D], donated
    v_cache: jax.Array,  # [N, Hkv, bs, D], donated
    slot_mapping: jax.Array,  # [T] int32, block_id * block_size + offset; -1 = skip
    k_scale: float = 1.0,  # an fp8 cache stores k / k_scale, v / v_scale (reference.to_fp8)
    v_scale: float = 1.0,
) -> tuple[jax.Array, jax.Array]:  # the updated (k_cache, v_cache)
    """XLA scatter into the donated caches, updated in place; rows with slot -1 are dropped.

    The issue asks for whichever of a Pallas kernel and the XLA scatter measures faster. Writing
    T rows is a pure memory op that XLA already fuses and runs in place on donated buffers; with
    no GPU to measure a Pallas variant against it, the scatter is the choice. Inside a caller's
    jit the donation is the caller's (donate the caches there).
    """
    return write_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
