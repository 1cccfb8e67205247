"""Which attention, KV-write, rotary and linear implementations the torch model uses, decided
once: pagedjax's custom ops (CUDA, C++ CPU) or their pure-torch reference."""

from __future__ import annotations

import torch

from pagedjax.backends.torch.model import LayerOps
from pagedjax.kernels_cuda import (
    decode_attention_with_kv_write,
    ops_backend,
    ragged_paged_attention,
    reference,
    rotary_embedding_,
    write_kv,
)

ATTENTION_IMPLS = ("auto", "cuda_fused", "reference")


def resolve_attention(attention_impl: str) -> LayerOps:
    """"auto": the pagedjax custom ops (CUDA, C++ CPU); "cuda_fused": the same, a decode step's
    KV write and attention in one CUDA kernel (the two ops off a GPU; not "auto"'s choice until
    a GPU measures it); "reference": their pure-torch reference."""
    if attention_impl == "auto":
        return LayerOps(ragged_paged_attention, write_kv, rotary_embedding_)
    if attention_impl == "cuda_fused":
        return LayerOps(ragged_paged_attention, write_kv, rotary_embedding_,
                        decode_attention_with_kv_write)
    if attention_impl == "reference":
        return LayerOps(_reference_attention, reference.write_kv, reference.rotary_embedding_)
    raise ValueError(f"attention_impl={attention_impl!r} is not available on the torch backend; "
                     f"use one of {ATTENTION_IMPLS}.")


def uses_cpu_linear(attention_impl: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the projections run on the packed C++ `pagedjax::linear` op: CPU, float32, the
    custom ops built and chosen (attention_impl "auto")."""
    return (attention_impl == "auto" and device.type == "cpu" and dtype == torch.float32
            and ops_backend() != "reference")


def _reference_attention(*args, max_query_len: int | None = None, **kwargs) -> torch.Tensor:
    """The reference reads the metadata on the host: it needs no launch hint."""
    del max_query_len
    return reference.ragged_paged_attention(*args, **kwargs)
