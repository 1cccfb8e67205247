"""Weights kept quantized, in GGML's blocks of 32 along the input dimension (a GGUF file's own
bytes), in NumPy: the formats, quantizing a float weight into them and dequantizing back. The
CPU kernels read the blocks as they are, row after row or interleaved (below;
kernels_cuda/csrc/cpu/kernels/quant_linear_kernel.h).

A weight [N, K] (HF's [out, in]) becomes uint8 [N, K / 32 * block_bytes]: row n's blocks in
order along K, each
    Q8_0: fp16 d, int8 q[32]                    w = d * q
    Q4_0: fp16 d, 16 bytes of nibbles           w = d * (q - 8)
    Q4_1: fp16 d, fp16 m, 16 bytes of nibbles   w = d * q + m
(nibble j is byte j's low half for j < 16, byte j - 16's high half after). int8 weight-only
quantization, symmetric per output channel (`quantization="int8"`), is Q8_0 with the channel's
scale in each of its row's blocks.

The CPU kernels also read the same bytes interleaved (`interleave_rows`, N a multiple of 8):
uint8 [N / 8, 8 * K / 32 * block_bytes], each group of 8 rows block by block: the 8 rows' d,
for Q4_1 their m, then their quants 4 bytes at a time (bytes 4t..4t+3 of each row, row after
row, for t in order). A 32-byte load then holds the same 4 bytes of 8 rows, whose dots land in
the 8 lanes of one register. The two layouts are told apart by the blocks' shape.

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


GROUP = 8  # rows of an interleaved group


def layout_of_blocks(shape: tuple[int, ...], in_features: int) -> tuple[int, int, bool]:
    """(qtype, out_features, interleaved) of blocks of this 2-D shape over in_features weights
    a row (each type's block has its own size: 34, 18 or 20 bytes; interleaved, 8 rows' worth
    a row of the array)."""
    num_blocks = max(in_features // BLOCK, 1)
    if len(shape) == 2 and in_features % BLOCK == 0 and shape[1] % num_blocks == 0:
        per_block = shape[1] // num_blocks
        for qtype, size in _BLOCK_BYTES.items():
            if per_block == size:
                return qtype, shape[0], False
            if per_block == GROUP * size:
                return qtype, shape[0] * GROUP, True
    raise ValueError(f"blocks of shape {tuple(shape)} are no blocks of a kept type over "
                     f"{in_features} weights a row; expected [out, in_features / 32 x (34, 18 or "
                     f"20)] or interleaved [out / 8, 8 x that].")


def qtype_of_blocks(shape: tuple[int, ...], in_features: int) -> int:
    """The GGML type of blocks of this shape (either layout) over in_features weights a row."""
    return layout_of_blocks(shape, in_features)[0]


def _quants_at(qtype: int) -> int:
    """Where a block's quants start (after d, and Q4_1's m)."""
    return block_bytes(qtype) - (32 if qtype == Q8_0 else 16)


def interleave_rows(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """GGUF's rows of blocks uint8 [N, B * size] (N a multiple of 8) → the interleaved layout
    [N / 8, 8 * B * size] (the module doc's), the same bytes moved."""
    n, row_bytes = blocks.shape
    size, head = block_bytes(qtype), _quants_at(qtype)
    if n % GROUP:
        raise ValueError(f"{n} rows do not interleave in groups of {GROUP}")
    raw = np.ascontiguousarray(blocks).reshape(n // GROUP, GROUP, row_bytes // size, size)
    raw = raw.transpose(0, 2, 1, 3)  # [G, B, 8 rows, size]
    halves = raw[..., :head].reshape(*raw.shape[:3], head // 2, 2)  # d (and m) per row
    halves = halves.transpose(0, 1, 3, 2, 4)  # [G, B, d or m, 8 rows, 2]
    quads = raw[..., head:].reshape(*raw.shape[:3], -1, 4).transpose(0, 1, 3, 2, 4)
    chunk = np.concatenate([halves.reshape(*raw.shape[:2], -1),
                            quads.reshape(*raw.shape[:2], -1)], axis=-1)  # [G, B, 8 * size]
    return np.ascontiguousarray(chunk.reshape(n // GROUP, -1))


def deinterleave_rows(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """interleave_rows' inverse: [N / 8, 8 * B * size] → GGUF's rows [N, B * size]."""
    groups, group_bytes = blocks.shape
    size, head = block_bytes(qtype), _quants_at(qtype)
    num_blocks = group_bytes // (GROUP * size)
    chunk = np.ascontiguousarray(blocks).reshape(groups, num_blocks, GROUP * size)
    halves = chunk[..., :GROUP * head].reshape(groups, num_blocks, head // 2, GROUP, 2)
    quads = chunk[..., GROUP * head:].reshape(groups, num_blocks, -1, GROUP, 4)
    raw = np.concatenate([halves.transpose(0, 1, 3, 2, 4).reshape(groups, num_blocks, GROUP, -1),
                          quads.transpose(0, 1, 3, 2, 4).reshape(groups, num_blocks, GROUP, -1)],
                         axis=-1)  # [G, B, 8 rows, size]
    return np.ascontiguousarray(raw.transpose(0, 2, 1, 3).reshape(groups * GROUP, -1))


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
    """uint8 [N, bytes] (or interleaved) → (int8 weights [N, B, 32] as the kernels see them:
    Q4_0 recentred to -8..7, Q4_1 0..15; scales d [N, B] float32; offsets m [N, B] float32,
    zero but for Q4_1)."""
    if layout_of_blocks(blocks.shape, in_features)[2]:
        blocks = deinterleave_rows(blocks, qtype)
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
    return w.reshape(q.shape[0], in_features).astype(np.float32)
