"""Torch custom ops of pagedjax: ragged paged attention and the KV-cache write (CUDA + C++ CPU),
and the CPU ops of the rest of a decoder layer (linear over packed weights or quantized blocks,
rotary embedding, RMSNorm with the residual add, SiLU-and-mul, a mixture of experts' routing
and expert block), and FP8 W8A8's per-token activation quantization (CUDA)."""

from pagedjax.kernels_cuda.ops import (
    decode_attention_with_kv_write,
    fused_add_rms_norm,
    linear,
    moe_experts,
    moe_routing,
    ops_backend,
    pack_linear_weight,
    pack_moe_weights,
    quant_linear,
    quantize_fp8_per_token,
    ragged_paged_attention,
    rms_norm,
    rotary_embedding_,
    silu_and_mul,
    write_kv,
)

__all__ = ["decode_attention_with_kv_write", "fused_add_rms_norm", "linear", "moe_experts",
           "moe_routing", "ops_backend",
           "pack_linear_weight", "pack_moe_weights", "quant_linear", "quantize_fp8_per_token",
           "ragged_paged_attention", "rms_norm", "rotary_embedding_", "silu_and_mul", "write_kv"]
