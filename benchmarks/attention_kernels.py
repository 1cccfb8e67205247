"""Attention kernel microbenchmark: our Pallas kernel and CUDA op beside JAX's Pallas paged
attention, PyTorch SDPA over a gathered (non-paged) KV, the references and copy bandwidth.

Decode in bf16, GQA 32/8, head_dim 128, block 16, over batch x context, then one mixed batch
(prefill chunks over a prefix + decodes). Each framework runs in its own process (XLA's allocator
keeps what it freed): without --framework this script runs `--framework jax`, then
`--framework torch`, as children. Per case and implementation: median µs, GB/s of *valid* KV
bytes read (GB = 1e9) and % of the same process's copy bandwidth, TFLOP/s of the visible
(causal) attention, max abs difference to the framework's reference, which implementation ran
(`detail`), and `l2_resident` when the working set fits in L2 (its GB/s is then inflated).
A failing case (out of memory included) is recorded and the sweep goes on; the JSON is rewritten
after every case. On CPU it runs tiny shapes (Pallas interpreted): a smoke test, not a measurement.

    python benchmarks/attention_kernels.py [--framework jax|torch] [--batches 1 8 64 256]
                                 [--contexts 512 2048 8192 32768] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_out_argument,
    environment,
    median_seconds,
    print_table,
    write_json,
)
from kernel_cases import (  # noqa: E402
    CPU_BATCHES,
    CPU_CONTEXTS,
    CPU_SHAPE,
    GPU_BATCHES,
    GPU_CONTEXTS,
    GPU_SHAPE,
    CaseSpec,
    NotApplicable,
    gpu_sweep,
)

FRAMEWORKS = ("jax", "torch")


# --- measuring ------------------------------------------------------------------------------


def _failure(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")[:400]
    oom = any(word in text for word in ("RESOURCE_EXHAUSTED", "out of memory", "OutOfMemory"))
    return ("oom: " if oom else "error: ") + text


def measure_impl(fw: ModuleType, name: str, spec: CaseSpec, inputs: Any, expected: np.ndarray,
                 copy_gbs: float, repeats: int) -> dict:
    """One row: prepare (checks which implementation runs), check against the reference, time."""
    impl = fw.IMPLEMENTATIONS[name]
    needed = spec.cache_bytes * (1 + impl.extra_cache_copies)
    if needed > 0.9 * fw.free_bytes():
        return dict(status=f"skipped: needs {needed / 1e9:.1f} GB, "
                           f"{fw.free_bytes() / 1e9:.1f} GB free")
    try:
        run, detail = impl.prepare(spec, inputs)
        out = impl.synchronize(run())
        error = float(np.max(np.abs(fw.to_numpy(out) - expected)))
        seconds = median_seconds(run, impl.synchronize, repeats)
    except NotApplicable as reason:
        return dict(status=f"skipped: {reason}")
    except Exception as error:  # noqa: BLE001 - one failing case must not end the sweep
        return dict(status=_failure(error))
    gbs = spec.kv_bytes / seconds / 1e9
    return dict(status="ok", detail=detail, us=seconds * 1e6, gbs=gbs,
                pct_copy=100 * gbs / copy_gbs, tflops=spec.flops / seconds / 1e12,
                max_abs_err=error)


def measure_case(fw: ModuleType, spec: CaseSpec, impls: list[str], copy_gbs: float, repeats: int,
                 l2_bytes: int) -> list[dict]:
    """One row per implementation; the framework's reference output is the expected one."""
    base = dict(case=spec.name, batch=spec.batch, context=spec.context,
                working_set_mb=spec.working_set_bytes / 1e6,
                l2_resident=spec.working_set_bytes <= l2_bytes)
    try:
        inputs = fw.device_inputs(spec)
        expected = fw.to_numpy(fw.reference_output(spec, inputs))
    except Exception as error:  # noqa: BLE001
        return [dict(base, impl=name, status=_failure(error)) for name in impls]
    rows = [dict(base, impl=name, **measure_impl(fw, name, spec, inputs, expected, copy_gbs,
                                                 repeats)) for name in impls]
    del inputs
    fw.release_memory()
    return rows


