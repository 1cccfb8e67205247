// Schemas of the pagedjax custom ops, their argument checks, the functional attention op and the
// CPU and Meta registrations. The CUDA kernels register themselves in attention_cuda.cu.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>

#include "attention.h"

namespace pagedjax {
namespace {

void check_same_device(const char* op, const char* name, const at::Tensor& t,
                       const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(),
              " but the other tensors are on ", ref.device());
}

// An int32 metadata tensor: `dim`-dimensional, contiguous, on the device of `ref`.
void check_int32_metadata(const char* name, const at::Tensor& t, int64_t dim,
                          const at::Tensor& ref) {
  const char* op = "ragged_paged_attention";
  TORCH_CHECK(t.scalar_type() == at::kInt, op, ": ", name, " must be int32, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dims, got shape ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (call .contiguous())");
  check_same_device(op, name, t, ref);
}

// A [N, Hkv, bs, D] cache: contiguous, on the device of `ref`, of ref's dtype or (allow_fp8)
// float8_e4m3fn (an FP8 KV cache, kv_cache_dtype="fp8").
void check_cache(const char* op, const char* name, const at::Tensor& cache,
                 const at::Tensor& ref, bool allow_fp8) {
  TORCH_CHECK(cache.dim() == 4, op, ": ", name,
              " must be [num_blocks, num_kv_heads, block_size, head_dim], got shape ",
              cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), op, ": ", name, " must be contiguous");
  TORCH_CHECK(cache.scalar_type() == ref.scalar_type() ||
                  (allow_fp8 && cache.scalar_type() == at::kFloat8_e4m3fn),
              op, ": ", name, " has dtype ", cache.scalar_type(), " but expected ",
              ref.scalar_type(), allow_fp8 ? " or float8_e4m3fn" : "");
  check_same_device(op, name, cache, ref);
}

void check_kv_scales(const char* op, double k_scale, double v_scale) {
  TORCH_CHECK(k_scale > 0 && v_scale > 0 && std::isfinite(k_scale) && std::isfinite(v_scale), op,
              ": k_scale and v_scale must be finite and > 0, got ", k_scale, " and ", v_scale);
}

}  // namespace

AttentionShape check_attention_args(const at::Tensor& out, const at::Tensor& q,
                                    const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& kv_lens, const at::Tensor& block_tables,
                                    const at::Tensor& query_start_loc,
                                    std::optional<int64_t> sliding_window,
                                    std::optional<double> soft_cap, double k_scale,
                                    double v_scale) {
  const char* op = "ragged_paged_attention";
  TORCH_CHECK(q.dim() == 3, op, ": q must be [num_tokens, num_q_heads, head_dim], got shape ",
              q.sizes());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), op, ": q must be floating point, got ",
              q.scalar_type());
  TORCH_CHECK(q.stride(2) == 1, op, ": q's last dim must be contiguous, got strides ",
              q.strides());
  check_cache(op, "k_cache", k_cache, q, /*allow_fp8=*/true);
  check_cache(op, "v_cache", v_cache, k_cache, /*allow_fp8=*/false);
  check_kv_scales(op, k_scale, v_scale);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache has shape ", v_cache.sizes(),
              " but k_cache has shape ", k_cache.sizes());
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), op,
              ": out must be a contiguous tensor of q's shape ", q.sizes(), ", got shape ",
              out.sizes(), " strides ", out.strides());
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), op, ": out has dtype ", out.scalar_type(),
              " but q has ", q.scalar_type());
  check_same_device(op, "out", out, q);

  AttentionShape shape{};
  shape.num_tokens = q.size(0);
  shape.num_q_heads = q.size(1);
  shape.head_dim = q.size(2);
  shape.num_blocks = k_cache.size(0);
  shape.num_kv_heads = k_cache.size(1);
  shape.block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == shape.head_dim, op, ": k_cache head_dim ", k_cache.size(3),
              " != q head_dim ", shape.head_dim);
  TORCH_CHECK(shape.num_kv_heads > 0 && shape.num_q_heads % shape.num_kv_heads == 0, op,
              ": num_q_heads ", shape.num_q_heads, " must be a multiple of num_kv_heads ",
              shape.num_kv_heads);
  shape.group = shape.num_q_heads / shape.num_kv_heads;

  check_int32_metadata("kv_lens", kv_lens, 1, q);
  check_int32_metadata("block_tables", block_tables, 2, q);
  check_int32_metadata("query_start_loc", query_start_loc, 1, q);
  shape.num_seqs = kv_lens.size(0);
  shape.max_blocks = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) == shape.num_seqs, op, ": block_tables has ",
              block_tables.size(0), " rows but kv_lens has ", shape.num_seqs, " sequences");
  TORCH_CHECK(query_start_loc.size(0) == shape.num_seqs + 1, op, ": query_start_loc must have ",
              shape.num_seqs + 1, " entries (num_seqs + 1), got ", query_start_loc.size(0));
  TORCH_CHECK(!sliding_window || *sliding_window > 0, op, ": sliding_window must be >= 1, got ",
              sliding_window.value_or(0));
  TORCH_CHECK(!soft_cap || *soft_cap > 0, op,
              ": soft_cap must be > 0, got ", soft_cap.value_or(0.0));
  return shape;
}

