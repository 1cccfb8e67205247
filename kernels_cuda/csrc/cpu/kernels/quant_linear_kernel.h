// The framework-free core of the quantized linear: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), with
// W kept in GGML's blocks of 32 weights along K (a GGUF file's bytes):
//   Q8_0: fp16 d, int8 q[32]                w = d * q
//   Q4_0: fp16 d, 16 bytes of nibbles        w = d * (q - 8)
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles w = d * q + m
// (nibble j of a Q4 block is byte j's low half for j < 16, byte j - 16's high half after).
// int8 weight-only quantization per output channel is Q8_0 with the channel's scale in every
// block of its row.
//
// Two layouts of the same bytes (quantization.py's interleave_rows):
// - rows: GGUF's, row after row, [N, K / 32 * block bytes];
// - interleaved (N a multiple of 8): [N / 8, 8 * K / 32 * block bytes], each group of 8 rows
//   block by block: for block b, the 8 rows' d (8 fp16), for Q4_1 their m (8 fp16), then their
//   quants 4 bytes at a time, quad t of every row before quad t + 1 (a 32-byte load holds bytes
//   4t..4t+3 of each row: lane r = row r). One stream to read, and the 8 rows' dots in the 8
//   int32 lanes of one register (llama.cpp's repacked Q4_0x8 idea).
//
// llama.cpp's approach: each row of x is quantized once per linear to blocks of 32 int8 with a
// float scale (d_x = max|x| / 127, q = round-half-even(x / d_x); per block sum(q), and
// s_x = d_x * sum(q) for Q4_1's offsets); then each block's product is an exact integer dot I
// (Q4_0's weights recentred: I = q_w . q_x - 8 sum(q_x); AVX2's maddubs
// and madd, or AVX-512 VNNI's dpbusd: the same integers). Then per block, in block order:
// acc = acc + (d_w * d_x) * float(I) (no fused multiply-add, so NumPy can replay it:
// tests/kernels/test_quant_linear.py), Q4_1's off = off + m_w * s_x, and y = (acc + off) + bias.
// Every element is computed the same way for any layout, thread split or row group, and for any
// M within one of the ranges below.
//
// x's int8 rounding alone moves a model's perplexity by 0.5-2 % (RESULTS.md), where a Q4 file
// may lose +0.5 % against itself dequantized and int8 +1 % against float32. So by rows of x:
// - 64 rows or more (prompts): no rounding of x. The weights are dequantized a tile at a time
//   into the float32 linear (dequantized_linear below): the dequantized model's bits, at about
//   the float32 linear's speed (with AVX2 1.2x the integer dots' time at 128 rows, 1.6-2x at
//   16-32: decode steps of up to 63 sequences keep the dots);
// - 2 to 63 rows (batched decode steps, short prompts): the integer dots above, llama.cpp's
//   numerics;
// - one row against Q4 blocks (a batch-1 decode step): x in 16-bit blocks, held as two int8
//   planes, q and a residual r = round-half-even(256 (x / d_x - q)) (clamped to int8), so that
//   x = (d_x / 256) (256 q + r) within d_x / 512. A block's dot is I = 256 (q_w . q) + q_w . r:
//   two int8 dots of the same unpacked weights, still exact (|I| < 2^24 also converts to float
//   exactly), with d_x / 256 and sum(256 q + r) as the block's scale and sum. At one row it
//   costs about what one plane does; at 4-16 rows, whose time the dots bound, 1.5-2x. Q8_0's
//   one row keeps one plane (its pairs do not fit the int16 sums).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"
#include "linear_cpu_kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pagedjax::cpu_quant {

constexpr int64_t kBlock = 32;  // weights per block
// GGML's type ids (a GGUF tensor's type): what the ops take as `qtype`.
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

inline int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ8_0: return 2 + 32;
    case kQ4_0: return 2 + 16;
    case kQ4_1: return 4 + 16;
    default: return 0;  // not a supported type
  }
}

// IEEE half → float, exactly (subnormals included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = mantissa;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return half_to_float(h);
}

