"""Torch custom ops of pagedjax: ragged paged attention and the KV-cache write (CUDA + C++ CPU),
and a CPU linear over packed weights."""

from pagedjax.kernels_cuda.ops import (
    linear,
    ops_backend,
    pack_linear_weight,
    ragged_paged_attention,
    rotary_embedding_,
    write_kv,
)

__all__ = ["linear", "ops_backend", "pack_linear_weight", "ragged_paged_attention",
           "rotary_embedding_", "write_kv"]
