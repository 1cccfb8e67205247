"""The JAX side of benchmarks/attention_kernels.py (this process imports no torch): our Pallas
kernel, its fused decode path (the KV write and attention in one kernel:
kernels_pallas/decode_attention.py), JAX's own Pallas paged attention and the jnp reference, on
inputs built from a `CaseSpec`.

On a GPU each Pallas implementation proves it is the compiled Triton kernel before it is timed.
"""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Callable
from typing import Any

# JAX allocates on demand instead of taking 75 % of the GPU up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import median_seconds  # noqa: E402
from kernel_cases import (  # noqa: E402
    CaseSpec,
    Implementation,
    Inputs,
    NotApplicable,
    pallas_options,
)

from pagedjax.kernels_pallas import (  # noqa: E402
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pagedjax.kernels_pallas.decode_attention import (  # noqa: E402
    decode_attention_with_kv_write,
    supports,
)
from pagedjax.kernels_pallas.ragged_paged_attention import TRITON_CALL_TARGETS  # noqa: E402

# L2 per GPU (the working set of a case below it is served from cache, not HBM).
_L2_BYTES = {"H200": 60 * 2**20, "H100": 50 * 2**20, "A100": 40 * 2**20}
_DEFAULT_L2_BYTES = 50 * 2**20


def device_info() -> dict:
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    l2 = next((size for kind, size in _L2_BYTES.items() if kind in device.device_kind),
              _DEFAULT_L2_BYTES) if device.platform == "gpu" else 0
    return dict(name=device.device_kind, platform=jax.default_backend(),
                total_bytes=stats.get("bytes_limit"), l2_bytes=l2)


def free_bytes() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return float("inf")  # CPU: tiny shapes only
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def release_memory() -> None:
    gc.collect()


@functools.partial(jax.jit, static_argnames=("num_blocks",))
def _cache_from_pool(pool: jax.Array, num_blocks: int) -> jax.Array:
    """[N, Hkv, bs, D] with block b = pool[b % P]: no full-size random temporary."""
    return pool[jnp.arange(num_blocks) % pool.shape[0]]


def device_inputs(spec: CaseSpec) -> Inputs:
    host = spec.host_inputs()
    dtype = jnp.dtype(spec.shape.dtype)
    pool = jnp.asarray(host["pool"], dtype)  # [2, P, Hkv, bs, D]
    return Inputs(
        q=jnp.asarray(host["q"], dtype),
        k_cache=_cache_from_pool(pool[0], spec.num_blocks),
        v_cache=_cache_from_pool(pool[1], spec.num_blocks),
        kv_lens=jnp.asarray(host["kv_lens"]), block_tables=jnp.asarray(host["block_tables"]),
        query_start_loc=jnp.asarray(host["query_start_loc"]),
    )


def reference_output(spec: CaseSpec, inputs: Inputs) -> jax.Array:
    fn = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=spec.sm_scale))
    return fn(*inputs)


def to_numpy(out: jax.Array) -> np.ndarray:
    return np.asarray(out.astype(jnp.float32))


def _checked(fn: Callable, *args) -> tuple[Callable[[], Any], str]:
    """(run, detail); on a GPU, fails unless fn lowers to the Triton kernel (not interpret)."""
    if jax.default_backend() == "cpu":
        return functools.partial(fn, *args), "interpret"
    hlo = fn.lower(*args).as_text()
    if not any(target in hlo for target in TRITON_CALL_TARGETS):
        raise RuntimeError("expected the compiled Triton kernel: no Triton call in the HLO")
    return functools.partial(fn, *args), "triton"


def _prepare_reference(spec: CaseSpec, inputs: Inputs) -> tuple[Callable[[], Any], str]:
    fn = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=spec.sm_scale))
    return functools.partial(fn, *inputs), "xla"


def _prepare_pallas(spec: CaseSpec, inputs: Inputs) -> tuple[Callable[[], Any], str]:
    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=spec.sm_scale,
                                   **pallas_options(spec)))
    return _checked(fn, *inputs)


