// The torch-free core of the packed float32 linear, shared by the torch op
// (../torch/linear_cpu.cpp), the JAX FFI handler (../xla_ffi/cpu_ffi.cpp) and the decoder layer
// (decoder_layer_kernel.h): y[M, N] = x[M, K] @ W[K, N] (+ bias) with W packed into column
// tiles, packed[t, k, j] = W[k, 16 t + j], zero-padded to a whole tile. See ../torch/linear_cpu.cpp
// for why this layout. `linear` splits the tiles [0, num_tiles) across threads (run_tiles).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_features.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pagedjax::cpu_linear {

constexpr int64_t kTile = 16;  // columns per packed tile (two 8-float AVX2 registers)
constexpr int64_t kRows = 4;   // AVX-512: rows per register block (4 x 4 tiles)
constexpr int kRowsAvx2 = 6;   // AVX2: rows per register block (6 x 16 columns: 12 registers)
// A few-row product streams one cache line of a tile per k step and does only 8-12 FMAs with
// it, so without help each load waits on L2 / L3 (a 5-row block spent half its samples on its
// first load: the target's pass of a speculative step at batch 1). So the first pass of 4-6
// rows over a tile asks for the tile's row kAhead k steps ahead (4 KB) into L1; the later
// passes read it from L2. Blocks of 1-3 rows read two or four tiles at once and are faster
// without (RESULTS.md, stop 73).
constexpr int64_t kAhead = 64;

// The next tiles' weights, streamed towards L2 while the current tiles compute: a block call
// that gets one issues a 64-byte line every `every` k steps (plan_prefetch). A decode step's
// weights come from DRAM: without it the first pass of rows over a tile waits for them, and the
// later passes (which hit L2) leave the memory idle. Same bits: it only moves data.
struct Prefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t every = 0;  // k steps between two lines; 0: none (the blocks then get null)
};

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
// MR * NT * 2 independent accumulator registers (12 in the main 6 x 1 block: 2 FMA pipes of 4-5
// cycles' latency need 8-10 to stay busy). Each k loads the NT tile rows, then broadcasts one
// row's x at a time and uses it at once: 12 accumulators + 2 tile registers + 1 broadcast fit
// the 16 registers, where broadcasting every row first would spill.
template <int MR, int NT, bool Ahead = false>
__attribute__((target("avx2,fma"))) void block_avx2(const float* x, int64_t ldx, const float* w,
                                                    int64_t K, const float* bias, float* y,
                                                    int64_t ldy, Prefetch* prefetch) {
  __m256 acc[MR][NT][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
  // k in chunks of `every` steps, one prefetched line before each (one chunk without: null).
  const char* next = prefetch ? prefetch->next : nullptr;
  const char* const end = prefetch ? prefetch->end : nullptr;
  const int64_t chunk = prefetch ? prefetch->every : K;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    if (next < end) {
      _mm_prefetch(next, _MM_HINT_T1);
      next += 64;
    }
    const int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t k = k0; k < k1; ++k) {
      __m256 wk[NT][2];
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        if constexpr (Ahead) {  // past the tile's end: the next tile's first lines, or none
          _mm_prefetch(reinterpret_cast<const char*>(w + (t * K + k + kAhead) * kTile),
                       _MM_HINT_T0);
        }
        wk[t][0] = _mm256_loadu_ps(w + (t * K + k) * kTile);
        wk[t][1] = _mm256_loadu_ps(w + (t * K + k) * kTile + 8);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m256 xk = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) {
          acc[r][t][0] = _mm256_fmadd_ps(xk, wk[t][0], acc[r][t][0]);
          acc[r][t][1] = _mm256_fmadd_ps(xk, wk[t][1], acc[r][t][1]);
        }
      }
    }
  }
  if (prefetch) prefetch->next = next;
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
// of 4-cycle latency need; a last block of 5 or 6 rows holds 20 or 24), and each k loads 4
// broadcasts and 4 tile rows for 16 FMAs (faster than AVX2 at 64 rows: RESULTS.md). Every
// element is still one FMA chain over k in order: the same bits as the AVX2 blocks.
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

