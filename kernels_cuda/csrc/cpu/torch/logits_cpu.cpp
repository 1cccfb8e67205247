// The samplers' one pass over the logits as a torch CPU op: logits [R, V] float32 → (argmax [R]
// int32, lse [R] float32). The kernel and why it is hand-written: ../kernels/logits_cpu_kernel.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "../kernels/logits_cpu_kernel.h"

namespace pagedjax {
namespace {

std::tuple<at::Tensor, at::Tensor> logits_stats_cpu(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "pagedjax::logits_stats: logits must be a contiguous float32 [rows, vocab], got ",
              logits.scalar_type(), " ", logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor argmax = at::empty({rows}, logits.options().dtype(at::kInt));
  at::Tensor lse = at::empty({rows}, logits.options());
  const float* x = logits.data_ptr<float>();
  int32_t* top = argmax.data_ptr<int32_t>();
  float* out = lse.data_ptr<float>();
  // a grain of ~32K logits: a small batch stays on one thread
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(vocab, 1)),
                   [&](int64_t begin, int64_t end) {
                     cpu_logits::stats_rows(x, vocab, top, out, begin, end);
                   });
  return {argmax, lse};
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def("logits_stats(Tensor logits) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) { m.impl("logits_stats", &pagedjax::logits_stats_cpu); }
