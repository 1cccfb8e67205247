// One decoder layer of the CPU float32 path as a single torch op: the layer that
// ../kernels/decoder_layer_kernel.h composes (Llama's, with Qwen3's per-head q/k norms and a
// mixture of experts' MLP where given; the JAX FFI handler runs the same), which is
// backends/torch/model.py's DecoderLayer op by op (so the same bits) without one Python call per
// op; decoder_layers runs a model's stack of them in one call. This file checks the tensors and
// hands their pointers over.
//
// Why: at a few rows the ops' kernels are the smaller part of a layer; most of a 1-token forward
// was the per-op path from Python (argument parsing, boxing, the nn.Module calls and views around
// ~12 ops a layer, ~14 with q/k norms and experts). One op cuts the draft's forward by about a
// third (RESULTS.md).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>

#include "../kernels/decoder_layer_kernel.h"
#include "torch_parallel.h"

namespace pagedjax {
namespace {

using OptTensor = std::optional<at::Tensor>;
constexpr const char* kOp = "pagedjax::decoder_layer";

// A contiguous float32 tensor of exactly `sizes`.
void check_float(const char* name, const at::Tensor& t, at::IntArrayRef sizes) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.sizes() == sizes, kOp,
              ": ", name, " must be a contiguous float32 ", sizes, ", got ", t.scalar_type(),
              " ", t.sizes(), (t.is_contiguous() ? "" : " (not contiguous)"));
}

// A weight packed for pagedjax::linear: [ceil(out / 16), in, 16] (pack_linear_weight).
void check_packed(const char* name, const at::Tensor& t, int64_t in, int64_t out) {
  check_float(name, t, {(out + cpu_linear::kTile - 1) / cpu_linear::kTile, in, cpu_linear::kTile});
}

// A projection's weight: packed for pagedjax::linear (qtype 0), or GGML blocks of qtype
// [out, in / 32 * block bytes] or interleaved [out / 8, 8 x that] (pagedjax::quant_linear).
cpu_layer::Projection projection(const char* name, const at::Tensor& t, int64_t in, int64_t out,
                                 int64_t qtype) {
  if (qtype == 0) {
    check_packed(name, t, in, out);
    return cpu_layer::Projection::of_packed(t.data_ptr<float>(), t.size(0));
  }
  const int64_t bytes = cpu_quant::block_bytes(qtype);
  TORCH_CHECK(bytes > 0 && in % cpu_quant::kBlock == 0, kOp, ": ", name, " qtype=", qtype,
              " over ", in, " inputs; use 8 (Q8_0), 2 (Q4_0) or 3 (Q4_1) over a multiple of 32");
  bool interleaved = false;
  TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.dim() == 2 &&
                  cpu_quant::rows_of_blocks(qtype, in, t.size(0), t.size(1), &interleaved) == out,
              kOp, ": ", name, " must be contiguous uint8 blocks [", out, ", ",
              in / cpu_quant::kBlock * bytes, "] (or interleaved [", out / cpu_quant::kGroup,
              ", ", cpu_quant::kGroup * (in / cpu_quant::kBlock) * bytes, "]), got ",
              t.scalar_type(), " ", t.sizes());
  return cpu_layer::Projection::of_blocks(t.data_ptr<uint8_t>(), qtype, interleaved);
}

// An int32 metadata tensor of `dim` dims, contiguous.
void check_int32(const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == dim && t.is_contiguous(), kOp, ": ",
              name, " must be a contiguous int32 tensor of ", dim, " dims, got ",
              t.scalar_type(), " ", t.sizes());
}

