// The torch-free core of the C++ CPU attention, shared by the torch op (attention_cpu.cpp) and
// the JAX FFI handler (attention_ffi.cpp). Parallel over (query row, KV head): one work item
// serves the G query heads of a KV head, reading each K/V tile once per pass for all G
// (converted once per pass for bf16/fp16). The softmax takes two passes over the visible
// context (logits, then values); float32 has AVX2 paths for the dot products, the exp and the
// value sums, chosen at run time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "attention_shape.h"
#include "cpu_features.h"

namespace pagedjax::cpu_attention {

// Raw views of the int32 batch metadata.
struct RaggedBatch {
  const int32_t* kv_lens;          // [S]
  const int32_t* block_tables;     // [S, M]
  const int32_t* query_start_loc;  // [S+1]
};

// What is wrong with the metadata values, which the kernel then trusts ("" when nothing).
inline std::string metadata_error(const AttentionShape& shape, const RaggedBatch& batch) {
  std::ostringstream error;
  const int32_t* qsl = batch.query_start_loc;
  if (qsl[0] != 0) error << "query_start_loc[0] must be 0, got " << qsl[0];
  if (error.tellp() == 0 && qsl[shape.num_seqs] > shape.num_tokens) {
    error << "query_start_loc[-1]=" << qsl[shape.num_seqs] << " exceeds num_tokens="
          << shape.num_tokens;
  }
  for (int64_t s = 0; s < shape.num_seqs && error.tellp() == 0; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    const int64_t kv_len = batch.kv_lens[s];
    if (q_len < 0) {
      error << "query_start_loc must be non-decreasing, got " << qsl[s] << " then "
            << qsl[s + 1] << " at sequence " << s;
    } else if (q_len > kv_len) {
      error << "sequence " << s << " has q_len=" << q_len << " > kv_lens[" << s << "]="
            << kv_len;
    } else if (kv_len > shape.max_blocks * shape.block_size) {
      error << "kv_lens[" << s << "]=" << kv_len << " does not fit in " << shape.max_blocks
            << " blocks of " << shape.block_size;
    }
    const int64_t num_used_blocks = (kv_len + shape.block_size - 1) / shape.block_size;
    for (int64_t b = 0; b < num_used_blocks && error.tellp() == 0; ++b) {
      const int32_t block = batch.block_tables[s * shape.max_blocks + b];
      if (block < 0 || block >= shape.num_blocks) {
        error << "block_tables[" << s << ", " << b << "]=" << block << " is out of range [0, "
              << shape.num_blocks << ")";
      }
    }
  }
  return error.tellp() == 0 ? "" : "ragged_paged_attention: " + error.str();
}

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  constexpr int64_t kLanes = 8;  // independent partial sums, so the loop vectorises
  T partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) partial[j] += a[i + j] * b[i + j];
  }
  T sum = 0;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int64_t j = 0; j < kLanes; ++j) sum += partial[j];
  return sum;
}

#if defined(__x86_64__)
// exp(x) for 8 floats: Cephes' expf (range reduction by ln 2, degree-5 polynomial), ~1 ulp
// over the softmax's range; x below -88 gives ~0, as exp does.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                    _mm256_set1_ps(-88.3762626647949f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

// p[i] = exp(p[i] - shift) for i < n, returning their sum.
__attribute__((target("avx2,fma"))) inline float exp_shifted_avx2(float* p, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 total = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), s));
    _mm256_storeu_ps(p + i, e);
    total = _mm256_add_ps(total, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, total);
  float sum = 0.f;
  for (int j = 0; j < 8; ++j) sum += lanes[j];
  for (; i < n; ++i) sum += (p[i] = std::exp(p[i] - shift));
  return sum;
}

