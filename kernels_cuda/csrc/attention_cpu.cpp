// C++ CPU kernels of the pagedjax ops. Inputs fp32/fp64/bf16/fp16, accumulation in
// at::opmath_type (fp32, or fp64 for fp64 inputs). Attention is parallel over (query row, KV
// head): one work item serves the G query heads of a KV head, so each K/V tile it reads is
// converted once and used G times; the softmax is computed online over the KV blocks.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention.h"

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

// Per-worker scratch: the G query rows of one KV head and their running softmax state.
template <typename acc_t>
struct Scratch {
  Scratch(int64_t group, int64_t block_size, int64_t head_dim)
      : q(group * head_dim), acc(group * head_dim), m(group), l(group),
        k(block_size * head_dim), v(block_size * head_dim), p(block_size) {}
  std::vector<acc_t> q;     // [G, D], pre-scaled by sm_scale
  std::vector<acc_t> acc;   // [G, D], unnormalised output
  std::vector<acc_t> m, l;  // [G], running max and running sum of exp
  std::vector<acc_t> k, v;  // [bs, D], the visible keys/values of one block
  std::vector<acc_t> p;     // [bs], logits, then probabilities
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

  // Query row t, KV head h: writes out[t, h*G:(h+1)*G, :].
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

    for (int64_t g = 0; g < G; ++g) {
      const scalar_t* qg = q + t * q_stride_token + (h * G + g) * q_stride_head;
      for (int64_t d = 0; d < D; ++d) sc.q[g * D + d] = static_cast<acc_t>(qg[d]) * sm_scale;
    }
    std::fill(sc.m.begin(), sc.m.end(), -std::numeric_limits<acc_t>::infinity());
    std::fill(sc.l.begin(), sc.l.end(), acc_t(0));
    std::fill(sc.acc.begin(), sc.acc.end(), acc_t(0));
    for (int64_t b = lo / bs; b * bs < hi; ++b) {
      const int64_t first = std::max(lo, b * bs), last = std::min(hi, (b + 1) * bs);
      attend_block(batch.block_tables[s * shape.max_blocks + b], h, first - b * bs, last - first,
                   sc);
    }
    for (int64_t g = 0; g < G; ++g) {
      const acc_t inv_l = sc.l[g] > 0 ? acc_t(1) / sc.l[g] : acc_t(0);
      for (int64_t d = 0; d < D; ++d) {
        o[g * D + d] = static_cast<scalar_t>(sc.acc[g * D + d] * inv_l);
      }
    }
  }

  // Keys/values [offset, offset + n) of one (block, KV head) tile: one online-softmax step.
  void attend_block(int64_t block, int64_t h, int64_t offset, int64_t n,
                    Scratch<acc_t>& sc) const {
    const int64_t D = shape.head_dim;
    const int64_t tile = ((block * shape.num_kv_heads + h) * shape.block_size + offset) * D;
    std::copy(k_cache + tile, k_cache + tile + n * D, sc.k.begin());
    std::copy(v_cache + tile, v_cache + tile + n * D, sc.v.begin());
    for (int64_t g = 0; g < shape.group; ++g) {
      acc_t block_max = -std::numeric_limits<acc_t>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        acc_t logit = dot(&sc.q[g * D], &sc.k[i * D], D);
        if (soft_cap > 0) logit = soft_cap * std::tanh(logit / soft_cap);
        sc.p[i] = logit;
        block_max = std::max(block_max, logit);
      }
      const acc_t m_new = std::max(sc.m[g], block_max);  // finite: n >= 1
      const acc_t alpha = std::exp(sc.m[g] - m_new);    // 0 on the first block
      acc_t sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        sc.p[i] = std::exp(sc.p[i] - m_new);
        sum += sc.p[i];
      }
      sc.m[g] = m_new;
      sc.l[g] = sc.l[g] * alpha + sum;
      acc_t* acc = &sc.acc[g * D];
      for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
      for (int64_t i = 0; i < n; ++i) {
        const acc_t* vi = &sc.v[i * D];
        for (int64_t d = 0; d < D; ++d) acc[d] += sc.p[i] * vi[d];
      }
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
                           Scratch<acc_t> scratch(shape.group, shape.block_size, shape.head_dim);
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
