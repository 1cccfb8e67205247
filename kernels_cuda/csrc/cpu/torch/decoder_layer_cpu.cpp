// One Llama decoder layer of the CPU float32 path as a single op: the same pagedjax ops in the
// same order as backends/torch/model.py's DecoderLayer (so the same bits), called through typed
// dispatcher handles instead of one Python call each.
//
// Why: at a few rows the ops' kernels are the smaller part of a layer; most of a 1-token forward
// was the per-op path from Python (argument parsing, boxing, the nn.Module calls and views around
// ~12 ops a layer). One op cuts the draft's forward by about a third (RESULTS.md).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace pagedjax {
namespace {

using OptTensor = std::optional<at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The ops' C++ signatures, as their kernels are registered.
using Tensor = at::Tensor;
using RmsNorm = Tensor(const Tensor&, const Tensor&, double);
using FusedAddRmsNorm = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                   double);
using Linear = Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t);
using Rotary = void(const Tensor&, const Tensor&, const Tensor&);
using WriteKV = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&);
using Attention = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         const Tensor&, const Tensor&, double, std::optional<int64_t>,
                         std::optional<double>, std::optional<int64_t>);
using SiluAndMul = Tensor(const Tensor&);

struct Ops {
  c10::TypedOperatorHandle<RmsNorm> rms_norm = find_op<RmsNorm>("pagedjax::rms_norm");
  c10::TypedOperatorHandle<FusedAddRmsNorm> fused_add_rms_norm =
      find_op<FusedAddRmsNorm>("pagedjax::fused_add_rms_norm");
  c10::TypedOperatorHandle<Linear> linear = find_op<Linear>("pagedjax::linear");
  c10::TypedOperatorHandle<Rotary> rotary = find_op<Rotary>("pagedjax::rotary_embedding_");
  c10::TypedOperatorHandle<WriteKV> write_kv = find_op<WriteKV>("pagedjax::write_kv");
  c10::TypedOperatorHandle<Attention> attention =
      find_op<Attention>("pagedjax::ragged_paged_attention");
  c10::TypedOperatorHandle<SiluAndMul> silu_and_mul =
      find_op<SiluAndMul>("pagedjax::silu_and_mul");
};

const Ops& ops() {
  static const Ops handles;  // looked up on the first call, when every op is registered
  return handles;
}

// x [T, H]: the previous layer's output (the embedding in the first layer, residual None)
// → (this layer's output [T, H], the residual stream [T, H]). Weights packed for
// pagedjax::linear; norms' weights [H]; k_cache/v_cache [N, Hkv, bs, D] written at slot_mapping.
std::tuple<at::Tensor, at::Tensor> decoder_layer_cpu(
    const at::Tensor& x, const OptTensor& residual, const at::Tensor& input_norm,
    const at::Tensor& qkv_weight, const OptTensor& qkv_bias, const at::Tensor& o_weight,
    const at::Tensor& post_norm, const at::Tensor& gate_up_weight, const at::Tensor& down_weight,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& kv_lens,
    const at::Tensor& block_tables, const at::Tensor& query_start_loc, int64_t num_q_heads,
    int64_t num_kv_heads, int64_t intermediate_size, double eps, double sm_scale,
    std::optional<int64_t> sliding_window, std::optional<int64_t> max_query_len) {
  const Ops& op = ops();
  TORCH_CHECK(x.dim() == 2, "pagedjax::decoder_layer: x must be [num_tokens, hidden], got ",
              x.sizes());
  const int64_t num_tokens = x.size(0), hidden = x.size(1), head_dim = k_cache.size(3);
  at::Tensor h, stream;
  if (residual) {
    std::tie(h, stream) = op.fused_add_rms_norm.call(x, *residual, input_norm, eps);
  } else {
    h = op.rms_norm.call(x, input_norm, eps);
    stream = x;
  }
  const int64_t q_size = num_q_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor qkv = op.linear.call(h, qkv_weight, qkv_bias, q_size + 2 * kv_size);  // [T, .]
  op.rotary.call(qkv.narrow(1, 0, q_size + kv_size)
                     .view({num_tokens, num_q_heads + num_kv_heads, head_dim}),
                 cos, sin);  // q and k, in place
  at::Tensor q = qkv.narrow(1, 0, q_size).view({num_tokens, num_q_heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
  at::Tensor v =
      qkv.narrow(1, q_size + kv_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
  op.write_kv.call(k, v, k_cache, v_cache, slot_mapping);
  at::Tensor attn = op.attention.call(q, k_cache, v_cache, kv_lens, block_tables,
                                      query_start_loc, sm_scale, sliding_window,
                                      /*soft_cap=*/std::nullopt, max_query_len);  // [T, Hq, D]
  at::Tensor o = op.linear.call(attn.reshape({num_tokens, q_size}), o_weight, std::nullopt, hidden);
  std::tie(h, stream) = op.fused_add_rms_norm.call(o, stream, post_norm, eps);
  at::Tensor gate_up = op.linear.call(h, gate_up_weight, std::nullopt, 2 * intermediate_size);
  at::Tensor out = op.linear.call(op.silu_and_mul.call(gate_up), down_weight, std::nullopt, hidden);
  return {out, stream};
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def(
      "decoder_layer(Tensor x, Tensor? residual, Tensor input_norm, Tensor qkv_weight, "
      "Tensor? qkv_bias, Tensor o_weight, Tensor post_norm, Tensor gate_up_weight, "
      "Tensor down_weight, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cos, Tensor sin, "
      "Tensor slot_mapping, Tensor kv_lens, Tensor block_tables, Tensor query_start_loc, "
      "int num_q_heads, int num_kv_heads, int intermediate_size, float eps, float sm_scale, "
      "int? sliding_window, int? max_query_len) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) { m.impl("decoder_layer", &pagedjax::decoder_layer_cpu); }