# --- driver ---------------------------------------------------------------------------------


def run_framework(args: argparse.Namespace) -> Path:
    """Every case with one framework's implementations; the JSON is rewritten after each case."""
    fw = importlib.import_module(f"kernels_{args.framework}")
    device = fw.device_info()
    on_gpu = device["platform"] == "gpu"
    shape = GPU_SHAPE if on_gpu else CPU_SHAPE
    batches = args.batches or (GPU_BATCHES if on_gpu else CPU_BATCHES)
    contexts = args.contexts or (GPU_CONTEXTS if on_gpu else CPU_CONTEXTS)
    impls = [name for name in args.impls or fw.IMPLEMENTATIONS if name in fw.IMPLEMENTATIONS]
    copy_gbs = fw.copy_bandwidth_gbs(2**31 if on_gpu else 2**26, args.repeats)
    print(f"{args.framework} on {device['name']}: copy bandwidth {copy_gbs:.1f} GB/s", flush=True)
    payload = dict(environment=environment(), framework=args.framework, device=device,
                   copy_bandwidth_gbs=copy_gbs, shape=dataclasses.asdict(shape), results=[])
    name = f"kernels_{args.framework}_{device['name'].replace(' ', '_')}.json"
    path = write_json(name, payload, args.out)
    for spec in gpu_sweep(batches, contexts, shape, on_gpu):
        rows = measure_case(fw, spec, impls, copy_gbs, args.repeats, device["l2_bytes"])
        payload["results"] += rows
        write_json(name, payload, args.out)
        for row in rows:
            print(json.dumps(row), flush=True)
    _print_summary(payload["results"])
    print(f"wrote {path}")
    plot(args.out)
    return path


def _print_summary(rows: list[dict]) -> None:
    columns = ["case", "batch", "context", "impl", "us", "gbs", "pct_copy", "tflops",
               "max_abs_err", "l2_resident", "status"]
    table = [dict(r, max_abs_err=f"{r['max_abs_err']:.2e}") if r.get("max_abs_err") is not None
             else r for r in rows]
    print_table(table, columns)


def plot(out_dir: Path) -> None:
    """% of copy bandwidth vs context, one panel per batch size, one line per implementation,
    over every kernels_{jax,torch}_*.json in out_dir (both once both have run)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plot")
        return
    paths = [p for fw in FRAMEWORKS for p in sorted(Path(out_dir).glob(f"kernels_{fw}_*.json"))]
    rows = [r for path in paths for r in json.loads(path.read_text())["results"]
            if r["case"] == "decode" and r["status"] == "ok"]
    batches = sorted({r["batch"] for r in rows})
    if not batches:
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.5), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        for impl in sorted({r["impl"] for r in rows}):
            points = sorted((r["context"], r["pct_copy"], r["l2_resident"]) for r in rows
                            if r["batch"] == batch and r["impl"] == impl)
            (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                              label=impl)
            in_l2 = [p for p in points if p[2]]
            ax.scatter([p[0] for p in in_l2], [p[1] for p in in_l2], s=90, marker="o",
                       facecolors="white", edgecolors=line.get_color(), zorder=3)
        ax.set(xscale="log", xlabel="context", ylabel="% of copy bandwidth", title=f"B={batch}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("decode attention (hollow: working set in L2, inflated GB/s)")
    fig.tight_layout()
    fig.savefig(Path(out_dir) / "kernels.png", dpi=120)
    print(f"wrote {Path(out_dir) / 'kernels.png'}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=FRAMEWORKS,
                        help="run one framework in this process (default: each in a child)")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--impls", nargs="+", help="implementation names (default: all of the "
                        "framework's)")
    parser.add_argument("--repeats", type=int, default=15)
    add_out_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.framework:
        run_framework(args)
        return 0
    argv = sys.argv[1:] if argv is None else argv
    codes = [subprocess.run([sys.executable, __file__, "--framework", fw, *argv]).returncode
             for fw in FRAMEWORKS]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
