// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) on the CPU with W kept in GGML's blocks (Q8_0, Q4_0,
// Q4_1; int8 per channel is Q8_0): ../kernels/quant_linear_kernel.h, whose integer dots read
// 1.06 (Q8_0) or 0.56-0.63 (Q4_x) bytes a weight where the float32 linear reads 4.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../kernels/quant_linear_kernel.h"
#include "torch_parallel.h"

namespace pagedjax {
namespace {

// The weight's rows (the blocks' layout in *interleaved), after checking every argument.
int64_t check_quant_linear_args(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                                const std::optional<at::Tensor>& bias, bool* interleaved) {
  const char* op = "pagedjax::quant_linear";
  const int64_t bytes = cpu_quant::block_bytes(qtype);
  TORCH_CHECK(bytes > 0, op, ": qtype=", qtype, " is not supported; use one of 8 (Q8_0), ",
              "2 (Q4_0), 3 (Q4_1)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, op,
              ": x must be float32 [num_rows, in_features] with contiguous rows, got ",
              x.scalar_type(), " ", x.sizes(), " strides ", x.strides());
  const int64_t K = x.size(1);
  TORCH_CHECK(K % cpu_quant::kBlock == 0, op, ": in_features=", K,
              " is not a multiple of the block size 32");
  const int64_t N = blocks.dim() == 2 ? cpu_quant::rows_of_blocks(qtype, K, blocks.size(0),
                                                                  blocks.size(1), interleaved)
                                      : -1;
  TORCH_CHECK(N >= 0 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(), op,
              ": blocks must be a contiguous uint8 [out_features, ", K / cpu_quant::kBlock,
              " blocks x ", bytes, " bytes] (or interleaved [out_features / 8, 8 x that]), got ",
              blocks.scalar_type(), " ", blocks.sizes());
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                op, ": bias must be a contiguous float32 [", N, "], got ",
                bias->scalar_type(), " ", bias->sizes());
  }
  return N;
}

at::Tensor quant_linear_cpu(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                            const std::optional<at::Tensor>& bias) {
  bool interleaved = false;
  const int64_t N = check_quant_linear_args(x, blocks, qtype, bias, &interleaved);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  cpu_quant::quant_linear(TorchParallel{}, x.data_ptr<float>(), x.stride(0), M, qtype,
                          blocks.data_ptr<uint8_t>(), interleaved, N, K,
                          bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), N);
  return y;
}

at::Tensor quant_linear_meta(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype,
                             const std::optional<at::Tensor>& bias) {
  bool interleaved = false;
  const int64_t N = check_quant_linear_args(x, blocks, qtype, bias, &interleaved);
  return at::empty({x.size(0), N}, x.options());
}

// The weights of the blocks (either layout) as float32 [N, K] (an embedding's rows, a
// reference).
at::Tensor dequantize_cpu(const at::Tensor& blocks, int64_t qtype, int64_t in_features) {
  bool interleaved = false;
  const int64_t N = blocks.dim() == 2 ? cpu_quant::rows_of_blocks(qtype, in_features,
                                                                  blocks.size(0), blocks.size(1),
                                                                  &interleaved)
                                      : -1;
  TORCH_CHECK(N >= 0 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "pagedjax::dequantize: blocks must be a contiguous uint8 [N, in_features / 32 * ",
              cpu_quant::block_bytes(qtype), "] (or interleaved [N / 8, 8 x that]) of qtype 8, 2 ",
              "or 3, got qtype=", qtype, " ", blocks.sizes());
  at::Tensor out = at::empty({N, in_features}, blocks.options().dtype(at::kFloat));
  const cpu_quant::Blocks w{qtype, blocks.data_ptr<uint8_t>(), in_features, interleaved};
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) cpu_quant::dequantize_row(w, n, dst + n * in_features);
  });
  return out;
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def("quant_linear(Tensor x, Tensor blocks, int qtype, Tensor? bias) -> Tensor");
  m.def("dequantize(Tensor blocks, int qtype, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) {
  m.impl("quant_linear", &pagedjax::quant_linear_cpu);
  m.impl("dequantize", &pagedjax::dequantize_cpu);
}

TORCH_LIBRARY_IMPL(pagedjax, Meta, m) { m.impl("quant_linear", &pagedjax::quant_linear_meta); }