def _prepare_jax_paged_attention(spec: CaseSpec,
                                 inputs: Inputs) -> tuple[Callable[[], Any], str]:
    """jax.experimental.pallas.ops.gpu.paged_attention: decode only, caches [Hkv, N, bs, D]."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    if not spec.decode_only:
        raise NotApplicable("decode only")
    num_pages = inputs.block_tables.shape[1]
    k_splits = min(16, 1 << (num_pages.bit_length() - 1))  # pages must split evenly
    per_split = -(-num_pages // k_splits)
    pages_per_compute_block = min(8, per_split)
    per_split = -(-per_split // pages_per_compute_block) * pages_per_compute_block
    tables = jnp.pad(inputs.block_tables, ((0, 0), (0, per_split * k_splits - num_pages)))
    k_pages = jnp.swapaxes(inputs.k_cache, 0, 1)  # [Hkv, N, bs, D]
    v_pages = jnp.swapaxes(inputs.v_cache, 0, 1)
    q = (inputs.q * spec.sm_scale).astype(inputs.q.dtype)  # it applies no softmax scale
    fn = jax.jit(functools.partial(
        paged_attention, k_splits=k_splits, pages_per_compute_block=pages_per_compute_block,
        interpret=jax.default_backend() == "cpu"))
    return _checked(fn, q, k_pages, v_pages, tables, inputs.kv_lens)


def _prepare_pallas_fused_decode(spec: CaseSpec,
                                 inputs: Inputs) -> tuple[Callable[[], Any], str]:
    """decode_attention_with_kv_write: each sequence's last key and value written back to their
    own slot (the same values: the output stays the reference's) and attended, on a copy of the
    caches that the calls donate to one another (an undonated cache would be copied whole by
    every call to be written in place)."""
    if not spec.decode_only:
        raise NotApplicable("decode only")
    _, num_q_heads, head_dim = inputs.q.shape
    if not supports(num_q_heads, inputs.k_cache.shape[1], head_dim):
        raise NotApplicable("a group or head_dim the fused kernel does not take")
    block_size = inputs.k_cache.shape[2]
    last = inputs.kv_lens - 1  # [S]
    blocks = jnp.take_along_axis(inputs.block_tables, (last // block_size)[:, None], 1)[:, 0]
    slots = (blocks * block_size + last % block_size).astype(jnp.int32)  # [S]
    k_new = inputs.k_cache[blocks, :, last % block_size]  # [S, Hkv, D]
    v_new = inputs.v_cache[blocks, :, last % block_size]
    fn = jax.jit(functools.partial(decode_attention_with_kv_write, sm_scale=spec.sm_scale,
                                   interpret=jax.default_backend() == "cpu"),
                 donate_argnums=(3, 4))
    caches = [jnp.copy(inputs.k_cache), jnp.copy(inputs.v_cache)]
    args = lambda: (inputs.q, k_new, v_new, *caches, slots, inputs.kv_lens,  # noqa: E731
                    inputs.block_tables, inputs.query_start_loc)
    detail = "interpret"
    if jax.default_backend() != "cpu":
        if not any(target in fn.lower(*args()).as_text() for target in TRITON_CALL_TARGETS):
            raise RuntimeError("expected the compiled Triton kernel: no Triton call in the HLO")
        detail = "triton"

    def run() -> jax.Array:
        out, caches[0], caches[1] = fn(*args())
        return out

    return run, detail


_sync = jax.block_until_ready
IMPLEMENTATIONS: dict[str, Implementation] = {
    "jnp_reference": Implementation(_prepare_reference, _sync),
    "pallas_ragged": Implementation(_prepare_pallas, _sync),
    "pallas_fused_decode": Implementation(_prepare_pallas_fused_decode, _sync,
                                          extra_cache_copies=1),
    "jax_pallas_paged": Implementation(_prepare_jax_paged_attention, _sync, extra_cache_copies=1),
}


def copy_bandwidth_gbs(num_bytes: int, repeats: int) -> float:
    """Device copy bandwidth: bytes read + written per second by a jitted copy into a donated
    buffer, GB = 1e9 (torch's `y.copy_(x)`). A copy that returns a new array allocated 1 GiB a
    call and measured 2.2-3.7 TB/s from one process to the next on an H200 (stop 76)."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy_into = jax.jit(lambda dst, src: dst.at[...].set(src), donate_argnums=0)
    dst = [jnp.zeros_like(x)]

    def copy() -> jax.Array:
        dst[0] = copy_into(dst[0], x)
        return dst[0]

    return 2 * x.nbytes / median_seconds(copy, jax.block_until_ready, repeats) / 1e9
