"""What every benchmark shares: the record of the machine beside its numbers (GPU, driver,
versions, commit), where the JSON goes (`--out DIR`), the table it prints, the model it loads
(`--model DIR`, the demo target, or a random Llama), and the order systems take their turns in.

Nothing here imports jax or torch: a benchmark process uses one framework only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from pagedjax.entrypoints.doctor import nvidia_gpus

_T = TypeVar("_T")
# A source checkout (pagedjax installed editable) keeps its results in benchmarks/results;
# an installed package writes under the current directory.
_ROOT = Path(__file__).resolve().parents[2]
CHECKOUT = _ROOT if (_ROOT / "pyproject.toml").is_file() else None
RESULTS_DIR = (CHECKOUT / "benchmarks" / "results" if CHECKOUT and
               (CHECKOUT / "benchmarks").is_dir() else Path("benchmark_results"))
_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "torch", "triton",
             "transformers")
# The "random 6-layer Llama": hidden 256, GQA 8/2, float32.
RANDOM_LLAMA = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                    initializer_range=0.02)


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=RESULTS_DIR,
                        help=f"folder for the JSON/PNG results (default {RESULTS_DIR})")


_DEVICE_DTYPE = "auto-on-gpu"  # --dtype's default, read when a command line is parsed


def _dtype(value: str) -> str:
    return ("auto" if nvidia_gpus() else "float32") if value == _DEVICE_DTYPE else value


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--dtype: the checkpoint's ("auto") on a GPU, float32 on CPU (where bf16 matmuls are slow
    and HF's float32 is the reference). The GPU is looked for only when the benchmark's command
    line is parsed, not whenever the `pagedjax` command builds its parser."""
    parser.add_argument("--dtype", type=_dtype, default=_DEVICE_DTYPE,
                        help="auto (the checkpoint's), float32, bfloat16 or float16 "
                             "(default: auto on a GPU, float32 on CPU)")


def add_async_scheduling_argument(parser: argparse.ArgumentParser) -> None:
    """--[no-]async-scheduling: the engine option (on by default: jax); results files of runs
    without it get "_sync"."""
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="launch each decode step before the last one's tokens reach the "
                             "host (the engine's default; jax)")


def add_model_arguments(parser: argparse.ArgumentParser, random_llama: bool = False) -> None:
    """--model DIR (default: the demo target) and, with random_llama, --random-llama."""
    parser.add_argument("--model", help="HF checkpoint dir (default: the demo target)")
    if random_llama:
        parser.add_argument("--random-llama", action="store_true",
                            help="a random 6-layer Llama (hidden 256, GQA 8/2) made in a temp "
                                 "dir")


@contextlib.contextmanager
def model_dir(args: argparse.Namespace) -> Iterator[str]:
    """args.model, set to the checkpoint the run loads: --random-llama's (made in a temporary
    folder that lives as long as the context), --model, or the demo target."""
    from pagedjax.model_loader.demo import demo_model_dirs

    with tempfile.TemporaryDirectory() as tmp:
        if getattr(args, "random_llama", False):
            from pagedjax.testing.checkpoints import make_tiny_checkpoint

            args.model = str(make_tiny_checkpoint(Path(tmp) / "random-llama", "llama",
                                                  **RANDOM_LLAMA))
        args.model = args.model or demo_model_dirs()[0]
        yield args.model


def model_name(args: argparse.Namespace) -> str:
    """The model's name in a results file name."""
    return "random-llama" if getattr(args, "random_llama", False) else Path(args.model).name


def in_turn(systems: Sequence[_T], round_index: int) -> list[_T]:
    """The systems in round `round_index`'s order: each round starts one system later, so that
    none always runs first or last while a shared host's speed drifts."""
    k = round_index % len(systems)
    return [*systems[k:], *systems[:k]]


# one-sided 95 % quantiles of Student's t by degrees of freedom (a two-sided 90 % interval)
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782,
        1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725)


def paired_ratio(seconds: Sequence[float], reference: Sequence[float]
                 ) -> tuple[float, float, float]:
    """How much faster a system ran than a reference from their passes in the same rounds
    (`in_turn`): the geometric mean of reference_r / seconds_r and its two-sided 90 % interval
    (Student's t on the logarithms; NaN bounds from one round). Pairs share a round's work and
    the host's speed at that time, so the interval shows what the host's drift leaves
    undecided."""
    logs = [math.log(ref / sec) for sec, ref in zip(seconds, reference, strict=True)]
    mean = sum(logs) / len(logs)
    if len(logs) < 2:
        return math.exp(mean), math.nan, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    half = _T95[min(len(logs) - 2, len(_T95) - 1)] * sd / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


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
    if commit is None and CHECKOUT is not None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, cwd=CHECKOUT, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = None
    gpus = nvidia_gpus()
    return {
        "machine": platform.machine(), "processor": _cpu_model(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "accelerator": gpus[0]["name"] if gpus else "cpu", "gpus": gpus, "commit": commit,
        "versions": {p: version(p) for p in _PACKAGES},
    }


def accelerator_tag(env: dict) -> str:
    """The accelerator's name in a results file name."""
    return env["accelerator"].replace(" ", "_")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def args_record(args: argparse.Namespace) -> dict:
    """The run's options as its JSON records them (without the `pagedjax` command's own)."""
    return {k: v for k, v in vars(args).items() if k not in ("command", "bench")}


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
