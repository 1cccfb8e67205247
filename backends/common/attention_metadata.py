"""The attention metadata both backends' models read: one flattened ragged batch of T tokens
from S sequences, passed explicitly (never a global: a traced step cannot see one)."""

from __future__ import annotations

from typing import Any, NamedTuple


class AttentionMetadata(NamedTuple):
    """Arrays of the step's framework (jax.Array or torch.Tensor)."""

    positions: Any  # [T] int32
    slot_mapping: Any  # [T] int32, -1 = padding
    query_start_loc: Any  # [S+1] int32
    kv_lens: Any  # [S] int32
    block_tables: Any  # [S, M] int32
    rope_cos: Any  # [max_model_len, D] float32
    rope_sin: Any  # [max_model_len, D] float32
    # static: one query token per sequence, T == S (the JAX attention's fast path)
    decode: bool = False
    # a host-known bound on a sequence's query length: torch's CUDA launch reads no device value
    max_query_len: int | None = None