// One row of x as blocks of 32 int8: q [K], r [K] (the residual plane, or null), and per block
// its scale d, its sum and d * sum (one plane: d_x and sum(q); two: d_x / 256 and
// sum(256 q + r)).
struct QuantizedRow {
  const int8_t* q;
  const int8_t* r;
  const float* d;
  const int32_t* sum;
  const float* s;
};

// Q4 blocks: one row of x meets them in two planes (see the header comment).
inline bool is_q4(int64_t qtype) { return qtype == kQ4_0 || qtype == kQ4_1; }

// Block b's scale, sum and d * sum from its max|x| and its planes' sums (r: null for one plane).
inline void finish_block(float scale, int32_t sum_q, int32_t sum_r, bool residual, float* d,
                         int32_t* sums, float* s) {
  *d = residual ? scale / 256.f : scale;
  *sums = residual ? 256 * sum_q + sum_r : sum_q;
  *s = *d * static_cast<float>(*sums);
}

// x[K] (K a multiple of 32) → q, r (if not null), d, sum, s (see QuantizedRow).
inline void quantize_row(const float* x, int64_t K, int8_t* q, int8_t* r, float* d,
                         int32_t* sums, float* s) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.f;
    const float inverse = scale != 0.f ? 1.f / scale : 0.f;
    int32_t sum_q = 0, sum_r = 0;
    for (int j = 0; j < kBlock; ++j) {
      const float y = xb[j] * inverse;
      const float v = std::nearbyint(y);
      q[b * kBlock + j] = static_cast<int8_t>(v);
      sum_q += static_cast<int32_t>(v);
      if (r) {  // y - v is exact (|y - v| <= 1/2 and v is y rounded): so is 256 (y - v)
        const int32_t e = std::min(127, static_cast<int32_t>(std::nearbyint((y - v) * 256.f)));
        r[b * kBlock + j] = static_cast<int8_t>(e);
        sum_r += e;
      }
    }
    finish_block(scale, sum_q, sum_r, r != nullptr, d + b, sums + b, s + b);
  }
}

#if defined(__x86_64__)
// 32 int32 → 32 int8 in order, saturating (packs interleave 128-bit lanes: permute back), and
// their sum.
__attribute__((target("avx2"))) inline int32_t pack_block(const __m256i ints[4], int8_t* out) {
  const __m256i lo = _mm256_packs_epi32(ints[0], ints[1]);
  const __m256i hi = _mm256_packs_epi32(ints[2], ints[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bytes);
  // the stored bytes' sum (a clamped residual counts as stored): widen and add
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i wide = _mm256_add_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes)),
                                        _mm256_cvtepi8_epi16(_mm256_extracti128_si256(bytes, 1)));
  const __m256i sum = _mm256_madd_epi16(wide, ones);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  return _mm_cvtsi128_si32(s4);
}

// quantize_row with AVX2, the same bits: max|x| over the block, the same float32 scale and
// inverse, x * inverse rounded half to even (the default rounding mode, as nearbyint), and the
// residual from the same float differences.
__attribute__((target("avx2"))) inline void quantize_row_avx2(const float* x, int64_t K,
                                                              int8_t* q, int8_t* r, float* d,
                                                              int32_t* sums, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float scale = _mm_cvtss_f32(m) / 127.f;
    const float inverse = scale != 0.f ? 1.f / scale : 0.f;
    const __m256 inv = _mm256_set1_ps(inverse);
    __m256i ints[4], residuals[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 y = _mm256_mul_ps(v[i], inv);
      const __m256 rounded = _mm256_round_ps(y, kRound);
      ints[i] = _mm256_cvtps_epi32(rounded);
      if (r) {
        const __m256 e = _mm256_mul_ps(_mm256_sub_ps(y, rounded), _mm256_set1_ps(256.f));
        residuals[i] = _mm256_cvtps_epi32(_mm256_round_ps(e, kRound));
      }
    }
    const int32_t sum_q = pack_block(ints, q + b * kBlock);
    const int32_t sum_r = r ? pack_block(residuals, r + b * kBlock) : 0;
    finish_block(scale, sum_q, sum_r, r != nullptr, d + b, sums + b, s + b);
  }
}
#endif

