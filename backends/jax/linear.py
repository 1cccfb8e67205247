"""The JAX backend's linear layers: `Dense` (XLA's dot; float8 weights with per-channel scales
under quantization="fp8": `fp8_dot`) and `PackedLinear` (the C++ CPU linear through XLA's FFI,
float32 or GGML blocks), and `dense` choosing between them."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from pagedjax.backends.common import quantization


def matmul_precision(dtype: jnp.dtype) -> jax.lax.Precision | None:
    """float32 means float32: NVIDIA GPUs would otherwise round matmul inputs to TF32."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


class PackedLinear(nn.Module):
    """Dense's y = x @ kernel (+ bias) with the kernel held in the C++ kernel's tile-major layout
    [ceil(out / 16), in, 16] (`pack_params`), through XLA's FFI: CPU, float32. XLA's own dots
    ran the decode step's few-row products at ~half the FMA peak (backends/jax/cpu_ffi.py).
    Where pack_params kept the weight quantized, its parameter is "blocks" instead (GGML's,
    uint8 [out, in / 32 * block bytes]) and the product cpu_ffi.quant_linear's."""

    features: int
    dtype: jnp.dtype
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        """num_rows: compute only the first rows of x, the rest zeros (cpu_ffi.linear)."""
        from pagedjax.backends.jax import cpu_ffi

        x = x.astype(self.dtype)
        if self.has_variable("params", "blocks"):
            y = cpu_ffi.quant_linear(x, self.get_variable("params", "blocks"), x.shape[-1],
                                     num_rows)
        else:
            tiles = -(-self.features // cpu_ffi.LINEAR_TILE)
            kernel = self.param("kernel", nn.initializers.zeros,
                                (tiles, x.shape[-1], cpu_ffi.LINEAR_TILE), self.dtype)
            y = cpu_ffi.linear(x, kernel, self.features, num_rows)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class Dense(nn.Module):
    """nn.Dense's y = x @ kernel (+ bias) (params "kernel" [in, out], "bias" [out]). Where the
    params hold a "weight_scale" [out] (quantization="fp8": fp8_params), the kernel is float8
    e4m3 [out, in] and each row of x is quantized per token: y = (q_x @ q_w^T) * scale_x *
    scale_w, an fp8 x fp8 dot that XLA runs as cuBLASLt's FP8 GEMM on Hopper."""

    features: int
    dtype: jnp.dtype
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        contract = (((x.ndim - 1,), (0,)), ((), ()))
        if self.has_variable("params", "weight_scale"):
            y = fp8_dot(x, self.get_variable("params", "kernel"),
                        self.get_variable("params", "weight_scale")).astype(self.dtype)
        else:
            kernel = self.param("kernel", nn.initializers.lecun_normal(),
                                (x.shape[-1], self.features), self.dtype)
            y = jax.lax.dot_general(x.astype(self.dtype), kernel, contract,
                                    precision=matmul_precision(self.dtype))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


def fp8_dot(x: jax.Array, kernel: jax.Array, weight_scale: jax.Array) -> jax.Array:
    """x [..., K] @ kernel^T (float8 e4m3 [N, K], weight_scale [N]) → float32 [..., N]: x's
    rows quantized to e4m3 with a scale each (max|x| / 448: quantization.quantize_fp8's). Both
    operands contract their minor dimension (K), the only layout cuBLASLt's FP8 GEMM takes."""
    rows = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(rows), axis=-1, keepdims=True) / quantization.FP8_MAX  # [..., 1]
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(rows / scale, -quantization.FP8_MAX, quantization.FP8_MAX).astype(kernel.dtype)
    y = jax.lax.dot_general(q, kernel, (((x.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y * scale * weight_scale


def dense(features: int, name: str | None, dtype: jnp.dtype, bias: bool = False,
          packed: bool = False) -> nn.Module:
    if packed:
        return PackedLinear(features, dtype, bias, name=name)
    return Dense(features, dtype, bias, name=name)
