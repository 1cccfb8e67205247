// The top-k / top-p / min-p filter of the samplers as a torch CPU op: logits [R, V] float32
// (already divided by the temperature) and knobs [R] → the logits with what the filter drops at
// -inf. The kernel and why it is hand-written: ../kernels/filter_cpu_kernel.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../kernels/filter_cpu_kernel.h"

namespace pagedjax {
namespace {

at::Tensor filter_logits_cpu(const at::Tensor& logits, const at::Tensor& top_k,
                             const at::Tensor& top_p, const at::Tensor& min_p) {
  const char* op = "pagedjax::filter_logits";
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              op, ": logits must be a contiguous float32 [rows, vocab], got ",
              logits.scalar_type(), " ", logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(top_k.dim() == 1 && top_k.size(0) == rows && top_k.scalar_type() == at::kInt &&
                  top_k.is_contiguous(),
              op, ": top_k must be a contiguous int32 [", rows, "], got ", top_k.scalar_type(),
              " ", top_k.sizes());
  for (const auto* knob : {&top_p, &min_p}) {
    TORCH_CHECK(knob->dim() == 1 && knob->size(0) == rows &&
                    knob->scalar_type() == at::kFloat && knob->is_contiguous(),
                op, ": top_p and min_p must be contiguous float32 [", rows, "], got ",
                knob->scalar_type(), " ", knob->sizes());
  }
  at::Tensor out = at::empty_like(logits);
  if (rows == 0 || vocab == 0) return out;
  const float* x = logits.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    cpu_filter::filter_rows(x, vocab, top_k.data_ptr<int32_t>(), top_p.data_ptr<float>(),
                            min_p.data_ptr<float>(), y, begin, end);
  });
  return out;
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def("filter_logits(Tensor logits, Tensor top_k, Tensor top_p, Tensor min_p) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) { m.impl("filter_logits", &pagedjax::filter_logits_cpu); }
