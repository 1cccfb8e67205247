"""Which attention, KV-write and linear implementations the JAX model uses, decided once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pagedjax.backends.jax.model import AttentionFn, WriteKVFn
from pagedjax.kernels_pallas.reference import (
    ragged_paged_attention_reference,
    write_kv_reference,
)
from pagedjax.kernels_pallas.tiled_attention import (
    ragged_paged_attention_cpu,
    ragged_paged_attention_tiled,
)

ATTENTION_IMPLS = ("auto", "pallas", "cpu", "tiled", "reference")


def resolve_attention(attention_impl: str) -> tuple[AttentionFn, WriteKVFn, str]:
    """"auto" is the Pallas kernel on GPU and "cpu" on CPU (interpret mode is slow): the C++
    kernel through XLA's FFI in float32; otherwise the jnp reference for decode and short
    queries, the tiled jnp version for long ones, whichever benchmarks/cpu_attention.py
    measured faster.

    Returns (attention_fn, write_kv_fn, resolved name).
    """
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={attention_impl!r} is unknown; use one of "
                         f"{ATTENTION_IMPLS}.")
    if attention_impl == "auto":
        attention_impl = "cpu" if jax.default_backend() == "cpu" else "pallas"
    if attention_impl == "cpu":
        return ragged_paged_attention_cpu, write_kv_reference, "cpu"
    if attention_impl == "tiled":
        return ragged_paged_attention_tiled, write_kv_reference, "tiled"
    if attention_impl == "reference":
        return ragged_paged_attention_reference, write_kv_reference, "reference"
    from pagedjax.kernels_pallas import ragged_paged_attention, write_kv

    return ragged_paged_attention, write_kv, "pallas"


def uses_cpu_linear(attention_impl: str, dtype: jnp.dtype, mesh: Mesh | None) -> bool:
    """The linear layers on the C++ kernel through XLA's FFI: with the C++ CPU attention
    ("cpu"), in float32, on one device (packed kernels have no tensor-parallel layout)."""
    if attention_impl != "cpu" or dtype != jnp.float32 or mesh is not None:
        return False
    from pagedjax.kernels_pallas import cpu_ffi

    return cpu_ffi.available()