template <int MR, int NT, bool Ahead = false>
void block(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
           int64_t ldy, Prefetch* prefetch) {
#if defined(__x86_64__)
  if (cpu_has_avx2_fma()) {
    return block_avx2<MR, NT, Ahead>(x, ldx, w, K, bias, y, ldy, prefetch);
  }
#endif
  block_scalar<MR, NT>(x, ldx, w, K, bias, y, ldy);
}

// How tile_group<NT> (AVX2) streams in the tiles [next_tile, end_tile): spread evenly over its
// block calls, at most a line every 2 k steps (none below 10 rows; a faster stream outruns the
// memory, which bounds those anyway).
template <int NT>
Prefetch plan_prefetch(const float* packed, int64_t M, int64_t K, int64_t next_tile,
                       int64_t end_tile) {
  constexpr int NT2 = NT >= 2 ? 2 : 1;
  const int64_t rest = M % kRowsAvx2;
  const int64_t calls = (M / kRowsAvx2 + (rest >= 4)) * NT +
                        (rest == 2 || rest == 3) * (NT / NT2) + (rest == 1 || rest == 3);
  const int64_t lines = (end_tile - next_tile) * K * kTile * int64_t{sizeof(float)} / 64;
  const int64_t per_call = (lines + calls - 1) / std::max<int64_t>(1, calls);
  Prefetch prefetch{reinterpret_cast<const char*>(packed + next_tile * K * kTile),
                    reinterpret_cast<const char*>(packed + end_tile * K * kTile)};
  if (per_call > 0 && K / per_call >= 2) prefetch.every = K / per_call;
  return prefetch;
}

// Every row of x against NT tiles starting at tile t. AVX-512: 4 rows x NT tiles per block, then
// the last 1-7 rows in one or two blocks. AVX2: see below; it prefetches the tiles from
// next_tile to end_tile (none if equal) as it goes.
template <int NT>
void tile_group(const float* x, int64_t ldx, int64_t M, const float* packed, int64_t K,
                const float* bias, float* y, int64_t ldy, int64_t t, int64_t next_tile,
                int64_t end_tile) {
  const float* w = packed + t * K * kTile;
  const float* b = bias ? bias + t * kTile : nullptr;
  y += t * kTile;
  int64_t m = 0;
#if defined(__x86_64__)
  if (cpu_has_avx512f()) {
    // Blocks of 4 rows while 8 or more are left; then the last 1-7 rows in one block (7: 4 + 3),
    // so that each tile row is loaded once for them: a speculative step's target pass has k + 1
    // rows per sequence (5 at batch 1, k = 4), and a 1-row block does one FMA per load.
    for (; M - m >= 8; m += kRows) {
      block_avx512<kRows, NT>(x + m * ldx, ldx, w, K, b, y + m * ldy, ldy);
    }
    if (M - m == 7) {
      block_avx512<kRows, NT>(x + m * ldx, ldx, w, K, b, y + m * ldy, ldy);
      m += kRows;
    }
    const float* xm = x + m * ldx;
    float* ym = y + m * ldy;
    switch (M - m) {
      case 6: return block_avx512<6, NT>(xm, ldx, w, K, b, ym, ldy);
      case 5: return block_avx512<5, NT>(xm, ldx, w, K, b, ym, ldy);
      case 4: return block_avx512<4, NT>(xm, ldx, w, K, b, ym, ldy);
      case 3: return block_avx512<3, NT>(xm, ldx, w, K, b, ym, ldy);
      case 2: return block_avx512<2, NT>(xm, ldx, w, K, b, ym, ldy);
      case 1: return block_avx512<1, NT>(xm, ldx, w, K, b, ym, ldy);
      default: return;
    }
  }
#endif
  // AVX2 (or scalar): blocks of 6 rows x 1 tile, then the last 1-5 rows: 5 or 4 a tile at a
  // time, 2 or 3 as 2 rows x 2 tiles (+ 1 row), 1 row against all NT tiles (8 accumulators).
  constexpr int NT2 = NT >= 2 ? 2 : 1;
  Prefetch prefetch = plan_prefetch<NT>(packed, M, K, next_tile, end_tile);
  Prefetch* pf = prefetch.every > 0 ? &prefetch : nullptr;
  auto rows_by_tile = [&](auto rows) {  // the next `rows` rows, one tile at a time
    constexpr int MR = decltype(rows)::value;
    for (int i = 0; i < NT; ++i) {
      const float* wi = w + i * K * kTile;
      const float* bi = b ? b + i * kTile : nullptr;
      float* yi = y + m * ldy + i * kTile;
      if (m == 0) {  // the tile's first pass: from L3 or memory (kAhead)
        block<MR, 1, true>(x + m * ldx, ldx, wi, K, bi, yi, ldy, pf);
      } else {
        block<MR, 1>(x + m * ldx, ldx, wi, K, bi, yi, ldy, pf);
      }
    }
    m += MR;
  };
  while (M - m >= kRowsAvx2) rows_by_tile(std::integral_constant<int, kRowsAvx2>{});
  if (M - m == 5) return rows_by_tile(std::integral_constant<int, 5>{});
  if (M - m == 4) return rows_by_tile(std::integral_constant<int, 4>{});
  const int64_t left = M - m;
  if (left >= 2) {
    for (int i = 0; i < NT; i += NT2)
      block<2, NT2>(x + m * ldx, ldx, w + i * K * kTile, K, b ? b + i * kTile : nullptr,
                    y + m * ldy + i * kTile, ldy, pf);
    m += 2;
  }
  if (left == 1 || left == 3) block<1, NT>(x + m * ldx, ldx, w, K, b, y + m * ldy, ldy, pf);
}

