// C++ CPU kernels of the pagedjax torch ops: attention (its core in
// ../kernels/attention_cpu_kernel.h, accumulating in at::opmath_type: fp32, or fp64 for fp64
// inputs) and write_kv. Inputs fp32/fp64/bf16/fp16; caches of their dtype or float8_e4m3fn (an
// FP8 KV cache, read as the bytes of ../kernels/fp8_e4m3.h).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

#include "../../attention.h"
#include "../kernels/attention_cpu_kernel.h"
#include "../kernels/fp8_e4m3.h"
#include "torch_parallel.h"

namespace pagedjax {
namespace {

using cpu_attention::CpuAttention;
using cpu_attention::RaggedBatch;

// The cache's elements as the kernels read them: scalar_t, or fp8::E4M3 for a float8 cache.
template <typename cache_t>
cache_t* cache_data(const at::Tensor& cache) {
  return static_cast<cache_t*>(cache.data_ptr());
}

template <typename scalar_t, typename cache_t, typename index_t>
void write_kv_kernel(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& slot_mapping, float k_scale,
                     float v_scale) {
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t head_dim = k_cache.size(3), num_slots = k_cache.size(0) * block_size;
  const index_t* slots = slot_mapping.const_data_ptr<index_t>();  // [T]
  const scalar_t* k_src = k.const_data_ptr<scalar_t>();           // [T, Hkv, D], strided
  const scalar_t* v_src = v.const_data_ptr<scalar_t>();
  cache_t* k_dst = cache_data<cache_t>(k_cache);  // [N, Hkv, bs, D]
  cache_t* v_dst = cache_data<cache_t>(v_cache);
  at::parallel_for(0, k.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding row
      TORCH_CHECK(slot < num_slots, "write_kv: slot_mapping[", t, "]=", slot,
                  " is out of range for a cache of ", num_slots, " slots");
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_dim;
        fp8::store_row(k_src + t * k.stride(0) + h * k.stride(1), k_dst + dst, head_dim, k_scale);
        fp8::store_row(v_src + t * v.stride(0) + h * v.stride(1), v_dst + dst, head_dim, v_scale);
      }
    }
  });
}

// Calls fn with cache_t: scalar_t, or fp8::E4M3 where the cache is float8_e4m3fn.
template <typename scalar_t, typename Fn>
void dispatch_cache(const at::Tensor& cache, const Fn& fn) {
  if (cache.scalar_type() == at::kFloat8_e4m3fn) {
    fn(fp8::E4M3{});
  } else {
    fn(scalar_t{});
  }
}

}  // namespace

void ragged_paged_attention_out_cpu(const at::Tensor& out, const at::Tensor& q,
                                    const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& kv_lens, const at::Tensor& block_tables,
                                    const at::Tensor& query_start_loc, double sm_scale,
                                    std::optional<int64_t> sliding_window,
                                    std::optional<double> soft_cap,
                                    std::optional<int64_t> /*max_query_len: CUDA-only hint*/,
                                    double k_scale, double v_scale) {
  const AttentionShape shape =
      check_attention_args(out, q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                           sliding_window, soft_cap, k_scale, v_scale);
  const RaggedBatch batch{kv_lens.const_data_ptr<int32_t>(),
                          block_tables.const_data_ptr<int32_t>(),
                          query_start_loc.const_data_ptr<int32_t>()};
  const std::string error = cpu_attention::metadata_error(shape, batch);
  TORCH_CHECK(error.empty(), error);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "ragged_paged_attention_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        dispatch_cache<scalar_t>(k_cache, [&](auto cache_element) {
          using cache_t = decltype(cache_element);
          const CpuAttention<scalar_t, acc_t, cache_t> attention{
              shape, batch, q.const_data_ptr<scalar_t>(), q.stride(0), q.stride(1),
              cache_data<const cache_t>(k_cache), cache_data<const cache_t>(v_cache),
              out.mutable_data_ptr<scalar_t>(), static_cast<acc_t>(sm_scale),
              sliding_window.value_or(0), static_cast<acc_t>(soft_cap.value_or(0.0)),
              static_cast<acc_t>(k_scale), static_cast<acc_t>(v_scale)};
          // One item per (query row, KV head), in one contiguous range of equal cost per thread.
          cpu_attention::run_items(TorchParallel{}, attention);
        });
      });
}

void write_kv_cpu(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& slot_mapping, double k_scale,
                  double v_scale) {
  check_write_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cpu", [&] {
    dispatch_cache<scalar_t>(k_cache, [&](auto cache_element) {
      using cache_t = decltype(cache_element);
      AT_DISPATCH_INDEX_TYPES(slot_mapping.scalar_type(), "write_kv_cpu", [&] {
        write_kv_kernel<scalar_t, cache_t, index_t>(k, v, k_cache, v_cache, slot_mapping,
                                                    static_cast<float>(k_scale),
                                                    static_cast<float>(v_scale));
      });
    });
  });
}

}  // namespace pagedjax
