// The elementwise glue of a decoder layer on the CPU, one op each where eager PyTorch runs 3-8:
//   rms_norm(x, weight, eps)                    HF's LlamaRMSNorm
//   fused_add_rms_norm(x, residual, weight, eps) (rms_norm(x + residual), x + residual)
//   silu_and_mul(x [T, 2I])                      silu(x[:, :I]) * x[:, I:]
// with HF's rounding: the norm in float32, the normalised row cast to the input dtype, then times
// the weight (rounded again); the residual sum rounded to the input dtype before it is normalised.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace pagedjax {
namespace {

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

// out[t] = weight * (scalar_t)(row * rsqrt(mean(row^2) + eps)), row = src[t] (float32 math).
template <typename scalar_t>
void normalize_rows(const scalar_t* src, const scalar_t* weight, scalar_t* out, int64_t rows,
                    int64_t hidden, double eps) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, hidden));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const scalar_t* x = src + r * hidden;
      float sum = 0.f;
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = static_cast<float>(x[i]);
        sum += v * v;
      }
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
      scalar_t* y = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(x[i]) * scale);
        y[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(normed));
      }
    }
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args("pagedjax::rms_norm", x, weight);
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    normalize_rows(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                   out.data_ptr<scalar_t>(), x.size(0), x.size(1), eps);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cpu(const at::Tensor& x,
                                                          const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps) {
  check_norm_args("pagedjax::fused_add_rms_norm", x, weight);
  check_rows("pagedjax::fused_add_rms_norm", "residual", residual, x);
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  const int64_t n = x.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm",
                                  [&] {
    const scalar_t* a = x.data_ptr<scalar_t>();
    const scalar_t* b = residual.data_ptr<scalar_t>();
    scalar_t* s = sum.data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i)
      s[i] = static_cast<scalar_t>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
    normalize_rows(s, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                   x.size(1), eps);
  });
  return {out, sum};
}

at::Tensor silu_and_mul_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.is_contiguous(),
              "pagedjax::silu_and_mul: x must be a contiguous [num_tokens, 2 * intermediate], "
              "got shape ", x.sizes());
  // ATen's vectorised silu, then the product in place: F.silu(gate) * up bit for bit, in two
  // kernels without Python between them.
  const int64_t half = x.size(1) / 2;
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