// x[K] → q, r (if not null), d, sum, s with the CPU's fastest version (the same bits).
inline void quantize_row_fast(const float* x, int64_t K, int8_t* q, int8_t* r, float* d,
                              int32_t* sums, float* s) {
#if defined(__x86_64__)
  if (cpu_has_avx2_fma()) return quantize_row_avx2(x, K, q, r, d, sums, s);
#endif
  quantize_row(x, K, q, r, d, sums, s);
}

// ---- Layouts ---------------------------------------------------------------------------------

constexpr int64_t kGroup = 8;  // rows of an interleaved group (the int32 lanes of a register)

// The rows of a weight given its blocks' 2-D shape [dim0, dim1] over K inputs, and whether they
// are interleaved; -1 where the shape is neither layout's (or qtype / K are not supported).
inline int64_t rows_of_blocks(int64_t qtype, int64_t K, int64_t dim0, int64_t dim1,
                              bool* interleaved) {
  const int64_t row_bytes = K / kBlock * block_bytes(qtype);
  *interleaved = false;
  if (row_bytes == 0 || K % kBlock != 0 || dim0 < 0) return -1;
  if (dim1 == row_bytes) return dim0;
  *interleaved = true;
  return dim1 == kGroup * row_bytes ? dim0 * kGroup : -1;
}

// A weight's blocks: their type, layout and where row n's block b starts (its bytes differ
// between the layouts; read_block below gives the same 32 weights either way).
struct Blocks {
  int64_t qtype;
  const uint8_t* data;
  int64_t K;
  bool interleaved;

  int64_t bytes() const { return block_bytes(qtype); }
  int64_t num_blocks() const { return K / kBlock; }
  // interleaved: group g's block b (8 rows), its bytes 8 x bytes()
  const uint8_t* chunk(int64_t g, int64_t b) const {
    return data + (g * num_blocks() + b) * kGroup * bytes();
  }
};

// Row n's block b: its 32 weights as int8 (Q4_1: 0..15, Q4_0: -8..7, Q8_0: as stored), its
// scale and (Q4_1) offset.
inline void read_block(const Blocks& w, int64_t n, int64_t b, int8_t* q, float* d, float* m) {
  const int64_t qtype = w.qtype;
  uint8_t bytes[32];  // the row's quants as GGUF stores them
  const int64_t quant_bytes = qtype == kQ8_0 ? 32 : 16;
  if (!w.interleaved) {
    const uint8_t* block = w.data + (n * w.num_blocks() + b) * w.bytes();
    *d = load_half(block);
    *m = qtype == kQ4_1 ? load_half(block + 2) : 0.f;
    std::memcpy(bytes, block + w.bytes() - quant_bytes, quant_bytes);
  } else {
    const uint8_t* chunk = w.chunk(n / kGroup, b);
    const int64_t r = n % kGroup;
    *d = load_half(chunk + 2 * r);
    *m = qtype == kQ4_1 ? load_half(chunk + 16 + 2 * r) : 0.f;
    const uint8_t* quants = chunk + (qtype == kQ4_1 ? 32 : 16);
    for (int64_t t = 0; t < quant_bytes / 4; ++t)
      std::memcpy(bytes + 4 * t, quants + (t * kGroup + r) * 4, 4);
  }
  if (qtype == kQ8_0) {
    std::memcpy(q, bytes, kBlock);
    return;
  }
  const int offset = qtype == kQ4_0 ? 8 : 0;
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>((bytes[j] & 0x0f) - offset);
    q[j + 16] = static_cast<int8_t>((bytes[j] >> 4) - offset);
  }
}

// Row n's weights dequantized: out[K].
inline void dequantize_row(const Blocks& w, int64_t n, float* out) {
  int8_t q[kBlock];
  for (int64_t b = 0; b < w.num_blocks(); ++b) {
    float d, m;
    read_block(w, n, b, q, &d, &m);
    for (int j = 0; j < kBlock; ++j) out[b * kBlock + j] = d * static_cast<float>(q[j]) + m;
  }
}

// ---- The integer dots ------------------------------------------------------------------------

