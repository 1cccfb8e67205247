"""Pallas kernels of pagedjax and their pure-jnp references."""

from pagedjax.kernels_pallas.ragged_paged_attention import ragged_paged_attention
from pagedjax.kernels_pallas.reference import ragged_paged_attention_reference
from pagedjax.kernels_pallas.write_kv import write_kv

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "write_kv"]
