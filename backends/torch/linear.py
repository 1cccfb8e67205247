"""The torch backend's linear layer: y = x @ W (+ bias), W stored [in, out]; on the CPU in
float32 packed for the C++ `pagedjax::linear`, kept in GGML blocks (quantization="int8" /
"gguf": `pagedjax::quant_linear`) or as float8 with per-channel scales (quantization="fp8":
`torch._scaled_mm`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedjax.backends.common import quantization
from pagedjax.backends.common.weight_quantizer import WeightQuantizer
from pagedjax.kernels_cuda import (
    linear,
    ops_backend,
    pack_linear_weight,
    quant_linear,
    quantize_fp8_per_token,
)


class Linear(nn.Module):
    """y = x @ weight (+ bias) with weight stored [in, out]: a single-token (GEMV) step streams
    the weight row by row into the output, ~1.6x faster on CPU than nn.Linear's [out, in].

    On the CPU in float32, `pack()` moves the weight to the tile-major layout of the
    `pagedjax::linear` op (kernels_cuda/csrc/cpu/torch/linear_cpu.cpp), which runs the few-row
    products of decode steps at close to memory bandwidth.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed = False  # weight is [in, out]; packed: [ceil(out / 16), in, 16]
        self.qtype: int | None = None  # quantized: weight is GGML blocks [out, in / 32 * bytes]

    @classmethod
    def packed_from(cls, weight: torch.Tensor) -> Linear:
        """A packed bias-free Linear computing x @ weight, weight [in, out] (copied)."""
        with torch.device("meta"):
            module = cls(*weight.shape)
        module.weight = nn.Parameter(weight, requires_grad=False)
        module.pack()
        return module

    def pack(self) -> None:
        self.weight = nn.Parameter(pack_linear_weight(self.weight), requires_grad=False)
        self.packed = True

    def keep_quantized(self, quantizer: WeightQuantizer, label: str) -> None:
        """The blocks `quantizer` keeps for this weight, else the weight packed."""
        kept = quantizer(label, self.weight.detach().T.float().numpy())  # [out, in]
        if kept is None:
            self.pack()
        else:
            self.keep_blocks(*kept)

    def keep_fp8(self) -> bool:
        """quantization="fp8": the weight as float8 e4m3 [out, in] with a float32 scale per
        output channel (weight_scale [1, out]; quantization.quantize_fp8), x quantized per token
        at each call (`fp8_linear`); False (left as it is) where in or out is not a multiple of
        16, as cuBLASLt's FP8 GEMM needs."""
        in_features, out_features = self.weight.shape
        if in_features % 16 or out_features % 16:
            return False
        device = self.weight.device
        q, scale = quantization.quantize_fp8(self.weight.detach().T.float().cpu().numpy())
        # [out, in] in rows: its transpose, _scaled_mm's second operand, must be column-major
        # for cuBLASLt (q keeps the transposed view's column order otherwise)
        fp8 = torch.from_numpy(np.ascontiguousarray(q).view(np.uint8)).view(torch.float8_e4m3fn)
        self.weight = nn.Parameter(fp8.to(device), requires_grad=False)  # [out, in]
        self.weight_scale = nn.Parameter(torch.from_numpy(scale)[None].to(device),
                                         requires_grad=False)  # [1, out]
        return True

    def keep_blocks(self, qtype: int, blocks: np.ndarray) -> None:
        """The weight as these GGML blocks of qtype ([out, in / 32 * block bytes], or
        interleaved in groups of 8 rows: the C++ kernel's layout, put back in rows where the
        C++ ops are not built and the pure-torch fallback reads them)."""
        in_features = self.weight.shape[0]  # the float weight's [in, out]
        if (ops_backend() == "reference"
                and quantization.layout_of_blocks(blocks.shape, in_features)[2]):
            blocks = quantization.deinterleave_rows(blocks, qtype)
        self.weight = nn.Parameter(torch.from_numpy(np.ascontiguousarray(blocks)),
                                   requires_grad=False)
        self.qtype = qtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qtype is not None:
            return quant_linear(x, self.weight, self.qtype, self.bias)
        if self.weight.dtype == torch.float8_e4m3fn:
            return fp8_linear(x, self.weight, self.weight_scale, self.bias)
        if self.packed:
            return linear(x, self.weight, self.bias, self.out_features)
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x, self.weight)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) → [..., N] in x's dtype, W float8 e4m3 [N, K] with
    weight_scale [1, N]: each row of x quantized to e4m3 with its own scale (max|x| / 448, the
    backends' quantize_fp8), then one FP8 GEMM scaled per row and per column (torch._scaled_mm:
    cuBLASLt on Hopper, whose row-wise scaling writes bfloat16)."""
    q, scale = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]))  # [M, K] e4m3, [M, 1]
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    y = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale,
                         out_dtype=out_dtype).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])