// Weight rows [n, n + NR) against MR quantized rows of x: y[r * NR + i] for row n + i. Scalar:
// any CPU, any layout, and the definition the vector versions match bit for bit.
template <int MR, int NR>
__attribute__((optimize("fp-contract=off"))) void dot_scalar(const Blocks& w, int64_t n,
                                                             const QuantizedRow* xs, float* y) {
  for (int i = 0; i < NR; ++i) {
    float acc[MR] = {}, off[MR] = {};
    int8_t q[kBlock];
    for (int64_t b = 0; b < w.num_blocks(); ++b) {
      float dw, mw;
      read_block(w, n + i, b, q, &dw, &mw);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = xs[r].q + b * kBlock;
        const int8_t* xr = xs[r].r ? xs[r].r + b * kBlock : nullptr;
        int32_t dot = 0;
        for (int j = 0; j < kBlock; ++j) {
          const int32_t x = xr ? 256 * int32_t{xq[j]} + int32_t{xr[j]} : int32_t{xq[j]};
          dot += int32_t{q[j]} * x;
        }
        const float scale = dw * xs[r].d[b];
        const float product = scale * static_cast<float>(dot);
        acc[r] = acc[r] + product;
        if (w.qtype == kQ4_1) {
          const float offset = mw * xs[r].s[b];
          off[r] = off[r] + offset;
        }
      }
    }
    for (int r = 0; r < MR; ++r) y[r * NR + i] = w.qtype == kQ4_1 ? acc[r] + off[r] : acc[r];
  }
}

