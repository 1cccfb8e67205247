// The samplers' Gumbel-max draw on the CPU (the torch op ../torch/gumbel_cpu.cpp): per row of
// x [R, V] float32 (scaled logits, -inf where filtered), the first index of the maximum of
// x[v] - log(-log(u(seed, step, v))), u being pagedjax/rng.py's counter-based uniform (the same
// lowbias32 hashes and 23-bit uniforms, exactly): an exact categorical sample from softmax(x)
// that a seeded request draws alike on either backend.
//
// Why hand-written: torch's ops (backends/torch/sampler.py's `uniform`, the noise, argmax, the
// reference) write and read [R, V] int64 arrays about fifteen times: ~1 ms a row of SmolLM2's
// 49,152 tokens, 65 ms of a 64-row decode step that takes ~130. Here one pass over each row.
// The logs are simd_math.h's log8 on AVX2 (a few ulp from std::log), std::log otherwise, so a
// draw equals the reference's except where two candidates lie within a few ulp of each other.
// A row holding a NaN takes the first NaN (torch.argmax's rule).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_features.h"
#include "simd_math.h"

namespace pagedjax::cpu_gumbel {

constexpr uint32_t kGolden = 0x9E3779B9u;  // pagedjax/rng.py's constants
constexpr uint32_t kStream = 0x85EBCA6Bu;
constexpr uint32_t kMixMul1 = 0x7FEB352Du;
constexpr uint32_t kMixMul2 = 0x846CA68Bu;
constexpr int kUniformBits = 23;

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= kMixMul1;
  x ^= x >> 15;
  x *= kMixMul2;
  return x ^ (x >> 16);
}

// A row's key: mix32(seed ^ mix32(step * GOLDEN)); token v's hash is mix32(key + v * STREAM).
inline uint32_t row_key(uint32_t seed, uint32_t step) {
  return mix32(seed ^ mix32(step * kGolden));
}

inline float uniform_of(uint32_t bits) {
  return (static_cast<float>(bits >> (32 - kUniformBits)) + 0.5f) *
         (1.0f / static_cast<float>(1 << kUniformBits));
}

// The draw over tokens [v0, V) of a row whose tokens before v0 gave (best, at), plain C++: the
// whole row on CPUs without AVX2, the AVX2 path's last V % 8 tokens.
inline int32_t draw_from(const float* x, int64_t V, uint32_t key, int64_t v0, float best,
                         int64_t at) {
  for (int64_t v = v0; v < V; ++v) {
    if (std::isnan(x[v])) return static_cast<int32_t>(v);
    const float u = uniform_of(mix32(key + static_cast<uint32_t>(v) * kStream));
    const float value = x[v] - std::log(-std::log(u));
    if (value > best) best = value, at = v;
  }
  return static_cast<int32_t>(at);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline __m256i mix32_8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(kMixMul1)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(kMixMul2)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// 8 tokens a step, a running maximum and its first index per lane (lane j sees j, j + 8, ...),
// then the lanes' maximum at its smallest index; the last V % 8 tokens by draw_from.
__attribute__((target("avx2,fma"))) inline int32_t draw_row_avx2(const float* x, int64_t V,
                                                                 uint32_t key) {
  const __m256i step = _mm256_set1_epi32(static_cast<int32_t>(8u * kStream));
  __m256i hash_in = _mm256_add_epi32(  // key + v * STREAM for v = 0..7
      _mm256_set1_epi32(static_cast<int32_t>(key)),
      _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                         _mm256_set1_epi32(static_cast<int32_t>(kStream))));
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256i best_index = _mm256_setzero_si256();
  __m256 any_nan = _mm256_setzero_ps();
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256 unit = _mm256_set1_ps(1.0f / static_cast<float>(1 << kUniformBits));
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 xv = _mm256_loadu_ps(x + v);
    const __m256i bits = _mm256_srli_epi32(mix32_8(hash_in), 32 - kUniformBits);
    const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(bits), half), unit);
    const __m256 minus_log_u = _mm256_sub_ps(_mm256_setzero_ps(), log8(u));
    const __m256 value = _mm256_sub_ps(xv, log8(minus_log_u));
    const __m256 greater = _mm256_cmp_ps(value, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, value, greater);
    best_index = _mm256_blendv_epi8(best_index, index, _mm256_castps_si256(greater));
    any_nan = _mm256_or_ps(any_nan, _mm256_cmp_ps(xv, xv, _CMP_UNORD_Q));
    hash_in = _mm256_add_epi32(hash_in, step);
    index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
  }
  if (_mm256_movemask_ps(any_nan)) {  // the first NaN
    return draw_from(x, V, key, 0, -std::numeric_limits<float>::infinity(), 0);
  }
  float lanes[8];
  int32_t lane_index[8];
  _mm256_storeu_ps(lanes, best);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lane_index), best_index);
  float top = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  for (int j = 0; j < 8; ++j) {
    if (lanes[j] > top || (lanes[j] == top && lane_index[j] < at)) {
      top = lanes[j];
      at = lane_index[j];
    }
  }
  return draw_from(x, V, key, v, top, at);
}
#endif

// Rows [begin, end) of x [R, V] with their seeds and steps (uint32 values) → tokens[begin, end).
inline void draw_rows(const float* x, int64_t V, const uint32_t* seeds, const uint32_t* steps,
                      int32_t* tokens, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const uint32_t key = row_key(seeds[r], steps[r]);
#if defined(__x86_64__)
    if (cpu_has_avx2_fma()) {
      tokens[r] = draw_row_avx2(x + r * V, V, key);
      continue;
    }
#endif
    tokens[r] = draw_from(x + r * V, V, key, 0, -std::numeric_limits<float>::infinity(), 0);
  }
}

}  // namespace pagedjax::cpu_gumbel