// [sum of v[0]'s lanes, ..., sum of v[7]'s lanes]: one reduction tree for 8 dot products. Each
// sum's order is fixed ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), whichever vector it
// sits in, so a key's logit does not depend on its neighbours.
__attribute__((target("avx2,fma"))) inline __m256 sum_lanes8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// p[i] = q . k[i] for the n keys k [n, D] (D a multiple of 8), 8 keys at a time: a key's lanes
// are one FMA chain over D, and the 8 horizontal sums share one reduction tree (per key it
// cost as much as the products at head_dim 32).
__attribute__((target("avx2,fma"))) inline void logits_avx2(const float* q, const float* k,
                                                            int64_t n, int64_t D, float* p) {
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t m = std::min<int64_t>(8, n - i);
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    if (m == 8) {
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + (i + j) * D + d), acc[j]);
      }
      _mm256_storeu_ps(p + i, sum_lanes8(acc));
    } else {  // the last n % 8 keys: the same chains, unused lanes left at zero
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int64_t j = 0; j < m; ++j)
          acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + (i + j) * D + d), acc[j]);
      }
      float sums[8];
      _mm256_storeu_ps(sums, sum_lanes8(acc));
      std::copy(sums, sums + m, p + i);
    }
  }
}

// acc [D] += sum_i p[i] * v[i] over the n values v [n, D] (D a multiple of 8).
__attribute__((target("avx2,fma"))) inline void accumulate_avx2(float* acc, const float* p,
                                                         const float* v, int64_t n, int64_t D) {
  for (int64_t d = 0; d < D; d += 8) {
    __m256 a = _mm256_loadu_ps(acc + d);
    for (int64_t i = 0; i < n; ++i)
      a = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_loadu_ps(v + i * D + d), a);
    _mm256_storeu_ps(acc + d, a);
  }
}

#endif

// Whether the float32 AVX2 paths serve head_dim D on this CPU.
inline bool use_avx2(int64_t D) { return D % 8 == 0 && cpu_has_avx2_fma(); }

template <typename T>
T exp_shifted(T* p, int64_t n, T shift) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_fma()) return exp_shifted_avx2(p, n, shift);
  }
#endif
  T sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (p[i] = std::exp(p[i] - shift));
  return sum;
}

// p[i] = q . k[i] for the n keys k [n, D].
template <typename T>
void logits(const T* q, const T* k, int64_t n, int64_t D, T* p) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>) {
    if (use_avx2(D)) return logits_avx2(q, k, n, D, p);
  }
#endif
  for (int64_t i = 0; i < n; ++i) p[i] = dot(q, k + i * D, D);
}

// acc [D] += sum_i p[i] * v[i] over the n values v [n, D].
template <typename T>
void accumulate(T* acc, const T* p, const T* v, int64_t n, int64_t D) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>) {
    if (use_avx2(D)) return accumulate_avx2(acc, p, v, n, D);
  }
#endif
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; ++d) acc[d] += p[i] * v[i * D + d];
}


// Per-worker scratch: the G query rows of one KV head, their logits and softmax sums.
template <typename acc_t>
struct Scratch {
  Scratch(int64_t group, int64_t block_size, int64_t head_dim, int64_t max_context)
      : q(group * head_dim), acc(group * head_dim), l(group), k(block_size * head_dim),
        v(block_size * head_dim), p(group * max_context) {}
  std::vector<acc_t> q;     // [G, D], pre-scaled by sm_scale
  std::vector<acc_t> acc;   // [G, D], unnormalised output
  std::vector<acc_t> l;     // [G], sum of exp
  std::vector<acc_t> k, v;  // [bs, D], one converted tile (non-acc_t caches)
  std::vector<acc_t> p;     // [G, context], logits, then exp(logit - max)
};

template <typename scalar_t, typename acc_t>
struct CpuAttention {
  const AttentionShape& shape;
  RaggedBatch batch;
  const scalar_t* q;  // [T, Hq, D], strided over T and Hq
  int64_t q_stride_token, q_stride_head;
  const scalar_t* k_cache;  // [N, Hkv, bs, D]
  const scalar_t* v_cache;  // [N, Hkv, bs, D]
  scalar_t* out;            // [T, Hq, D], contiguous
  acc_t sm_scale;
  int64_t sliding_window;  // 0: none
  acc_t soft_cap;          // 0: none

