// CUDA kernels of a decoder layer's elementwise glue, one kernel each where eager PyTorch runs
// 3-10 (the CPU versions and their rounding: cpu/torch/norm_act_cpu.cpp, cpu/torch/rotary_cpu.cpp):
//   rms_norm(x, weight, eps)                     HF's LlamaRMSNorm
//   fused_add_rms_norm(x, residual, weight, eps) (rms_norm(x + residual), x + residual)
//   silu_and_mul(x [T, 2I])                      silu(x[:, :I]) * x[:, I:]
//   rotary_embedding_(x [T, H, D], cos, sin)     HF's rotate_half rotation, in place
// Math in float32, rounded where HF's eager ops round: the normalised row to the input dtype
// before the weight, the residual sum before it is normalised, silu before the product.
// Why: under a CUDA graph a 1B decode step at batch 1 still spent ~0.9 ms in ~400 such small
// kernels of its eager versions (H200, RESULTS.md).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "cuda_utils.h"

namespace pagedjax {
namespace {

constexpr int kThreads = 256;  // a row's threads (8 warps)

void check_cuda_rows(const char* op, const char* name, const at::Tensor& t,
                     const at::Tensor& ref) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.is_contiguous(), op, ": ", name,
              " must be a contiguous CUDA [num_tokens, hidden], got ", t.device(), " ",
              t.sizes());
  TORCH_CHECK(t.sizes() == ref.sizes() && t.scalar_type() == ref.scalar_type() &&
                  t.device() == ref.device(),
              op, ": ", name, " must match x (", ref.scalar_type(), " ", ref.sizes(), "), got ",
              t.scalar_type(), " ", t.sizes());
}

void check_cuda_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  check_cuda_rows(op, "x", x, x);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && weight.device() == x.device(),
              op, ": weight must be a contiguous ", x.scalar_type(), " [", x.size(1),
              "] on x's device, got ", weight.scalar_type(), " ", weight.sizes());
}

// The sum of v over the block's threads (a multiple of 32, at most 1024), in every thread.
__device__ float block_sum(float v) {
  __shared__ float partial[32];
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? partial[lane] : 0.f;
  v = warp_sum(v);
  __syncthreads();  // partial is reused by the next call
  return v;
}

// grid: T rows; block: kThreads. sum (with residual): x + residual rounded, written and normed.
// Any hidden size; two passes over the row (the second reads it again, from L1/L2).
template <typename scalar_t>
__global__ void rms_norm_kernel(const scalar_t* __restrict__ x,
                                const scalar_t* __restrict__ residual,
                                const scalar_t* __restrict__ weight, scalar_t* __restrict__ out,
                                scalar_t* __restrict__ sum, int64_t hidden, float eps) {
  const int64_t row = blockIdx.x * hidden;
  const scalar_t* src = residual == nullptr ? x + row : sum + row;
  float squares = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    scalar_t v = x[row + i];
    if (residual != nullptr) {
      v = static_cast<scalar_t>(static_cast<float>(v) + static_cast<float>(residual[row + i]));
      sum[row + i] = v;  // read back below by this same thread
    }
    const float f = static_cast<float>(v);
    squares += f * f;
  }
  const float scale = rsqrtf(block_sum(squares) / static_cast<float>(hidden) + eps);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const scalar_t normed = static_cast<scalar_t>(static_cast<float>(src[i]) * scale);
    out[row + i] =
        static_cast<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(normed));
  }
}

// The same for a row of 16-byte vectors held in registers: grid T rows; block: the row's
// vectors / kVecs threads, rounded up to a warp. One read of x (and residual), one write of out
// (and sum), all 16 bytes wide: a 2048-wide bf16 row is one vector per thread of 256.
template <typename scalar_t, int kVecs>
__global__ void rms_norm_vec_kernel(const scalar_t* __restrict__ x,
                                    const scalar_t* __restrict__ residual,
                                    const scalar_t* __restrict__ weight,
                                    scalar_t* __restrict__ out, scalar_t* __restrict__ sum,
                                    int vecs_per_row, float eps) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * vecs_per_row * kVec;
  float v[kVecs][kVec];
  float squares = 0.f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    if (c >= vecs_per_row) continue;
    load_floats(x + row + c * kVec, v[j]);
    if (residual != nullptr) {
      float r[kVec];
      load_floats(residual + row + c * kVec, r);
      uint4 raw;
      scalar_t* rounded = reinterpret_cast<scalar_t*>(&raw);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        rounded[e] = static_cast<scalar_t>(v[j][e] + r[e]);
        v[j][e] = static_cast<float>(rounded[e]);
      }
      *reinterpret_cast<uint4*>(sum + row + c * kVec) = raw;
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) squares += v[j][e] * v[j][e];
  }
  const float scale =
      rsqrtf(block_sum(squares) / static_cast<float>(vecs_per_row * kVec) + eps);
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    if (c >= vecs_per_row) continue;
    float w[kVec];
    load_floats(weight + c * kVec, w);
    uint4 raw;
    scalar_t* normed = reinterpret_cast<scalar_t*>(&raw);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float n = static_cast<float>(static_cast<scalar_t>(v[j][e] * scale));
      normed[e] = static_cast<scalar_t>(w[e] * n);
    }
    *reinterpret_cast<uint4*>(out + row + c * kVec) = raw;
  }
}

