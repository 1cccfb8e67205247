"""Weights kept quantized, in GGML's blocks of 32 along the input dimension (a GGUF file's own
bytes), in NumPy: the formats, quantizing a float weight into them and dequantizing back. The
CPU kernels read the blocks as they are (kernels_cuda/csrc/cpu/kernels/quant_linear_kernel.h).

A weight [N, K] (HF's [out, in]) becomes uint8 [N, K / 32 * block_bytes]: row n's blocks in
order along K, each
    Q8_0: fp16 d, int8 q[32]                    w = d * q
    Q4_0: fp16 d, 16 bytes of nibbles           w = d * (q - 8)
    Q4_1: fp16 d, fp16 m, 16 bytes of nibbles   w = d * q + m
(nibble j is byte j's low half for j < 16, byte j - 16's high half after). int8 weight-only
quantization, symmetric per output channel (`quantization="int8"`), is Q8_0 with the channel's
scale in each of its row's blocks.

FP8 W8A8 (`quantization="fp8"`, vLLM's dynamic FP8) is not blocks: each weight [N, K] becomes
float8 e4m3 with one float32 scale per output channel, w = scale[n] * q[n, k]; the backends
quantize each row of x per token on the fly (quantize_fp8 over its last axis) and multiply fp8
by fp8 (cuBLASLt on Hopper GPUs).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 32
# GGML's type ids, as a GGUF tensor names its type
Q4_0, Q4_1, Q8_0 = 2, 3, 8
QTYPE_NAMES = {Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1"}
_BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20}


def block_bytes(qtype: int) -> int:
    if qtype not in _BLOCK_BYTES:
        raise ValueError(f"qtype={qtype} is not a kept block type; use one of "
                         f"{ {v: k for k, v in QTYPE_NAMES.items()} }.")
    return _BLOCK_BYTES[qtype]


def qtype_of_blocks(row_bytes: int, in_features: int) -> int:
    """The type of a row of blocks [row_bytes] over in_features weights (each type's block has
    its own size: 34, 18 or 20 bytes)."""
    per_block, rest = divmod(row_bytes, max(in_features // BLOCK, 1))
    qtype = next((q for q, size in _BLOCK_BYTES.items() if size == per_block), None)
    if rest or in_features % BLOCK or qtype is None:
        raise ValueError(f"{row_bytes} bytes a row are no blocks of a kept type over "
                         f"{in_features} weights; expected in_features / 32 x (34, 18 or 20).")
    return qtype


def _blocks_of(weight: np.ndarray) -> np.ndarray:
    """[N, K] float → [N, K / 32, 32] float32."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"in_features={k} is not a multiple of the block size {BLOCK}.")
    return np.asarray(weight, np.float32).reshape(n, k // BLOCK, BLOCK)


def _pack(scales: list[np.ndarray], values: np.ndarray) -> np.ndarray:
    """fp16 scales [N, B] each and the value bytes [N, B, V] → uint8 [N, B * (2 len + V)]."""
    parts = [s.astype(np.float16)[..., None].view(np.uint8) for s in scales]
    n, b = values.shape[:2]
    return np.concatenate(parts + [values.view(np.uint8)], axis=-1).reshape(n, -1)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[N, B, 32] in 0..15 → [N, B, 16] bytes (low: 0..15, high: 16..31)."""
    q = q.astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def quantize_q8_0(weight: np.ndarray) -> np.ndarray:
    """GGML's Q8_0: per block d = max|w| / 127, q = round(w / d)."""
    x = _blocks_of(weight)
    d = np.abs(x).max(-1) / 127
    inverse = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
    q = np.rint(x * inverse[..., None]).astype(np.int8)
    return _pack([d], q)


def quantize_int8_per_channel(weight: np.ndarray) -> np.ndarray:
    """Symmetric int8 per output channel: d = max|w_n| / 127 (as fp16) for the whole row,
    q = round(w / d) in [-127, 127], in Q8_0's layout."""
    x = _blocks_of(weight)
    d = (np.abs(x).max((1, 2)) / 127).astype(np.float16).astype(np.float32)  # [N]
    inverse = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.rint(x * inverse[:, None, None]), -127, 127).astype(np.int8)
    return _pack([np.broadcast_to(d[:, None], x.shape[:2])], q)


def quantize_q4_0(weight: np.ndarray) -> np.ndarray:
    """GGML's Q4_0: d = (the largest-magnitude w) / -8, q = clip(w / d + 8.5, 0, 15)."""
    x = _blocks_of(weight)
    index = np.abs(x).argmax(-1)[..., None]
    d = np.take_along_axis(x, index, -1)[..., 0] / -8
    inverse = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, (x * inverse[..., None] + 8.5).astype(np.int8))
    return _pack([d], _nibbles(q))


def quantize_q4_1(weight: np.ndarray) -> np.ndarray:
    """GGML's Q4_1: m = min w, d = (max w - m) / 15, q = clip((w - m) / d + 0.5, 0, 15)."""
    x = _blocks_of(weight)
    low, high = x.min(-1), x.max(-1)
    d = (high - low) / 15
    inverse = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, ((x - low[..., None]) * inverse[..., None] + 0.5).astype(np.int8))
    return _pack([d, low], _nibbles(q))


QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0, "Q4_1": quantize_q4_1,
              "int8": quantize_int8_per_channel}
QTYPE_OF = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1, "int8": Q8_0}


FP8_DTYPE = ml_dtypes.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


def quantize_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., K] → (q [..., K] float8 e4m3, scale [...] float32): scale = max|x| / 448 over
    the last axis (1 where it is 0), q = x / scale rounded to nearest (never past ±448: a cast
    of a larger value would be NaN)."""
    x = np.asarray(x, np.float32)
    scale = np.abs(x).max(-1) / np.float32(FP8_MAX)
    scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
    q = np.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q, scale


def unpack(blocks: np.ndarray, qtype: int, in_features: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint8 [N, bytes] → (int8 weights [N, B, 32] as the kernels see them: Q4_0 recentred to
    -8..7, Q4_1 0..15; scales d [N, B] float32; offsets m [N, B] float32, zero but for Q4_1)."""
    size = block_bytes(qtype)
    n = blocks.shape[0]
    raw = np.ascontiguousarray(blocks).reshape(n, in_features // BLOCK, size)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = np.zeros_like(d)
    if qtype == Q8_0:
        return raw[..., 2:].copy().view(np.int8), d, m
    if qtype == Q4_1:
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = raw[..., size - 16:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int8)
    return (q - 8 if qtype == Q4_0 else q).astype(np.int8), d, m


def dequantize(blocks: np.ndarray, qtype: int, in_features: int) -> np.ndarray:
    """The float32 weight [N, K] the blocks hold."""
    q, d, m = unpack(blocks, qtype, in_features)
    w = d[..., None] * q.astype(np.float32) + m[..., None]
    return w.reshape(blocks.shape[0], in_features).astype(np.float32)
