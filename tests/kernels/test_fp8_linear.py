"""FP8 W8A8 (quantization="fp8"): weights float8 e4m3 with a scale per output channel, each row
of x quantized per token at each call, one fp8 x fp8 product scaled per row and per column:
- both backends' products (torch._scaled_mm, XLA's dot over float8) equal a NumPy model of that
  arithmetic (the products of two e4m3 values are exact in float32; only the sums' order
  differs), padding rows (zeros) giving zeros;
- the quantization saturates at ±448 instead of overflowing to NaN;
- the jax product lowered for CUDA is a dot over f8E4M3FN operands, and compiled on a GPU its
  GEMM reads float8 operands."""

from __future__ import annotations

import re

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


def gemm_operand_types(hlo: str) -> list[list[str]]:
    """The operand types of each dot and custom call in a compiled module's text (which names
    operands without their types), computation by computation."""
    found = []
    for computation in re.split(r"\n\s*\n", hlo):
        types = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.-]+) = (\S+)", computation, re.M))
        for args in re.findall(r"\b(?:dot|custom-call)\(([^)]*)\)", computation):
            found.append([types.get(op.split()[-1], op) for op in args.split(", ")])
    return found


def test_the_compiled_gemms_operand_types_are_read() -> None:
    """gemm_operand_types on XLA:CPU's compiled fp8 product: a dot over widened float32 copies
    (so the GPU test below can fail)."""
    x, _, q_w, _ = case(4)
    hlo = jax.jit(lambda a, b: jnp.dot(a.astype(b.dtype), b,
                                       preferred_element_type=jnp.float32)).lower(
        x, jnp.asarray(np.ascontiguousarray(q_w.T))).compile().as_text()
    assert gemm_operand_types(hlo) == [["f32[4,64]{1,0}", "f32[64,48]{1,0}"]]


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
    got = np.asarray(jax.jit(fp8_dot)(x, jnp.asarray(q_w), w_scale))
    np.testing.assert_allclose(got, numpy_model(x, q_w, w_scale), rtol=1e-5, atol=1e-4)
    assert not got[-1].any()


def test_the_product_approximates_the_float_one_as_e4m3_allows() -> None:
    """Three mantissa bits: each of x and w within 1/16 relative (half a step)."""
    x, w, q_w, w_scale = case(16)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    got = np.asarray(fp8_dot(x, jnp.asarray(q_w), w_scale))
    bound = np.abs(x).astype(np.float64) @ np.abs(w).T * (2 * 2**-4 + 2**-8)
    assert (np.abs(got - exact) <= bound + 1e-6).all()


def test_lowered_for_cuda_it_is_a_float8_dot_over_both_minor_dimensions() -> None:
    """x [M, K] and the weight [N, K] each contract their minor dimension: the "TN" layout, the
    only one cuBLASLt's FP8 GEMM takes (a weight kept [K, N] is transposed by XLA in every
    step: the H200 run of 2026-12-04 found the fp8 step 1 ms slower than bf16's)."""
    x, _, q_w, w_scale = case(4)
    text = jax.jit(fp8_dot).trace(x, jnp.asarray(q_w), w_scale).lower(
        lowering_platforms=("cuda",)).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and "f8E4M3FN" in dots[0] and "-> tensor<4x48xf32>" in dots[0]
    assert "tensor<48x64xf8E4M3FN>" in dots[0], dots[0]
    assert "contracting_dims = [1] x [1]" in dots[0], dots[0]


@pytest.mark.gpu
def test_on_hopper_xlas_gemm_reads_float8_operands() -> None:
    x, _, q_w, w_scale = case(16)
    kernel = jnp.asarray(q_w)
    compiled = jax.jit(fp8_dot).lower(x, kernel, w_scale).compile()
    # the GEMM reads both operands as float8 (cuBLASLt's custom call, or a dot in a GEMM fusion),
    # not widened copies (XLA:CPU's choice; the H200 run of 2026-12-04 found no cuBLASLt call)
    gemms = gemm_operand_types(compiled.as_text())
    assert any(all(t.startswith("f8e4m3fn[") for t in types) for types in gemms), gemms
    got = np.asarray(compiled(x, kernel, w_scale))
    np.testing.assert_allclose(got, numpy_model(x, q_w, w_scale), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_bfloat16_x_is_quantized_from_its_bfloat16_values(device: str) -> None:
    """A model's bfloat16 activations: each row quantized from the bfloat16 values it holds (not
    the float32 ones they were rounded from: a second rounding moves ~1 in 5 outputs past 2 %,
    which the H200 run of 2026-12-04 showed), the product written in bfloat16 (cuBLASLt's
    row-wise scaling on Hopper)."""
    x, _, q_w, w_scale = case(16)
    x_bf16 = torch.from_numpy(x).bfloat16()
    weight = torch.from_numpy(q_w.view(np.uint8)).view(torch.float8_e4m3fn).to(device)
    got = fp8_linear(x_bf16.to(device), weight, torch.from_numpy(w_scale)[None].to(device), None)
    assert got.dtype == torch.bfloat16
    expected = numpy_model(x_bf16.float().numpy(), q_w, w_scale)
    np.testing.assert_allclose(got.float().cpu().numpy(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_per_token_quantization_is_quantize_fp8_exactly(device: str, dtype) -> None:
    """kernels_cuda.quantize_fp8_per_token (one CUDA kernel in a CUDA build, the reference
    elsewhere) equals the NumPy quantize_fp8 bit for bit: a row of zeros (scale 1), a row past
    ±448, an odd width, rows wider than the kernel's threads."""
    from pagedjax.kernels_cuda import quantize_fp8_per_token

    rng = np.random.default_rng(11)
    for shape in [(4, 2048), (1, 8192), (3, 80)]:
        x = rng.standard_normal(shape).astype(np.float32)
        x[0] = 0.0
        if shape[0] > 2:
            x[2] *= 1e3
        x_t = torch.from_numpy(x).to(dtype)
        q, scale = quantize_fp8_per_token(x_t.to(device))
        want_q, want_scale = quant.quantize_fp8(x_t.float().numpy())
        assert q.dtype == torch.float8_e4m3fn and q.shape == shape
        assert scale.dtype == torch.float32 and scale.shape == (shape[0], 1)
        np.testing.assert_array_equal(scale.cpu().numpy()[:, 0], want_scale)
        np.testing.assert_array_equal(q.cpu().view(torch.uint8).numpy(),
                                      want_q.view(np.uint8))
