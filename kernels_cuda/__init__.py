"""Torch custom ops of pagedjax: ragged paged attention and the KV-cache write (CUDA + C++ CPU)."""

from pagedjax.kernels_cuda.ops import ops_backend, ragged_paged_attention, write_kv

__all__ = ["ops_backend", "ragged_paged_attention", "write_kv"]
