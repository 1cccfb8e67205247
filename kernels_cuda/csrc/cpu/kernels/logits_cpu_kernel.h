// The torch-free core of the samplers' one pass over the logits on the CPU, shared by the torch
// op (../torch/logits_cpu.cpp) and the JAX FFI handler (../xla_ffi/cpu_ffi.cpp): per row of
// logits [R, V] float32, the greedy token (argmax) and the log-sum-exp that turns any logit into
// its logprob (logprob = logit - lse). jnp / torch reductions are the reference
// (backends/*/sampler.py).
//
// Why hand-written: a step's sampler read the logits four to six times (XLA: log_softmax's max,
// sum of exps and subtraction, written out whole, then argmax's max and first-hit; torch:
// log_softmax then argmax), and the written-out logprobs were only ever gathered at one token.
// On SmolLM2 (49,152 tokens), a 64-row step spent 35 ms of 242 there on jax and 15 of 180 on
// torch (RESULTS.md); two passes over each row, the second from the L2, take a few.
//
// Semantics, per row: argmax = the first index of the maximum, a NaN counting as the maximum
// (the first NaN wins; jnp's and the samplers' argmax); lse = max + log(sum exp(x - max)), NaN
// where the row holds one, and the maximum itself where that is infinite (every entry -inf:
// -inf). Each exp is float32 (simd_math.h's exp8 on AVX2, std::exp otherwise), summed in float32
// lanes: within a few ulp of jax.nn.logsumexp.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_features.h"
#include "simd_math.h"

namespace pagedjax::cpu_logits {

// argmax and lse of one row, plain C++ (the reference the AVX2 path must match on argmax).
inline void row_stats_scalar(const float* row, int64_t V, int32_t* argmax, float* lse) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(row[i])) {
      *argmax = static_cast<int32_t>(i);
      *lse = row[i];
      return;
    }
    if (row[i] > top) {
      top = row[i];
      at = i;
    }
  }
  *argmax = static_cast<int32_t>(at);
  if (std::isinf(top)) {
    *lse = top;
    return;
  }
  float sum = 0.f;
  for (int64_t i = 0; i < V; ++i) sum += std::exp(row[i] - top);
  *lse = top + std::log(sum);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline float horizontal(__m256 v, bool max) {
  __m128 x = max ? _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
                 : _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = max ? _mm_max_ps(x, _mm_movehl_ps(x, x)) : _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = max ? _mm_max_ss(x, _mm_shuffle_ps(x, x, 1)) : _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

// Pass 1: the maximum, and whether any entry is NaN (then the scalar path answers). Pass 2, from
// the L2: the sum of exp(x - max) and the first index holding the maximum.
__attribute__((target("avx2,fma"))) inline void row_stats_avx2(const float* row, int64_t V,
                                                               int32_t* argmax, float* lse) {
  const int64_t body = V / 8 * 8;
  __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan8 = _mm256_setzero_ps();
  for (int64_t i = 0; i < body; i += 8) {
    const __m256 x = _mm256_loadu_ps(row + i);
    top8 = _mm256_max_ps(top8, x);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  float top = horizontal(top8, true);
  bool nan = _mm256_movemask_ps(nan8) != 0;
  for (int64_t i = body; i < V; ++i) {
    nan |= std::isnan(row[i]);
    top = row[i] > top ? row[i] : top;
  }
  if (nan || std::isinf(top)) {
    row_stats_scalar(row, V, argmax, lse);
    return;
  }
  const __m256 top_v = _mm256_set1_ps(top);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t at = -1;
  for (int64_t i = 0; i < body; i += 8) {
    const __m256 x = _mm256_loadu_ps(row + i);
    sum8 = _mm256_add_ps(sum8, exp8(_mm256_sub_ps(x, top_v)));
    if (at < 0) {
      const int hits = _mm256_movemask_ps(_mm256_cmp_ps(x, top_v, _CMP_EQ_OQ));
      if (hits) at = i + __builtin_ctz(hits);
    }
  }
  float sum = horizontal(sum8, false);
  for (int64_t i = body; i < V; ++i) {
    sum += std::exp(row[i] - top);
    if (at < 0 && row[i] == top) at = i;
  }
  *argmax = static_cast<int32_t>(at);
  *lse = top + std::log(sum);
}
#endif

// Rows [begin, end) of x [R, V] → argmax [R] and lse [R].
inline void stats_rows(const float* x, int64_t V, int32_t* argmax, float* lse, int64_t begin,
                       int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
#if defined(__x86_64__)
    if (cpu_has_avx2_fma() && V >= 8) {
      row_stats_avx2(x + r * V, V, argmax + r, lse + r);
      continue;
    }
#endif
    row_stats_scalar(x + r * V, V, argmax + r, lse + r);
  }
}

}  // namespace pagedjax::cpu_logits