#if defined(__x86_64__)
// The integer dots of the x86 kernels: AVX2's maddubs + madd, or AVX-512 VNNI's dpbusd. Both
// are exact: an unsigned byte (a Q4 nibble, a Q8_0 weight's magnitude) times a signed one, each
// 4-byte dot at most 4 x 127 x 127 (no maddubs pair of Q8_0 saturates: 2 x 127 x 127 < 32767).
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace avx2 {
// pairs: 16 int16 lanes, each the sum of 2-byte dots (exact while the sums fit: the caller's)
inline __m256i pair_add(__m256i pairs, __m256i u, __m256i x) {
  return _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u, x));
}
inline __m256i pairs_sum(__m256i a, __m256i b) { return _mm256_add_epi16(a, b); }
inline __m256i widen(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
inline __m256i dot_add(__m256i lanes, __m256i u, __m256i x) {
  return _mm256_add_epi32(lanes, widen(_mm256_maddubs_epi16(u, x)));
}
#include "quant_dot_x86.h"  // NOLINT(build/include): twice, on purpose
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,f16c,avx512f,avx512vl,avx512vnni")
namespace vnni {
// dpbusd sums each lane's 4-byte dots in int32 at once: "pairs" are int32 lanes here
inline __m256i pair_add(__m256i pairs, __m256i u, __m256i x) {
  return _mm256_dpbusd_epi32(pairs, u, x);
}
inline __m256i pairs_sum(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
inline __m256i widen(__m256i pairs) { return pairs; }
inline __m256i dot_add(__m256i lanes, __m256i u, __m256i x) {
  return _mm256_dpbusd_epi32(lanes, u, x);
}
#include "quant_dot_x86.h"  // NOLINT(build/include): twice, on purpose
}  // namespace vnni
#pragma GCC pop_options
#endif

// Weight rows [n, n + NR) (NR: 1, or kGroup from an interleaved group's first row) against MR
// rows of x (Fine: in two planes), with the CPU's fastest version: y[r * NR + i].
template <int64_t QT, int MR, int NR, bool Fine>
void dot_of(const Blocks& w, int64_t n, const QuantizedRow* xs, float* y) {
#if defined(__x86_64__)
  if (cpu_has_avx2_f16c()) {
    const bool vnni = cpu_has_avx512_vnni();
    if constexpr (NR == kGroup) {
      return vnni ? vnni::dot_group<QT, MR, Fine>(w, n / kGroup, xs, y)
                  : avx2::dot_group<QT, MR, Fine>(w, n / kGroup, xs, y);
    } else {
      return vnni ? vnni::dot_rows<QT, MR, Fine>(w, n, xs, y)
                  : avx2::dot_rows<QT, MR, Fine>(w, n, xs, y);
    }
  }
#endif
  dot_scalar<MR, NR>(w, n, xs, y);
}

// Two planes come only with Q4 blocks and one row of x (quant_linear): the other kernels are
// not instantiated.
template <int MR, int NR>
void dot(const Blocks& w, int64_t n, const QuantizedRow* xs, float* y) {
  const bool fine = MR == 1 && xs[0].r != nullptr;
  switch (w.qtype) {
    case kQ8_0: return dot_of<kQ8_0, MR, NR, false>(w, n, xs, y);
    case kQ4_0:
      return fine ? dot_of<kQ4_0, 1, NR, true>(w, n, xs, y)
                  : dot_of<kQ4_0, MR, NR, false>(w, n, xs, y);
    default:
      return fine ? dot_of<kQ4_1, 1, NR, true>(w, n, xs, y)
                  : dot_of<kQ4_1, MR, NR, false>(w, n, xs, y);
  }
}

// ---- Many rows: the weights dequantized a tile at a time -------------------------------------
//
// From kFloatRows rows of x, the blocks take the float32 linear's path: each thread dequantizes
// 16 weight rows into a packed tile (the layout pack_linear_weight gives the dequantized
// weights) and runs cpu_linear's register blocks over every row of x. Its products are then the
// dequantized model's linear's, bit for bit, at about the float32 linear's speed (Q4 with AVX2
// at 128 rows: 1.2x the int8 dots' time, two int8 planes ~1.7x: RESULTS.md).
constexpr int64_t kTileRows = cpu_linear::kTile;  // weight rows of a packed tile
constexpr int64_t kFloatRows = 64;                 // rows of x from which they take it

#if defined(__x86_64__)
// Interleaved group g's 8 rows into columns [0, 8) of a packed tile (16 floats a k): quad t of
// the 8 rows is one 32-byte load (lane r: row r's bytes 4t..4t+3): Q8_0's weights 4t..4t+3, Q4's
// low nibbles weights 4t..4t+3 and high ones 16 + 4t... A byte shuffle and a dword permutation
// turn a quad into 8 bytes a weight (rows 0..7), each widened to 8 floats: d * q + m, as
// dequantize_row computes them.
template <int64_t QT>
__attribute__((target("avx2,f16c"))) void dequantize_group_avx2(const Blocks& w, int64_t g,
                                                                float* tile) {
  const __m256i low_mask = _mm256_set1_epi8(0x0f);
  // per 128-bit lane: byte i of dwords 0..3, for i = 0..3 (a 4 x 4 byte transpose)
  const __m256i by_weight = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                             0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i rows_together = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i offset = _mm256_set1_epi32(QT == kQ4_0 ? 8 : 0);
  constexpr int kQuads = QT == kQ8_0 ? 8 : 4, kHalves = QT == kQ8_0 ? 1 : 2;
  for (int64_t b = 0; b < w.num_blocks(); ++b) {
    const uint8_t* chunk = w.chunk(g, b);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk)));
    const __m256 mw =
        QT == kQ4_1
            ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16)))
            : _mm256_setzero_ps();
    const uint8_t* quants = chunk + (QT == kQ4_1 ? 32 : 16);
    for (int t = 0; t < kQuads; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * t));
      const __m256i halves[2] = {QT == kQ8_0 ? v : _mm256_and_si256(v, low_mask),
                                 _mm256_and_si256(_mm256_srli_epi16(v, 4), low_mask)};
      for (int h = 0; h < kHalves; ++h) {
        // qword i: weight 4t + i (+ 16 for Q4's high nibbles) of rows 0..7
        const __m256i q = _mm256_permutevar8x32_epi32(
            _mm256_shuffle_epi8(halves[h], by_weight), rows_together);
        const __m128i pairs[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
        for (int i = 0; i < 4; ++i) {
          const __m128i bytes = i % 2 ? _mm_srli_si128(pairs[i / 2], 8) : pairs[i / 2];
          const __m256i ints = QT == kQ8_0 ? _mm256_cvtepi8_epi32(bytes)
                                           : _mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), offset);
          const __m256 weights = _mm256_add_ps(_mm256_mul_ps(dw, _mm256_cvtepi32_ps(ints)), mw);
          _mm256_storeu_ps(tile + (b * kBlock + 16 * h + 4 * t + i) * kTileRows, weights);
        }
      }
    }
  }
}
#endif

