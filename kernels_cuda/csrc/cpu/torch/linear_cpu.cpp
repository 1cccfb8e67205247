// y[M, N] = x[M, K] @ W[K, N] (+ bias) on the CPU, float32, with W packed once at load time into
// column tiles: packed[t, k, j] = W[k, 16 t + j], zero-padded to a whole tile.
//
// Why hand-written: a decode step multiplies a few rows by every weight of the model, where the
// libraries run far below the memory bandwidth. Side by side (benchmarks/probes/cpu_linear.py; figures
// in benchmarks/results/RESULTS.md, "CPU linear"), at 4 rows this kernel is 1.6-2.5x as fast as
// oneDNN's prepacked linear, 3-5x MKL's sgemm (torch.nn.functional.linear) and 2.6-4.3x XLA's
// dot; at 1 row 1.4-3.4x oneDNN's and 0.9-1.4x XLA's; at 16 rows 0.9-1.6x oneDNN's. With the
// AVX2 blocks of 6 rows (12 accumulators; 2026-11-27) it leads from 64 rows on as well: 1.1-1.4x
// oneDNN's and 1.0-1.1x XLA's per decoder layer at 64 and 256 rows; only a 49k-vocabulary LM
// head at 256 rows stays faster on oneDNN (0.7x ours).
// With the tile-major layout each tile is one contiguous stream (the prefetchers' best case), the
// tiles are split across threads, and a tile is read from DRAM once and reused from L1/L2 by
// every block of rows.
//
// Each output element is one FMA chain over k in order, whatever M and the row grouping: a row's
// result does not depend on the other rows of the batch.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

#include "../kernels/linear_cpu_kernel.h"
#include "torch_parallel.h"

namespace pagedjax {
namespace {

using cpu_linear::kTile;

void check_linear_args(const at::Tensor& x, const at::Tensor& packed_weight,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  const char* op = "pagedjax::linear";
  TORCH_CHECK(x.dim() == 2, op, ": x must be [num_rows, in_features], got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed_weight.scalar_type() == at::kFloat, op,
              ": float32 only, got x ", x.scalar_type(), " and weight ",
              packed_weight.scalar_type());
  TORCH_CHECK(x.stride(1) == 1, op, ": x's rows must be contiguous, got strides ", x.strides());
  TORCH_CHECK(packed_weight.dim() == 3 && packed_weight.size(2) == kTile &&
                  packed_weight.size(1) == x.size(1) && packed_weight.is_contiguous(),
              op, ": packed_weight must be a contiguous [ceil(out/16), in_features=", x.size(1),
              ", 16] (pack_linear_weight), got shape ", packed_weight.sizes());
  TORCH_CHECK(out_features > (packed_weight.size(0) - 1) * kTile &&
                  out_features <= packed_weight.size(0) * kTile,
              op, ": out_features=", out_features, " does not match ", packed_weight.size(0),
              " tiles of ", kTile);
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                op, ": bias must be a contiguous float32 [", out_features, "], got ",
                bias->scalar_type(), " ", bias->sizes());
  }
}

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& packed_weight,
                      const std::optional<at::Tensor>& bias, int64_t out_features) {
  check_linear_args(x, packed_weight, bias, out_features);
  const int64_t M = x.size(0), K = x.size(1), num_tiles = packed_weight.size(0);
  const int64_t padded = num_tiles * kTile;
  // The last tile's padding columns land in a padded output that is cut (a view: no copy when
  // out_features is a multiple of 16).
  at::Tensor y = at::empty({M, padded}, x.options());
  at::Tensor padded_bias;
  const float* b = nullptr;
  if (bias) {
    padded_bias = padded == out_features ? *bias : at::constant_pad_nd(*bias, {0, padded - out_features});
    b = padded_bias.data_ptr<float>();
  }
  if (M == 0) return at::empty({0, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed_weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  cpu_linear::linear(TorchParallel{}, xp, ldx, M, wp, K, num_tiles, b, yp, padded);
  return padded == out_features ? y : y.narrow(1, 0, out_features).contiguous();
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& packed_weight,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  check_linear_args(x, packed_weight, bias, out_features);
  return at::empty({x.size(0), out_features}, x.options());
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def("linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) { m.impl("linear", &pagedjax::linear_cpu); }

TORCH_LIBRARY_IMPL(pagedjax, Meta, m) { m.impl("linear", &pagedjax::linear_meta); }
