"""How the CUDA extension is built: explicit archs, a cached build folder, a loud failure on a GPU
machine (the pure-torch fallback only without a GPU), and CUDA sources that nvcc compiles for
sm_80 and sm_90. A GPU is simulated where one is needed; nothing here runs a kernel.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from pagedjax.kernels_cuda import ops
from tests.kernels import nvcc_check

_ARCH_FLAGS = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
               "-gencode=arch=compute_90,code=compute_90"]


@pytest.fixture
def simulated_gpu(monkeypatch):
    """torch sees an H100 (sm_90); the CUDA runtime is never called."""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")


def test_arch_flags(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert ops.cuda_arch_flags() == _ARCH_FLAGS
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6 9.0a")
    assert ops.cuda_arch_flags() == ["-gencode=arch=compute_86,code=sm_86",
                                     "-gencode=arch=compute_90a,code=sm_90a"]
    with pytest.raises(ValueError, match="sm90"):
        ops.cuda_arch_flags("sm90")


def test_cuda_build_passes_explicit_archs_to_a_versioned_folder(simulated_gpu, monkeypatch):
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    assert ops._build() == "cuda"
    (kwargs,) = calls
    assert kwargs["with_cuda"] and kwargs["extra_cuda_cflags"][-3:] == _ARCH_FLAGS
    assert any(source.endswith("attention_cuda.cu") for source in kwargs["sources"])
    # torch adds no arch of its own (it would guess from the visible GPU) when flags are given.
    assert cpp_extension._get_cuda_arch_flags(kwargs["extra_cuda_cflags"]) == []
    folder = Path(kwargs["build_directory"]).name
    assert folder.startswith(f"pagedjax_ops_torch{torch.__version__}".replace("+", "_"))
    assert folder.endswith("sm_80_sm_90_compute_90")
    assert ops.build_directory(with_cuda=False) != ops.build_directory(with_cuda=True)


def test_build_links_the_libstdcxx_this_process_loaded(simulated_gpu, monkeypatch):
    """A toolchain that links libstdc++ statically (the GPU machines' /opt/gcc) gave the
    extension its own copy, whose number formatting crashed the first TORCH_CHECK that named a
    number: the build names the loaded libstdc++ first, so every symbol it has comes from it."""
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    ops._build()
    (kwargs,) = calls
    (library,) = kwargs["extra_ldflags"]
    maps = Path("/proc/self/maps").read_text()
    assert "/libstdc++.so" in library and library in maps and Path(library).exists()


@pytest.mark.parametrize("failure", ["build_error", "no_compiler", "old_gpu"])
def test_a_failed_build_on_a_gpu_machine_is_loud(simulated_gpu, monkeypatch, failure):
    """No fallback and no warning: one error that names nvcc, ninja, the archs and the folder."""
    if failure == "build_error":
        error = RuntimeError("nvcc fatal   : Unsupported gpu architecture 'compute_90'")
        monkeypatch.setattr(ops, "_build", lambda: (_ for _ in ()).throw(error))
        expected = "Unsupported gpu architecture"
    elif failure == "no_compiler":
        monkeypatch.setattr(ops.shutil, "which", lambda name: None)
        expected = "no C++ compiler"
    else:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
        expected = "below sm_80"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CPU path's fallback warning would fail here
        with pytest.raises(ops.CudaBuildError) as raised:
            ops.ops_backend.__wrapped__()
    message = str(raised.value)
    for needed in (expected, "nvcc:", "ninja:", "sm_80", "sm_90", "build folder", "H100"):
        assert needed in message, f"{needed!r} missing from: {message}"


def test_a_second_process_reuses_the_cached_build():
    """A second process loads this machine's built extension without rebuilding it."""
    backend = ops.ops_backend()
    assert backend == ("cuda" if torch.cuda.is_available() else "cpp")
    code = "from pagedjax.kernels_cuda import ops; print(ops.ops_backend())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == backend
    assert "building" not in child.stderr


@pytest.mark.nvcc
@pytest.mark.skipif(not nvcc_check.can_compile(),
                    reason="needs the CUDA toolkit (nvcc) and a C++ compiler")
def test_cuda_sources_compile_for_sm80_and_sm90(request):
    """nvcc compiles every .cu file for the build's archs; no GPU needed. The compiles started
    in the background when the session was collected (conftest.py), or earlier for the same
    sources, headers and flags (nvcc_check.py); this test runs last and waits for them."""
    compiles = (request.config.stash.get(nvcc_check.COMPILES, None)
                or nvcc_check.start_compiles())
    results = nvcc_check.results(compiles, timeout=1800)
    assert sorted(results) == sorted(ops._CUDA_SOURCES)
    for name, result in results.items():
        assert result["returncode"] == 0, f"{name}:\n{result['stderr'][-4000:]}"
        fatbin = Path(result["object"]).read_bytes()  # its fat binary names each SASS arch
        assert b"sm_80" in fatbin and b"sm_90" in fatbin
