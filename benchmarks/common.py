"""What every benchmark records beside its numbers (machine, GPU, driver, versions, commit), and
where it writes them (`--out DIR`, default benchmarks/results).

Nothing here imports jax or torch: a benchmark process uses one framework only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from pagedjax.entrypoints.doctor import nvidia_gpus

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "torch", "triton",
             "transformers")


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=RESULTS_DIR,
                        help=f"folder for the JSON/PNG results (default {RESULTS_DIR})")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--dtype: the checkpoint's ("auto") on a GPU, float32 on CPU (where bf16 matmuls are slow
    and HF's float32 is the reference)."""
    parser.add_argument("--dtype", default="auto" if nvidia_gpus() else "float32",
                        help="auto (the checkpoint's), float32, bfloat16 or float16 "
                             "(default: auto on a GPU, float32 on CPU)")


def add_async_scheduling_argument(parser: argparse.ArgumentParser) -> None:
    """--[no-]async-scheduling: the engine option (on by default: jax); results files of runs
    without it get "_sync"."""
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="launch each decode step before the last one's tokens reach the "
                             "host (the engine's default; jax)")


def environment() -> dict:
    """Machine, GPU and driver, package versions and git commit of this run."""
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    # PAGEDJAX_COMMIT: where the tree is a copy whose .git is not its own (a lent GPU machine's
    # copy carried a stale HEAD), the commit as the caller knows it
    commit = os.environ.get("PAGEDJAX_COMMIT")
    try:
        commit = commit or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=RESULTS_DIR.parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    gpus = nvidia_gpus()
    return {
        "machine": platform.machine(), "processor": _cpu_model(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "accelerator": gpus[0]["name"] if gpus else "cpu", "gpus": gpus, "commit": commit,
        "versions": {p: version(p) for p in _PACKAGES},
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json(name: str, payload: dict, out_dir: Path = RESULTS_DIR) -> Path:
    """out_dir/name, written atomically: a run killed mid-write leaves the last complete file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")  # Paths (args) as text
    tmp.replace(path)
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def step_phases_ms(timings: Any) -> dict[str, float]:
    """ms per engine step in each phase of an engine's `step_timings` (schedule, prepare,
    launch, execute, update, output, detokenize), their sum ("step") and the share outside the
    step's launch and execute ("host share")."""
    steps = max(timings.num_steps, 1)
    phases = {phase: 1e3 * seconds / steps for phase, seconds in timings.seconds.items()}
    step_ms = sum(phases.values())
    device_ms = phases["launch"] + phases["execute"]  # the step itself, called then waited for
    return {**phases, "step": step_ms, "host share": (step_ms - device_ms) / step_ms}


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


@contextlib.contextmanager
def stderr_fd_captured():
    """What native code writes to file descriptor 2 meanwhile, in log["text"] (xgrammar logs
    the schema keywords it ignores there; XLA its command-buffer updates)."""
    log = {"text": ""}
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield log
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            log["text"] = tmp.read().decode(errors="replace")
