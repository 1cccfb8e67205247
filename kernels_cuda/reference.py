"""Pure-torch reference of the pagedjax ops: the fallback when the extension cannot be built.

Same semantics as `pagedjax.kernels_pallas.reference` (see its docstring). A Python loop over
sequences, each attended with dense einsums over its gathered context; it reads the metadata on
the host, so it synchronises with the device.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # the largest finite float8 e4m3fn value


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale rounded to float8 e4m3fn (nearest, ties to even), saturated to +-448 (an FP8 KV
    cache's store, vLLM's semantics; torch's own cast would make NaN of what overflows)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def from_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached keys or values as attention reads them, in `dtype`: an fp8 cache's times its
    scale, any other cast."""
    if x.dtype == torch.float8_e4m3fn:
        return x.to(dtype) * scale
    return x.to(dtype)


def ragged_paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, Hkv, bs, D]
    v_cache: torch.Tensor,  # [N, Hkv, bs, D]
    kv_lens: torch.Tensor,  # [S] int32
    block_tables: torch.Tensor,  # [S, M] int32
    query_start_loc: torch.Tensor,  # [S+1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, Hq, D]; padding rows are zeros
    """Attention of each sequence's last q_len tokens over its paged context (causal); an fp8
    cache holds values / scale (k_scale for keys, v_scale for values)."""
    num_q_heads, head_dim = q.shape[1:]
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    starts = query_start_loc.tolist()
    for s, kv_len in enumerate(kv_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        if end == start:
            continue
        blocks = block_tables[s, : -(-kv_len // block_size)].long()
        # [n, Hkv, bs, D] -> [Hkv, n * bs, D] -> the first kv_len keys
        keys = k_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
        values = v_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :kv_len]
        qs = q[start:end].to(acc_dtype).view(end - start, num_kv_heads, group, head_dim)
        keys = from_cache(keys, k_scale, acc_dtype)
        logits = torch.einsum("thgd,hkd->hgtk", qs, keys) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        positions = torch.arange(kv_len - (end - start), kv_len, device=q.device)  # [q_len]
        key_pos = torch.arange(kv_len, device=q.device)  # [kv_len]
        visible = key_pos[None, :] <= positions[:, None]  # [q_len, kv_len]
        if sliding_window is not None:
            visible &= positions[:, None] - key_pos[None, :] < sliding_window
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        attended = torch.einsum("hgtk,hkd->thgd", probs, from_cache(values, v_scale, acc_dtype))
        out[start:end] = attended.reshape(end - start, num_q_heads, head_dim)
    return out.to(q.dtype)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, Hkv, bs, D], written in place
    v_cache: torch.Tensor,  # [N, Hkv, bs, D], written in place
    slot_mapping: torch.Tensor,  # [T], block_id * block_size + offset; -1 = skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter new keys/values into their cache slots; rows with slot -1 are skipped. An fp8
    cache stores k / k_scale and v / v_scale (to_fp8)."""
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    for cache, x, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        rows = x[keep]  # [n, Hkv, D]
        fp8 = cache.dtype == torch.float8_e4m3fn
        cache[blocks, :, offsets] = to_fp8(rows, scale) if fp8 else rows.to(cache.dtype)


def linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
           out_features: int) -> torch.Tensor:
    """x [M, in] @ W [in, out] (+ bias [out]) → [M, out], with W given packed as
    [ceil(out / 16), in, 16] (packed[t, k, j] = W[k, 16 t + j])."""
    tiles, in_features, tile = packed_weight.shape
    weight = packed_weight.transpose(0, 1).reshape(in_features, tiles * tile)[:, :out_features]
    out = x @ weight
    return out if bias is None else out + bias


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w13_packed: torch.Tensor, w2_packed: torch.Tensor,
                intermediate_size: int) -> torch.Tensor:
    """x [T, H] through each token's k experts (topk_ids, topk_weights [T, k]) → [T, H]: from
    zeros, expert by expert in order (HF's loop), weight * (silu(x @ gate) * (x @ up)) @ down
    added into its tokens' rows; w13 [E, ceil(2I / 16), H, 16], w2 [E, ceil(H / 16), I, 16]
    packed per expert as pack_linear_weight packs a weight."""
    hidden, inter = x.shape[1], intermediate_size
    y = torch.zeros_like(x)
    for e in range(w13_packed.shape[0]):
        tokens, choice = torch.nonzero(topk_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = linear(x[tokens], w13_packed[e], None, 2 * inter)  # [n, 2I]
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out = linear(act, w2_packed[e], None, hidden)  # [n, H]
        y.index_add_(0, tokens, out * topk_weights[tokens, choice][:, None])
    return y


def moe_routing(logits: torch.Tensor, k: int, renormalize: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] float32, experts [T, k] int64): the softmax over
    all experts (float32), its top k, divided by their sum where renormalize."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


_BLOCK_BYTES = {8: 34, 2: 18, 3: 20}  # GGML's Q8_0, Q4_0, Q4_1: 32 weights a block


def dequantize(blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """GGML blocks uint8 [N, K / 32 * block bytes] → the float32 weights [N, K] they hold:
    Q8_0 d * q; Q4_0 d * (q - 8); Q4_1 d * q + m (fp16 d, m; nibble j of a Q4 block is byte
    j's low half for j < 16, byte j - 16's high half after)."""
    size = _BLOCK_BYTES[qtype]
    n = blocks.shape[0]
    raw = blocks.reshape(n, in_features // 32, size)
    d = raw[..., :2].contiguous().view(torch.float16).float()  # [N, B, 1]
    if qtype == 8:
        return (d * raw[..., 2:].contiguous().view(torch.int8).float()).reshape(n, in_features)
    nibbles = raw[..., size - 16:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()  # [N, B, 32]
    if qtype == 2:
        return (d * (q - 8)).reshape(n, in_features)
    m = raw[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(n, in_features)


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W [N, K]^T (+ bias) with W the float32 weights GGML blocks hold (the op
    quantizes a few rows of x to int8 blocks: this is the product it approximates)."""
    out = x @ dequantize(blocks, qtype, x.shape[1]).T
    return out if bias is None else out + bias


def rotary_embedding_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [T, H, D] ← x * cos + rotate_half(x) * sin in float32 (HF's), in place; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    x.copy_(x.to(torch.float32) * cos[:, None] + rotated.to(torch.float32) * sin[:, None])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: the variance in float32, the normalised x cast back, then * weight."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (clamp(x / scale) in float8 e4m3 [M, K], scale = max|x| / 448 per row [M, 1],
    1 for a row of zeros): the backends' quantize_fp8 per token, in float32."""
    rows = x.float()
    scale = rows.abs().amax(-1, keepdim=True) / FP8_MAX  # [M, 1]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
