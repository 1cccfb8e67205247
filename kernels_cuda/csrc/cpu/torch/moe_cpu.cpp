// A mixture of experts' expert block on the CPU in float32 as one torch op:
//   moe_experts(x [T, H], topk_ids [T, k], topk_weights [T, k], w13_packed, w2_packed,
//               intermediate_size) -> y [T, H]
// the kernel of ../kernels/moe_experts_kernel.h (the JAX FFI handler runs the same). This file
// checks the tensors and hands their pointers over.
//
// Why: torch's grouped_mm over the sorted pairs ran a Qwen3-MoE decode step at 2.4x its dense
// twin's time on CPU; this runs each chosen expert's products on the packed linear's blocks, an
// expert's weights read once: 1.2x (benchmarks/moe.py, 2-core EPYC).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

#include "../kernels/moe_experts_kernel.h"
#include "torch_parallel.h"

namespace pagedjax {
namespace {

constexpr const char* kOp = "pagedjax::moe_experts";

std::vector<int64_t> dims(const at::Tensor& t) { return {t.sizes().begin(), t.sizes().end()}; }

void check_moe_args(const at::Tensor& x, const at::Tensor& topk_ids,
                    const at::Tensor& topk_weights, const at::Tensor& w13_packed,
                    const at::Tensor& w2_packed, int64_t intermediate_size) {
  const std::string error =
      cpu_moe::shape_error(kOp, dims(x), dims(topk_ids), dims(topk_weights), dims(w13_packed),
                           dims(w2_packed), intermediate_size);
  TORCH_CHECK(error.empty(), error);
  for (const auto& [name, t] : {std::pair{"x", &x}, std::pair{"topk_weights", &topk_weights},
                                std::pair{"w13_packed", &w13_packed},
                                std::pair{"w2_packed", &w2_packed}}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), kOp, ": ", name,
                " must be a contiguous float32 tensor, got ", t->scalar_type(),
                t->is_contiguous() ? "" : " (not contiguous)");
  }
  TORCH_CHECK((topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong) &&
                  topk_ids.is_contiguous(),
              kOp, ": topk_ids must be a contiguous int32 or int64 tensor, got ",
              topk_ids.scalar_type(), topk_ids.is_contiguous() ? "" : " (not contiguous)");
}

template <typename index_t>
void run(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
         const at::Tensor& w13_packed, const at::Tensor& w2_packed, int64_t intermediate_size,
         at::Tensor& y) {
  const cpu_moe::MoeExperts<index_t> experts{
      x.size(1), intermediate_size, w13_packed.size(0), topk_ids.size(1), x.data_ptr<float>(),
      topk_ids.data_ptr<index_t>(), topk_weights.data_ptr<float>(), w13_packed.data_ptr<float>(),
      w2_packed.data_ptr<float>()};
  const int64_t rows = x.size(0);
  const std::string error = experts.error(kOp, rows);
  TORCH_CHECK(error.empty(), error);
  experts.run(TorchParallel{}, rows, rows, y.data_ptr<float>());
}

at::Tensor moe_experts_cpu(const at::Tensor& x, const at::Tensor& topk_ids,
                           const at::Tensor& topk_weights, const at::Tensor& w13_packed,
                           const at::Tensor& w2_packed, int64_t intermediate_size) {
  check_moe_args(x, topk_ids, topk_weights, w13_packed, w2_packed, intermediate_size);
  at::Tensor y = at::empty_like(x);
  if (topk_ids.scalar_type() == at::kInt) {
    run<int32_t>(x, topk_ids, topk_weights, w13_packed, w2_packed, intermediate_size, y);
  } else {
    run<int64_t>(x, topk_ids, topk_weights, w13_packed, w2_packed, intermediate_size, y);
  }
  return y;
}

at::Tensor moe_experts_meta(const at::Tensor& x, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, const at::Tensor& w13_packed,
                            const at::Tensor& w2_packed, int64_t intermediate_size) {
  check_moe_args(x, topk_ids, topk_weights, w13_packed, w2_packed, intermediate_size);
  return at::empty_like(x);
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed, "
        "Tensor w2_packed, int intermediate_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) { m.impl("moe_experts", &pagedjax::moe_experts_cpu); }

TORCH_LIBRARY_IMPL(pagedjax, Meta, m) { m.impl("moe_experts", &pagedjax::moe_experts_meta); }
