// The torch-free core of the grammar's token mask on the CPU (structured outputs), the torch
// op's (../torch/token_mask_cpu.cpp): per row of logits x [R, V] float32 and its bitmask [R, W]
// int32 (bit t % 32 of word t / 32 set: token t allowed; 32 W >= V), the masked row (x where
// allowed, -inf elsewhere) and its argmax, the greedy token under the grammar, in the same pass.
// backends/torch/sampler.py's apply_token_bitmask (torch ops) is the reference.
//
// Why hand-written: torch's branch-free form (each bit turned into a 0.0 or -inf bias, added)
// makes four [R, W, 32] int32 tensors, then an argmax reads the result again: 240 µs at
// [32, 4096] on this project's 2-core host, in a step whose grammar costs are the budget
// (issue 28: at most 10 % at batch 32). This reads each logit once and each word once.
//
// Argmax semantics (the samplers'): the first index of the maximum, a NaN counting as the maximum
// (the first NaN wins); a row with every token masked has argmax 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_features.h"
#include "logits_cpu_kernel.h"  // cpu_logits::horizontal

namespace pagedjax::cpu_token_mask {

inline bool allowed(const int32_t* bits, int64_t t) {
  return (static_cast<uint32_t>(bits[t >> 5]) >> (t & 31)) & 1u;
}

// One row, plain C++ (the reference the AVX2 path must match bit for bit).
inline void mask_row_scalar(const float* x, const int32_t* bits, int64_t V, float* out,
                            int32_t* argmax) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float top = neg_inf;
  int64_t at = 0;
  bool nan = false;
  for (int64_t i = 0; i < V; ++i) {
    const float v = allowed(bits, i) ? x[i] : neg_inf;
    out[i] = v;
    if (nan) continue;
    if (std::isnan(v)) {
      nan = true;
      at = i;
    } else if (v > top) {
      top = v;
      at = i;
    }
  }
  *argmax = static_cast<int32_t>(at);
}

#if defined(__x86_64__)
// Pass 1, a 32-token word at a time: each group of 8 bits → a lane mask, blended with -inf,
// stored, and the running maximum (and NaN flag) kept. Pass 2, from the L1/L2: the first index
// of the maximum (or of the first NaN: the scalar path answers).
__attribute__((target("avx2,fma"))) inline void mask_row_avx2(const float* x,
                                                              const int32_t* bits, int64_t V,
                                                              float* out, int32_t* argmax) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 top8 = neg_inf;
  __m256 nan8 = _mm256_setzero_ps();
  const int64_t words = V / 32;
  for (int64_t w = 0; w < words; ++w) {
    const uint32_t word = static_cast<uint32_t>(bits[w]);
    for (int g = 0; g < 4; ++g) {
      const __m256i b = _mm256_set1_epi32(static_cast<int32_t>((word >> (8 * g)) & 0xFFu));
      const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(b, lane_bit), lane_bit);
      const int64_t i = 32 * w + 8 * g;
      const __m256 v = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(x + i), _mm256_castsi256_ps(on));
      _mm256_storeu_ps(out + i, v);
      top8 = _mm256_max_ps(top8, v);
      nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  }
  float top = cpu_logits::horizontal(top8, true);
  bool nan = _mm256_movemask_ps(nan8) != 0;
  for (int64_t i = 32 * words; i < V; ++i) {  // the last, partial word
    const float v = allowed(bits, i) ? x[i] : -std::numeric_limits<float>::infinity();
    out[i] = v;
    nan |= std::isnan(v);
    top = v > top ? v : top;
  }
  if (nan) {  // rare: the first NaN, found by the plain path
    mask_row_scalar(x, bits, V, out, argmax);
    return;
  }
  const __m256 top_v = _mm256_set1_ps(top);
  const int64_t body = V / 8 * 8;
  int64_t at = -1;
  for (int64_t i = 0; i < body && at < 0; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(out + i), top_v,
                                                      _CMP_EQ_OQ));
    if (hits) at = i + __builtin_ctz(hits);
  }
  for (int64_t i = body; i < V && at < 0; ++i) {
    if (out[i] == top) at = i;
  }
  *argmax = static_cast<int32_t>(at < 0 ? 0 : at);  // every token masked: -inf == -inf at 0
}
#endif

// Rows [begin, end) of x [R, V] and bitmask [R, W] → out [R, V] and argmax [R].
inline void mask_rows(const float* x, int64_t V, const int32_t* bitmask, int64_t W, float* out,
                      int32_t* argmax, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
#if defined(__x86_64__)
    if (cpu_has_avx2_fma()) {
      mask_row_avx2(x + r * V, bitmask + r * W, V, out + r * V, argmax + r);
      continue;
    }
#endif
    mask_row_scalar(x + r * V, bitmask + r * W, V, out + r * V, argmax + r);
  }
}

}  // namespace pagedjax::cpu_token_mask