constexpr int64_t kGroup = 4;  // tiles a tile_group<kGroup> call takes where they line up

// Tiles per task so that a task has at least ~64K multiply-adds: small products stay on one thread.
inline int64_t tile_grain(int64_t M, int64_t K) {
  return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, M * K * kTile));
}

// Tiles [t0, t1) of y [M, num_tiles * 16] (ldy floats per row) = x [M, K] (ldx) @ packed, plus
// bias (num_tiles * 16 floats, or null): groups of kGroup tiles where they line up, single tiles
// at the ends. Callers split by tiles, not groups: 9 groups of a 576-column linear split 5 / 4
// over two threads, 36 tiles split 18 / 18.
inline void run_tiles(const float* x, int64_t ldx, int64_t M, const float* packed, int64_t K,
                      const float* bias, float* y, int64_t ldy, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1;) {
    const int64_t n = t % kGroup == 0 && t + kGroup <= t1 ? kGroup : 1;
    const int64_t next_end = std::min(t1, t + 2 * n);  // the next call's tiles: prefetched now
    if (n == kGroup) {
      tile_group<kGroup>(x, ldx, M, packed, K, bias, y, ldy, t, t + n, next_end);
    } else {
      tile_group<1>(x, ldx, M, packed, K, bias, y, ldy, t, t + n, next_end);
    }
    t += n;
  }
}

// y [M, num_tiles * 16] (ldy floats a row) = x [M, K] (ldx) @ packed (+ bias, as run_tiles),
// the tiles split across the threads of `par` (parallel.h).
template <typename Parallel>
void linear(const Parallel& par, const float* x, int64_t ldx, int64_t M, const float* packed,
            int64_t K, int64_t num_tiles, const float* bias, float* y, int64_t ldy) {
  if (M == 0) return;
  par.for_range(num_tiles, tile_grain(M, K), [&](int64_t t0, int64_t t1) {
    run_tiles(x, ldx, M, packed, K, bias, y, ldy, t0, t1);
  });
}

}  // namespace pagedjax::cpu_linear
