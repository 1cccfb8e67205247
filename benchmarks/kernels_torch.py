"""The torch side of benchmarks/attention_kernels.py (this process imports no jax): our CUDA op
(the C++ op on CPU) and PyTorch's scaled_dot_product_attention over a KV cache gathered
contiguous beforehand (a non-paged reference: the gather is not timed), on inputs built from a
`CaseSpec`.

Each implementation asserts what it times: the pagedjax op must be served by the CUDA extension
on a GPU (never the pure-torch fallback), SDPA is pinned to one backend.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from common import median_seconds
from kernel_cases import CaseSpec, Implementation, Inputs, NotApplicable
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedjax.kernels_cuda import ops, reference


def _synchronize(out: torch.Tensor) -> torch.Tensor:
    if out.is_cuda:
        torch.cuda.synchronize()
    return out


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_info() -> dict:
    if not torch.cuda.is_available():
        return dict(name="cpu", platform="cpu", total_bytes=None, l2_bytes=0)
    props = torch.cuda.get_device_properties(0)
    return dict(name=props.name, platform="gpu", total_bytes=props.total_memory,
                l2_bytes=props.L2_cache_size)


def free_bytes() -> float:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else float("inf")


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_inputs(spec: CaseSpec) -> Inputs:
    """The case's host inputs on the device; block b of each cache is pool[b % P]."""
    host = spec.host_inputs()
    device, dtype = _device(), getattr(torch, spec.shape.dtype)
    pool = torch.from_numpy(host["pool"]).to(device, dtype)  # [2, P, Hkv, bs, D]
    index = torch.arange(spec.num_blocks, device=device) % pool.shape[1]
    return Inputs(
        q=torch.from_numpy(host["q"]).to(device, dtype),
        k_cache=pool[0][index], v_cache=pool[1][index],
        kv_lens=torch.from_numpy(host["kv_lens"]).to(device),
        block_tables=torch.from_numpy(host["block_tables"]).to(device),
        query_start_loc=torch.from_numpy(host["query_start_loc"]).to(device),
    )


def reference_output(spec: CaseSpec, inputs: Inputs) -> torch.Tensor:
    return reference.ragged_paged_attention(*inputs, sm_scale=spec.sm_scale)


def to_numpy(out: torch.Tensor) -> np.ndarray:
    return out.float().cpu().numpy()


def _prepare_pagedjax_op(spec: CaseSpec, inputs: Inputs) -> tuple[Callable[[], Any], str]:
    """Fails unless the extension serves the op: "cuda" for GPU tensors, "cpp" for CPU ones."""
    backend, want = ops.ops_backend(), "cuda" if inputs.q.is_cuda else "cpp"
    if backend != want:
        raise RuntimeError(f"the pagedjax ops are served by {backend!r}, not {want!r}: "
                           f"refusing to time a fallback")
    run = functools.partial(ops.ragged_paged_attention, *inputs, sm_scale=spec.sm_scale,
                            max_query_len=max(spec.q_lens))
    return run, backend


def _prepare_sdpa_gathered(spec: CaseSpec, inputs: Inputs) -> tuple[Callable[[], Any], str]:
    """Decode only: the G query heads of a KV head as G queries, [S, Hkv, G, D], against its KV
    gathered to [S, Hkv, M * bs, D]; mem-efficient attention on GPU (pinned), math on CPU."""
    if not spec.decode_only:
        raise NotApplicable("decode only")
    num_seqs, hq, d = inputs.q.shape
    _, hkv, bs, _ = inputs.k_cache.shape
    tables = inputs.block_tables.long()  # [S, M]
    length = tables.shape[1] * bs

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [S, Hkv, M * bs, D]
        return cache[tables].permute(0, 2, 1, 3, 4).reshape(num_seqs, hkv, length, d)

    k, v = gather(inputs.k_cache), gather(inputs.v_cache)
    visible = torch.arange(length, device=k.device)[None, :] < inputs.kv_lens[:, None].long()
    mask = visible[:, None, None, :]  # [S, 1, 1, L]
    q = inputs.q.view(num_seqs, hkv, hq // hkv, d)  # [S, Hkv, G, D]
    backend = SDPBackend.EFFICIENT_ATTENTION if k.is_cuda else SDPBackend.MATH

    def run() -> torch.Tensor:  # [S, Hq, D]
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=spec.sm_scale)
        return out.reshape(num_seqs, hq, d)

    return run, f"sdpa:{backend.name.lower()}"


IMPLEMENTATIONS: dict[str, Implementation] = {
    "torch_pagedjax_op": Implementation(_prepare_pagedjax_op, _synchronize),
    "torch_sdpa_gathered": Implementation(_prepare_sdpa_gathered, _synchronize,
                                          extra_cache_copies=1),
}


def copy_bandwidth_gbs(num_bytes: int, repeats: int) -> float:
    """Device copy bandwidth: bytes read + written per second by a tensor copy, GB = 1e9."""
    x = torch.ones(num_bytes // 4, device=_device())
    y = torch.empty_like(x)
    return 2 * x.nbytes / median_seconds(lambda: y.copy_(x), _synchronize, repeats) / 1e9
