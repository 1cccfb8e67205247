// A causal LM's J autoregressive single-token greedy steps in one torch CPU op: each step embeds
// its tokens, runs the fused decoder stack (pagedjax::decoder_layers), the final norm and the LM
// head, and feeds its argmax to the next step. It is backends/torch/model.py's
// LlamaForCausalLM.forward followed by logits_stats' argmax and the token's logprob, op for op
// through the same ops (so the same bits). A speculative step's draft runs K - 1 of them
// (backends/torch/spec_step.py keeps the Python loop as the reference and for the devices
// without this op), a greedy decode step one (backends/torch/step.py).
//
// Why: at one token a sequence, the draft's ~0.1 ms of stack and head sit inside ~0.25 ms of
// Python (the forward's ~10 ops and nn.Module calls, the loop's metadata), four times a step.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace pagedjax {
namespace {

constexpr const char* kOp = "pagedjax::greedy_decode";
using OptTensor = std::optional<at::Tensor>;

// The ops a step runs, through the dispatcher (each one's own checks apply).
using LayersFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const c10::List<OptTensor>&, at::TensorList, at::TensorList,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, at::IntArrayRef, double, double, at::ArrayRef<double>);
using NormFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, double);
using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t);
using QuantLinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&);
using StatsFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&);

struct StepOps {
  c10::TypedOperatorHandle<LayersFn> layers;
  c10::TypedOperatorHandle<NormFn> norm;
  c10::TypedOperatorHandle<LinearFn> linear;
  c10::TypedOperatorHandle<QuantLinearFn> quant_linear;
  c10::TypedOperatorHandle<StatsFn> stats;

  static const StepOps& get() {
    static const StepOps ops = [] {
      auto find = [](const char* name) {
        return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
      };
      return StepOps{find("pagedjax::decoder_layers").typed<LayersFn>(),
                     find("pagedjax::fused_add_rms_norm").typed<NormFn>(),
                     find("pagedjax::linear").typed<LinearFn>(),
                     find("pagedjax::quant_linear").typed<QuantLinearFn>(),
                     find("pagedjax::logits_stats").typed<StatsFn>()};
    }();
    return ops;
  }
};

// input_ids [S] int32: each sequence's token at step 0; positions [J, S] int32 and slot_mapping
// [J, S] (int32 or int64, -1: write nothing): step j's token's position and KV slot (kv_lens =
// positions + 1, one query token a sequence); block_tables [S, M] int32. embedding [V, H] and
// rope_cos / rope_sin [P, D]: the tables the tokens and positions index; weights, k_caches,
// v_caches, sizes, eps, sm_scale, kv_scales: decoder_layers' (caches written at the slots);
// final_norm [H]; head: the LM head packed for pagedjax::linear (head_qtype None) or its GGML
// blocks for pagedjax::quant_linear. → (tokens [J, S] int32: step j's argmax, step j + 1's
// input; logprobs [J, S] float32: each token's logprob, its logit minus the row's logsumexp).
std::tuple<at::Tensor, at::Tensor> greedy_decode_cpu(
    const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& embedding, const at::Tensor& rope_cos,
    const at::Tensor& rope_sin, const c10::List<OptTensor>& weights, at::TensorList k_caches,
    at::TensorList v_caches, at::IntArrayRef sizes, double eps, double sm_scale,
    at::ArrayRef<double> kv_scales, const at::Tensor& final_norm, const at::Tensor& head,
    std::optional<int64_t> head_qtype, int64_t vocab_size) {
  TORCH_CHECK(input_ids.scalar_type() == at::kInt && input_ids.dim() == 1, kOp,
              ": input_ids must be int32 [S], got ", input_ids.scalar_type(), " ",
              input_ids.sizes());
  const int64_t S = input_ids.size(0);
  TORCH_CHECK(positions.scalar_type() == at::kInt && positions.dim() == 2 &&
                  positions.size(1) == S,
              kOp, ": positions must be int32 [J, ", S, "], got ", positions.scalar_type(), " ",
              positions.sizes());
  const int64_t J = positions.size(0);
  TORCH_CHECK(slot_mapping.sizes() == positions.sizes(), kOp, ": slot_mapping must be [", J,
              ", ", S, "] like positions, got ", slot_mapping.sizes());
  TORCH_CHECK(embedding.dim() == 2 && embedding.size(0) >= vocab_size, kOp,
              ": embedding must be [V >= ", vocab_size, ", H], got ", embedding.sizes());
  const StepOps& ops = StepOps::get();
  at::Tensor out = at::empty({J, S}, input_ids.options());
  at::Tensor logprobs = at::empty({J, S}, embedding.options().dtype(at::kFloat));
  // one query token a sequence: query_start_loc = [0, 1, ..., S]
  const at::Tensor query_start_loc = at::arange(S + 1, input_ids.options());
  const at::Tensor positions_long = positions.to(at::kLong);
  const at::Tensor kv_lens = positions + 1;  // [J, S] int32
  at::Tensor tokens = input_ids.to(at::kLong);
  for (int64_t j = 0; j < J; ++j) {
    const at::Tensor rows = positions_long[j];
    const at::Tensor x = at::index_select(embedding, 0, tokens);  // [S, H]
    const at::Tensor cos = at::index_select(rope_cos, 0, rows);   // [S, D]
    const at::Tensor sin = at::index_select(rope_sin, 0, rows);
    auto [h, residual] =
        ops.layers.call(x, weights, k_caches, v_caches, cos, sin, slot_mapping[j], kv_lens[j],
                        block_tables, query_start_loc, sizes, eps, sm_scale, kv_scales);
    const at::Tensor normed = std::get<0>(ops.norm.call(h, residual, final_norm, eps));
    const at::Tensor logits =
        head_qtype ? ops.quant_linear.call(normed, head, *head_qtype, std::nullopt)
                   : ops.linear.call(normed, head, std::nullopt, vocab_size);  // [S, V]
    const auto [argmax, lse] = ops.stats.call(logits);  // [S] int32, [S] float32
    tokens = argmax.to(at::kLong);
    out[j].copy_(argmax);
    logprobs[j].copy_(logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse);
  }
  return {out, logprobs};
}

}  // namespace
}  // namespace pagedjax

TORCH_LIBRARY_FRAGMENT(pagedjax, m) {
  m.def(
      "greedy_decode(Tensor input_ids, Tensor positions, Tensor slot_mapping, "
      "Tensor block_tables, Tensor embedding, Tensor rope_cos, Tensor rope_sin, "
      "Tensor?[] weights, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] sizes, float eps, "
      "float sm_scale, float[] kv_scales, Tensor final_norm, Tensor head, int? head_qtype, "
      "int vocab_size) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedjax, CPU, m) { m.impl("greedy_decode", &pagedjax::greedy_decode_cpu); }