// The experts of a mixture-of-experts MLP: the router packed for pagedjax::linear [ceil(E / 16),
// H, 16], w13 [E, ceil(2I / 16), H, 16] and w2 [E, ceil(H / 16), I, 16] packed by
// pack_moe_weights (pagedjax::moe_experts's).
cpu_layer::Experts experts(const at::Tensor& router, const at::Tensor& w13, const at::Tensor& w2,
                           int64_t H, int64_t I, int64_t top_k, bool renormalize) {
  TORCH_CHECK(w13.dim() == 4 && w13.size(0) >= 1, kOp,
              ": with router_weight, gate_up_weight must be the experts' w13 [E, ceil(2I / 16), "
              "H, 16], got ", w13.sizes());
  const int64_t E = w13.size(0);
  check_packed("router_weight", router, H, E);
  check_float("gate_up_weight (w13)", w13,
              {E, (2 * I + cpu_linear::kTile - 1) / cpu_linear::kTile, H, cpu_linear::kTile});
  check_float("down_weight (w2)", w2,
              {E, (H + cpu_linear::kTile - 1) / cpu_linear::kTile, I, cpu_linear::kTile});
  TORCH_CHECK(top_k >= 1 && top_k <= E, kOp, ": top_k=", top_k, " must be in [1, num_experts=",
              E, "]");
  return {cpu_layer::Projection::of_packed(router.data_ptr<float>(), router.size(0)),
          w13.data_ptr<float>(), w2.data_ptr<float>(), E, top_k, renormalize};
}