// Weight rows [n0, n0 + 16) into a packed tile: tile[k * 16 + j] = W[n0 + j, k] dequantized
// (dequantize_row's bits), zeros past row N.
inline void dequantize_tile(const Blocks& w, int64_t n0, int64_t N, float* tile,
                            std::vector<float>& row) {
  const int64_t K = w.K;
  for (int64_t half = 0; half < kTileRows; half += kGroup) {
    const int64_t n = n0 + half;
#if defined(__x86_64__)
    if (w.interleaved && n < N && cpu_has_avx2_f16c()) {
      switch (w.qtype) {
        case kQ8_0: dequantize_group_avx2<kQ8_0>(w, n / kGroup, tile + half); break;
        case kQ4_0: dequantize_group_avx2<kQ4_0>(w, n / kGroup, tile + half); break;
        default: dequantize_group_avx2<kQ4_1>(w, n / kGroup, tile + half);
      }
      continue;
    }
#endif
    row.resize(K);
    for (int64_t i = 0; i < kGroup; ++i) {
      if (n + i < N) {
        dequantize_row(w, n + i, row.data());
      } else {
        std::fill(row.begin(), row.end(), 0.f);
      }
      for (int64_t k = 0; k < K; ++k) tile[k * kTileRows + half + i] = row[k];
    }
  }
}

// y[M, ldy] (columns [0, N)) = x @ W^T + bias through dequantized tiles (see above), the tiles
// split across threads. A last tile of 8 rows writes through a scratch (y has no columns past N).
template <typename Parallel>
void dequantized_linear(const Parallel& par, const float* x, int64_t ldx, int64_t M,
                        const Blocks& w, int64_t N, const float* bias, float* y, int64_t ldy) {
  const int64_t K = w.K, tiles = (N + kTileRows - 1) / kTileRows;
  par.for_range(tiles, 1, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> tile, row, scratch;
    tile.resize(K * kTileRows);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows, width = std::min(kTileRows, N - n0);
      dequantize_tile(w, n0, N, tile.data(), row);
      if (width == kTileRows) {
        cpu_linear::tile_group<1>(x, ldx, M, tile.data(), K, bias ? bias + n0 : nullptr, y + n0,
                                  ldy, 0, 0, 0);
        continue;
      }
      float padded_bias[kTileRows] = {};
      if (bias) std::copy(bias + n0, bias + N, padded_bias);
      scratch.resize(M * kTileRows);
      cpu_linear::tile_group<1>(x, ldx, M, tile.data(), K, padded_bias, scratch.data(),
                                kTileRows, 0, 0, 0);
      for (int64_t m = 0; m < M; ++m)
        std::copy(scratch.data() + m * kTileRows, scratch.data() + m * kTileRows + width,
                  y + m * ldy + n0);
    }
  });
}

// ---- The linear ------------------------------------------------------------------------------

constexpr int kRowGroup = 4;  // rows of x per pass over weight rows (read once per group)

// x's M quantized rows (quant_linear's buffers; residual: null for one plane).
struct XRows {
  const int8_t* q;
  const int8_t* residual;
  const float* d;
  const int32_t* sums;
  const float* s;
  int64_t K;

  QuantizedRow operator()(int64_t r) const {
    const int64_t num_blocks = K / kBlock;
    return {q + r * K, residual ? residual + r * K : nullptr, d + r * num_blocks,
            sums + r * num_blocks, s + r * num_blocks};
  }
};

