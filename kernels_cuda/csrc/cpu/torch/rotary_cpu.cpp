// Rotary position embedding in place on the CPU, HF's rotate_half layout, computed in float32:
//   x[..., i]        = x[i] * cos[i]        - x[i + D/2] * sin[i]
//   x[..., i + D/2]  = x[i + D/2] * cos[i + D/2] + x[i] * sin[i + D/2]
// for every token t and head h of x [T, H, D], with cos/sin [T, D] already gathered at each token's
// position. x may be a strided view (the q and k heads of a fused qkv projection); only its head
// vectors must be contiguous. One call replaces the ~10 eager ops per tensor of the torch version.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../kernels/norm_act_cpu_kernel.h"

namespace pagedjax {
namespace {

void check_rotary_args(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "pagedjax::rotary_embedding_";
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, op,
              ": x must be [num_tokens, num_heads, head_dim] with an even head_dim, got shape ",
              x.sizes());
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), op,
              ": x's heads must be contiguous vectors, got strides ", x.strides());
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == x.size(0) && t->size(1) == x.size(2) &&
                    t->is_contiguous() && t->scalar_type() == at::kFloat,
                op, ": cos and sin must be contiguous float32 [", x.size(0), ", ", x.size(2),
                "], got ", t->scalar_type(), " ", t->sizes());
  }
}

template <typename scalar_t>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t num_tokens = x.size(0), num_heads = x.size(1), d = x.size(2);
  const int64_t token_stride = x.stride(0);
  scalar_t* xp = x.data_ptr<scalar_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, num_heads * d));
  at::parallel_for(0, num_tokens, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      cpu_norm::rotate_heads(xp + t * token_stride, num_heads, d, d, cp + t * d, sp + t * d);
    }
  });
}

void rotary_embedding_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rotary_args(x, cos, sin);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_embedding_",
                                  [&] { rotate<scalar_t>(x, cos, sin); });
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def("rotary_embedding_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) { m.impl("rotary_embedding_", &pagedjax::rotary_embedding_cpu); }

TORCH_LIBRARY_IMPL(pagedjax, Meta, m) { m.impl("rotary_embedding_", &pagedjax::check_rotary_args); }