void check_write_kv_args(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                         double k_scale, double v_scale) {
  const char* op = "write_kv";
  check_cache(op, "k_cache", k_cache, k_cache, false);
  check_cache(op, "v_cache", v_cache, k_cache, false);
  check_kv_scales(op, k_scale, v_scale);
  const bool fp8_cache = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache has shape ", v_cache.sizes(),
              " but k_cache has shape ", k_cache.sizes());
  for (const auto& [name, t] : {std::pair{"k", &k}, std::pair{"v", &v}}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == k_cache.size(1) && t->size(2) == k_cache.size(3),
                op, ": ", name, " must be [num_tokens, num_kv_heads=", k_cache.size(1),
                ", head_dim=", k_cache.size(3), "], got shape ", t->sizes());
    TORCH_CHECK(t->stride(2) == 1, op, ": ", name, "'s last dim must be contiguous, got strides ",
                t->strides());
    TORCH_CHECK(t->scalar_type() == k_cache.scalar_type() ||
                    (fp8_cache && at::isFloatingType(t->scalar_type()) &&
                     t->scalar_type() != at::kFloat8_e4m3fn && t->scalar_type() == k.scalar_type()),
                op, ": ", name, " has dtype ", t->scalar_type(), " but the cache has ",
                k_cache.scalar_type(), " (cast it to the cache dtype; an fp8 cache takes k and "
                "v of one float dtype)");
    check_same_device(op, name, *t, k_cache);
  }
  TORCH_CHECK(v.size(0) == k.size(0), op, ": k has ", k.size(0), " tokens but v has ", v.size(0));
  TORCH_CHECK(slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong,
              op, ": slot_mapping must be int32 or int64, got ", slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) &&
                  slot_mapping.is_contiguous(),
              op, ": slot_mapping must be a contiguous [num_tokens=", k.size(0),
              "] tensor, got shape ", slot_mapping.sizes());
  check_same_device(op, "slot_mapping", slot_mapping, k_cache);
}

namespace {

// The functional op: allocate the output, then run the out= op of the inputs' backend.
at::Tensor ragged_paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& kv_lens,
                                  const at::Tensor& block_tables,
                                  const at::Tensor& query_start_loc, double sm_scale,
                                  std::optional<int64_t> sliding_window,
                                  std::optional<double> soft_cap,
                                  std::optional<int64_t> max_query_len, double k_scale,
                                  double v_scale) {
  static const auto out_op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("pagedjax::ragged_paged_attention_out", "")
                                 .typed<AttentionOutFn>();
  at::Tensor out = at::empty(q.sizes(), q.options());  // q's dtype, whatever the caches' are  // [T, Hq, D], contiguous
  out_op.call(out, q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, sm_scale,
              sliding_window, soft_cap, max_query_len, k_scale, v_scale);
  return out;
}

// Meta kernels: shape and dtype checks only, so the ops trace under FakeTensor/torch.compile.
void ragged_paged_attention_out_meta(const at::Tensor& out, const at::Tensor& q,
                                     const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& kv_lens, const at::Tensor& block_tables,
                                     const at::Tensor& query_start_loc, double /*sm_scale*/,
                                     std::optional<int64_t> sliding_window,
                                     std::optional<double> soft_cap,
                                     std::optional<int64_t> /*max_query_len*/, double k_scale,
                                     double v_scale) {
  check_attention_args(out, q, k_cache, v_cache, kv_lens, block_tables, query_start_loc,
                       sliding_window, soft_cap, k_scale, v_scale);
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY(pagedjax, m) {
  m.def(
      "ragged_paged_attention_out(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor kv_lens, Tensor block_tables, Tensor query_start_loc, float sm_scale, "
      "int? sliding_window=None, float? soft_cap=None, int? max_query_len=None, "
      "float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def(
      "ragged_paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_lens, "
      "Tensor block_tables, Tensor query_start_loc, float sm_scale, int? sliding_window=None, "
      "float? soft_cap=None, int? max_query_len=None, float k_scale=1.0, "
      "float v_scale=1.0) -> Tensor");
  m.def(
      "write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, float k_scale=1.0, float v_scale=1.0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedjax, CompositeExplicitAutograd, m) {
  m.impl("ragged_paged_attention", &pagedjax::ragged_paged_attention);
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) {
  m.impl("ragged_paged_attention_out", &pagedjax::ragged_paged_attention_out_cpu);
  m.impl("write_kv", &pagedjax::write_kv_cpu);
}

TORCH_LIBRARY_IMPL(pagedjax, Meta, m) {
  m.impl("ragged_paged_attention_out", &pagedjax::ragged_paged_attention_out_meta);
  m.impl("write_kv", &pagedjax::check_write_kv_args);
}
