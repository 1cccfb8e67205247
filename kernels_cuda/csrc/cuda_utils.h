// Device helpers shared by the CUDA kernels: 16-byte cp.async copies, fp32 widening loads and
// warp reductions. Included by .cu files only.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pagedjax {

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

inline bool aligned_16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

}  // namespace pagedjax
