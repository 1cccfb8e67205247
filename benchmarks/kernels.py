"""Attention kernel microbenchmark: our Pallas kernel and CUDA op vs JAX's Pallas paged
attention, PyTorch SDPA over a gathered (non-paged) KV, and the jnp reference.

Decode in bf16, GQA 32/8, head_dim 128, block 16, over batch x context, then one mixed batch
(prefill chunks over a prefix + decodes). Device copy bandwidth is measured first; each result
gives the median time in µs, GB/s of *valid* KV bytes read (GB = 1e9) and that as % of copy
bandwidth, TFLOP/s of the visible (causal) attention and the max abs difference to the jnp
reference. Writes benchmarks/results/kernels_<backend>.json (+ .png when matplotlib imports).
On CPU it runs tiny shapes in interpret mode: a smoke test, not a measurement.

    python benchmarks/kernels.py [--batches 1 8 64 256] [--contexts 512 2048 8192 32768]

More implementations (a torch CUDA op, say) join with `register(name, prepare, synchronize)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# torch shares the GPU in this process: JAX allocates on demand instead of taking 75 % up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_torch  # noqa: E402
from common import RESULTS_DIR, environment, print_table, write_json  # noqa: E402

from pagedjax.kernels_pallas import (  # noqa: E402
    ragged_paged_attention,
    ragged_paged_attention_reference,
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """Model-side shape of the attention."""

    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: Any = jnp.bfloat16


@dataclasses.dataclass
class Case:
    """One batch in the batch contract's layout, on device."""

    name: str  # "decode" | "mixed"
    batch: int  # number of sequences
    context: int  # decode context length (0 for mixed)
    shape: Shape
    q: jax.Array  # [T, Hq, D]
    k_cache: jax.Array  # [N, Hkv, bs, D]
    v_cache: jax.Array  # [N, Hkv, bs, D]
    kv_lens: jax.Array  # [S] int32
    block_tables: jax.Array  # [S, M] int32
    query_start_loc: jax.Array  # [S+1] int32
    q_lens_host: np.ndarray  # [S]
    kv_lens_host: np.ndarray  # [S]

    @property
    def sm_scale(self) -> float:
        return self.shape.head_dim**-0.5

    @property
    def args(self) -> tuple[jax.Array, ...]:
        return (self.q, self.k_cache, self.v_cache, self.kv_lens, self.block_tables,
                self.query_start_loc)

    @property
    def decode_only(self) -> bool:
        return bool(np.all(self.q_lens_host == 1))

    @property
    def kv_bytes(self) -> int:
        """Valid K and V bytes: every context token once, whatever the kernel reads."""
        s = self.shape
        itemsize = jnp.dtype(s.dtype).itemsize
        return int(self.kv_lens_host.sum()) * s.num_kv_heads * s.head_dim * 2 * itemsize

    @property
    def flops(self) -> int:
        """2 matmuls x 2 flops per visible (query, key) pair, head and dim."""
        q, kv = self.q_lens_host, self.kv_lens_host
        visible = np.sum(q * (kv - q) + q * (q + 1) // 2)  # causal: query i sees kv - q + i + 1
        return int(4 * visible * self.shape.num_q_heads * self.shape.head_dim)


def make_case(name: str, q_lens: list[int], kv_lens: list[int], shape: Shape, *, seed: int = 0,
              context: int = 0) -> Case:
    """Random batch with randomly permuted pages; caches filled by tiling a random pool."""
    rng = np.random.default_rng(seed)
    q_lens_host, kv_lens_host = np.asarray(q_lens), np.asarray(kv_lens)
    pages = -(-kv_lens_host // shape.block_size)
    num_blocks = int(pages.sum()) + 1
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(kv_lens), int(pages.max())), np.int32)
    for s, start in enumerate(np.cumsum(pages) - pages):
        tables[s, : pages[s]] = perm[start : start + pages[s]]
    cache_shape = (num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim)
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    num_tokens = int(q_lens_host.sum())
    q = jax.random.normal(key_q, (num_tokens, shape.num_q_heads, shape.head_dim), shape.dtype)
    return Case(
        name=name, batch=len(kv_lens), context=context, shape=shape, q=q,
        k_cache=_tiled_random(key_k, cache_shape, shape.dtype),
        v_cache=_tiled_random(key_v, cache_shape, shape.dtype),
        kv_lens=jnp.asarray(kv_lens_host, jnp.int32), block_tables=jnp.asarray(tables),
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens_host)]), jnp.int32),
        q_lens_host=q_lens_host, kv_lens_host=kv_lens_host,
    )


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _tiled_random(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A big random-looking cache without a full-size random temporary."""
    pool = jax.random.normal(key, (min(shape[0], 256), *shape[1:]), dtype)
    return jnp.tile(pool, (-(-shape[0] // pool.shape[0]), 1, 1, 1))[: shape[0]]


# --- implementations ------------------------------------------------------------------------


class NotApplicable(Exception):
    """An implementation cannot run this case (unsupported batch, or not enough memory)."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    """prepare(case) does the setup (layout, jit) outside the timing and returns run() -> output;
    synchronize(output) blocks until the device is done."""

    prepare: Callable[[Case], Callable[[], Any]]
    synchronize: Callable[[Any], Any] = jax.block_until_ready


IMPLEMENTATIONS: dict[str, Implementation] = {}


def register(name: str, prepare: Callable[[Case], Callable[[], Any]],
             synchronize: Callable[[Any], Any] = jax.block_until_ready) -> None:
    IMPLEMENTATIONS[name] = Implementation(prepare, synchronize)


def _prepare_reference(case: Case) -> Callable[[], Any]:
    fn = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=case.sm_scale))
    return functools.partial(fn, *case.args)


def _prepare_pallas(case: Case) -> Callable[[], Any]:
    fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=case.sm_scale))
    return functools.partial(fn, *case.args)


def _prepare_jax_paged_attention(case: Case) -> Callable[[], Any]:
    """jax.experimental.pallas.ops.gpu.paged_attention: decode only, caches [Hkv, N, bs, D]."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    if not case.decode_only:
        raise NotApplicable("decode only")
    if 2 * case.k_cache.nbytes > _free_device_bytes():
        raise NotApplicable("no memory for its cache layout")
    num_pages = case.block_tables.shape[1]
    k_splits = min(16, 1 << (num_pages.bit_length() - 1))  # pages must split evenly
    per_split = -(-num_pages // k_splits)
    pages_per_compute_block = min(8, per_split)
    per_split = -(-per_split // pages_per_compute_block) * pages_per_compute_block
    tables = jnp.pad(case.block_tables, ((0, 0), (0, per_split * k_splits - num_pages)))
    k_pages = jnp.swapaxes(case.k_cache, 0, 1)  # [Hkv, N, bs, D]
    v_pages = jnp.swapaxes(case.v_cache, 0, 1)
    q = (case.q * case.sm_scale).astype(case.q.dtype)  # it applies no softmax scale
    fn = jax.jit(functools.partial(
        paged_attention, k_splits=k_splits, pages_per_compute_block=pages_per_compute_block,
        interpret=jax.default_backend() == "cpu"))
    return functools.partial(fn, q, k_pages, v_pages, tables, case.kv_lens)


register("jnp_reference", _prepare_reference)
register("pallas_ragged", _prepare_pallas)
register("jax_pallas_paged", _prepare_jax_paged_attention)
kernels_torch.register_all(register, NotApplicable)


# --- measuring ------------------------------------------------------------------------------


def _free_device_bytes() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return float("inf")  # CPU: tiny shapes only
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def median_seconds(run: Callable[[], Any], synchronize: Callable[[Any], Any],
                   repeats: int) -> float:
    """Median wall time per call, synchronised on the device.

    Short kernels are timed in back-to-back groups (one sync per group) so that launch
    latency overlaps with the previous call, as it does in a model step.
    """
    synchronize(run())  # compile and warm up
    start = time.perf_counter()
    synchronize(run())
    single = time.perf_counter() - start
    group = max(1, min(50, int(2e-3 / max(single, 1e-7))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(group):
            out = run()
        synchronize(out)
        samples.append((time.perf_counter() - start) / group)
    return statistics.median(samples)


def copy_bandwidth_gbs(num_bytes: int, repeats: int) -> float:
    """Device copy bandwidth: bytes read + written per second by a jitted copy, GB = 1e9."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(jnp.copy)
    return 2 * x.nbytes / median_seconds(lambda: copy(x), jax.block_until_ready, repeats) / 1e9


def measure_case(case: Case, names: list[str], copy_gbs: float, repeats: int) -> list[dict]:
    """One row per implementation: time, bandwidth, throughput, error vs the reference."""
    rows, expected = [], None
    for name in sorted(names, key=lambda n: n != "jnp_reference"):  # reference first
        impl = IMPLEMENTATIONS[name]
        row = dict(case=case.name, batch=case.batch, context=case.context, impl=name)
        try:
            run = impl.prepare(case)
        except NotApplicable as reason:
            rows.append(dict(row, status=f"skipped: {reason}"))
            continue
        out = impl.synchronize(run())
        if name == "jnp_reference":
            expected = kernels_torch.to_numpy(out)
        seconds = median_seconds(run, impl.synchronize, repeats)
        gbs = case.kv_bytes / seconds / 1e9
        rows.append(dict(
            row, status="ok", us=seconds * 1e6, gbs=gbs, pct_copy=100 * gbs / copy_gbs,
            tflops=case.flops / seconds / 1e12,
            max_abs_err=None if expected is None
            else float(np.max(np.abs(kernels_torch.to_numpy(out) - expected))),
        ))
        del run, out
    return rows


# --- driver ---------------------------------------------------------------------------------


def _fits(batch: int, context: int, shape: Shape) -> bool:
    """K and V caches within 80 % of free memory (JAX's kernel checks its own extra copy)."""
    cache_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim
    return cache_bytes * jnp.dtype(shape.dtype).itemsize < 0.8 * _free_device_bytes()


def _mixed_lens(on_cpu: bool) -> tuple[list[int], list[int]]:
    """Prefill chunks over a cached prefix plus decodes: (q_lens, kv_lens)."""
    if on_cpu:
        return [8, 8, 1, 1, 1, 1], [32, 16, 40, 9, 64, 17]
    return [512] * 4 + [1] * 60, [2048] * 4 + [4096] * 60


def run_benchmark(args: argparse.Namespace) -> dict:
    on_cpu = jax.default_backend() == "cpu"
    shape = Shape(8, 2, 64, 16) if on_cpu else Shape()
    copy_gbs = copy_bandwidth_gbs(2**26 if on_cpu else 2**31, args.repeats)
    print(f"device copy bandwidth: {copy_gbs:.1f} GB/s")
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            if not _fits(batch, context, shape):
                rows.append(dict(case="decode", batch=batch, context=context,
                                 status="skipped: does not fit"))
                continue
            case = make_case("decode", [1] * batch, [context] * batch, shape, context=context)
            rows += measure_case(case, args.impls, copy_gbs, args.repeats)
            del case
    q_lens, kv_lens = _mixed_lens(on_cpu)
    rows += measure_case(make_case("mixed", q_lens, kv_lens, shape), args.impls, copy_gbs,
                         args.repeats)
    return dict(environment=environment(), backend=jax.default_backend(),
                copy_bandwidth_gbs=copy_gbs, shape={k: str(v) for k, v in
                                                    dataclasses.asdict(shape).items()},
                results=rows)


def plot(payload: dict, path: Path) -> None:
    """% of copy bandwidth vs context, one panel per batch size, one line per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plot")
        return
    rows = [r for r in payload["results"] if r["case"] == "decode" and r["status"] == "ok"]
    batches = sorted({r["batch"] for r in rows})
    if not batches:
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.5), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        for impl in sorted({r["impl"] for r in rows}):
            points = sorted((r["context"], r["pct_copy"]) for r in rows
                            if r["batch"] == batch and r["impl"] == impl)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=impl)
        ax.set(xscale="log", xlabel="context", ylabel="% of copy bandwidth", title=f"B={batch}")
    axes[0][0].legend()
    fig.suptitle(f"decode attention, {payload['environment']['accelerator']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    on_cpu = jax.default_backend() == "cpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4] if on_cpu
                        else [1, 8, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32, 128] if on_cpu
                        else [512, 2048, 8192, 32768])
    parser.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS),
                        choices=list(IMPLEMENTATIONS))
    parser.add_argument("--repeats", type=int, default=3 if on_cpu else 15)
    args = parser.parse_args()
    payload = run_benchmark(args)
    columns = ["case", "batch", "context", "impl", "us", "gbs", "pct_copy", "tflops",
               "max_abs_err", "status"]
    table = [dict(r, max_abs_err=f"{r['max_abs_err']:.2e}") if r.get("max_abs_err") is not None
             else r for r in payload["results"]]
    print_table(table, columns)
    backend = payload["backend"]
    print(f"wrote {write_json(f'kernels_{backend}.json', payload)}")
    plot(payload, RESULTS_DIR / f"kernels_{backend}.png")


if __name__ == "__main__":
    main()
