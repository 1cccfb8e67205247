// The grammar's token mask as a torch CPU op: logits [R, V] float32 and bitmask [R, W] int32 →
// (the masked logits [R, V], their argmax [R] int32) in one pass. The kernel and why it is
// hand-written: ../kernels/token_mask_cpu_kernel.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

#include "../kernels/token_mask_cpu_kernel.h"

namespace pagedjax {
namespace {

std::tuple<at::Tensor, at::Tensor> apply_token_bitmask_cpu(const at::Tensor& logits,
                                                           const at::Tensor& bitmask) {
  const char* op = "pagedjax::apply_token_bitmask";
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              op, ": logits must be a contiguous float32 [rows, vocab], got ",
              logits.scalar_type(), " ", logits.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.size(0) == rows && bitmask.size(1) * 32 >= vocab &&
                  bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              op, ": bitmask must be a contiguous int32 [", rows, ", >= ", (vocab + 31) / 32,
              "], got ", bitmask.scalar_type(), " ", bitmask.sizes());
  at::Tensor out = at::empty_like(logits);
  at::Tensor argmax = at::empty({rows}, logits.options().dtype(at::kInt));
  const float* x = logits.data_ptr<float>();
  const int32_t* bits = bitmask.data_ptr<int32_t>();
  float* y = out.data_ptr<float>();
  int32_t* top = argmax.data_ptr<int32_t>();
  const int64_t words = bitmask.size(1);
  // a grain of ~32K logits, as the samplers' other passes: a small batch stays on one thread
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(vocab, 1)),
                   [&](int64_t begin, int64_t end) {
                     cpu_token_mask::mask_rows(x, vocab, bits, words, y, top, begin, end);
                   });
  return {out, argmax};
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def("apply_token_bitmask(Tensor logits, Tensor bitmask) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) {
  m.impl("apply_token_bitmask", &pagedjax::apply_token_bitmask_cpu);
}
