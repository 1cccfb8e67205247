// The framework-free core of the quantized linear: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), with
// W kept in GGML's blocks of 32 weights along K (a GGUF file's bytes, row by row):
//   Q8_0: fp16 d, int8 q[32]                w = d * q
//   Q4_0: fp16 d, 16 bytes of nibbles        w = d * (q - 8)
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles w = d * q + m
// (nibble j of a Q4 block is byte j's low half for j < 16, byte j - 16's high half after).
// int8 weight-only quantization per output channel is Q8_0 with the channel's scale in every
// block of its row.
//
// llama.cpp's approach: each row of x is quantized once per linear to blocks of 32 int8 with a
// float scale (d_x = max|x| / 127, q = round-half-even(x / d_x), and s_x = d_x * sum(q) for
// Q4_1's offsets), then each block's product is an integer dot (below kFloatRows rows of x; from
// there on, the float32 linear over the weights dequantized once): AVX2's maddubs (unsigned x
// signed bytes into int16 pairs, exact: |q_x| <= 127, |q_w| <= 127) and madd into 8 int32
// lanes, lane l the sum of the 4 products of bytes 4l..4l+3 (the scalar version sums the same
// way). Then per block, per lane: acc[l] = acc[l] + (d_w * d_x) * float(lane[l]) (no fused
// multiply-add, so NumPy can replay it: tests/kernels/test_quant_linear.py), the lanes summed
// as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), plus Q4_1's sum over blocks of
// m_w * s_x in block order, plus the bias. Every element is computed the same way for any M,
// thread split or row group.
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

// One row of x as blocks of 32 int8: q [K], and per block its scale d and d * sum(q).
struct QuantizedRow {
  const int8_t* q;
  const float* d;
  const float* s;
};

// x[K] (K a multiple of 32) → q, d, s (see QuantizedRow).
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.f;
    const float inverse = scale != 0.f ? 1.f / scale : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inverse));
      q[b * kBlock + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

#if defined(__x86_64__)
// quantize_row with AVX2, the same bits: max|x| over the block, the same float32 scale and
// inverse, x * inverse rounded half to even (the default rounding mode, as nearbyint).
__attribute__((target("avx2"))) inline void quantize_row_avx2(const float* x, int64_t K,
                                                              int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
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
    __m256i ints[4];
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      ints[i] = _mm256_cvtps_epi32(r);
      sum = _mm256_add_epi32(sum, ints[i]);
    }
    // int32 x 32 → int8 x 32 in order (packs interleave 128-bit lanes: permute back)
    const __m256i lo = _mm256_packs_epi32(ints[0], ints[1]);
    const __m256i hi = _mm256_packs_epi32(ints[2], ints[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), bytes);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    d[b] = scale;
    s[b] = scale * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}
#endif

// x[K] → q, d, s with the CPU's fastest version (the same bits).
inline void quantize_row_fast(const float* x, int64_t K, int8_t* q, float* d, float* s) {
#if defined(__x86_64__)
  if (cpu_has_avx2_fma()) return quantize_row_avx2(x, K, q, d, s);
#endif
  quantize_row(x, K, q, d, s);
}

// The 32 weights of a block as int8 (Q4_1: 0..15, Q4_0: -8..7, Q8_0: as stored); its scale and
// (Q4_1) offset.
inline void unpack_block(int64_t qtype, const uint8_t* block, int8_t* w, float* d, float* m) {
  *d = load_half(block);
  *m = 0.f;
  if (qtype == kQ8_0) {
    std::memcpy(w, block + 2, kBlock);
    return;
  }
  const uint8_t* nibbles = block + (qtype == kQ4_1 ? 4 : 2);
  if (qtype == kQ4_1) *m = load_half(block + 2);
  const int offset = qtype == kQ4_0 ? 8 : 0;
  for (int j = 0; j < 16; ++j) {
    w[j] = static_cast<int8_t>((nibbles[j] & 0x0f) - offset);
    w[j + 16] = static_cast<int8_t>((nibbles[j] >> 4) - offset);
  }
}

// The dequantized weights of one row of blocks: out[K].
inline void dequantize_row(int64_t qtype, const uint8_t* row, int64_t K, float* out) {
  int8_t w[kBlock];
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float d, m;
    unpack_block(qtype, row + b * block_bytes(qtype), w, &d, &m);
    for (int j = 0; j < kBlock; ++j) out[b * kBlock + j] = d * static_cast<float>(w[j]) + m;
  }
}

