// The quantized linear's x86 integer-dot kernels (quant_linear_kernel.h's numerics), included
// there twice: in namespace avx2 (compiled for AVX2 + F16C, dot_add: maddubs + madd) and in
// namespace vnni (AVX-512 VNNI on 256-bit registers, dot_add: dpbusd), each under its own
// `#pragma GCC target`, so that every intrinsic inlines into the kernel that calls it. No
// include guard or #pragma once, on purpose. dot_add(lanes, u, x): lanes + the 4-byte dots of
// unsigned u and signed x, exact. QT: the blocks' type (a template argument: no branch on it
// inside the loops). Fine: x comes in two planes (q, and the residual r: quant_linear_kernel.h;
// Q4 only), each dotted with the same unpacked weights: I = 256 (u . q) + u . r. A Q4 block's dots
// accumulate as pairs (pair_add: AVX2's maddubs summed in int16, exact: 8 pairs of at most
// 2 x 15 x 128 each, widened to int32 once a block; dpbusd's int32 as they are), Q8_0's with
// dot_add (its pairs reach 2 x 127 x 127).

// Plain rows: one weight row against MR rows of x (a horizontal sum per block and row).
template <int64_t QT, int MR, bool Fine>
__attribute__((optimize("fp-contract=off"))) void dot_rows(
    const Blocks& w, int64_t n, const QuantizedRow* xs, float* y) {
  float acc[MR], off[MR];
  for (int r = 0; r < MR; ++r) acc[r] = off[r] = 0.f;
  constexpr int64_t qtype = QT;
  const int64_t bytes = w.bytes();
  const uint8_t* row = w.data + n * w.num_blocks() * bytes;
  const __m256i low_mask = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < w.num_blocks(); ++b) {
    const uint8_t* block = row + b * bytes;
    uint16_t halves[2];
    std::memcpy(halves, block, sizeof halves);
    const float dw = _cvtsh_ss(halves[0]);
    const float mw = qtype == kQ4_1 ? _cvtsh_ss(halves[1]) : 0.f;
    __m256i u;  // the weights as unsigned bytes: Q4's nibbles, Q8_0's magnitudes
    __m256i sign = _mm256_setzero_si256();
    if constexpr (QT == kQ8_0) {
      sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
      u = _mm256_sign_epi8(sign, sign);
    } else {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + bytes - 16));
      u = _mm256_and_si256(
          _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low_mask);  // 0..15: low, high
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[r].q + b * kBlock));
      if constexpr (QT == kQ8_0) x = _mm256_sign_epi8(x, sign);
      __m256i lanes = dot_add(_mm256_setzero_si256(), u, x);
      if constexpr (Fine) {  // 256 (u . q) + u . r, lane by lane
        const __m256i residual =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[r].r + b * kBlock));
        lanes = dot_add(_mm256_slli_epi32(lanes, 8), u, residual);
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
      int32_t dot = _mm_cvtsi128_si32(s4);
      if constexpr (QT == kQ4_0) dot -= 8 * xs[r].sum[b];
      const float scale = dw * xs[r].d[b];
      const float product = scale * static_cast<float>(dot);
      acc[r] = acc[r] + product;
      if constexpr (QT == kQ4_1) {
        const float offset = mw * xs[r].s[b];
        off[r] = off[r] + offset;
      }
    }
  }
  for (int r = 0; r < MR; ++r) y[r] = qtype == kQ4_1 ? acc[r] + off[r] : acc[r];
}

// Interleaved: group g's 8 weight rows against MR rows of x, y[r * 8 + i]: per block, the 8
// rows' weights unpacked once into registers, each row of x's 4-byte quads broadcast against
// them (lane i: row i's dot), then the block's float step for the 8 rows at once. A row of x
// sums its block in P partial lanes (integers: any order gives the same sum), so that few rows
// do not wait on one chain of dpbusd latencies.
template <int64_t QT, int MR, bool Fine>
__attribute__((optimize("fp-contract=off"))) void dot_group(
    const Blocks& w, int64_t g, const QuantizedRow* xs, float* y) {
  constexpr int P = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  __m256 acc[MR], off[MR];
  for (int r = 0; r < MR; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  const __m256i low_mask = _mm256_set1_epi8(0x0f);
  const int64_t num_blocks = w.num_blocks();
  const uint8_t* chunk = w.chunk(g, 0);
  constexpr int64_t chunk_bytes = kGroup * (QT == kQ8_0 ? 34 : QT == kQ4_1 ? 20 : 18);
  for (int64_t b = 0; b < num_blocks; ++b, chunk += chunk_bytes) {
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk)));
    const uint8_t* quants = chunk + (QT == kQ4_1 ? 32 : 16);
    __m256i lanes[MR][P], fine[MR][P];  // fine: the residual plane's dots (Q4)
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < P; ++p) lanes[r][p] = fine[r][p] = _mm256_setzero_si256();
    if constexpr (QT == kQ8_0) {
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {  // quad t of the 8 rows
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * t));
        const __m256i u = _mm256_sign_epi8(v, v);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          int32_t quad;
          std::memcpy(&quad, xs[r].q + b * kBlock + 4 * t, 4);
          lanes[r][t % P] =
              dot_add(lanes[r][t % P], u, _mm256_sign_epi8(_mm256_set1_epi32(quad), v));
        }
      }
    } else {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {  // low nibbles: quad t, high: quad t + 4 (weights 16 + 4t..)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * t));
        const __m256i low = _mm256_and_si256(v, low_mask);
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_mask);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          int32_t lo, hi;
          std::memcpy(&lo, xs[r].q + b * kBlock + 4 * t, 4);
          std::memcpy(&hi, xs[r].q + b * kBlock + 16 + 4 * t, 4);
          const int p = (2 * t) % P, p1 = (2 * t + 1) % P;
          lanes[r][p] = pair_add(lanes[r][p], low, _mm256_set1_epi32(lo));
          lanes[r][p1] = pair_add(lanes[r][p1], high, _mm256_set1_epi32(hi));
          if constexpr (Fine) {
            std::memcpy(&lo, xs[r].r + b * kBlock + 4 * t, 4);
            std::memcpy(&hi, xs[r].r + b * kBlock + 16 + 4 * t, 4);
            fine[r][p] = pair_add(fine[r][p], low, _mm256_set1_epi32(lo));
            fine[r][p1] = pair_add(fine[r][p1], high, _mm256_set1_epi32(hi));
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m256i dot = lanes[r][0];
      if constexpr (QT == kQ8_0) {
        for (int p = 1; p < P; ++p) dot = _mm256_add_epi32(dot, lanes[r][p]);
      } else {
        for (int p = 1; p < P; ++p) dot = pairs_sum(dot, lanes[r][p]);
        dot = widen(dot);
        if constexpr (Fine) {
          __m256i residual = fine[r][0];
          for (int p = 1; p < P; ++p) residual = pairs_sum(residual, fine[r][p]);
          dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), widen(residual));
        }
      }
      if constexpr (QT == kQ4_0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * xs[r].sum[b]));
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xs[r].d[b]));
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(dot)));
      if constexpr (QT == kQ4_1) {
        const __m256 mw =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16)));
        off[r] = _mm256_add_ps(off[r], _mm256_mul_ps(mw, _mm256_set1_ps(xs[r].s[b])));
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    _mm256_storeu_ps(y + r * kGroup, QT == kQ4_1 ? _mm256_add_ps(acc[r], off[r]) : acc[r]);
}
