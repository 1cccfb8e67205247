// FP8 W8A8's activation quantization as one CUDA kernel (quantization="fp8", backends/torch/
// linear.py's fp8_linear): each row of x [M, K] to float8 e4m3 with its own scale,
//   scale = max|x| / 448 (1 for a row of zeros),  q = clamp(x / scale, -448, 448) in e4m3,
// the math and rounding of the eager reference (kernels_cuda/reference.py: float32 division,
// round to nearest even) in one launch where the reference runs nine (H200: FP8's step was
// 1.2 ms of device time slower than bf16's at batch 1, RESULTS.md, stop 78).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "cuda_utils.h"

namespace pagedjax {
namespace {

constexpr int kThreads = 256;      // a row's threads (8 warps)
constexpr float kFp8Max = 448.f;   // e4m3's largest finite value

// The max of v over the block's threads (a multiple of 32, at most 1024), in every thread.
__device__ float block_max(float v) {
  __shared__ float partial[32];
  v = warp_max(v);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / kWarpSize ? partial[lane] : 0.f;
  return warp_max(v);
}

// grid: M rows; block: kThreads. Two passes over the row (the second from L1/L2).
template <typename scalar_t>
__global__ void quantize_fp8_per_token_kernel(const scalar_t* __restrict__ x,
                                              __nv_fp8_e4m3* __restrict__ q,
                                              float* __restrict__ scales, int64_t k) {
  const scalar_t* row = x + blockIdx.x * k;
  float amax = 0.f;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) {
    amax = fmaxf(amax, fabsf(static_cast<float>(row[i])));
  }
  amax = block_max(amax);
  float scale = amax / kFp8Max;
  if (!(scale > 0.f)) scale = 1.f;
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  __nv_fp8_e4m3* dst = q + blockIdx.x * k;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) {
    const float v = static_cast<float>(row[i]) / scale;  // IEEE division, as the reference's
    dst[i] = __nv_fp8_e4m3(fminf(fmaxf(v, -kFp8Max), kFp8Max));  // round to nearest even
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_per_token_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(),
              "pagedjax::quantize_fp8_per_token: x must be a contiguous CUDA [rows, features], "
              "got ", x.device(), " ", x.sizes());
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scales = at::ones({x.size(0), 1}, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {q, scales};
  const c10::cuda::CUDAGuard device_guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  PAGEDJAX_DISPATCH_CUDA_FLOATING_TYPES(x.scalar_type(), "quantize_fp8_per_token_cuda", [&] {
    quantize_fp8_per_token_kernel<scalar_t><<<x.size(0), kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), reinterpret_cast<__nv_fp8_e4m3*>(q.mutable_data_ptr()),
        scales.mutable_data_ptr<float>(), x.size(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {q, scales};
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def("quantize_fp8_per_token(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedjax, CUDA, m) {
  m.impl("quantize_fp8_per_token", &pagedjax::quantize_fp8_per_token_cuda);
}
