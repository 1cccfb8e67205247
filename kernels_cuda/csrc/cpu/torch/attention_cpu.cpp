// C++ CPU kernels of the pagedjax torch ops: attention (its core in
// ../kernels/attention_cpu_kernel.h, accumulating in at::opmath_type: fp32, or fp64 for fp64
// inputs) and write_kv. Inputs fp32/fp64/bf16/fp16.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

#include "../../attention.h"
#include "../kernels/attention_cpu_kernel.h"
#include "torch_parallel.h"

namespace pagedjax {
namespace {

using cpu_attention::CpuAttention;
using cpu_attention::RaggedBatch;

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
                                    std::optional<double> soft_cap,
                                    std::optional<int64_t> /*max_query_len: CUDA-only hint*/) {
  const AttentionShape shape =
      check_attention_args(out, q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                           sliding_window, soft_cap);
  const RaggedBatch batch{kv_lens.const_data_ptr<int32_t>(),
                          block_tables.const_data_ptr<int32_t>(),
                          query_start_loc.const_data_ptr<int32_t>()};
  const std::string error = cpu_attention::metadata_error(shape, batch);
  TORCH_CHECK(error.empty(), error);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "ragged_paged_attention_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const CpuAttention<scalar_t, acc_t> attention{
            shape, batch, q.const_data_ptr<scalar_t>(), q.stride(0), q.stride(1),
            k_cache.const_data_ptr<scalar_t>(), v_cache.const_data_ptr<scalar_t>(),
            out.mutable_data_ptr<scalar_t>(), static_cast<acc_t>(sm_scale),
            sliding_window.value_or(0), static_cast<acc_t>(soft_cap.value_or(0.0))};
        // One item per (query row, KV head), in one contiguous range of equal cost per thread.
        cpu_attention::run_items(TorchParallel{}, attention);
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
