"""`pagedjax doctor`: what this machine gives pagedjax, in one screen.

The device (nvidia-smi, JAX, torch), versions, the attention implementation each backend will
use, the status of the CUDA/C++ ops build, and a smoke run of each backend's attention against
its reference. Exit status 1 when something is wrong (e.g. a GPU that a framework cannot see,
or a failed CUDA build): the first command of a GPU run. Imports jax and torch only when run.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from typing import Any

_PACKAGES = ("pagedjax", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax",
             "torch", "triton", "transformers", "ninja")


def nvidia_gpus() -> list[dict]:
    """[{name, driver, memory_mib}] from nvidia-smi; [] without an NVIDIA GPU (or nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
             "--format=csv,noheader,nounits"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, check=True,
                               timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in lines:
        name, driver, memory = (field.strip() for field in line.split(","))
        gpus.append({"name": name, "driver": driver, "memory_mib": int(float(memory))})
    return gpus


def _versions() -> dict[str, str | None]:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {package: version(package) for package in _PACKAGES}


def _probe(fn) -> dict:
    """fn() as a dict, or {"error": ...}: one failing probe must not stop the report."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - the doctor reports, it does not crash
        return {"error": f"{type(error).__name__}: {error}"[:2000]}


def _jax_info() -> dict:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from pagedjax.backends.jax.attention import resolve_attention

    backend = jax.default_backend()
    impl = resolve_attention("auto").name
    if impl.startswith("pallas"):
        impl += " (compiled with Triton)" if backend == "gpu" else " (interpreted)"
    elif impl == "cpu":
        from pagedjax.backends.jax import cpu_ffi

        impl += (" (C++ kernel through XLA's FFI in float32)" if cpu_ffi.available()
                 else " (jnp: the C++ kernel did not build)")
    return {"backend": backend, "devices": [f"{d.platform}:{d.id} {d.device_kind}"
                                            for d in jax.devices()], "attention": impl}


def _torch_info() -> dict:
    import torch

    info: dict[str, Any] = {"cuda_build": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        major, minor = torch.cuda.get_device_capability()
        free, total = torch.cuda.mem_get_info()
        info["device"] = (f"{torch.cuda.get_device_name()} sm_{major}{minor}, "
                          f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    return info


def _ops_build() -> dict:
    """Builds (or loads) the torch ops: which implementation serves them, and where."""
    import torch

    from pagedjax.kernels_cuda import ops

    on_gpu = torch.cuda.is_available()
    info = {"build_directory": str(ops.build_directory(on_gpu)),
            "cuda_arch_flags": ops.cuda_arch_flags() if on_gpu else []}
    try:
        info["backend"] = ops.ops_backend()
    except ops.CudaBuildError as error:
        info.update(backend="failed", error=str(error))
    info["attention"] = {"cuda": "CUDA extension", "cpp": "C++ CPU kernels",
                         "reference": "pure-torch reference (slow)"}.get(info["backend"], "none")
    return info


def _smoke_case(rng) -> dict:
    """A tiny decode + prefill batch: [T=6, Hq=4, D=64], 2 KV heads, blocks of 16."""
    import numpy as np

    num_blocks, tables = 8, rng.permutation(8)[:6].reshape(2, 3).astype(np.int32)
    cache = (num_blocks, 2, 16, 64)
    return dict(q=rng.standard_normal((6, 4, 64), np.float32),
                k_cache=rng.standard_normal(cache, np.float32),
                v_cache=rng.standard_normal(cache, np.float32),
                kv_lens=np.asarray([40, 5], np.int32), block_tables=tables,
                query_start_loc=np.asarray([0, 1, 6], np.int32))


def _smoke_jax() -> dict:
    """The JAX backend's attention (float32) against the jnp reference."""
    import jax.numpy as jnp
    import numpy as np

    from pagedjax.backends.jax.attention import resolve_attention

    impl = resolve_attention("auto")
    attention, name = impl.attention_fn, impl.name
    if name == "reference":
        return {"ran": "reference (nothing to compare on this device)"}
    from pagedjax.kernels_pallas import ragged_paged_attention_reference

    case = {k: jnp.asarray(v) for k, v in _smoke_case(np.random.default_rng(0)).items()}
    got, want = (np.asarray(fn(**case, sm_scale=0.125))
                 for fn in (attention, ragged_paged_attention_reference))
    return {"ran": name, "max_abs_err": float(np.abs(got - want).max())}


def _smoke_torch(backend: str | None) -> dict:
    """The torch ops on the device they serve, against the pure-torch reference."""
    import numpy as np
    import torch

    from pagedjax.kernels_cuda import ops, reference

    if backend in (None, "failed"):
        return {"ran": "nothing: the ops did not build"}
    device = "cuda" if backend == "cuda" else "cpu"
    case = {k: torch.from_numpy(v).to(device)
            for k, v in _smoke_case(np.random.default_rng(0)).items()}
    got = ops.ragged_paged_attention(**case, sm_scale=0.125, max_query_len=5)
    want = reference.ragged_paged_attention(**case, sm_scale=0.125)
    return {"ran": f"{backend} on {device}", "max_abs_err": float((got - want).abs().max())}


def _problems(report: dict) -> list[str]:
    problems = []
    gpu_visible = bool(report["nvidia_smi"])
    for name in ("jax", "torch", "ops_build", "smoke_jax", "smoke_torch"):
        if "error" in report[name]:
            problems.append(f"{name}: {report[name]['error'].splitlines()[0]}")
    if gpu_visible and report["jax"].get("backend") not in ("gpu", None):
        problems.append("nvidia-smi sees a GPU but JAX runs on CPU: install jax with its CUDA "
                        "plugin (jax[cuda13] on CUDA 13 drivers)")
    if gpu_visible and report["torch"].get("cuda_available") is False:
        problems.append("nvidia-smi sees a GPU but torch does not: install a CUDA build of torch")
    if report["ops_build"].get("backend") == "failed":
        problems.append("the CUDA ops build failed (see ops_build.error)")
    for name in ("smoke_jax", "smoke_torch"):
        if report[name].get("max_abs_err", 0.0) > 1e-4:
            problems.append(f"{name}: max abs error {report[name]['max_abs_err']:.2e} > 1e-4")
    return problems


def collect() -> dict:
    """Everything the doctor knows, as plain data."""
    report = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "versions": _versions(),
        "nvidia_smi": nvidia_gpus(),
        "nvcc": shutil.which("nvcc"),
        "ninja": shutil.which("ninja"),
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_HOME",
                                              "TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR",
                                              "XLA_PYTHON_CLIENT_PREALLOCATE")},
        "jax": _probe(_jax_info),
        "torch": _probe(_torch_info),
        "ops_build": _probe(_ops_build),
    }
    report["smoke_jax"] = _probe(_smoke_jax)
    report["smoke_torch"] = _probe(lambda: _smoke_torch(report["ops_build"].get("backend")))
    report["problems"] = _problems(report)
    return report


def format_report(report: dict) -> str:
    """The report as indented `key: value` lines, problems last."""
    lines = []
    for key, value in report.items():
        if key == "problems":
            continue
        if isinstance(value, dict):
            items = [f"  {k}: {v}" for k, v in value.items() if v is not None]
            lines += [f"{key}:", *(items or ["  (none)"])]
        else:
            lines.append(f"{key}: {value}")
    problems = report["problems"]
    lines.append("problems: none" if not problems else "PROBLEMS:")
    lines += [f"  - {problem}" for problem in problems]
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return 1 if report["problems"] else 0