template <typename scalar_t, int kVecs>
void launch_rms_norm_vec(const at::Tensor& x, const at::Tensor* residual,
                         const at::Tensor& weight, const at::Tensor& out, const at::Tensor* sum,
                         int vecs_per_row, float eps) {
  const int threads =
      static_cast<int>(ceil_div(ceil_div(vecs_per_row, kVecs), kWarpSize) * kWarpSize);
  rms_norm_vec_kernel<scalar_t, kVecs>
      <<<x.size(0), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          x.const_data_ptr<scalar_t>(),
          residual == nullptr ? nullptr : residual->const_data_ptr<scalar_t>(),
          weight.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
          sum == nullptr ? nullptr : sum->mutable_data_ptr<scalar_t>(), vecs_per_row, eps);
}

template <typename scalar_t>
void launch_rms_norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                     const at::Tensor& out, const at::Tensor* sum, double eps) {
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard device_guard(x.device());
  constexpr int kVec = 16 / sizeof(scalar_t);
  const int64_t hidden = x.size(1), vecs_per_row = hidden / kVec;
  const bool aligned = aligned_16(x) && aligned_16(weight) &&
                       (residual == nullptr || aligned_16(*residual));  // out, sum: fresh
  const float feps = static_cast<float>(eps);
  if (aligned && hidden % kVec == 0 && vecs_per_row <= 1024) {
    launch_rms_norm_vec<scalar_t, 1>(x, residual, weight, out, sum, vecs_per_row, feps);
  } else if (aligned && hidden % kVec == 0 && vecs_per_row <= 4096) {
    launch_rms_norm_vec<scalar_t, 4>(x, residual, weight, out, sum, vecs_per_row, feps);
  } else {
    rms_norm_kernel<scalar_t><<<x.size(0), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<scalar_t>(),
        residual == nullptr ? nullptr : residual->const_data_ptr<scalar_t>(),
        weight.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
        sum == nullptr ? nullptr : sum->mutable_data_ptr<scalar_t>(), hidden, feps);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cuda_norm_args("pagedjax::rms_norm", x, weight);
  at::Tensor out = at::empty_like(x);
  PAGEDJAX_DISPATCH_CUDA_FLOATING_TYPES(x.scalar_type(), "rms_norm_cuda", [&] {
    launch_rms_norm<scalar_t>(x, nullptr, weight, out, nullptr, eps);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cuda(const at::Tensor& x,
                                                           const at::Tensor& residual,
                                                           const at::Tensor& weight,
                                                           double eps) {
  check_cuda_norm_args("pagedjax::fused_add_rms_norm", x, weight);
  check_cuda_rows("pagedjax::fused_add_rms_norm", "residual", residual, x);
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  PAGEDJAX_DISPATCH_CUDA_FLOATING_TYPES(x.scalar_type(), "fused_add_rms_norm_cuda", [&] {
    launch_rms_norm<scalar_t>(x, &residual, weight, out, &sum, eps);
  });
  return {out, sum};
}

// grid: T rows; block: kThreads. out[t, i] = silu(x[t, i]) * x[t, I + i], silu rounded first.
// Any intermediate size.
template <typename scalar_t>
__global__ void silu_and_mul_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ out,
                                    int64_t inter) {
  const scalar_t* gate = x + blockIdx.x * 2 * inter;
  const scalar_t* up = gate + inter;
  scalar_t* dst = out + blockIdx.x * inter;
  for (int64_t i = threadIdx.x; i < inter; i += blockDim.x) {
    const float g = static_cast<float>(gate[i]);
    const scalar_t silu = static_cast<scalar_t>(g / (1.f + expf(-g)));
    dst[i] = static_cast<scalar_t>(static_cast<float>(silu) * static_cast<float>(up[i]));
  }
}

// The same over 16-byte vectors, one per thread across every row: grid ceil(T * I / kVec /
// kThreads), so a single row of 8192 bf16 spreads over 4 blocks instead of looping in one.
template <typename scalar_t>
__global__ void silu_and_mul_vec_kernel(const scalar_t* __restrict__ x,
                                        scalar_t* __restrict__ out, int64_t vecs_per_row,
                                        int64_t num_vecs) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_vecs) return;
  const int64_t row = i / vecs_per_row, c = i % vecs_per_row;
  const scalar_t* gate = x + (row * 2 * vecs_per_row + c) * kVec;
  float g[kVec], u[kVec];
  load_floats(gate, g);
  load_floats(gate + vecs_per_row * kVec, u);
  uint4 raw;
  scalar_t* dst = reinterpret_cast<scalar_t*>(&raw);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const scalar_t silu = static_cast<scalar_t>(g[e] / (1.f + expf(-g[e])));
    dst[e] = static_cast<scalar_t>(static_cast<float>(silu) * u[e]);
  }
  *reinterpret_cast<uint4*>(out + i * kVec) = raw;
}

