// Shared declarations of the pagedjax custom ops: argument checks (ops.cpp) and the CPU and
// CUDA implementations (cpu/torch/attention_cpu.cpp, cuda/attention_cuda.cu).
//
// Layout (per layer): k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim].
// Sequence s owns query rows [query_start_loc[s], query_start_loc[s+1]), its last q_len tokens;
// query i sits at position kv_lens[s] - q_len + i and sees key j iff j <= pos and, with a
// sliding window w, pos - j < w. The score s = (q . k_j) * sm_scale is soft-capped to
// soft_cap * tanh(s / soft_cap) before the mask and the softmax when soft_cap is given (the
// kernels take 0 for none). Rows past query_start_loc[S] are padding and come out as zeros.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "attention_shape.h"

namespace pagedjax {

// TORCH_CHECKs every argument's rank, shape, dtype, contiguity and device; returns the sizes.
// The caches are q's dtype, or float8_e4m3fn (an FP8 KV cache: values are code * k_scale /
// code * v_scale; write_kv stores k / k_scale, v / v_scale rounded to e4m3, saturated to 448).
AttentionShape check_attention_args(
    const at::Tensor& out,              // [T, Hq, D], contiguous
    const at::Tensor& q,                // [T, Hq, D], last dim contiguous
    const at::Tensor& k_cache,          // [N, Hkv, bs, D], contiguous
    const at::Tensor& v_cache,          // [N, Hkv, bs, D], contiguous
    const at::Tensor& kv_lens,          // [S] int32
    const at::Tensor& block_tables,     // [S, M] int32
    const at::Tensor& query_start_loc,  // [S+1] int32
    std::optional<int64_t> sliding_window,
    std::optional<double> soft_cap,
    double k_scale,
    double v_scale);

// TORCH_CHECKs the arguments of write_kv.
void check_write_kv_args(
    const at::Tensor& k,              // [T, Hkv, D], last dim contiguous
    const at::Tensor& v,              // [T, Hkv, D], last dim contiguous
    const at::Tensor& k_cache,        // [N, Hkv, bs, D], contiguous
    const at::Tensor& v_cache,        // [N, Hkv, bs, D], contiguous
    const at::Tensor& slot_mapping,  // [T] int32 or int64
    double k_scale,
    double v_scale);

// Kernel signatures of the out= attention op and of write_kv, shared by every backend (the
// functional op calls the out= op through the dispatcher with exactly this signature).
// max_query_len is a host-side hint (an upper bound on q_len) that only picks a CUDA launch
// configuration; the CPU kernels ignore it.
using AttentionOutFn = void(
    const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& kv_lens, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, double sm_scale, std::optional<int64_t> sliding_window,
    std::optional<double> soft_cap, std::optional<int64_t> max_query_len, double k_scale,
    double v_scale);

using WriteKvFn = void(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                       double k_scale, double v_scale);

// CPU kernels (cpu/torch/attention_cpu.cpp); they check their arguments themselves.
AttentionOutFn ragged_paged_attention_out_cpu;
WriteKvFn write_kv_cpu;

}  // namespace pagedjax
