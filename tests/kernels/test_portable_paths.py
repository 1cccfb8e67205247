"""The C++ kernels' portable paths, which a CPU without AVX2 (or not x86) runs, on this machine:
PAGEDJAX_NO_AVX2=1 keeps every kernel off its SIMD paths (cpu_features.h, read once a process),
and the kernel tests run again in a process with it set, each kernel against its reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagedjax.kernels_cuda import ops, ops_backend

pytestmark = pytest.mark.skipif(ops_backend() == "reference", reason="the C++ ops are not built")

KERNEL_TESTS = ["test_cpu_ops.py", "test_cuda_ops.py", "test_cpu_decoder_layer.py",
                "test_moe_experts.py", "test_quant_linear.py", "test_cpu_ffi.py"]
PORTABLE = {**os.environ, "PAGEDJAX_NO_AVX2": "1"}


def test_the_switch_takes_the_portable_linear(tmp_path) -> None:
    """The float linear's portable path multiplies, then adds (no FMA): within float32's
    rounding of float64 math, and, over long dots, not the FMA path's bits."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 1024)).astype(np.float32)
    w = rng.standard_normal((1024, 64)).astype(np.float32)
    packed = ops.pack_linear_weight(torch.from_numpy(w))
    torch.save((torch.from_numpy(x), packed), tmp_path / "case.pt")
    script = ("import sys, torch\n"
              "from pagedjax.kernels_cuda import ops\n"
              "x, packed = torch.load(sys.argv[1])\n"
              "torch.save(ops.linear(x, packed, None, 64), sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "case.pt"),
                    str(tmp_path / "portable.pt")], env=PORTABLE, check=True)
    portable = torch.load(tmp_path / "portable.pt").numpy()
    np.testing.assert_allclose(portable, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-3)
    assert not np.array_equal(portable, ops.linear(torch.from_numpy(x), packed, None, 64).numpy())


@pytest.mark.slow
def test_the_kernel_tests_pass_on_the_portable_paths() -> None:
    """Every CPU kernel test (torch's ops, XLA's FFI handlers, the fused layer, the quantized
    linear's exact NumPy model) once more with PAGEDJAX_NO_AVX2=1."""
    here = os.path.dirname(__file__)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x",
         "-m", "not gpu and not slow and not real_model",
         *(os.path.join(here, name) for name in KERNEL_TESTS)],
        env=PORTABLE, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = re.search(r"^(\d+) passed", result.stdout, re.MULTILINE)
    assert summary is not None and int(summary.group(1)) > 300, result.stdout[-2000:]
