// y[M, N] = x[M, K] @ W[K, N] (+ bias) on the CPU, float32, with W packed once at load time into
// column tiles: packed[t, k, j] = W[k, 16 t + j], zero-padded to a whole tile.
//
// Why: a decode step multiplies a few rows by every weight of the model. MKL's small-M GEMM runs
// these at a fraction of the memory bandwidth on some x86 parts (measured 13 GB/s on a 2-core AMD
// EPYC for M = 1, where a plain copy reaches 30). With the tile-major layout each tile is one
// contiguous stream (the prefetchers' best case), the tiles are split across threads, and a tile is
// read from DRAM once and reused from L1/L2 by every group of 4 rows.
//
// Each output element is one FMA chain over k in order, whatever M and the row grouping: a row's
// result does not depend on the other rows of the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pagedjax {
namespace {

constexpr int64_t kTile = 16;  // columns per packed tile (two 8-float AVX2 registers)
constexpr int64_t kRows = 4;   // rows per register block: 4 x 16 accumulators = 8 registers

// The rows [MR] against NT consecutive tiles, written to y (ldy floats per row) plus bias.
// Scalar version: any CPU, and the reference for the AVX2 one.
template <int MR, int NT>
void block_scalar(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias,
                  float* y, int64_t ldy) {
  float acc[MR][NT * kTile] = {};
  for (int64_t k = 0; k < K; ++k) {
    for (int t = 0; t < NT; ++t) {
      const float* wk = w + (t * K + k) * kTile;
      for (int r = 0; r < MR; ++r)
        for (int j = 0; j < kTile; ++j) acc[r][t * kTile + j] += x[r * ldx + k] * wk[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT * kTile; ++j) y[r * ldy + j] = acc[r][j] + (bias ? bias[j] : 0.f);
}

#if defined(__x86_64__)
// MR * NT * 2 independent accumulator registers: at least 8 in every instantiation used, enough
// to hide the FMA latency.
template <int MR, int NT>
__attribute__((target("avx2,fma"))) void block_avx2(const float* x, int64_t ldx, const float* w,
                                                    int64_t K, const float* bias, float* y,
                                                    int64_t ldy) {
  __m256 acc[MR][NT][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 xk[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) xk[r] = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const float* wk = w + (t * K + k) * kTile;
      const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        acc[r][t][0] = _mm256_fmadd_ps(xk[r], w0, acc[r][t][0]);
        acc[r][t][1] = _mm256_fmadd_ps(xk[r], w1, acc[r][t][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) {
    const __m256 b0 = bias ? _mm256_loadu_ps(bias + t * kTile) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + t * kTile + 8) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      _mm256_storeu_ps(y + r * ldy + t * kTile, _mm256_add_ps(acc[r][t][0], b0));
      _mm256_storeu_ps(y + r * ldy + t * kTile + 8, _mm256_add_ps(acc[r][t][1], b1));
    }
  }
}

// The same blocks with AVX-512: a tile is one 16-float register, 32 registers hold 4 rows x 4
// tiles of accumulators (16 independent chains where AVX2's 4 x 1 has 8, just what 2 FMA pipes
// of 4-cycle latency need), and each k loads 4 broadcasts and 4 tile rows for 16 FMAs: 5-10 %
// faster at 64 rows on a 2-core AMD EPYC (Zen 4), ~95 % of its FMA peak. Every element is still
// one FMA chain over k in order: the same bits as the AVX2 blocks.
template <int MR, int NT>
__attribute__((target("avx512f"))) void block_avx512(const float* x, int64_t ldx,
                                                      const float* w, int64_t K,
                                                      const float* bias, float* y,
                                                      int64_t ldy) {
  __m512 acc[MR][NT];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wk[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) wk[t] = _mm512_loadu_ps(w + (t * K + k) * kTile);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 xk = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_fmadd_ps(xk, wk[t], acc[r][t]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + t * kTile) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      _mm512_storeu_ps(y + r * ldy + t * kTile, _mm512_add_ps(acc[r][t], b));
    }
  }
}

#endif

template <int MR, int NT>
void block(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
           int64_t ldy) {
#if defined(__x86_64__)
  if (cpu_has_avx2_fma()) return block_avx2<MR, NT>(x, ldx, w, K, bias, y, ldy);
#endif
  block_scalar<MR, NT>(x, ldx, w, K, bias, y, ldy);
}

// Every row of x against NT tiles starting at tile t. AVX-512: 4 rows x NT tiles per block, then
// 2 and 1. Otherwise groups of 4 rows take one tile at a time, and the last 1-3 rows take 2 or 4
// tiles at once, keeping 8 accumulators busy.
template <int NT>
void tile_group(const float* x, int64_t ldx, int64_t M, const float* packed, int64_t K,
                const float* bias, float* y, int64_t ldy, int64_t t) {
  const float* w = packed + t * K * kTile;
  const float* b = bias ? bias + t * kTile : nullptr;
  y += t * kTile;
  int64_t m = 0;
#if defined(__x86_64__)
  if (cpu_has_avx512f()) {
    for (; m + kRows <= M; m += kRows) {
      block_avx512<kRows, NT>(x + m * ldx, ldx, w, K, b, y + m * ldy, ldy);
    }
    if (M - m >= 2) {
      block_avx512<2, NT>(x + m * ldx, ldx, w, K, b, y + m * ldy, ldy);
      m += 2;
    }
    if (m < M) block_avx512<1, NT>(x + m * ldx, ldx, w, K, b, y + m * ldy, ldy);
    return;
  }
#endif
  for (; m + kRows <= M; m += kRows)
    for (int i = 0; i < NT; ++i)
      block<kRows, 1>(x + m * ldx, ldx, w + i * K * kTile, K, b ? b + i * kTile : nullptr,
                      y + m * ldy + i * kTile, ldy);
  const int64_t left = M - m;
  if (left >= 2) {
    constexpr int NT2 = NT >= 2 ? 2 : 1;
    for (int i = 0; i < NT; i += NT2)
      block<2, NT2>(x + m * ldx, ldx, w + i * K * kTile, K, b ? b + i * kTile : nullptr,
                    y + m * ldy + i * kTile, ldy);
    m += 2;
  }
  if (left == 1 || left == 3) block<1, NT>(x + m * ldx, ldx, w, K, b, y + m * ldy, ldy);
}

void check_linear_args(const at::Tensor& x, const at::Tensor& packed_weight,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  const char* op = "pagedjax::linear";
  TORCH_CHECK(x.dim() == 2, op, ": x must be [num_rows, in_features], got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed_weight.scalar_type() == at::kFloat, op,
              ": float32 only, got x ", x.scalar_type(), " and weight ",
              packed_weight.scalar_type());
  TORCH_CHECK(x.stride(1) == 1, op, ": x's rows must be contiguous, got strides ", x.strides());
  TORCH_CHECK(packed_weight.dim() == 3 && packed_weight.size(2) == kTile &&
                  packed_weight.size(1) == x.size(1) && packed_weight.is_contiguous(),
              op, ": packed_weight must be a contiguous [ceil(out/16), in_features=", x.size(1),
              ", 16] (pack_linear_weight), got shape ", packed_weight.sizes());
  TORCH_CHECK(out_features > (packed_weight.size(0) - 1) * kTile &&
                  out_features <= packed_weight.size(0) * kTile,
              op, ": out_features=", out_features, " does not match ", packed_weight.size(0),
              " tiles of ", kTile);
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                op, ": bias must be a contiguous float32 [", out_features, "], got ",
                bias->scalar_type(), " ", bias->sizes());
  }
}

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& packed_weight,
                      const std::optional<at::Tensor>& bias, int64_t out_features) {
  check_linear_args(x, packed_weight, bias, out_features);
  const int64_t M = x.size(0), K = x.size(1), num_tiles = packed_weight.size(0);
  const int64_t padded = num_tiles * kTile;
  // The last tile's padding columns land in a padded output that is cut (a view: no copy when
  // out_features is a multiple of 16).
  at::Tensor y = at::empty({M, padded}, x.options());
  at::Tensor padded_bias;
  const float* b = nullptr;
  if (bias) {
    padded_bias = padded == out_features ? *bias : at::constant_pad_nd(*bias, {0, padded - out_features});
    b = padded_bias.data_ptr<float>();
  }
  if (M == 0) return at::empty({0, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed_weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  constexpr int64_t kGroup = 4;  // tiles per task
  const int64_t num_groups = (num_tiles + kGroup - 1) / kGroup;
  // At least ~64K multiply-adds per task, so small products stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, M * K * kGroup * kTile));
  at::parallel_for(0, num_groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t = g * kGroup;
      if (t + kGroup <= num_tiles) {
        tile_group<kGroup>(xp, ldx, M, wp, K, b, yp, padded, t);
      } else {
        for (int64_t i = t; i < num_tiles; ++i) tile_group<1>(xp, ldx, M, wp, K, b, yp, padded, i);
      }
    }
  });
  return padded == out_features ? y : y.narrow(1, 0, out_features).contiguous();
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& packed_weight,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  check_linear_args(x, packed_weight, bias, out_features);
  return at::empty({x.size(0), out_features}, x.options());
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def("linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) { m.impl("linear", &pagedjax::linear_cpu); }

TORCH_LIBRARY_IMPL(pagedjax, Meta, m) { m.impl("linear", &pagedjax::linear_meta); }