// y[:, n : n + NR] (+ bias) = weight rows [n, n + NR) against every row of x, kRowGroup rows
// of x at a time.
template <int NR>
void dot_all_rows(const Blocks& w, int64_t n, const XRows& rows, int64_t M, const float* bias,
                  float* y, int64_t ldy) {
  float out[kRowGroup * NR];
  int64_t r = 0;
  for (; r + kRowGroup <= M; r += kRowGroup) {
    const QuantizedRow group[kRowGroup] = {rows(r), rows(r + 1), rows(r + 2), rows(r + 3)};
    dot<kRowGroup, NR>(w, n, group, out);
    for (int i = 0; i < kRowGroup; ++i)
      for (int j = 0; j < NR; ++j)
        y[(r + i) * ldy + n + j] = out[i * NR + j] + (bias ? bias[n + j] : 0.f);
  }
  for (; r < M; ++r) {
    const QuantizedRow alone = rows(r);
    dot<1, NR>(w, n, &alone, out);
    for (int j = 0; j < NR; ++j) y[r * ldy + n + j] = out[j] + (bias ? bias[n + j] : 0.f);
  }
}

// y[M, ldy] (columns [0, N)) = x[M, K] (ldx floats per row) @ W^T + bias; W: N rows of
// K / 32 blocks of qtype, interleaved or not (rows_of_blocks). x is quantized first (M rows,
// split across threads), then the weight rows (or groups of 8) are split across threads; each
// runs every group of kRowGroup rows of x against its weight rows (whose bytes stay in L1
// meanwhile). From kFloatRows rows, the dequantized tiles instead (see the header comment;
// RESULTS.md, benchmarks/probes/quant_linear_rows.py).
template <typename Parallel>
void quant_linear(const Parallel& par, const float* x, int64_t ldx, int64_t M, int64_t qtype,
                  const uint8_t* blocks, bool interleaved, int64_t N, int64_t K,
                  const float* bias, float* y, int64_t ldy) {
  const Blocks w{qtype, blocks, K, interleaved};
  if (M >= kFloatRows) {
    return dequantized_linear(par, x, ldx, M, w, N, bias, y, ldy);
  }
  const int64_t num_blocks = K / kBlock, row_bytes = num_blocks * w.bytes();
  // x's quantized rows, in buffers the calling thread keeps (no allocation per call); the
  // other threads get their addresses (a thread_local named in a lambda is the running
  // thread's own)
  static thread_local std::vector<int8_t> q_buffer, r_buffer;
  static thread_local std::vector<float> d_buffer, s_buffer;
  static thread_local std::vector<int32_t> sum_buffer;
  const bool residual = is_q4(qtype) && M == 1;
  q_buffer.resize(std::max<size_t>(q_buffer.size(), M * K));
  if (residual) r_buffer.resize(std::max<size_t>(r_buffer.size(), M * K));
  d_buffer.resize(std::max<size_t>(d_buffer.size(), M * num_blocks));
  s_buffer.resize(std::max<size_t>(s_buffer.size(), M * num_blocks));
  sum_buffer.resize(std::max<size_t>(sum_buffer.size(), M * num_blocks));
  int8_t* const q = q_buffer.data();
  int8_t* const r_plane = residual ? r_buffer.data() : nullptr;
  float* const d = d_buffer.data();
  float* const s = s_buffer.data();
  int32_t* const sums = sum_buffer.data();
  auto quantize_rows = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row_fast(x + r * ldx, K, q + r * K, r_plane ? r_plane + r * K : nullptr,
                        d + r * num_blocks, sums + r * num_blocks, s + r * num_blocks);
  };
  if (M * K < 65536) {  // a decode step's few rows: not worth a parallel region
    quantize_rows(0, M);
  } else {
    par.for_range(M, 1, quantize_rows);
  }
  const XRows rows{q, r_plane, d, sums, s, K};
  const int64_t step = interleaved ? kGroup : 1, units = N / step;
  // ~16 KB of weights a range at least, and every thread busy where N allows
  const int64_t unit_bytes = std::max<int64_t>(1, row_bytes * step);
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(
      16384 / unit_bytes, units / std::max<int64_t>(1, par.num_threads())));
  par.for_range(units, grain, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      if (interleaved) {
        dot_all_rows<kGroup>(w, u * kGroup, rows, M, bias, y, ldy);
      } else {
        dot_all_rows<1>(w, u, rows, M, bias, y, ldy);
      }
    }
  });
}

}  // namespace pagedjax::cpu_quant
