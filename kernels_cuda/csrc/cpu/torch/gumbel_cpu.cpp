// The samplers' Gumbel-max draw as a torch CPU op: x [R, V] float32, seeds and steps [R] (uint32
// values in int64) → tokens [R] int32. The kernel and why it is hand-written:
// ../kernels/gumbel_cpu_kernel.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../kernels/gumbel_cpu_kernel.h"

namespace pagedjax {
namespace {

at::Tensor gumbel_argmax_cpu(const at::Tensor& x, const at::Tensor& seeds,
                             const at::Tensor& steps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "pagedjax::gumbel_argmax: x must be a contiguous float32 [rows, vocab], got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(seeds.dim() == 1 && steps.dim() == 1 && seeds.size(0) == rows &&
                  steps.size(0) == rows,
              "pagedjax::gumbel_argmax: seeds and steps must be [", rows, "], got ",
              seeds.sizes(), " and ", steps.sizes());
  at::Tensor tokens = at::empty({rows}, x.options().dtype(at::kInt));
  // uint32 counters: the low 32 bits of each value (pagedjax/rng.py's)
  const at::Tensor seed64 = seeds.to(at::kLong).contiguous();
  const at::Tensor step64 = steps.to(at::kLong).contiguous();
  const int64_t* seed_values = seed64.data_ptr<int64_t>();
  const int64_t* step_values = step64.data_ptr<int64_t>();
  std::vector<uint32_t> seed32(seed_values, seed_values + rows);
  std::vector<uint32_t> step32(step_values, step_values + rows);
  const float* data = x.data_ptr<float>();
  int32_t* out = tokens.data_ptr<int32_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    cpu_gumbel::draw_rows(data, vocab, seed32.data(), step32.data(), out, begin, end);
  });
  return tokens;
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def("gumbel_argmax(Tensor x, Tensor seeds, Tensor steps) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) { m.impl("gumbel_argmax", &pagedjax::gumbel_argmax_cpu); }
