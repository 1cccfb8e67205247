// Helpers shared by the CUDA kernels: dtype / head-size dispatch, device attributes, 16-byte
// cp.async copies, fp32 widening loads and warp reductions. Included by .cu files only.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace pagedjax {

// fp32, fp16 and bf16 (no fp64 kernels on the GPU).
#define PAGEDJAX_DISPATCH_CUDA_FLOATING_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)              \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Calls fn(std::integral_constant<int, head_dim>) for the compiled head sizes.
template <typename Fn>
void dispatch_head_dim(int64_t head_dim, Fn&& fn) {
  switch (head_dim) {
    case 16: return fn(std::integral_constant<int, 16>{});  // tiny test models
    case 32: return fn(std::integral_constant<int, 32>{});  // the demo pair
    case 64: return fn(std::integral_constant<int, 64>{});
    case 80: return fn(std::integral_constant<int, 80>{});
    case 96: return fn(std::integral_constant<int, 96>{});
    case 128: return fn(std::integral_constant<int, 128>{});
    case 256: return fn(std::integral_constant<int, 256>{});
    default:
      TORCH_CHECK(false, "ragged_paged_attention (CUDA): head_dim=", head_dim,
                  " is not compiled; supported: 16, 32, 64, 80, 96, 128, 256");
  }
}

inline int device_attribute(cudaDeviceAttr attribute) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, c10::cuda::current_device()));
  return value;
}

inline bool aligned_16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 16-byte global -> shared copy; `valid == false` zero-fills the destination instead.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(valid ? 16 : 0));
#else
  *static_cast<uint4*>(smem_dst) =
      valid ? *static_cast<const uint4*>(gmem_src) : make_uint4(0, 0, 0, 0);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most kPending committed cp.async groups of this thread are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

// Reads 16 bytes (16 / sizeof(scalar_t) elements) and widens them to fp32.
template <typename scalar_t, int kVec = 16 / sizeof(scalar_t)>
__device__ __forceinline__ void load_floats(const scalar_t* src, float (&dst)[kVec]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const scalar_t* values = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec; ++i) dst[i] = static_cast<float>(values[i]);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  }
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(kFullMask, x, offset);
  }
  return x;
}

}  // namespace pagedjax
