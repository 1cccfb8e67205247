"""What the Pallas kernel lowers to for an NVIDIA GPU, checked on the CPU.

Every configuration the tests, the models and the benchmarks run compiled (`gpu_configs.py`) is
lowered with interpret=False for the `cuda` platform. Each must become exactly one Triton custom
call (`__gpu$xla.gpu.triton` from jaxlib 0.10.2 and 0.11, `triton_kernel_call_ffi` where jaxlib
compiles to PTX while lowering), with no while/case/if around it (on GPU their predicate would
sync with the host inside every layer). The Triton module of a float32 configuration must
multiply at IEEE float32 precision (HIGHEST), never TF32.

Triton's compile to PTX and a run need a GPU: see the tests marked `gpu`.
"""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl

from pagedjax.kernels_pallas import ragged_paged_attention
from pagedjax.kernels_pallas.ragged_paged_attention import TRITON_CALL_TARGETS, _TritonParams
from tests.kernels.gpu_configs import (
    TEST_CONFIGS,
    KernelConfig,
    benchmark_configs,
    model_configs,
)

_HOST_SYNCING_OPS = re.compile(r"stablehlo\.(while|case|if)\b")
# tt.dot %a, %b, %c[, inputPrecision = tf32] : tensor<MxKxf32> * tensor<KxNxf32> -> ...
_TT_DOT = re.compile(r"tt\.dot [^:]*?(?:inputPrecision = (\w+))?\s*: tensor<[\dx]*x(\w+)>")

ALL_CONFIGS = TEST_CONFIGS + model_configs() + benchmark_configs()


@contextlib.contextmanager
def _gpu_target():
    """jax >= 0.11 asks which GPU it lowers for when none is attached: an abstract H100."""
    if jax.default_backend() == "gpu":
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                         platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


@pytest.fixture
def triton_modules(monkeypatch) -> list[str]:
    """The text of every Triton module lowered while the test runs.

    Wraps jax's (private) Pallas-to-Triton lowering; if jax renames it, this fails loudly.
    """
    from jax._src.pallas.triton import pallas_call_registration as registration

    modules = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def recording_lower(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", recording_lower)
    return modules


def _lower_for_cuda(fn, *args, **kwargs) -> str:
    """StableHLO text of fn lowered for an NVIDIA GPU (no GPU needed)."""
    with _gpu_target():
        return jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()


def _dot_precisions(module: str) -> list[tuple[str, str]]:
    """(input precision, operand element type) of every tt.dot; ieee is the unprinted default."""
    return [(precision or "ieee", dtype) for precision, dtype in _TT_DOT.findall(module)]


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: c.name)
def test_lowers_to_one_triton_call(config: KernelConfig, triton_modules):
    fn = functools.partial(ragged_paged_attention, sm_scale=config.head_dim**-0.5,
                           interpret=False, **config.kwargs)
    hlo = _lower_for_cuda(fn, **config.abstract_args())
    calls = sum(len(re.findall(rf'custom_call @"?{re.escape(target)}"?\(', hlo))
                for target in TRITON_CALL_TARGETS)
    assert calls == 1, f"expected one Triton custom call ({TRITON_CALL_TARGETS}), got {calls}"
    assert not _HOST_SYNCING_OPS.search(hlo), _HOST_SYNCING_OPS.search(hlo).group(0)
    (module,) = triton_modules
    dots = _dot_precisions(module)
    assert len(dots) == 2, dots  # q.k^T and p.v
    if config.dtype == "float32":
        assert dots == [("ieee", "f32")] * 2, f"float32 must not run as TF32: {dots}"


def test_the_precision_check_sees_tf32(triton_modules):
    """Control: a float32 dot at default precision does lower to TF32, so the check can fail."""

    def kernel(x_ref, o_ref):
        o_ref[...] = lax.dot_general(x_ref[...], x_ref[...], (((1,), (0,)), ((), ())))

    fn = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
                        compiler_params=_TritonParams(num_warps=4), interpret=False)
    _lower_for_cuda(fn, jax.ShapeDtypeStruct((16, 16), jnp.float32))
    assert _dot_precisions(triton_modules[-1]) == [("tf32", "f32")]


def test_triton_rejects_tiles_below_16():
    config = TEST_CONFIGS[0]
    fn = functools.partial(ragged_paged_attention, sm_scale=0.1, interpret=False,
                           rows_per_tile=8)
    with pytest.raises(ValueError, match="Triton needs"):
        jax.jit(fn).trace(**config.abstract_args())


def test_the_lists_cover_decode_and_multi_token_paths():
    """Both static paths, every dtype, and the benchmark's decode shape are lowered above."""
    decode = {c.kwargs.get("decode", False) for c in ALL_CONFIGS}
    dtypes = {c.dtype for c in ALL_CONFIGS}
    assert decode == {True, False} and dtypes == {"float32", "bfloat16", "float16"}
    assert any(c.name == "bench-decode-b64-ctx2048" and c.kwargs["decode"]
               and (c.num_q_heads, c.num_kv_heads, c.head_dim, c.block_size) == (32, 8, 128, 16)
               for c in ALL_CONFIGS)