  // Index of the sequence owning query row t, or -1 for a padding row.
  int64_t sequence_of_row(int64_t t) const {
    const int32_t* starts = batch.query_start_loc;
    if (t >= starts[shape.num_seqs]) return -1;
    return std::upper_bound(starts + 1, starts + shape.num_seqs + 1, t) - (starts + 1);
  }

  // Query row t, KV head h: writes out[t, h*G:(h+1)*G, :]. Two passes over the visible keys:
  // the logits of all G query heads first, one softmax per head, then the weighted values.
  void run(int64_t t, int64_t h, Scratch<acc_t>& sc) const {
    const int64_t G = shape.group, D = shape.head_dim, bs = shape.block_size;
    scalar_t* o = out + (t * shape.num_q_heads + h * G) * D;  // [G, D]
    const int64_t s = sequence_of_row(t);
    if (s < 0) {
      std::fill(o, o + G * D, scalar_t(0));
      return;
    }
    const int32_t start = batch.query_start_loc[s];
    const int64_t q_len = batch.query_start_loc[s + 1] - start;
    const int64_t pos = batch.kv_lens[s] - q_len + (t - start);
    const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
    const int64_t hi = pos + 1;  // visible keys: [lo, hi)
    const int64_t n_visible = hi - lo;
    const int32_t* blocks = batch.block_tables + s * shape.max_blocks;

    for (int64_t g = 0; g < G; ++g) {
      const scalar_t* qg = q + t * q_stride_token + (h * G + g) * q_stride_head;
      for (int64_t d = 0; d < D; ++d) sc.q[g * D + d] = static_cast<acc_t>(qg[d]) * sm_scale;
    }
    // p [G, n_visible]: logits, then probabilities (unnormalised)
    for (int64_t b = lo / bs; b * bs < hi; ++b) {
      const int64_t first = std::max(lo, b * bs), n = std::min(hi, (b + 1) * bs) - first;
      const acc_t* k = tile(k_cache, blocks[b], h, first - b * bs, n, sc.k);
      for (int64_t g = 0; g < G; ++g) {
        acc_t* p = &sc.p[g * n_visible + first - lo];
        logits(&sc.q[g * D], k, n, D, p);
        if (soft_cap > 0) {
          for (int64_t i = 0; i < n; ++i) p[i] = soft_cap * std::tanh(p[i] / soft_cap);
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      acc_t* p = &sc.p[g * n_visible];
      sc.l[g] = exp_shifted(p, n_visible, *std::max_element(p, p + n_visible));
    }
    std::fill(sc.acc.begin(), sc.acc.end(), acc_t(0));
    for (int64_t b = lo / bs; b * bs < hi; ++b) {
      const int64_t first = std::max(lo, b * bs), n = std::min(hi, (b + 1) * bs) - first;
      const acc_t* v = tile(v_cache, blocks[b], h, first - b * bs, n, sc.v);
      for (int64_t g = 0; g < G; ++g) {
        accumulate(&sc.acc[g * D], &sc.p[g * n_visible + first - lo], v, n, D);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const acc_t inv_l = acc_t(1) / sc.l[g];  // >= 1: the max logit's term is exp(0)
      for (int64_t d = 0; d < D; ++d) {
        o[g * D + d] = static_cast<scalar_t>(sc.acc[g * D + d] * inv_l);
      }
    }
  }

  // Rows [offset, offset + n) of one (block, KV head) tile of a cache as acc_t: in place when
  // the cache is acc_t already, else converted into buffer.
  const acc_t* tile(const scalar_t* cache, int64_t block, int64_t h, int64_t offset, int64_t n,
                    std::vector<acc_t>& buffer) const {
    const int64_t D = shape.head_dim;
    const scalar_t* src = cache + ((block * shape.num_kv_heads + h) * shape.block_size + offset) * D;
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      return src;
    } else {
      std::copy(src, src + n * D, buffer.begin());
      return buffer.data();
    }
  }
};

}  // namespace pagedjax::cpu_attention
