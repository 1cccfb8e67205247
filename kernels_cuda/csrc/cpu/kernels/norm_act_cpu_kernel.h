// The torch-free cores of the decoder layer's elementwise glue, shared by the torch ops
// (../torch/norm_act_cpu.cpp, ../torch/rotary_cpu.cpp) and the fused decoder layer
// (decoder_layer_kernel.h): one row at a time, float32 math with HF's roundings (see
// ../torch/norm_act_cpu.cpp); float32 rows take AVX2
// paths where the CPU has them (a row's sum of squares in a fixed order, so a row's result does
// not depend on the batch).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_features.h"
#include "simd_math.h"

namespace pagedjax::cpu_norm {

#if defined(__x86_64__)
// sum(x[i]^2) over n floats: 8 lanes, their sum in a fixed tree, then the n % 8 tail.
__attribute__((target("avx2,fma"))) inline float sum_of_squares_avx2(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
              ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

// y = weight * (x * scale) over n floats (two roundings, as the scalar loop).
__attribute__((target("avx2,fma"))) inline void scale_rows_avx2(const float* x,
                                                               const float* weight, float scale,
                                                               float* y, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(x + i), s);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), normed));
  }
  for (; i < n; ++i) y[i] = weight[i] * (x[i] * scale);
}

// out[i] = silu(gate[i]) * up[i] = gate / (1 + exp(-gate)) * up over n floats.
__attribute__((target("avx2,fma"))) inline void silu_and_mul_avx2(const float* gate,
                                                                 const float* up, float* out,
                                                                 int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}
#endif

template <typename scalar_t>
float sum_of_squares(const scalar_t* x, int64_t n) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (cpu_has_avx2_fma()) return sum_of_squares_avx2(x, n);
  }
#endif
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  return sum;
}

// y = weight * (scalar_t)(x * scale) over one row of n.
template <typename scalar_t>
void scale_row(const scalar_t* x, const scalar_t* weight, float scale, scalar_t* y, int64_t n) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (cpu_has_avx2_fma()) return scale_rows_avx2(x, weight, scale, y, n);
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t normed = static_cast<scalar_t>(static_cast<float>(x[i]) * scale);
    y[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(normed));
  }
}

// out = weight * (scalar_t)(row * rsqrt(mean(row^2) + eps)) for one row of `hidden` (float32 math).
template <typename scalar_t>
void normalize_row(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t hidden,
                   double eps) {
  const float mean = sum_of_squares(x, hidden) / static_cast<float>(hidden);
  scale_row(x, weight, 1.f / std::sqrt(mean + static_cast<float>(eps)), out, hidden);
}

// out[i] = silu(gate[i]) * up[i] over n floats (float32 rows; the torch op's other dtypes take
// ATen's silu).
inline void silu_and_mul_row(const float* gate, const float* up, float* out, int64_t n) {
#if defined(__x86_64__)
  if (cpu_has_avx2_fma()) return silu_and_mul_avx2(gate, up, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// Rotary position embedding of num_heads head vectors of d (contiguous, head_stride apart) of
// one token in place, HF's rotate_half layout, in float32, by its cos/sin rows [d]:
//   v[i]       = v[i] cos[i] - v[i + d/2] sin[i]
//   v[i + d/2] = v[i + d/2] cos[i + d/2] + v[i] sin[i + d/2]
template <typename scalar_t>
void rotate_heads(scalar_t* x, int64_t num_heads, int64_t head_stride, int64_t d,
                  const float* c, const float* s) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    scalar_t* v = x + h * head_stride;
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
      v[i] = static_cast<scalar_t>(a * c[i] - b * s[i]);
      v[i + half] = static_cast<scalar_t>(b * c[i + half] + a * s[i + half]);
    }
  }
}

}  // namespace pagedjax::cpu_norm
