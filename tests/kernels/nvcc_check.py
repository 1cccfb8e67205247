"""nvcc compiles of the CUDA sources for the build's archs, started in the background when a
session collects the `nvcc` test and collected by that test.

The compiles are single-threaded and take ~4 min of CPU: they run beside the suite (see
tests/support/background.py), and the test, ordered last (tests/kernels/conftest.py), mostly
finds them done.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from pagedjax.kernels_cuda import ops
from tests.support import background

COMPILES = pytest.StashKey[list["Compile"]]()  # the session's background compiles


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


@dataclass
class Compile:
    command: list[str]
    output: Path
    log: Path  # its stderr (a file: a pipe nobody reads until the test would stall it)
    process: subprocess.Popen

    def wait(self, timeout: float) -> tuple[int, str]:
        """(return code, stderr)."""
        self.process.wait(timeout=timeout)
        return self.process.returncode, self.log.read_text(errors="replace")


def start_compiles(folder: Path | None = None) -> list[Compile]:
    """One nvcc process per CUDA source, at the lowest CPU priority, outputs under folder.

    A CPU wheel of torch ships the c10/cuda headers but not the header CMake generates for them:
    a one-line stand-in is written there.
    """
    folder = Path(folder or tempfile.mkdtemp(prefix="pagedjax-nvcc-"))
    generated = folder / "include" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    generated.parent.mkdir(parents=True, exist_ok=True)
    generated.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    compiles = []
    for name in ops._CUDA_SOURCES:
        output, log = folder / f"{Path(name).name}.o", folder / f"{Path(name).name}.log"
        command = nvcc_command(ops._CSRC / name, folder / "include", output)
        with log.open("w") as stderr:
            process = background.start_low_priority(command, stderr=stderr)
        compiles.append(Compile(command, output, log, process))
    return compiles


def stop(compiles: list[Compile]) -> None:
    """End the compiles still running and delete their folder."""
    background.stop([c.process for c in compiles])
    for folder in {c.output.parent for c in compiles}:
        shutil.rmtree(folder, ignore_errors=True)