at::Tensor silu_and_mul_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.size(1) % 2 == 0 && x.is_contiguous(),
              "pagedjax::silu_and_mul: x must be a contiguous CUDA [num_tokens, 2 * "
              "intermediate], got ", x.device(), " ", x.sizes());
  const int64_t inter = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), inter}, x.options());
  if (x.size(0) == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  PAGEDJAX_DISPATCH_CUDA_FLOATING_TYPES(x.scalar_type(), "silu_and_mul_cuda", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    if (inter % kVec == 0 && aligned_16(x)) {
      const int64_t num_vecs = x.size(0) * inter / kVec;
      silu_and_mul_vec_kernel<scalar_t><<<ceil_div(num_vecs, kThreads), kThreads, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), inter / kVec,
          num_vecs);
    } else {
      silu_and_mul_kernel<scalar_t><<<x.size(0), kThreads, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), inter);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// grid: T tokens; block: kThreads over (head, i < D/2) pairs. x's heads are contiguous vectors
// of D, tokens token_stride apart (a view of q and k in a fused qkv projection).
template <typename scalar_t>
__global__ void rotary_kernel(scalar_t* __restrict__ x, const float* __restrict__ cos,
                              const float* __restrict__ sin, int64_t token_stride,
                              int num_heads, int head_dim) {
  const int half = head_dim / 2;
  const float* c = cos + blockIdx.x * head_dim;
  const float* s = sin + blockIdx.x * head_dim;
  scalar_t* token = x + blockIdx.x * token_stride;
  for (int p = threadIdx.x; p < num_heads * half; p += blockDim.x) {
    scalar_t* v = token + (p / half) * head_dim;
    const int i = p % half;
    const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
    v[i] = static_cast<scalar_t>(a * c[i] - b * s[i]);
    v[i + half] = static_cast<scalar_t>(b * c[i + half] + a * s[i + half]);
  }
}

void rotary_embedding_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "pagedjax::rotary_embedding_";
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              op, ": x must be a CUDA [num_tokens, num_heads, head_dim] of contiguous heads "
              "with an even head_dim, got ", x.device(), " ", x.sizes(), " strides ",
              x.strides());
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) == x.size(2) &&
                    t->is_contiguous() && t->scalar_type() == at::kFloat &&
                    t->device() == x.device(),
                op, ": cos and sin must be contiguous float32 [", x.size(0), ", ", x.size(2),
                "] on x's device, got ", t->scalar_type(), " ", t->sizes());
  }
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard device_guard(x.device());
  PAGEDJAX_DISPATCH_CUDA_FLOATING_TYPES(x.scalar_type(), "rotary_embedding_cuda", [&] {
    rotary_kernel<scalar_t><<<x.size(0), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.mutable_data_ptr<scalar_t>(), cos.const_data_ptr<float>(),
        sin.const_data_ptr<float>(), x.stride(0), static_cast<int>(x.size(1)),
        static_cast<int>(x.size(2)));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_IMPL(pagedjax, CUDA, m) {
  m.impl("rms_norm", &pagedjax::rms_norm_cuda);
  m.impl("fused_add_rms_norm", &pagedjax::fused_add_rms_norm_cuda);
  m.impl("silu_and_mul", &pagedjax::silu_and_mul_cuda);
  m.impl("rotary_embedding_", &pagedjax::rotary_embedding_cuda);
}
