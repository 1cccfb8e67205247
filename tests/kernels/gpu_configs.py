"""The Pallas kernel configurations that run compiled (Triton) on a GPU, in one place.

- `TEST_CONFIGS`: small concrete batches that `test_pallas_attention.py` runs against the float64
  oracle (interpreted on CPU, compiled on a GPU); every tile dim is a power of two >= 16.
- `model_configs()`: the shapes the JAX backend calls the kernel with for the models the tests
  and benchmarks load (tiny test models, the demo pair, the Llama-3.2-1B shape of gpu_suite.py).
- `benchmark_configs()`: every case of `benchmarks/attention_kernels.py`'s GPU sweep.

`test_pallas_lowering.py` lowers all of them to Triton on the CPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tests.kernels.naive import make_ragged_case

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One call of the kernel: a ragged batch, head/cache shapes, dtype and static options."""

    name: str
    q_lens: tuple[int, ...]  # [S]
    kv_lens: tuple[int, ...]  # [S]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    options: tuple[tuple[str, object], ...] = ()  # sliding_window, decode, tuning knobs, ...
    num_padding_rows: int = 0

    @property
    def kwargs(self) -> dict:
        return dict(self.options)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens) + self.num_padding_rows

    def abstract_args(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Argument shapes only: enough to trace and lower, no memory."""
        pages = [-(-kv // self.block_size) for kv in self.kv_lens]
        num_seqs, dtype = len(self.kv_lens), jnp.dtype(self.dtype)
        cache = (sum(pages) + 1, self.num_kv_heads, self.block_size, self.head_dim)
        return dict(
            q=jax.ShapeDtypeStruct((self.num_tokens, self.num_q_heads, self.head_dim), dtype),
            k_cache=jax.ShapeDtypeStruct(cache, dtype),
            v_cache=jax.ShapeDtypeStruct(cache, dtype),
            kv_lens=jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
            block_tables=jax.ShapeDtypeStruct((num_seqs, max(pages)), jnp.int32),
            query_start_loc=jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32),
        )

    def numpy_case(self, seed: int = 0) -> dict:
        """Random float32 NumPy inputs (round q and the caches to `dtype` before use)."""
        return make_ragged_case(
            np.random.default_rng(seed), list(self.q_lens), list(self.kv_lens),
            num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, block_size=self.block_size,
            num_padding_rows=self.num_padding_rows,
        )  # fmt: skip


def _config(name, q_lens, kv_lens, heads, head_dim, block_size, dtype, padding=0, **options):
    return KernelConfig(name, tuple(q_lens), tuple(kv_lens), *heads, head_dim, block_size, dtype,
                        tuple(sorted(options.items())), padding)


_DTYPE_OPTIONS = dict(sliding_window=24, soft_cap=10.0)
TEST_CONFIGS = [
    *(_config(f"decode-{dtype}", [1, 1, 1, 0], [40, 1, 17, 0], (8, 2), 128, 16, dtype,
              padding=1, decode=True, **_DTYPE_OPTIONS)
      for dtype in ("float32", "bfloat16", "float16")),
    *(_config(f"mixed-{dtype}", [1, 1, 15, 0, 5, 0], [17, 1, 15, 16, 51, 0], (8, 2), 128, 16,
              dtype, padding=2, **_DTYPE_OPTIONS)
      for dtype in ("float32", "bfloat16", "float16")),
    _config("decode-g3-d256-bs8", [1, 1], [300, 2], (3, 1), 256, 8, "bfloat16", decode=True),
    _config("decode-split3-f32", [1, 1, 1, 1], [1, 15, 16, 700], (8, 2), 128, 16, "float32",
            decode=True, num_splits=3),
    _config("decode-batch-multi-token-path", [1, 1, 1, 0], [33, 9, 64, 0], (8, 2), 64, 16,
            "float32", padding=1, decode=False),
    _config("mixed-g8-d80-bs8-window", [5, 1, 3], [40, 7, 9], (8, 1), 80, 8, "float16",
            sliding_window=8, soft_cap=3.0),
    _config("mixed-g1-d96-bs32-split4", [5, 1, 3], [40, 7, 9], (2, 2), 96, 32, "float32",
            num_splits=4),
    _config("mixed-g2-rows16", [9, 1], [30, 2], (4, 2), 64, 16, "bfloat16", rows_per_tile=16),
    _config("tiny-d8-decode", [1, 1, 0], [20, 3, 0], (4, 2), 8, 16, "float32", padding=1,
            decode=True),
    _config("tiny-d16-mixed", [6, 1], [6, 30], (4, 2), 16, 16, "float32", sliding_window=24),
]

# (name, Hq, Hkv, D, dtype, sliding window) of every model the tests and benchmarks load.
_MODELS = [
    ("tiny-llama", 4, 2, 16, "float32", None),
    ("tiny-mistral", 4, 2, 16, "float32", 24),
    ("tiny-draft", 4, 2, 8, "float32", None),
    ("demo-target", 8, 4, 32, "bfloat16", None),
    ("demo-draft", 4, 2, 32, "bfloat16", None),
    ("llama-3.2-1b", 32, 8, 64, "bfloat16", None),
    ("llama-3.2-1b-f32", 32, 8, 64, "float32", None),
]


def model_configs(block_size: int = 16, max_pages: int = 64) -> list[KernelConfig]:
    """A padded decode bucket (T == S == 8) and a prefill bucket (T = 128) per model."""
    configs = []
    for name, hq, hkv, d, dtype, window in _MODELS:
        options = {} if window is None else dict(sliding_window=window)
        long = max_pages * block_size
        configs += [
            _config(f"{name}-decode", [1] * 7 + [0], [long] + [17] * 6 + [0], (hq, hkv), d,
                    block_size, dtype, padding=1, decode=True, **options),
            _config(f"{name}-prefill", [100, 20, 1, 0], [long, 20, 33, 0], (hq, hkv), d,
                    block_size, dtype, padding=7, **options),
        ]
    return configs


def _load_kernel_cases():
    """benchmarks/kernel_cases.py as a module (benchmarks/ is not a package)."""
    if "kernel_cases" not in sys.modules:
        spec = importlib.util.spec_from_file_location("kernel_cases",
                                                      _BENCHMARKS / "kernel_cases.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernel_cases"] = module
        spec.loader.exec_module(module)
    return sys.modules["kernel_cases"]


def benchmark_configs() -> list[KernelConfig]:
    """Every case of the kernel benchmark's default GPU sweep, as the benchmark calls it."""
    bench = _load_kernel_cases()
    shape = bench.GPU_SHAPE
    return [
        _config(f"bench-{spec.name}-b{spec.batch}-ctx{spec.context}", spec.q_lens,
                spec.kv_lens, (shape.num_q_heads, shape.num_kv_heads), shape.head_dim,
                shape.block_size, shape.dtype, **bench.pallas_options(spec))
        for spec in bench.gpu_sweep(bench.GPU_BATCHES, bench.GPU_CONTEXTS)
    ]
