// The ragged paged attention ops on CUDA (torch.ops.pagedjax.ragged_paged_attention_out and the
// fused decode's decode_attention_with_kv_write_out): argument checks, then run_attention
// (attention_kernels.cuh), instantiated per input dtype in attention_{f32,f16,bf16}.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "../attention.h"
#include "attention_kernels.cuh"

namespace pagedjax {
namespace attention_impl {

extern PAGEDJAX_RUN_ATTENTION(float, float)
extern PAGEDJAX_RUN_ATTENTION(float, fp8_t)
extern PAGEDJAX_RUN_ATTENTION(c10::Half, c10::Half)
extern PAGEDJAX_RUN_ATTENTION(c10::Half, fp8_t)
extern PAGEDJAX_RUN_ATTENTION(c10::BFloat16, c10::BFloat16)
extern PAGEDJAX_RUN_ATTENTION(c10::BFloat16, fp8_t)

}  // namespace attention_impl

namespace {

using attention_impl::check_cuda_attention_args;
using attention_impl::fp8_t;
using attention_impl::NewKV;
using attention_impl::run_attention;

void ragged_paged_attention_out_cuda(const at::Tensor& out, const at::Tensor& q,
                                     const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& kv_lens, const at::Tensor& block_tables,
                                     const at::Tensor& query_start_loc, double sm_scale,
                                     std::optional<int64_t> sliding_window,
                                     std::optional<double> soft_cap,
                                     std::optional<int64_t> max_query_len, double k_scale,
                                     double v_scale) {
  const AttentionShape shape =
      check_attention_args(out, q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                           sliding_window, soft_cap, k_scale, v_scale);
  check_cuda_attention_args(shape, out, q, k_cache, v_cache);
  if (shape.num_tokens == 0) return;
  const c10::cuda::CUDAGuard device_guard(q.device());
  int64_t max_q = max_query_len.value_or(0);
  if (!max_query_len && shape.num_seqs > 0) {  // no host-side hint: a synchronising read
    max_q = (query_start_loc.slice(0, 1) - query_start_loc.slice(0, 0, -1)).max().item<int64_t>();
  }
  const bool fp8_cache = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  PAGEDJAX_DISPATCH_CUDA_FLOATING_TYPES(q.scalar_type(), "ragged_paged_attention_cuda", [&] {
    if (fp8_cache) {
      run_attention<scalar_t, fp8_t>(shape, out, q, k_cache, v_cache, kv_lens, block_tables,
                                     query_start_loc, sm_scale, sliding_window, soft_cap, max_q,
                                     k_scale, v_scale);
    } else {
      run_attention<scalar_t, scalar_t>(shape, out, q, k_cache, v_cache, kv_lens, block_tables,
                                        query_start_loc, sm_scale, sliding_window, soft_cap,
                                        max_q, k_scale, v_scale);
    }
  });
}

// write_kv then ragged_paged_attention_out for a decode step (every sequence's one query token
// at its row, padding sequences none) in one kernel launch (plus the split merge).
void decode_attention_with_kv_write_out_cuda(
    const at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& kv_lens, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, double sm_scale, std::optional<int64_t> sliding_window,
    std::optional<double> soft_cap, double k_scale, double v_scale) {
  const char* op = "pagedjax::decode_attention_with_kv_write_out";
  const AttentionShape shape =
      check_attention_args(out, q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                           sliding_window, soft_cap, k_scale, v_scale);
  check_cuda_attention_args(shape, out, q, k_cache, v_cache);
  for (const auto* t : {&k, &v}) {
    TORCH_CHECK(t->is_cuda() && t->dim() == 3 && t->size(0) == shape.num_tokens &&
                    t->size(1) == shape.num_kv_heads && t->size(2) == shape.head_dim &&
                    t->stride(2) == 1 && t->scalar_type() == q.scalar_type(),
                op, ": k and v must be CUDA ", q.scalar_type(), " [", shape.num_tokens, ", ",
                shape.num_kv_heads, ", ", shape.head_dim, "] with contiguous heads, got ",
                t->scalar_type(), " ", t->sizes(), " strides ", t->strides());
  }
  TORCH_CHECK(k.strides() == v.strides(), op, ": k and v must share strides (views of one qkv "
              "product), got ", k.strides(), " and ", v.strides());
  TORCH_CHECK(slot_mapping.is_cuda() && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == shape.num_tokens &&
                  slot_mapping.scalar_type() == at::kInt && slot_mapping.is_contiguous(),
              op, ": slot_mapping must be a contiguous CUDA int32 [", shape.num_tokens,
              "], got ", slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  if (shape.num_tokens == 0) return;
  const c10::cuda::CUDAGuard device_guard(q.device());
  const NewKV new_kv{k, v, slot_mapping};
  const bool fp8_cache = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  PAGEDJAX_DISPATCH_CUDA_FLOATING_TYPES(q.scalar_type(), "decode_attention_with_kv_write", [&] {
    if (fp8_cache) {
      run_attention<scalar_t, fp8_t>(shape, out, q, k_cache, v_cache, kv_lens, block_tables,
                                     query_start_loc, sm_scale, sliding_window, soft_cap, 1,
                                     k_scale, v_scale, &new_kv);
    } else {
      run_attention<scalar_t, scalar_t>(shape, out, q, k_cache, v_cache, kv_lens, block_tables,
                                        query_start_loc, sm_scale, sliding_window, soft_cap, 1,
                                        k_scale, v_scale, &new_kv);
    }
  });
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def(
      "decode_attention_with_kv_write_out(Tensor(a!) out, Tensor q, Tensor k, Tensor v, "
      "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, Tensor kv_lens, "
      "Tensor block_tables, Tensor query_start_loc, float sm_scale, int? sliding_window=None, "
      "float? soft_cap=None, float k_scale=1.0, float v_scale=1.0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedjax, CUDA, m) {
  m.impl("ragged_paged_attention_out", &pagedjax::ragged_paged_attention_out_cuda);
  m.impl("decode_attention_with_kv_write_out",
         &pagedjax::decode_attention_with_kv_write_out_cuda);
}
