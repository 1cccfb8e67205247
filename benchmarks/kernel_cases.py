"""The kernel benchmark's cases, framework-neutral: shapes, sweeps and deterministic host inputs
that `kernels_jax.py` and `kernels_torch.py` turn into device arrays the same way, and the
shapes both give their implementations (`Inputs`, `Implementation`, `NotApplicable`).

Imports neither jax nor torch. The Pallas lowering test reads the GPU sweep from here, so every
configuration the benchmark times is also lowered to Triton in CI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

GPU_BATCHES = (1, 8, 64, 256)
# Largest case: B=256 x 32768 tokens, K+V 34 GB in bf16; with one implementation's layout copy
# (JAX's paged attention, SDPA's gather) 69 GB: the sweep is sized to an 80 GB GPU.
GPU_CONTEXTS = (512, 2048, 8192, 32768)
CPU_BATCHES, CPU_CONTEXTS = (1, 4), (32, 128)


@dataclasses.dataclass(frozen=True)
class Shape:
    """Model-side shape of the attention."""

    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2


GPU_SHAPE, CPU_SHAPE = Shape(), Shape(8, 2, 64, 16)


@dataclasses.dataclass(frozen=True)
class CaseSpec:
    """One batch in the batch contract's layout, framework-neutral (host ints only)."""

    name: str  # "decode" | "mixed"
    batch: int  # number of sequences
    context: int  # decode context length (0 for mixed)
    q_lens: tuple[int, ...]  # [S]
    kv_lens: tuple[int, ...]  # [S]
    shape: Shape
    seed: int = 0

    @property
    def decode_only(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    @property
    def sm_scale(self) -> float:
        return self.shape.head_dim**-0.5

    @property
    def num_pages(self) -> np.ndarray:  # [S]
        return -(-np.asarray(self.kv_lens) // self.shape.block_size)

    @property
    def num_blocks(self) -> int:
        return int(self.num_pages.sum()) + 1

    @property
    def cache_bytes(self) -> int:
        """K and V caches as allocated."""
        s = self.shape
        return 2 * self.num_blocks * s.num_kv_heads * s.block_size * s.head_dim * s.itemsize

    @property
    def kv_bytes(self) -> int:
        """Valid K and V bytes: every context token once, whatever the kernel reads."""
        s = self.shape
        return sum(self.kv_lens) * s.num_kv_heads * s.head_dim * 2 * s.itemsize

    @property
    def working_set_bytes(self) -> int:
        """Bytes one call touches: valid KV, q, out, tables."""
        s = self.shape
        q_bytes = sum(self.q_lens) * s.num_q_heads * s.head_dim * s.itemsize
        return self.kv_bytes + 2 * q_bytes + 4 * int(self.num_pages.sum())

    @property
    def flops(self) -> int:
        """2 matmuls x 2 flops per visible (query, key) pair, head and dim."""
        q, kv = np.asarray(self.q_lens), np.asarray(self.kv_lens)
        visible = np.sum(q * (kv - q) + q * (q + 1) // 2)  # causal: query i sees kv - q + i + 1
        return int(4 * visible * self.shape.num_q_heads * self.shape.head_dim)

    def host_inputs(self) -> dict[str, np.ndarray]:
        """Deterministic inputs, the same in every framework. The caches are built on the device
        from `pool` (64 random blocks): block b holds pool[b % 64]."""
        rng = np.random.default_rng(self.seed)
        s, pages = self.shape, self.num_pages
        perm = rng.permutation(self.num_blocks).astype(np.int32)
        tables = np.zeros((self.batch, int(pages.max())), np.int32)  # [S, M]
        for seq, start in enumerate(np.cumsum(pages) - pages):
            tables[seq, : pages[seq]] = perm[start : start + pages[seq]]
        pool_shape = (2, 64, s.num_kv_heads, s.block_size, s.head_dim)
        return dict(
            q=rng.standard_normal((sum(self.q_lens), s.num_q_heads, s.head_dim), np.float32),
            pool=rng.standard_normal(pool_shape, np.float32),  # K pool, V pool
            kv_lens=np.asarray(self.kv_lens, np.int32),
            block_tables=tables,
            query_start_loc=np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32),
        )


class NotApplicable(Exception):
    """An implementation cannot run this case (e.g. decode only)."""


class Inputs(NamedTuple):
    """One case on the device: jax arrays or torch tensors."""

    q: Any  # [T, Hq, D]
    k_cache: Any  # [N, Hkv, bs, D]
    v_cache: Any  # [N, Hkv, bs, D]
    kv_lens: Any  # [S] int32
    block_tables: Any  # [S, M] int32
    query_start_loc: Any  # [S+1] int32


@dataclasses.dataclass(frozen=True)
class Implementation:
    """prepare(spec, inputs) does the setup outside the timing and returns (run, detail), where
    detail names what actually runs; synchronize(out) waits for the device; extra_cache_copies
    sizes its memory need."""

    prepare: Callable[[CaseSpec, Inputs], tuple[Callable[[], Any], str]]
    synchronize: Callable[[Any], Any]
    extra_cache_copies: int = 0


def gpu_sweep(batches: tuple[int, ...], contexts: tuple[int, ...], shape: Shape = GPU_SHAPE,
              on_gpu: bool = True) -> list[CaseSpec]:
    """Decode cases over batch x context, then one mixed batch."""
    specs = [CaseSpec("decode", b, c, (1,) * b, (c,) * b, shape) for b in batches for c in contexts]
    q_lens, kv_lens = (([512] * 4 + [1] * 60, [2048] * 4 + [4096] * 60) if on_gpu
                       else ([8, 8, 1, 1, 1, 1], [32, 16, 40, 9, 64, 17]))
    specs.append(CaseSpec("mixed", len(kv_lens), 0, tuple(q_lens), tuple(kv_lens), shape))
    return specs


def pallas_options(spec: CaseSpec) -> dict:
    """Static options of our Pallas kernel for a case: decode batches take the decode path."""
    return dict(decode=spec.decode_only)
