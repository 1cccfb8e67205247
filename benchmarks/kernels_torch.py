"""The torch side of benchmarks/kernels.py: our CUDA op (C++ op on CPU), and PyTorch's
scaled_dot_product_attention over a KV cache gathered contiguous beforehand (a non-paged
reference: the gather is not timed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _tensor(array: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A jax array as a torch tensor on the benchmark device (bf16 goes through float32)."""
    host = np.asarray(array)
    if host.dtype.name == "bfloat16":
        return torch.from_numpy(host.astype(np.float32)).to(_device(), torch.bfloat16)
    return torch.from_numpy(np.array(host)).to(_device(), dtype)


def synchronize(out: torch.Tensor) -> torch.Tensor:
    if out.is_cuda:
        torch.cuda.synchronize()
    return out


def prepare_pagedjax_op(case) -> Callable[[], torch.Tensor]:
    from pagedjax.kernels_cuda import ragged_paged_attention

    args = [_tensor(a) for a in case.args]
    max_query_len = int(case.q_lens_host.max())
    return lambda: ragged_paged_attention(*args, sm_scale=case.sm_scale,
                                          max_query_len=max_query_len)


def prepare_sdpa_gathered(case, not_applicable: type[Exception]) -> Callable[[], torch.Tensor]:
    """Decode only: q [S, Hq, 1, D] against each sequence's KV gathered to [S, Hkv, L, D]."""
    if not case.decode_only:
        raise not_applicable("decode only")
    q, k_cache, v_cache = (_tensor(a) for a in (case.q, case.k_cache, case.v_cache))
    tables = torch.from_numpy(np.asarray(case.block_tables)).long().to(_device())  # [S, M]
    s, m = tables.shape
    _, hkv, bs, d = k_cache.shape

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [S, Hkv, M * bs, D]
        return cache[tables].permute(0, 2, 1, 3, 4).reshape(s, hkv, m * bs, d)

    k, v = gather(k_cache), gather(v_cache)
    kv_lens = torch.from_numpy(case.kv_lens_host).to(_device())
    mask = (torch.arange(m * bs, device=_device())[None, :] < kv_lens[:, None])[:, None, None]
    q = q[:, :, None, :]  # [S, Hq, 1, D]
    return lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=case.sm_scale, enable_gqa=True)[:, :, 0]


def to_numpy(out: Any) -> np.ndarray:
    if isinstance(out, torch.Tensor):
        return out.float().cpu().numpy()
    return np.asarray(out, np.float32)


def register_all(register: Callable, not_applicable: type[Exception]) -> None:
    register("torch_pagedjax_op", prepare_pagedjax_op, synchronize)
    register("torch_sdpa_gathered", lambda case: prepare_sdpa_gathered(case, not_applicable),
             synchronize)
