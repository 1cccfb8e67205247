// The torch-free core of the C++ CPU attention, shared by the torch op
// (../torch/attention_cpu.cpp), the JAX FFI handler (../xla_ffi/cpu_ffi.cpp) and the decoder
// layer (decoder_layer_kernel.h). Parallel over (query row, KV head): one work item
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
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "../../attention_shape.h"
#include "cpu_features.h"
#include "fp8_e4m3.h"
#include "simd_math.h"

namespace pagedjax::cpu_attention {

// The shape of T query rows of num_q_heads heads over caches of dimensions [N, Hkv, bs, D] and
// block tables of [S, M] (any indexable dimensions: torch sizes, XLA FFI dimensions).
template <typename Dims>
AttentionShape attention_shape(int64_t num_tokens, int64_t num_q_heads, const Dims& cache,
                               const Dims& tables) {
  AttentionShape shape{};
  shape.num_tokens = num_tokens;
  shape.num_q_heads = num_q_heads;
  shape.head_dim = cache[3];
  shape.num_blocks = cache[0];
  shape.num_kv_heads = cache[1];
  shape.block_size = cache[2];
  shape.group = num_q_heads / shape.num_kv_heads;
  shape.num_seqs = tables[0];
  shape.max_blocks = tables[1];
  return shape;
}

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

// For GC heads g and W vectors of dimensions from d0: acc[g, d] += sum_i p[g, i] * v[i, d], each
// value vector loaded once for the GC heads, one FMA chain per element in key order.
template <int GC, int W>
__attribute__((target("avx2,fma"))) inline void accumulate_block_avx2(
    float* acc, const float* p, int64_t p_stride, const float* v, int64_t n, int64_t D,
    int64_t d0) {
  __m256 a[GC][W];
  for (int g = 0; g < GC; ++g)
    for (int j = 0; j < W; ++j) a[g][j] = _mm256_loadu_ps(acc + g * D + d0 + 8 * j);
  for (int64_t i = 0; i < n; ++i) {
    __m256 value[W];
    for (int j = 0; j < W; ++j) value[j] = _mm256_loadu_ps(v + i * D + d0 + 8 * j);
    for (int g = 0; g < GC; ++g) {
      const __m256 weight = _mm256_set1_ps(p[g * p_stride + i]);
      for (int j = 0; j < W; ++j) a[g][j] = _mm256_fmadd_ps(weight, value[j], a[g][j]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int j = 0; j < W; ++j) _mm256_storeu_ps(acc + g * D + d0 + 8 * j, a[g][j]);
}

// GC heads over all D dimensions (a multiple of 8), 8 accumulator registers at a time.
template <int GC>
__attribute__((target("avx2,fma"))) inline void accumulate_heads_avx2(
    float* acc, const float* p, int64_t p_stride, const float* v, int64_t n, int64_t D) {
  constexpr int W = 8 / GC;
  int64_t d0 = 0;
  for (; d0 + 8 * W <= D; d0 += 8 * W) {
    accumulate_block_avx2<GC, W>(acc, p, p_stride, v, n, D, d0);
  }
  for (; d0 < D; d0 += 8) accumulate_block_avx2<GC, 1>(acc, p, p_stride, v, n, D, d0);
}

// acc [G, D] += p [G, n] (rows p_stride apart) @ v [n, D], D a multiple of 8: heads in groups of
// 4, 2, 1 sharing each value load.
__attribute__((target("avx2,fma"))) inline void accumulate_avx2(float* acc, const float* p,
                                                                int64_t p_stride, const float* v,
                                                                int64_t n, int64_t D, int64_t G) {
  int64_t g = 0;
  for (; g + 4 <= G; g += 4) {
    accumulate_heads_avx2<4>(acc + g * D, p + g * p_stride, p_stride, v, n, D);
  }
  for (; g + 2 <= G; g += 2) {
    accumulate_heads_avx2<2>(acc + g * D, p + g * p_stride, p_stride, v, n, D);
  }
  for (; g < G; ++g) accumulate_heads_avx2<1>(acc + g * D, p + g * p_stride, p_stride, v, n, D);
}

// max(p[0..n)), n >= 1: 8 lanes, then their maximum (exact, so the order does not matter).
__attribute__((target("avx2,fma"))) inline float max_avx2(const float* p, int64_t n) {
  __m256 m = _mm256_set1_ps(p[0]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(p + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  float result = *std::max_element(lanes, lanes + 8);
  for (; i < n; ++i) result = std::max(result, p[i]);
  return result;
}

#endif

// Whether the float32 AVX2 paths serve head_dim D on this CPU.
inline bool use_avx2(int64_t D) { return D % 8 == 0 && cpu_has_avx2_fma(); }

template <typename T>
T max_of(const T* p, int64_t n) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>) {
    if (cpu_has_avx2_fma()) return max_avx2(p, n);
  }
#endif
  return *std::max_element(p, p + n);
}

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

// acc [G, D] += p [G, n] (rows p_stride apart) @ v [n, D].
template <typename T>
void accumulate(T* acc, const T* p, int64_t p_stride, const T* v, int64_t n, int64_t D,
                int64_t G) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>) {
    if (use_avx2(D)) return accumulate_avx2(acc, p, p_stride, v, n, D, G);
  }
#endif
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p[g * p_stride + i] * v[i * D + d];
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

constexpr int64_t kItemOverhead = 16;  // an item's fixed cost, in keys (for split_items)

// cache_t: the caches' element, scalar_t or fp8::E4M3 (an FP8 KV cache, read as code * scale).
template <typename scalar_t, typename acc_t, typename cache_t = scalar_t>
struct CpuAttention {
  const AttentionShape& shape;
  RaggedBatch batch;
  const scalar_t* q;  // [T, Hq, D], strided over T and Hq
  int64_t q_stride_token, q_stride_head;
  const cache_t* k_cache;  // [N, Hkv, bs, D]
  const cache_t* v_cache;  // [N, Hkv, bs, D]
  scalar_t* out;           // [T, Hq, D], contiguous
  acc_t sm_scale;
  int64_t sliding_window;  // 0: none
  acc_t soft_cap;          // scores soft_cap * tanh(s / soft_cap), s = scaled q . k; 0: none
  acc_t k_scale = 1, v_scale = 1;  // an fp8 cache's values are code * scale (else unused)

  // Index of the sequence owning query row t, or -1 for a padding row.
  int64_t sequence_of_row(int64_t t) const {
    const int32_t* starts = batch.query_start_loc;
    if (t >= starts[shape.num_seqs]) return -1;
    return std::upper_bound(starts + 1, starts + shape.num_seqs + 1, t) - (starts + 1);
  }

  // Item boundaries [parts + 1] over the (query row, KV head) items, row-major: contiguous
  // ranges of about equal cost (each item its row's visible keys plus a fixed cost), so that
  // threads finish together: a boundary may fall between two KV heads of a row (which read
  // different K/V), so that one decoding row's heads spread over the threads too. A sequence's
  // rows, which read the same blocks, stay together but at the boundaries.
  std::vector<int64_t> split_items(int64_t parts) const {
    const int64_t H = shape.num_kv_heads;
    const int64_t num_items = shape.num_tokens * H;
    std::vector<int64_t> cost(shape.num_tokens + 1, 0);  // prefix sums over rows, one head each
    for (int64_t t = 0; t < shape.num_tokens; ++t) {
      const int64_t seq = sequence_of_row(t);
      const auto [lo, hi] = seq < 0 ? std::pair<int64_t, int64_t>{0, 0} : visible_keys(t, seq);
      cost[t + 1] = cost[t] + (hi - lo) + kItemOverhead;
    }
    std::vector<int64_t> bounds(parts + 1, num_items);
    bounds[0] = 0;
    for (int64_t p = 1, t = 0; p < parts; ++p) {  // items whose prefix cost is within p/parts
      const int64_t target = cost[shape.num_tokens] * H * p / parts;
      while (t < shape.num_tokens && cost[t + 1] * H <= target) ++t;
      const int64_t heads =  // row t's first heads that still fit
          t < shape.num_tokens ? (target - cost[t] * H) / (cost[t + 1] - cost[t]) : 0;
      bounds[p] = std::clamp(t * H + heads, bounds[p - 1], num_items);
    }
    return bounds;
  }

  // [lo, hi): the keys query row t of sequence s sees.
  std::pair<int64_t, int64_t> visible_keys(int64_t t, int64_t s) const {
    const int32_t start = batch.query_start_loc[s];
    const int64_t q_len = batch.query_start_loc[s + 1] - start;
    const int64_t pos = batch.kv_lens[s] - q_len + (t - start);
    const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
    return {lo, pos + 1};
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
    const auto [lo, hi] = visible_keys(t, s);
    const int64_t n_visible = hi - lo;
    const int32_t* blocks = batch.block_tables + s * shape.max_blocks;

    for (int64_t g = 0; g < G; ++g) {
      const scalar_t* qg = q + t * q_stride_token + (h * G + g) * q_stride_head;
      for (int64_t d = 0; d < D; ++d) sc.q[g * D + d] = static_cast<acc_t>(qg[d]) * sm_scale;
    }
    // p [G, n_visible]: logits, then probabilities (unnormalised)
    for (int64_t b = lo / bs; b * bs < hi; ++b) {
      const int64_t first = std::max(lo, b * bs), n = std::min(hi, (b + 1) * bs) - first;
      if ((b + 1) * bs < hi) prefetch_tile(k_cache, blocks[b + 1], h, 0);
      prefetch_tile(v_cache, blocks[b], h, 1);
      const acc_t* k = tile(k_cache, blocks[b], h, first - b * bs, n, k_scale, sc.k);
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
      sc.l[g] = exp_shifted(p, n_visible, max_of(p, n_visible));
    }
    std::fill(sc.acc.begin(), sc.acc.end(), acc_t(0));
    for (int64_t b = lo / bs; b * bs < hi; ++b) {
      const int64_t first = std::max(lo, b * bs), n = std::min(hi, (b + 1) * bs) - first;
      const acc_t* v = tile(v_cache, blocks[b], h, first - b * bs, n, v_scale, sc.v);
      accumulate(sc.acc.data(), &sc.p[first - lo], n_visible, v, n, D, G);
    }
    for (int64_t g = 0; g < G; ++g) {
      const acc_t inv_l = acc_t(1) / sc.l[g];  // >= 1: the max logit's term is exp(0)
      for (int64_t d = 0; d < D; ++d) {
        o[g * D + d] = static_cast<scalar_t>(sc.acc[g * D + d] * inv_l);
      }
    }
  }

  // Asks for one (block, KV head) tile ahead of its use: into L1 (level 0) or L2 (level 1).
  void prefetch_tile(const cache_t* cache, int64_t block, int64_t h, int level) const {
    const char* src = reinterpret_cast<const char*>(
        cache + (block * shape.num_kv_heads + h) * shape.block_size * shape.head_dim);
    const int64_t bytes = shape.block_size * shape.head_dim * int64_t(sizeof(cache_t));
    for (int64_t i = 0; i < bytes; i += 64) {
      if (level == 0) __builtin_prefetch(src + i, 0, 3);
      else __builtin_prefetch(src + i, 0, 2);
    }
  }

  // Rows [offset, offset + n) of one (block, KV head) tile of a cache as acc_t: in place when
  // the cache is acc_t already, else converted into buffer (an fp8 cache's times its scale).
  const acc_t* tile(const cache_t* cache, int64_t block, int64_t h, int64_t offset, int64_t n,
                    acc_t scale, std::vector<acc_t>& buffer) const {
    const int64_t D = shape.head_dim;
    const cache_t* src = cache + ((block * shape.num_kv_heads + h) * shape.block_size + offset) * D;
    if constexpr (std::is_same_v<cache_t, acc_t>) {
      return src;
    } else if constexpr (fp8::is_fp8<cache_t>) {
      fp8::load_row(src, buffer.data(), n * D, scale);
      return buffer.data();
    } else {
      std::copy(src, src + n * D, buffer.begin());
      return buffer.data();
    }
  }
};

// Every (query row, KV head) item of `attention`, in one contiguous range of about equal cost per
// thread of `par` (parallel.h), each range with its own scratch.
template <typename Parallel, typename scalar_t, typename acc_t, typename cache_t>
void run_items(const Parallel& par, const CpuAttention<scalar_t, acc_t, cache_t>& attention) {
  const AttentionShape& shape = attention.shape;
  const int64_t num_items = shape.num_tokens * shape.num_kv_heads;
  const int64_t parts =
      std::clamp<int64_t>(par.num_threads(), 1, std::max<int64_t>(num_items, 1));
  const std::vector<int64_t> bounds = attention.split_items(parts);
  par.for_range(parts, 1, [&](int64_t p0, int64_t p1) {
    Scratch<acc_t> scratch(shape.group, shape.block_size, shape.head_dim,
                           shape.max_blocks * shape.block_size);
    for (int64_t item = bounds[p0]; item < bounds[p1]; ++item) {
      attention.run(item / shape.num_kv_heads, item % shape.num_kv_heads, scratch);
    }
  });
}

}  // namespace pagedjax::cpu_attention
