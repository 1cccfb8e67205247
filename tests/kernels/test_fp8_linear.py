"""FP8 W8A8 (quantization="fp8"): weights float8 e4m3 with a scale per output channel, each row
of x quantized per token at each call, one fp8 x fp8 product scaled per row and per column:
- both backends' products (torch._scaled_mm, XLA's dot over float8) equal a NumPy model of that
  arithmetic (the products of two e4m3 values are exact in float32; only the sums' order
  differs), padding rows (zeros) giving zeros;
- the quantization saturates at ±448 instead of overflowing to NaN;
- the jax product lowered for CUDA is a dot over f8E4M3FN operands (cuBLASLt's FP8 GEMM on
  Hopper: checked in the compiled HLO on a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pagedjax.backends.common import quantization as quant
from pagedjax.backends.jax.linear import fp8_dot
from pagedjax.backends.torch.linear import fp8_linear


def numpy_model(x: np.ndarray, q_w: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """x [M, K] float32, q_w [N, K] e4m3, w_scale [N] → [M, N] in float64 over the quantized
    values (the exact products, summed exactly)."""
    q_x, x_scale = quant.quantize_fp8(x)
    dot = q_x.astype(np.float64) @ q_w.astype(np.float64).T
    return dot * x_scale[:, None] * w_scale[None]


def case(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n, k = 48, 64
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2, (n, 1))).astype(np.float32)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 30, (rows, 1))).astype(np.float32)
    x[-1] = 0  # a padding row
    q_w, w_scale = quant.quantize_fp8(w)
    return x, w, q_w, w_scale


def test_quantize_fp8_saturates_and_rounds_to_nearest() -> None:
    x = np.array([[448.0, -1000.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    q, scale = quant.quantize_fp8(x)
    np.testing.assert_array_equal(scale, np.float32([1000 / 448, 1.0]))
    assert not np.isnan(q.astype(np.float32)).any()
    assert q.astype(np.float32)[0, 1] == -448  # the row's maximum maps to e4m3's largest
    torch_q = (torch.from_numpy(x[:1]) / torch.from_numpy(scale[:1, None])).to(
        torch.float8_e4m3fn)
    np.testing.assert_array_equal(torch_q.float().numpy(), q[:1].astype(np.float32))


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_torchs_scaled_mm_is_the_model(rows: int) -> None:
    x, _, q_w, w_scale = case(rows, rows)
    weight = torch.from_numpy(q_w.view(np.uint8)).view(torch.float8_e4m3fn)  # [N, K]
    bias = torch.arange(48, dtype=torch.float32)
    got = fp8_linear(torch.from_numpy(x), weight, torch.from_numpy(w_scale)[None], bias).numpy()
    expected = numpy_model(x, q_w, w_scale) + bias.numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got[-1], bias.numpy())  # a zero row: the bias alone


@pytest.mark.parametrize("rows", [1, 7, 33])
def test_jaxs_float8_dot_is_the_model(rows: int) -> None:
    x, _, q_w, w_scale = case(rows, rows)
    got = np.asarray(jax.jit(fp8_dot)(x, jnp.asarray(np.ascontiguousarray(q_w.T)), w_scale))
    np.testing.assert_allclose(got, numpy_model(x, q_w, w_scale), rtol=1e-5, atol=1e-4)
    assert not got[-1].any()


def test_the_product_approximates_the_float_one_as_e4m3_allows() -> None:
    """Three mantissa bits: each of x and w within 1/16 relative (half a step)."""
    x, w, q_w, w_scale = case(16)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    got = np.asarray(fp8_dot(x, jnp.asarray(np.ascontiguousarray(q_w.T)), w_scale))
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T * (2 * 2**-4 + 2**-8)
    assert (np.abs(got - exact) <= bound + 1e-6).all()


def test_lowered_for_cuda_it_is_a_float8_dot() -> None:
    x, _, q_w, w_scale = case(4)
    kernel = jnp.asarray(np.ascontiguousarray(q_w.T))
    text = jax.jit(fp8_dot).trace(x, kernel, w_scale).lower(
        lowering_platforms=("cuda",)).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and "f8E4M3FN" in dots[0] and "-> tensor<4x48xf32>" in dots[0]


@pytest.mark.gpu
def test_on_hopper_xla_runs_cublaslts_fp8_gemm() -> None:
    x, _, q_w, w_scale = case(16)
    kernel = jnp.asarray(np.ascontiguousarray(q_w.T))
    compiled = jax.jit(fp8_dot).lower(x, kernel, w_scale).compile()
    assert "cublas$lt$matmul$f8" in compiled.as_text()
    got = np.asarray(compiled(x, kernel, w_scale))
    np.testing.assert_allclose(got, numpy_model(x, q_w, w_scale), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_on_hopper_torchs_scaled_mm_runs() -> None:
    x, _, q_w, w_scale = case(16)
    weight = torch.from_numpy(q_w.view(np.uint8)).view(torch.float8_e4m3fn).cuda()
    got = fp8_linear(torch.from_numpy(x).cuda().bfloat16(), weight,
                     torch.from_numpy(w_scale)[None].cuda(), None)
    assert got.dtype == torch.bfloat16
    np.testing.assert_allclose(got.float().cpu().numpy(), numpy_model(x, q_w, w_scale),
                               rtol=2e-2, atol=5e-2)