inline float sum_lanes(const float* acc) {
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// One weight row against MR quantized rows of x: y[r] for r < MR. Scalar: any CPU, and the
// definition the AVX2 version matches bit for bit.
template <int MR>
__attribute__((optimize("fp-contract=off"))) void dot_rows_scalar(int64_t qtype, const uint8_t* wrow, int64_t K, const QuantizedRow* xs,
                     float* y) {
  float acc[MR][8] = {};
  float offsets[MR] = {};
  int8_t w[kBlock];
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float dw, mw;
    unpack_block(qtype, wrow + b * block_bytes(qtype), w, &dw, &mw);
    for (int r = 0; r < MR; ++r) {
      const int8_t* xq = xs[r].q + b * kBlock;
      const float scale = dw * xs[r].d[b];
      for (int l = 0; l < 8; ++l) {
        int32_t lane = 0;
        for (int j = 4 * l; j < 4 * l + 4; ++j) lane += int32_t{w[j]} * int32_t{xq[j]};
        const float product = scale * static_cast<float>(lane);
        acc[r][l] = acc[r][l] + product;
      }
      if (qtype == kQ4_1) {
        const float offset = mw * xs[r].s[b];
        offsets[r] = offsets[r] + offset;
      }
    }
  }
  for (int r = 0; r < MR; ++r) y[r] = sum_lanes(acc[r]) + offsets[r];
}

#if defined(__x86_64__)
// 32 int8 weights of a block into a register (Q4 nibbles spread, Q4_0 recentred).
__attribute__((target("avx2"))) inline __m256i load_block_avx2(int64_t qtype,
                                                               const uint8_t* block) {
  if (qtype == kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  const __m128i packed =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (qtype == kQ4_1 ? 4 : 2)));
  const __m128i low_mask = _mm_set1_epi8(0x0f);
  const __m128i low = _mm_and_si128(packed, low_mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), low_mask);
  __m256i w = _mm256_set_m128i(high, low);  // bytes 0..15: low nibbles, 16..31: high
  if (qtype == kQ4_0) w = _mm256_sub_epi8(w, _mm256_set1_epi8(8));
  return w;
}

// 8 int32 lanes of w . x over a block (lane l: bytes 4l..4l+3), exactly: |w|, |x| <= 127.
__attribute__((target("avx2"))) inline __m256i dot_lanes_avx2(__m256i w, __m256i x) {
  const __m256i abs_w = _mm256_sign_epi8(w, w);     // |w| as unsigned bytes
  const __m256i signed_x = _mm256_sign_epi8(x, w);  // x with w's sign (0 where w is 0)
  const __m256i pairs = _mm256_maddubs_epi16(abs_w, signed_x);  // 16 x int16, exact
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

template <int MR>
__attribute__((target("avx2,f16c"), optimize("fp-contract=off"))) void dot_rows_avx2(
    int64_t qtype, const uint8_t* wrow, int64_t K, const QuantizedRow* xs, float* y) {
  __m256 acc[MR];
  float offsets[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm256_setzero_ps();
    offsets[r] = 0.f;
  }
  const int64_t bytes = block_bytes(qtype);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* block = wrow + b * bytes;
    const __m256i w = load_block_avx2(qtype, block);
    uint16_t halves[2];
    std::memcpy(halves, block, sizeof halves);
    const float dw = _cvtsh_ss(halves[0]);
    const float mw = qtype == kQ4_1 ? _cvtsh_ss(halves[1]) : 0.f;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[r].q + b * kBlock));
      const __m256 lanes = _mm256_cvtepi32_ps(dot_lanes_avx2(w, x));
      const __m256 product = _mm256_mul_ps(_mm256_set1_ps(dw * xs[r].d[b]), lanes);
      acc[r] = _mm256_add_ps(acc[r], product);
      if (qtype == kQ4_1) {
        const float offset = mw * xs[r].s[b];
        offsets[r] = offsets[r] + offset;
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    y[r] = sum_lanes(lanes) + offsets[r];
  }
}
#endif

template <int MR>
void dot_rows(int64_t qtype, const uint8_t* wrow, int64_t K, const QuantizedRow* xs, float* y) {
#if defined(__x86_64__)
  if (cpu_has_avx2_f16c()) return dot_rows_avx2<MR>(qtype, wrow, K, xs, y);
#endif
  dot_rows_scalar<MR>(qtype, wrow, K, xs, y);
}

constexpr int kRowGroup = 4;  // rows of x per pass over a weight row (a row read once per group)
// From this many rows of x on, the weights are dequantized once into float32 tiles and the
// product is the float32 linear's (linear_cpu_kernel.h): the integer dots cost each row the
// same, the tiles' FMAs 4x less per row once the dequantization is paid (a 576 x 3072 Q4_1
// weight: 0.93 ms integer at 32 rows, 0.24 ms float + the dequantization; RESULTS.md).
constexpr int64_t kFloatRows = 32;

// W's blocks [N rows] → packed float32 tiles [ceil(N / 16), K, 16] (linear_cpu_kernel.h's
// layout; the last tile's missing rows zero), the tiles split across `par`'s threads.
template <typename Parallel>
void dequantize_tiles(const Parallel& par, int64_t qtype, const uint8_t* w, int64_t N,
                      int64_t K, float* packed) {
  const int64_t row_bytes = K / kBlock * block_bytes(qtype);
  const int64_t tile = cpu_linear::kTile, num_tiles = (N + tile - 1) / tile;
  par.for_range(num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(tile * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * tile, count = std::min(tile, N - first);
      for (int64_t j = 0; j < count; ++j)
        dequantize_row(qtype, w + (first + j) * row_bytes, K, rows.data() + j * K);
      std::fill(rows.begin() + count * K, rows.end(), 0.f);
      float* out = packed + t * K * tile;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < tile; ++j) out[k * tile + j] = rows[j * K + k];
    }
  });
}

