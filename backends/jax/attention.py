"""Which attention and KV-write implementation the JAX model uses."""

from __future__ import annotations

import jax

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
    queries, the tiled jnp version for long ones, whichever benchmarks/probes/cpu_attention.py
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