// x [T, H]: the previous layer's output (the embedding in the first layer, residual None)
// → (this layer's output [T, H], the residual stream [T, H]). Weights packed for
// pagedjax::linear, or (qtypes[i] != 0) GGML blocks for pagedjax::quant_linear; norms' weights
// [H]; k_cache/v_cache [N, Hkv, bs, D] (float32, or float8_e4m3fn with k_scale / v_scale)
// written at slot_mapping. q_norm, k_norm [D] (Qwen3): each q and k head normalised before
// rope. router_weight (a mixture of experts, packed float32 only): the MLP is the experts,
// gate_up_weight and down_weight their w13 and w2, intermediate_size each expert's.
// Every row is computed, padding rows (past query_start_loc[S]) included, as the ops would.
std::tuple<at::Tensor, at::Tensor> decoder_layer_cpu(
    const at::Tensor& x, const OptTensor& residual, const at::Tensor& input_norm,
    const at::Tensor& qkv_weight, const OptTensor& qkv_bias, const at::Tensor& o_weight,
    const at::Tensor& post_norm, const at::Tensor& gate_up_weight, const at::Tensor& down_weight,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& kv_lens,
    const at::Tensor& block_tables, const at::Tensor& query_start_loc, int64_t num_q_heads,
    int64_t num_kv_heads, int64_t intermediate_size, double eps, double sm_scale,
    std::optional<int64_t> sliding_window, std::optional<int64_t> /*max_query_len: CUDA-only*/,
    at::OptionalIntArrayRef qtypes, double k_scale, double v_scale, const OptTensor& q_norm,
    const OptTensor& k_norm, const OptTensor& router_weight, int64_t top_k, bool renormalize) {
  TORCH_CHECK(x.dim() == 2, kOp, ": x must be [num_tokens, hidden], got ", x.sizes());
  TORCH_CHECK(k_cache.dim() == 4, kOp, ": k_cache must be [N, Hkv, bs, D], got ",
              k_cache.sizes());
  const int64_t T = x.size(0), H = x.size(1), D = k_cache.size(3), I = intermediate_size;
  TORCH_CHECK(num_kv_heads > 0 && k_cache.size(1) == num_kv_heads &&
                  num_q_heads % num_kv_heads == 0 && D % 2 == 0,
              kOp, ": num_kv_heads=", num_kv_heads, " must divide num_q_heads=", num_q_heads,
              " and be k_cache's dim 1, with an even head_dim, got k_cache ", k_cache.sizes());
  const int64_t q_size = num_q_heads * D, qkv_size = q_size + 2 * num_kv_heads * D;
  check_float("x", x, {T, H});
  if (residual) check_float("residual", *residual, {T, H});
  check_float("input_norm", input_norm, {H});
  check_float("post_norm", post_norm, {H});
  TORCH_CHECK(!qtypes || qtypes->size() == 4, kOp,
              ": qtypes must be 4 ints (qkv, o, gate_up, down; 0: packed float32)");
  auto qtype = [&](int i) { return qtypes ? (*qtypes)[i] : int64_t{0}; };
  const cpu_layer::Projection qkv = projection("qkv_weight", qkv_weight, H, qkv_size, qtype(0));
  if (qkv_bias) check_float("qkv_bias", *qkv_bias, {qkv_size});
  const cpu_layer::Projection o = projection("o_weight", o_weight, q_size, H, qtype(1));
  cpu_layer::Projection gate_up, down;
  cpu_layer::Experts moe;
  if (router_weight) {
    TORCH_CHECK(qtype(2) == 0 && qtype(3) == 0, kOp, ": the experts are packed float32 only");
    moe = experts(*router_weight, gate_up_weight, down_weight, H, I, top_k, renormalize);
  } else {
    gate_up = projection("gate_up_weight", gate_up_weight, H, 2 * I, qtype(2));
    down = projection("down_weight", down_weight, I, H, qtype(3));
  }
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), kOp,
              ": q_norm and k_norm come together");
  if (q_norm) {
    check_float("q_norm", *q_norm, {D});
    check_float("k_norm", *k_norm, {D});
  }
  const bool fp8_cache = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  if (fp8_cache) {  // an FP8 KV cache: k / k_scale, v / v_scale stored as e4m3
    TORCH_CHECK(v_cache.scalar_type() == at::kFloat8_e4m3fn && k_cache.is_contiguous() &&
                    v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
                kOp, ": an fp8 k_cache needs a contiguous fp8 v_cache of its shape, got ",
                v_cache.scalar_type(), " ", v_cache.sizes());
    TORCH_CHECK(k_scale > 0 && v_scale > 0 && std::isfinite(k_scale) && std::isfinite(v_scale),
                kOp, ": k_scale and v_scale must be finite and > 0, got ", k_scale, " and ",
                v_scale);
  } else {
    check_float("k_cache", k_cache, k_cache.sizes());
    check_float("v_cache", v_cache, k_cache.sizes());
  }
  check_float("cos", cos, {T, D});
  check_float("sin", sin, {T, D});
  TORCH_CHECK((slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong) &&
                  slot_mapping.dim() == 1 && slot_mapping.size(0) == T &&
                  slot_mapping.is_contiguous(),
              kOp, ": slot_mapping must be a contiguous int32 or int64 [", T, "], got ",
              slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  check_int32("kv_lens", kv_lens, 1);
  check_int32("block_tables", block_tables, 2);
  check_int32("query_start_loc", query_start_loc, 1);
  TORCH_CHECK(block_tables.size(0) == kv_lens.size(0) &&
                  query_start_loc.size(0) == kv_lens.size(0) + 1,
              kOp, ": expected kv_lens [S], block_tables [S, M], query_start_loc [S+1], got ",
              kv_lens.sizes(), ", ", block_tables.sizes(), ", ", query_start_loc.sizes());
  TORCH_CHECK(!sliding_window || *sliding_window > 0, kOp, ": sliding_window must be >= 1, got ",
              sliding_window.value_or(0));

  const AttentionShape shape = cpu_attention::attention_shape(T, num_q_heads, k_cache.sizes(),
                                                              block_tables.sizes());
  const cpu_layer::Weights weights{input_norm.data_ptr<float>(),
                                   qkv,
                                   qkv_bias ? qkv_bias->data_ptr<float>() : nullptr,
                                   o,
                                   post_norm.data_ptr<float>(),
                                   gate_up,
                                   down,
                                   q_norm ? q_norm->data_ptr<float>() : nullptr,
                                   k_norm ? k_norm->data_ptr<float>() : nullptr,
                                   moe};
  const cpu_attention::RaggedBatch batch{kv_lens.data_ptr<int32_t>(),
                                         block_tables.data_ptr<int32_t>(),
                                         query_start_loc.data_ptr<int32_t>()};
  at::Tensor out = at::empty({T, H}, x.options()), stream = at::empty({T, H}, x.options());
  AT_DISPATCH_INDEX_TYPES(slot_mapping.scalar_type(), "decoder_layer_cpu", [&] {
    const cpu_layer::DecoderLayer<index_t> layer{
        shape, H, I, eps, static_cast<float>(sm_scale), sliding_window.value_or(0),
        x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr, weights,
        cos.data_ptr<float>(), sin.data_ptr<float>(), slot_mapping.data_ptr<index_t>(), batch,
        static_cast<float>(k_scale), static_cast<float>(v_scale)};
    const std::string error = layer.error(T);
    TORCH_CHECK(error.empty(), kOp, ": ", error);
    if (fp8_cache) {
      layer.run(TorchParallel{}, T, out.data_ptr<float>(), stream.data_ptr<float>(),
                static_cast<fp8::E4M3*>(k_cache.data_ptr()),
                static_cast<fp8::E4M3*>(v_cache.data_ptr()));
    } else {
      layer.run(TorchParallel{}, T, out.data_ptr<float>(), stream.data_ptr<float>(),
                k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
    }
  });
  return {out, stream};
}

constexpr int64_t kLayerWeights = 10;  // decoder_layers' weights per layer, in this order:
// input_norm, qkv_weight, qkv_bias?, o_weight, post_norm, gate_up_weight, down_weight, q_norm?,
// k_norm?, router_weight?
constexpr int64_t kLayerSizes = 10;  // and its sizes per layer: num_q_heads, num_kv_heads,
// intermediate_size, sliding_window (0: none), the four qtypes, top_k, renormalize (0 or 1)

// The layers [0, L) in turn, each as decoder_layer (the same checks, the same bits), the first
// with no residual: a model's whole stack in one call from Python (a call of decoder_layer's
// ~35 arguments costs ~20 us before any work, 30 of them a step). k_caches, v_caches: a layer each;
// kv_scales: each layer's (k_scale, v_scale). → the last layer's (output, residual stream).
std::tuple<at::Tensor, at::Tensor> decoder_layers_cpu(
    const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& weights,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& kv_lens,
    const at::Tensor& block_tables, const at::Tensor& query_start_loc, at::IntArrayRef sizes,
    double eps, double sm_scale, at::ArrayRef<double> kv_scales) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * kLayerWeights &&
                  static_cast<int64_t>(sizes.size()) == L * kLayerSizes &&
                  static_cast<int64_t>(v_caches.size()) == L &&
                  static_cast<int64_t>(kv_scales.size()) == 2 * L,
              "pagedjax::decoder_layers: for ", L, " layers (k_caches) expected ",
              L * kLayerWeights, " weights, ", L * kLayerSizes, " sizes, ", L, " v_caches and ",
              2 * L, " kv_scales, got ", weights.size(), ", ", sizes.size(), ", ",
              v_caches.size(), " and ", kv_scales.size());
  at::Tensor out = x;
  OptTensor residual;
  for (int64_t l = 0; l < L; ++l) {
    auto weight = [&](int64_t i) { return weights.get(l * kLayerWeights + i); };
    auto required = [&](int64_t i) {
      OptTensor t = weight(i);
      TORCH_CHECK(t.has_value(), "pagedjax::decoder_layers: layer ", l, "'s weight ", i,
                  " is None; only qkv_bias, q_norm, k_norm and router_weight may be");
      return *t;
    };
    const int64_t* s = sizes.data() + l * kLayerSizes;
    std::tie(out, residual) = decoder_layer_cpu(
        out, residual, required(0), required(1), weight(2), required(3), required(4),
        required(5), required(6), k_caches[l], v_caches[l], cos, sin, slot_mapping, kv_lens,
        block_tables, query_start_loc, s[0], s[1], s[2], eps, sm_scale,
        s[3] > 0 ? std::optional<int64_t>(s[3]) : std::nullopt, std::nullopt,
        at::IntArrayRef(s + 4, 4), kv_scales[2 * l], kv_scales[2 * l + 1], weight(7),
        weight(8), weight(9), s[8], s[9] != 0);
  }
  TORCH_CHECK(residual.has_value(), "pagedjax::decoder_layers: no layers (k_caches is empty)");
  return {out, *residual};
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
      "int? sliding_window, int? max_query_len, int[]? qtypes=None, float k_scale=1.0, "
      "float v_scale=1.0, Tensor? q_norm=None, Tensor? k_norm=None, Tensor? router_weight=None, "
      "int top_k=0, bool renormalize=False) -> (Tensor, Tensor)");
  m.def(
      "decoder_layers(Tensor x, Tensor?[] weights, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor kv_lens, "
      "Tensor block_tables, Tensor query_start_loc, int[] sizes, float eps, float sm_scale, "
      "float[] kv_scales) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) {
  m.impl("decoder_layer", &pagedjax::decoder_layer_cpu);
  m.impl("decoder_layers", &pagedjax::decoder_layers_cpu);
}
