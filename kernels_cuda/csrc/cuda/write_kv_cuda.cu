// CUDA kernels of write_kv: scatters this step's keys/values into their cache slots as a copy of
// 16-byte vectors, so one kernel serves every dtype; into a float8_e4m3fn cache (an FP8 KV cache)
// each element is stored as x / scale, rounded to nearest even and saturated to +-448
// (__NV_SATFINITE, vLLM's conversion). Slots of -1 are skipped.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <cstdint>
#include <utility>

#include "../attention.h"
#include "cuda_utils.h"

namespace pagedjax {
namespace {

constexpr int kThreads = 128;

// grid: T; block: 128. Strides are in 16-byte vectors.
template <typename index_t>
__global__ void write_kv_kernel(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                int64_t k_stride_token, int64_t k_stride_head,
                                int64_t v_stride_token, int64_t v_stride_head,
                                uint4* __restrict__ k_cache, uint4* __restrict__ v_cache,
                                const index_t* __restrict__ slot_mapping, int64_t num_slots,
                                int num_kv_heads, int block_size, int vecs_per_row) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // padding row
  CUDA_KERNEL_ASSERT(slot < num_slots);
  const int64_t block = slot / block_size, offset = slot % block_size;
  for (int i = threadIdx.x; i < num_kv_heads * vecs_per_row; i += blockDim.x) {
    const int h = i / vecs_per_row, c = i % vecs_per_row;
    const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * vecs_per_row + c;
    k_cache[dst] = k[token * k_stride_token + h * k_stride_head + c];
    v_cache[dst] = v[token * v_stride_token + h * v_stride_head + c];
  }
}

// grid: T; block: 128. Element by element: k, v [T, Hkv, D] (strides in elements) into fp8.
template <typename scalar_t, typename index_t>
__global__ void write_kv_fp8_kernel(const scalar_t* __restrict__ k,
                                    const scalar_t* __restrict__ v, int64_t k_stride_token,
                                    int64_t k_stride_head, int64_t v_stride_token,
                                    int64_t v_stride_head, __nv_fp8_e4m3* __restrict__ k_cache,
                                    __nv_fp8_e4m3* __restrict__ v_cache,
                                    const index_t* __restrict__ slot_mapping, int64_t num_slots,
                                    int num_kv_heads, int block_size, int head_dim,
                                    float k_scale, float v_scale) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // padding row
  CUDA_KERNEL_ASSERT(slot < num_slots);
  const int64_t block = slot / block_size, offset = slot % block_size;
  for (int i = threadIdx.x; i < num_kv_heads * head_dim; i += blockDim.x) {
    const int h = i / head_dim, d = i % head_dim;
    const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_dim + d;
    const float key = static_cast<float>(k[token * k_stride_token + h * k_stride_head + d]);
    const float value = static_cast<float>(v[token * v_stride_token + h * v_stride_head + d]);
    // the constructor converts with __NV_SATFINITE (saturating) and rounds to nearest even
    k_cache[dst] = __nv_fp8_e4m3(key / k_scale);
    v_cache[dst] = __nv_fp8_e4m3(value / v_scale);
  }
}

void write_kv_fp8_cuda(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                       double k_scale, double v_scale) {
  const c10::cuda::CUDAGuard device_guard(k.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  PAGEDJAX_DISPATCH_CUDA_FLOATING_TYPES(k.scalar_type(), "write_kv_fp8_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(slot_mapping.scalar_type(), "write_kv_fp8_cuda", [&] {
      write_kv_fp8_kernel<scalar_t, index_t><<<k.size(0), kThreads, 0, stream>>>(
          k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(), k.stride(0), k.stride(1),
          v.stride(0), v.stride(1), static_cast<__nv_fp8_e4m3*>(k_cache.mutable_data_ptr()),
          static_cast<__nv_fp8_e4m3*>(v_cache.mutable_data_ptr()),
          slot_mapping.const_data_ptr<index_t>(), k_cache.size(0) * k_cache.size(2),
          k_cache.size(1), k_cache.size(2), k_cache.size(3), static_cast<float>(k_scale),
          static_cast<float>(v_scale));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void write_kv_cuda(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& slot_mapping, double k_scale,
                   double v_scale) {
  check_write_kv_args(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  if (k.size(0) == 0) return;
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    return write_kv_fp8_cuda(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  }
  const int64_t element_size = k_cache.element_size();
  const int64_t row_bytes = k_cache.size(3) * element_size;
  TORCH_CHECK(row_bytes % 16 == 0, "write_kv (CUDA): a head row must be a multiple of 16 bytes, ",
              "got head_dim=", k_cache.size(3), " x ", element_size, " bytes");
  for (const auto& [name, t] : {std::pair{"k", &k}, std::pair{"v", &v}}) {
    TORCH_CHECK(aligned_16(*t) && (t->stride(0) * element_size) % 16 == 0 &&
                    (t->stride(1) * element_size) % 16 == 0,
                "write_kv (CUDA): ", name, " must be 16-byte aligned with strides that are ",
                "multiples of 16 bytes, got strides ", t->strides(), " (call .contiguous())");
  }
  TORCH_CHECK(aligned_16(k_cache) && aligned_16(v_cache),
              "write_kv (CUDA): k_cache and v_cache must be 16-byte aligned");
  if (k.size(0) == 0) return;
  const c10::cuda::CUDAGuard device_guard(k.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t vec = 16 / element_size;  // elements per 16-byte vector
  AT_DISPATCH_INDEX_TYPES(slot_mapping.scalar_type(), "write_kv_cuda", [&] {
    write_kv_kernel<index_t><<<k.size(0), kThreads, 0, stream>>>(
        static_cast<const uint4*>(k.const_data_ptr()),
        static_cast<const uint4*>(v.const_data_ptr()),
        k.stride(0) / vec, k.stride(1) / vec, v.stride(0) / vec, v.stride(1) / vec,
        static_cast<uint4*>(k_cache.mutable_data_ptr()),
        static_cast<uint4*>(v_cache.mutable_data_ptr()), slot_mapping.const_data_ptr<index_t>(),
        k_cache.size(0) * k_cache.size(2), k_cache.size(1), k_cache.size(2), row_bytes / 16);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_IMPL(pagedjax, CUDA, m) {
  m.impl("write_kv", &pagedjax::write_kv_cuda);
}
