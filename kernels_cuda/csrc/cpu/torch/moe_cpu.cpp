// A mixture of experts' expert block on the CPU in float32 as one torch op:
//   moe_experts(x [T, H], topk_ids [T, k], topk_weights [T, k], w13_packed, w2_packed,
//               intermediate_size) -> y [T, H]
// the kernel of ../kernels/moe_experts_kernel.h (the JAX FFI handler runs the same), and its
// routing as another:
//   moe_routing(logits [T, E], top_k, renormalize) -> (topk_weights [T, k], topk_ids [T, k])
// (route_rows: the fused decoder layer's, so the op-by-op layer chooses its experts' bits). This
// file checks the tensors and hands their pointers over.
//
// Why: torch's grouped_mm over the sorted pairs ran a Qwen3-MoE decode step at 2.4x its dense
// twin's time on CPU; this runs each chosen expert's products on the packed linear's blocks, an
// expert's weights read once: 1.2x (benchmarks/moe.py, 2-core EPYC).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>
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

void check_routing_args(const at::Tensor& logits, int64_t top_k) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "pagedjax::moe_routing: logits must be a contiguous float32 [num_tokens, "
              "num_experts], got ", logits.scalar_type(), " ", logits.sizes());
  TORCH_CHECK(top_k >= 1 && top_k <= logits.size(1), "pagedjax::moe_routing: top_k=", top_k,
              " must be in [1, num_experts=", logits.size(1), "]");
}

// logits [T, E] → (weights [T, k] float32, ids [T, k] int64: torch.topk's dtype).
std::tuple<at::Tensor, at::Tensor> moe_routing_cpu(const at::Tensor& logits, int64_t top_k,
                                                   bool renormalize) {
  check_routing_args(logits, top_k);
  const int64_t T = logits.size(0), E = logits.size(1);
  at::Tensor probs = logits.clone();  // route_rows overwrites its rows
  at::Tensor weights = at::empty({T, top_k}, logits.options());
  at::Tensor ids = at::empty({T, top_k}, logits.options().dtype(at::kLong));
  cpu_moe::route_rows(TorchParallel{}, probs.data_ptr<float>(), E, T, E, top_k, renormalize,
                      weights.data_ptr<float>(), ids.data_ptr<int64_t>());
  return {weights, ids};
}

std::tuple<at::Tensor, at::Tensor> moe_routing_meta(const at::Tensor& logits, int64_t top_k,
                                                    bool /*renormalize*/) {
  check_routing_args(logits, top_k);
  return {at::empty({logits.size(0), top_k}, logits.options()),
          at::empty({logits.size(0), top_k}, logits.options().dtype(at::kLong))};
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13_packed, "
        "Tensor w2_packed, int intermediate_size) -> Tensor");
  m.def("moe_routing(Tensor logits, int top_k, bool renormalize) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) {
  m.impl("moe_experts", &pagedjax::moe_experts_cpu);
  m.impl("moe_routing", &pagedjax::moe_routing_cpu);
}

TORCH_LIBRARY_IMPL(pagedjax, Meta, m) {
  m.impl("moe_experts", &pagedjax::moe_experts_meta);
  m.impl("moe_routing", &pagedjax::moe_routing_meta);
}