// y[M, ldy] (columns [0, N)) = x[M, K] (ldx floats per row) @ W^T + bias; W: N rows of
// K / 32 blocks of qtype. x is quantized first (M rows, split across threads), then the N
// weight rows are split across threads; each runs every group of kRowGroup rows of x against
// its weight rows, one weight row at a time.
template <typename Parallel>
void quant_linear(const Parallel& par, const float* x, int64_t ldx, int64_t M, int64_t qtype,
                  const uint8_t* w, int64_t N, int64_t K, const float* bias, float* y,
                  int64_t ldy) {
  const int64_t num_blocks = K / kBlock, row_bytes = num_blocks * block_bytes(qtype);
  if (M >= kFloatRows) {
    // in chunks of ~4 MB of float32 tiles (a 49k-vocabulary head is never all dequantized)
    const int64_t tile = cpu_linear::kTile;
    const int64_t chunk_rows = tile * std::max<int64_t>(1, (int64_t{1} << 20) / (K * tile));
    static thread_local std::vector<float> tiles, wide, chunk_bias;
    for (int64_t n0 = 0; n0 < N; n0 += chunk_rows) {
      const int64_t n = std::min(chunk_rows, N - n0), num_tiles = (n + tile - 1) / tile;
      const int64_t padded = num_tiles * tile;
      tiles.resize(std::max<size_t>(tiles.size(), num_tiles * K * tile));
      dequantize_tiles(par, qtype, w + n0 * row_bytes, n, K, tiles.data());
      const float* b = bias ? bias + n0 : nullptr;
      if (padded == n) {
        cpu_linear::linear(par, x, ldx, M, tiles.data(), K, num_tiles, b, y + n0, ldy);
        continue;
      }
      if (b) {  // the last tile's missing columns: a zero-padded bias, a wide output cut
        chunk_bias.assign(b, b + n);
        chunk_bias.resize(padded, 0.f);
        b = chunk_bias.data();
      }
      wide.resize(std::max<size_t>(wide.size(), M * padded));
      cpu_linear::linear(par, x, ldx, M, tiles.data(), K, num_tiles, b, wide.data(), padded);
      for (int64_t r = 0; r < M; ++r)
        std::copy(wide.data() + r * padded, wide.data() + r * padded + n, y + r * ldy + n0);
    }
    return;
  }
  // x's quantized rows, in buffers the calling thread keeps (no allocation per call); the
  // other threads get their addresses (a thread_local named in a lambda is the running
  // thread's own)
  static thread_local std::vector<int8_t> q_buffer;
  static thread_local std::vector<float> d_buffer, s_buffer;
  q_buffer.resize(std::max<size_t>(q_buffer.size(), M * K));
  d_buffer.resize(std::max<size_t>(d_buffer.size(), M * num_blocks));
  s_buffer.resize(std::max<size_t>(s_buffer.size(), M * num_blocks));
  int8_t* const q = q_buffer.data();
  float* const d = d_buffer.data();
  float* const s = s_buffer.data();
  auto quantize_rows = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row_fast(x + r * ldx, K, q + r * K, d + r * num_blocks, s + r * num_blocks);
  };
  if (M * K < 65536) {  // a decode step's few rows: not worth a parallel region
    quantize_rows(0, M);
  } else {
    par.for_range(M, 1, quantize_rows);
  }
  auto row = [&](int64_t r) {
    return QuantizedRow{q + r * K, d + r * num_blocks, s + r * num_blocks};
  };
  // ~16 KB of weights a range at least, and every thread busy where N allows
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(
      16384 / std::max<int64_t>(1, row_bytes), N / std::max<int64_t>(1, par.num_threads())));
  par.for_range(N, grain, [&](int64_t begin, int64_t end) {
    float out[kRowGroup];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* wrow = w + n * row_bytes;
      const float b = bias ? bias[n] : 0.f;
      int64_t r = 0;
      for (; r + kRowGroup <= M; r += kRowGroup) {
        const QuantizedRow group[kRowGroup] = {row(r), row(r + 1), row(r + 2), row(r + 3)};
        dot_rows<kRowGroup>(qtype, wrow, K, group, out);
        for (int i = 0; i < kRowGroup; ++i) y[(r + i) * ldy + n] = out[i] + b;
      }
      for (; r < M; ++r) {
        const QuantizedRow alone = row(r);
        dot_rows<1>(qtype, wrow, K, &alone, out);
        y[r * ldy + n] = out[0] + b;
      }
    }
  });
}

}  // namespace pagedjax::cpu_quant
