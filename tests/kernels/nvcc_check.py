"""nvcc compiles of the CUDA sources for the build's archs, started in the background when a
session collects the `nvcc` test and collected by that test.

The compiles are single-threaded and take ~4 min of CPU: they run beside the suite (see
tests/support/background.py), and the test, ordered last (tests/kernels/conftest.py), mostly
finds them done. Each object is kept beside torch's extension builds (ops.build_directory),
named by a hash of what it is made from: the source and the local headers it includes, torch's
version (its headers), nvcc's version and the flags. A source or header changed: that source
compiles again; nothing changed: the test checks the object of the last compile. A failed
compile is never kept.

One process compiles at a time (a lock file): the workers of `pytest -n 2` each start the
compiles, and the second finds the objects the first made.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from pagedjax.kernels_cuda import ops
from tests.support import background

COMPILES = pytest.StashKey[subprocess.Popen]()  # the session's background compiles


def nvcc() -> str | None:
    """nvcc from CUDA_HOME or PATH (torch's CPU wheels do not look for one)."""
    home = os.environ.get("CUDA_HOME") or cpp_extension.CUDA_HOME
    candidate = Path(home) / "bin" / "nvcc" if home else None
    return str(candidate) if candidate and candidate.exists() else shutil.which("nvcc")


def can_compile() -> bool:
    return nvcc() is not None and shutil.which("c++") is not None


def nvcc_command(source: Path, include_dir: Path, output: Path) -> list[str]:
    """torch's own nvcc flags for an extension, with the build's default archs (not a GPU
    machine's TORCH_CUDA_ARCH_LIST: the check is the same everywhere)."""
    includes = [*cpp_extension.include_paths(), str(include_dir)]
    return [nvcc(), "-c", str(source), "-o", str(output),
            *(f"-I{path}" for path in includes), *cpp_extension.COMMON_NVCC_FLAGS, "-std=c++20",
            "-O3", "--compiler-options", "-fPIC", "-DTORCH_EXTENSION_NAME=pagedjax_ops",
            *ops.cuda_arch_flags(ops.DEFAULT_CUDA_ARCHS)]


def _local_files(source: Path) -> list[Path]:
    """source and the headers it includes with quotes, theirs too."""
    found, todo = [], [source]
    while todo:
        path = todo.pop()
        if path not in found:
            found.append(path)
            todo += [(path.parent / name).resolve()
                     for name in re.findall(r'^#include "([^"]+)"', path.read_text(), re.M)]
    return found


def objects() -> dict[str, Path]:
    """CUDA source -> where its object is kept."""
    import torch

    version = subprocess.run([nvcc(), "--version"], capture_output=True, text=True).stdout
    # torch's include paths name the venv it is installed in (a clone's own): its headers are
    # torch.__version__'s, wherever they lie, so a fresh clone finds the objects made before
    torch_root = str(Path(torch.__file__).resolve().parent)
    flags = [flag.replace(torch_root, "TORCH")
             for flag in nvcc_command(Path("SOURCE"), Path("INCLUDE"), Path("OUTPUT"))[1:]]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    out = {}
    for name in ops._CUDA_SOURCES:
        digest = hashlib.sha256(json.dumps([version, torch.__version__, flags]).encode())
        for path in _local_files((ops._CSRC / name).resolve()):
            digest.update(path.relative_to(ops._CSRC.resolve()).as_posix().encode()
                          + path.read_bytes())
        out[name] = root / "pagedjax_nvcc_check" / f"{Path(name).stem}-{digest.hexdigest()[:16]}.o"
    return out


def start_compiles() -> subprocess.Popen:
    """This module as a script, at the lowest CPU priority: it compiles each source whose object
    is not kept yet, and writes what came of each to a file (results() reads it)."""
    results_file = Path(tempfile.mkdtemp(prefix="pagedjax-nvcc-")) / "results.json"
    return background.start_low_priority(
        [sys.executable, "-m", "tests.kernels.nvcc_check", str(results_file)],
        cwd=Path(__file__).resolve().parents[2], stderr=subprocess.DEVNULL)


def results(process: subprocess.Popen, timeout: float) -> dict[str, dict]:
    """Waits for start_compiles' process: source -> {"returncode", "stderr", "object"}."""
    process.wait(timeout=timeout)
    results_file = Path(process.args[-1])
    outcome = json.loads(results_file.read_text())
    shutil.rmtree(results_file.parent, ignore_errors=True)
    return outcome


def stop(process: subprocess.Popen | None) -> None:
    """End the compiles if they still run (their partial outputs are never kept)."""
    if process is not None:
        background.stop([process])
        shutil.rmtree(Path(process.args[-1]).parent, ignore_errors=True)


def _compile(todo: dict[str, Path], scratch: Path) -> dict[str, dict]:
    """One nvcc process per source, at once, in scratch; each object that compiled is moved to
    where it is kept.

    A CPU wheel of torch ships the c10/cuda headers but not the header CMake generates for them:
    a one-line stand-in is written there."""
    generated = scratch / "include" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    generated.parent.mkdir(parents=True)
    generated.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    runs = {}
    for name, kept in todo.items():
        output, log = scratch / kept.name, scratch / f"{kept.name}.log"
        with log.open("w") as stderr:  # a file: a pipe nobody reads would stall nvcc
            command = nvcc_command(ops._CSRC / name, scratch / "include", output)
            runs[name] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    outcome = {}
    for name, process in runs.items():
        kept = todo[name]
        outcome[name] = {"returncode": process.wait(), "object": str(kept),
                         "stderr": (scratch / f"{kept.name}.log").read_text(errors="replace")}
        if outcome[name]["returncode"] == 0:
            os.replace(scratch / kept.name, kept)
    return outcome


def main(results_file: Path) -> None:
    kept = objects()
    folder = next(iter(kept.values())).parent
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session's or worker's compiles finish first
        outcome = {name: {"returncode": 0, "object": str(path), "stderr": "kept"}
                   for name, path in kept.items() if path.is_file()}
        todo = {name: path for name, path in kept.items() if name not in outcome}
        if todo:
            for stale in folder.glob("compiling-*"):  # compiles that were stopped
                shutil.rmtree(stale, ignore_errors=True)
            scratch = Path(tempfile.mkdtemp(prefix="compiling-", dir=folder))
            outcome |= _compile(todo, scratch)
            shutil.rmtree(scratch, ignore_errors=True)
    partial = results_file.with_suffix(".tmp")
    partial.write_text(json.dumps(outcome))
    os.replace(partial, results_file)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
