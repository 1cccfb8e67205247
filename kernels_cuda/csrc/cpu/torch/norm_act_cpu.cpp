// The elementwise glue of a decoder layer on the CPU, one op each where eager PyTorch runs 3-8:
//   rms_norm(x, weight, eps)                    HF's LlamaRMSNorm
//   fused_add_rms_norm(x, residual, weight, eps) (rms_norm(x + residual), x + residual)
//   silu_and_mul(x [T, 2I])                      silu(x[:, :I]) * x[:, I:]
// with HF's rounding: the norm in float32, the normalised row cast to the input dtype, then times
// the weight (rounded again); the residual sum rounded to the input dtype before it is normalised.
// Rows split across threads; float32 rows take AVX2 paths where the CPU has them (a row's sum of
// squares in a fixed order, so a row's result does not depend on the batch).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "../kernels/norm_act_cpu_kernel.h"
#include "../kernels/parallel.h"

namespace pagedjax {
namespace {

using cpu_norm::normalize_row;
using cpu_parallel::row_grain;

void check_rows(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), op, ": ", name,
              " must be a contiguous [num_tokens, hidden], got shape ", t.sizes());
  TORCH_CHECK(t.sizes() == ref.sizes() && t.scalar_type() == ref.scalar_type(), op, ": ", name,
              " must match x (", ref.scalar_type(), " ", ref.sizes(), "), got ",
              t.scalar_type(), " ", t.sizes());
}

void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  check_rows(op, "x", x, x);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              op, ": weight must be a contiguous ", x.scalar_type(), " [", x.size(1), "], got ",
              weight.scalar_type(), " ", weight.sizes());
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args("pagedjax::rms_norm", x, weight);
  at::Tensor out = at::empty_like(x);
  const int64_t hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), row_grain(hidden), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        normalize_row(src + r * hidden, w, dst + r * hidden, hidden, eps);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cpu(const at::Tensor& x,
                                                          const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps) {
  check_norm_args("pagedjax::fused_add_rms_norm", x, weight);
  check_rows("pagedjax::fused_add_rms_norm", "residual", residual, x);
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  const int64_t hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm",
                                  [&] {
    const scalar_t* a = x.data_ptr<scalar_t>();
    const scalar_t* b = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* s = sum.data_ptr<scalar_t>();
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), row_grain(hidden), [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * hidden; i < r1 * hidden; ++i)  // one rounded add per element
        s[i] = static_cast<scalar_t>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
      for (int64_t r = r0; r < r1; ++r)
        normalize_row(s + r * hidden, w, y + r * hidden, hidden, eps);
    });
  });
  return {out, sum};
}

at::Tensor silu_and_mul_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.is_contiguous(),
              "pagedjax::silu_and_mul: x must be a contiguous [num_tokens, 2 * intermediate], "
              "got shape ", x.sizes());
  const int64_t half = x.size(1) / 2;
#if defined(__x86_64__)
  if (x.scalar_type() == at::kFloat && cpu_has_avx2_fma()) {  // one pass, rows across threads
    at::Tensor out = at::empty({x.size(0), half}, x.options());
    const float* src = x.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, x.size(0), row_grain(half), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        cpu_norm::silu_and_mul_avx2(src + 2 * r * half, src + (2 * r + 1) * half,
                                    dst + r * half, half);
    });
    return out;
  }
#endif
  // ATen's vectorised silu, then the product in place: F.silu(gate) * up bit for bit.
  return at::silu(x.narrow(1, 0, half)).mul_(x.narrow(1, half, half));
}

at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor& weight, double /*eps*/) {
  check_norm_args("pagedjax::rms_norm", x, weight);
  return at::empty_like(x);
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_meta(const at::Tensor& x,
                                                           const at::Tensor& residual,
                                                           const at::Tensor& weight,
                                                           double /*eps*/) {
  check_norm_args("pagedjax::fused_add_rms_norm", x, weight);
  check_rows("pagedjax::fused_add_rms_norm", "residual", residual, x);
  return {at::empty_like(x), at::empty_like(x)};
}

at::Tensor silu_and_mul_meta(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0,
              "pagedjax::silu_and_mul: x must be [num_tokens, 2 * intermediate], got shape ",
              x.sizes());
  return at::empty({x.size(0), x.size(1) / 2}, x.options());
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> "
        "(Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) {
  m.impl("rms_norm", &pagedjax::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &pagedjax::fused_add_rms_norm_cpu);
  m.impl("silu_and_mul", &pagedjax::silu_and_mul_cpu);
}

TORCH_LIBRARY_IMPL(pagedjax, Meta, m) {
  m.impl("rms_norm", &pagedjax::rms_norm_meta);
  m.impl("fused_add_rms_norm", &pagedjax::fused_add_rms_norm_meta);
  m.impl("silu_and_mul", &pagedjax::silu_and_mul_meta);
}
