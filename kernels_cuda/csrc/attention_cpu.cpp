// C++ CPU kernels of the pagedjax ops. Inputs fp32/fp64/bf16/fp16, accumulation in
// at::opmath_type (fp32, or fp64 for fp64 inputs). Attention is parallel over (query row, KV
// head): one work item serves the G query heads of a KV head, reading each K/V tile once per
// pass for all G (converted once per pass for bf16/fp16). The softmax takes two passes over the
// visible context (logits, then values); float32 has AVX2 paths for the dot products, the exp and
// the value sums, chosen at run time.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "attention.h"
#include "cpu_features.h"

namespace pagedjax {
namespace {

// Raw views of the (checked) int32 batch metadata.
struct RaggedBatch {
  const int32_t* kv_lens;          // [S]
  const int32_t* block_tables;     // [S, M]
  const int32_t* query_start_loc;  // [S+1]
};

// Checks the metadata values, which the kernels then trust (cheap here; CUDA cannot afford it).
void check_metadata_values(const AttentionShape& shape, const RaggedBatch& batch) {
  const char* op = "ragged_paged_attention";
  const int32_t* qsl = batch.query_start_loc;
  TORCH_CHECK(qsl[0] == 0, op, ": query_start_loc[0] must be 0, got ", qsl[0]);
  TORCH_CHECK(qsl[shape.num_seqs] <= shape.num_tokens, op, ": query_start_loc[-1]=",
              qsl[shape.num_seqs], " exceeds num_tokens=", shape.num_tokens);
  for (int64_t s = 0; s < shape.num_seqs; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    const int64_t kv_len = batch.kv_lens[s];
    TORCH_CHECK(q_len >= 0, op, ": query_start_loc must be non-decreasing, got ", qsl[s],
                " then ", qsl[s + 1], " at sequence ", s);
    TORCH_CHECK(q_len <= kv_len, op, ": sequence ", s, " has q_len=", q_len, " > kv_lens[", s,
                "]=", kv_len);
    TORCH_CHECK(kv_len <= shape.max_blocks * shape.block_size, op, ": kv_lens[", s, "]=", kv_len,
                " does not fit in ", shape.max_blocks, " blocks of ", shape.block_size);
    const int64_t num_used_blocks = (kv_len + shape.block_size - 1) / shape.block_size;
    for (int64_t b = 0; b < num_used_blocks; ++b) {
      const int32_t block = batch.block_tables[s * shape.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < shape.num_blocks, op, ": block_tables[", s, ", ", b,
                  "]=", block, " is out of range [0, ", shape.num_blocks, ")");
    }
  }
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
__attribute__((target("avx2,fma"))) __m256 exp8(__m256 x) {
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
__attribute__((target("avx2,fma"))) float exp_shifted_avx2(float* p, int64_t n, float shift) {
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

// p[i] = q . k[i] for the n keys k [n, D] (D a multiple of 8).
__attribute__((target("avx2,fma"))) void logits_avx2(const float* q, const float* k, int64_t n,
                                                     int64_t D, float* p) {
  for (int64_t i = 0; i < n; ++i) {
    const float* ki = k + i * D;
    __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(ki));
    for (int64_t d = 8; d < D; d += 8)
      sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(ki + d), sum);
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    p[i] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
  }
}

// acc [D] += sum_i p[i] * v[i] over the n values v [n, D] (D a multiple of 8).
__attribute__((target("avx2,fma"))) void accumulate_avx2(float* acc, const float* p,
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
bool use_avx2(int64_t D) { return D % 8 == 0 && cpu_has_avx2_fma(); }

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

template <typename scalar_t>
struct CpuAttention {
  using acc_t = at::opmath_type<scalar_t>;

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

template <typename scalar_t, typename index_t>
void write_kv_kernel(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t head_dim = k_cache.size(3), num_slots = k_cache.size(0) * block_size;
  const index_t* slots = slot_mapping.const_data_ptr<index_t>();  // [T]
  const scalar_t* k_src = k.const_data_ptr<scalar_t>();           // [T, Hkv, D], strided
  const scalar_t* v_src = v.const_data_ptr<scalar_t>();
  scalar_t* k_dst = k_cache.mutable_data_ptr<scalar_t>();  // [N, Hkv, bs, D]
  scalar_t* v_dst = v_cache.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, k.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding row
      TORCH_CHECK(slot < num_slots, "write_kv: slot_mapping[", t, "]=", slot,
                  " is out of range for a cache of ", num_slots, " slots");
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_dim;
        const scalar_t* k_row = k_src + t * k.stride(0) + h * k.stride(1);
        const scalar_t* v_row = v_src + t * v.stride(0) + h * v.stride(1);
        std::copy(k_row, k_row + head_dim, k_dst + dst);
        std::copy(v_row, v_row + head_dim, v_dst + dst);
      }
    }
  });
}

}  // namespace

void ragged_paged_attention_out_cpu(const at::Tensor& out, const at::Tensor& q,
                                    const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& kv_lens, const at::Tensor& block_tables,
                                    const at::Tensor& query_start_loc, double sm_scale,
                                    std::optional<int64_t> sliding_window,
                                    std::optional<double> logits_soft_cap,
                                    std::optional<int64_t> /*max_query_len: CUDA-only hint*/) {
  const AttentionShape shape =
      check_attention_args(out, q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                           sliding_window, logits_soft_cap);
  const RaggedBatch batch{kv_lens.const_data_ptr<int32_t>(),
                          block_tables.const_data_ptr<int32_t>(),
                          query_start_loc.const_data_ptr<int32_t>()};
  check_metadata_values(shape, batch);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "ragged_paged_attention_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const CpuAttention<scalar_t> attention{
            shape, batch, q.const_data_ptr<scalar_t>(), q.stride(0), q.stride(1),
            k_cache.const_data_ptr<scalar_t>(), v_cache.const_data_ptr<scalar_t>(),
            out.mutable_data_ptr<scalar_t>(), static_cast<acc_t>(sm_scale),
            sliding_window.value_or(0), static_cast<acc_t>(logits_soft_cap.value_or(0.0))};
        // One item per (query row, KV head); grain 1 as items cost up to a whole context.
        at::parallel_for(0, shape.num_tokens * shape.num_kv_heads, 1,
                         [&](int64_t begin, int64_t end) {
                           Scratch<acc_t> scratch(shape.group, shape.block_size, shape.head_dim,
                                                  shape.max_blocks * shape.block_size);
                           for (int64_t item = begin; item < end; ++item) {
                             attention.run(item / shape.num_kv_heads,
                                           item % shape.num_kv_heads, scratch);
                           }
                         });
      });
}

void write_kv_cpu(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_write_kv_args(k, v, k_cache, v_cache, slot_mapping);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(slot_mapping.scalar_type(), "write_kv_cpu", [&] {
      write_kv_kernel<scalar_t, index_t>(k, v, k_cache, v_cache, slot_mapping);
    });
  });
}

}  // namespace pagedjax
