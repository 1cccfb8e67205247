// One decoder layer of the Llama family on the CPU in float32 (ModelConfig.fusable_decoder_layer:
// Llama's layer, with Qwen3's per-head q/k norms and a mixture of experts' MLP where the model
// has them; its projections packed, or kept quantized: Projection), composed once for both
// bindings: the torch op pagedjax::decoder_layer (../torch/decoder_layer_cpu.cpp) and the JAX FFI
// handler (../xla_ffi/cpu_ffi.cpp), so the two backends' CPU paths compute the same bits. The
// kernels are the torch ops' (linear, norm, rotary, attention, moe_routing, moe_experts), called
// in the order of backends/torch/model.py's DecoderLayer, so the layer is that module's
// op-by-op bits too:
//   stream = x + residual (x alone in the first layer); h = rms_norm(stream)
//   q, k, v = h @ qkv (+ bias); each q and k head rms_norm'ed (q_norm, k_norm: Qwen3); q, k
//   rotated; k, v written to the caches at slot_mapping
//   stream += attention(q, caches) @ o; h = rms_norm(stream)
//   out = (silu(gate) * up)(h @ gate_up) @ down, or with experts: each token's top k of the
//   softmax of h @ router (route_rows), through their experts (MoeExperts)
// Plain pointers and sizes only: the bindings check their tensors' or buffers' shapes and
// dtypes, call error(), then run().
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "../../attention_shape.h"
#include "attention_cpu_kernel.h"
#include "fp8_e4m3.h"
#include "linear_cpu_kernel.h"
#include "moe_experts_kernel.h"
#include "norm_act_cpu_kernel.h"
#include "parallel.h"
#include "quant_linear_kernel.h"

namespace pagedjax::cpu_layer {

using cpu_linear::kTile;

// A projection's weight: float32 packed into tiles (linear_cpu_kernel.h), or GGML blocks kept
// quantized (quant_linear_kernel.h: quantization "int8" or "gguf").
struct Projection {
  const float* packed = nullptr;     // [tiles, in, 16]
  int64_t tiles = 0;
  const uint8_t* blocks = nullptr;   // [out, in / 32 * block bytes] or interleaved; null: packed
  int64_t qtype = 0;                 // blocks' GGML type
  bool interleaved = false;          // blocks in groups of 8 rows (quant_linear_kernel.h)

  static Projection of_packed(const float* packed, int64_t tiles) { return {packed, tiles}; }
  static Projection of_blocks(const uint8_t* blocks, int64_t qtype, bool interleaved) {
    return {nullptr, 0, blocks, qtype, interleaved};
  }

  // The floats of an output row: out (blocks) or whole tiles (packed, the padding columns too).
  int64_t width(int64_t out) const { return blocks ? out : tiles * kTile; }

  // What is wrong with the weight for `in` inputs and `out` outputs ("" when nothing).
  std::string error(const char* name, int64_t in, int64_t out) const {
    if (blocks) {
      if (cpu_quant::block_bytes(qtype) == 0 || in % cpu_quant::kBlock != 0) {
        return std::string("decoder_layer: ") + name + " blocks of qtype " +
               std::to_string(qtype) + " over " + std::to_string(in) + " inputs";
      }
      return "";
    }
    return tiles * kTile < out ? std::string("decoder_layer: packed ") + name +
                                     " with too few tiles for its columns"
                               : "";
  }

  // y[R, ldy] = x[R, in] (ldx floats a row) @ W (+ bias) over `out` columns (width(out) written).
  template <typename Parallel>
  void apply(const Parallel& par, const float* x, int64_t ldx, int64_t R, int64_t in,
             int64_t out, const float* bias, float* y, int64_t ldy) const {
    if (blocks) {
      cpu_quant::quant_linear(par, x, ldx, R, qtype, blocks, interleaved, out, in, bias, y,
                              ldy);
    } else {
      cpu_linear::linear(par, x, ldx, R, packed, in, tiles, bias, y, ldy);
    }
  }
};

// A mixture of experts' MLP (moe_experts_kernel.h), each expert's width I, SiLU.
struct Experts {
  Projection router;            // E outputs, packed
  const float* w13 = nullptr;   // [E, ceil(2I / 16), H, 16]: each expert's gate_up packed
  const float* w2 = nullptr;    // [E, ceil(H / 16), I, 16]: each expert's down packed
  int64_t num_experts = 0;      // E; 0: the layer's MLP is dense
  int64_t top_k = 0;            // k
  bool renormalize = false;     // the k weights divided by their sum
};

// The layer's weights: the norms' in float32, the projections packed or kept quantized.
struct Weights {
  const float* input_norm;  // [H]
  Projection qkv;           // (Hq + 2 Hkv) D outputs
  const float* qkv_bias;    // [(Hq + 2 Hkv) D], or null: none
  Projection o;             // H outputs
  const float* post_norm;   // [H]
  Projection gate_up;       // 2 I outputs (a dense MLP's)
  Projection down;          // H outputs (a dense MLP's)
  const float* q_norm = nullptr;  // [D]: each q head's RMSNorm weight (Qwen3); null: none
  const float* k_norm = nullptr;  // [D]: each k head's (with q_norm)
  Experts experts;                // num_experts > 0: the MLP (gate_up, down unused)
};

template <typename index_t>  // slot_mapping's: int32_t or int64_t
struct DecoderLayer {
  const AttentionShape& shape;  // T query rows (padding included), Hq; the caches', the tables'
  int64_t hidden;               // H
  int64_t intermediate;         // I: the dense MLP's, or each expert's
  double eps;
  float sm_scale;
  int64_t sliding_window;  // 0: none
  const float* x;          // [T, H]: the last layer's output (the embedding in the first)
  const float* residual;   // [T, H]: the stream before the last layer; null in the first
  Weights weights;
  const float* cos;             // [T, D], at each token's position
  const float* sin;             // [T, D]
  const index_t* slot_mapping;  // [T]; < 0: padding
  cpu_attention::RaggedBatch batch;
  float k_scale = 1.f, v_scale = 1.f;  // an fp8 cache's: it stores k / k_scale, v / v_scale

  int64_t q_size() const { return shape.num_q_heads * shape.head_dim; }
  int64_t kv_size() const { return shape.num_kv_heads * shape.head_dim; }

  // What is wrong with the sizes or the metadata values, which run() then trusts, for the first
  // `rows` rows ("" when nothing).
  std::string error(int64_t rows) const {
    const Weights& w = weights;
    const Experts& ex = w.experts;
    const bool moe = ex.num_experts > 0;
    for (const std::string& error :
         {w.qkv.error("qkv", hidden, q_size() + 2 * kv_size()), w.o.error("o", q_size(), hidden),
          moe ? "" : w.gate_up.error("gate_up", hidden, 2 * intermediate),
          moe ? "" : w.down.error("down", intermediate, hidden),
          moe ? ex.router.error("router", hidden, ex.num_experts) : ""}) {
      if (!error.empty()) return error;
    }
    if (moe && (ex.router.blocks || !ex.w13 || !ex.w2 || ex.top_k < 1 ||
                ex.top_k > ex.num_experts)) {
      return "decoder_layer: experts need a packed router, packed w13 and w2 and top_k=" +
             std::to_string(ex.top_k) + " in [1, num_experts=" +
             std::to_string(ex.num_experts) + "]";
    }
    if (!w.q_norm != !w.k_norm) return "decoder_layer: q_norm and k_norm come together";
    if (std::string error = cpu_attention::metadata_error(shape, batch); !error.empty()) {
      return error;
    }
    if (rows < 0 || rows > shape.num_tokens) {
      return "decoder_layer: rows=" + std::to_string(rows) + " is not in [0, num_tokens=" +
             std::to_string(shape.num_tokens) + "]";
    }
    const int64_t num_slots = shape.num_blocks * shape.block_size;
    for (int64_t t = 0; t < rows; ++t) {
      if (slot_mapping[t] >= num_slots) {
        return "decoder_layer: slot_mapping[" + std::to_string(t) + "]=" +
               std::to_string(slot_mapping[t]) + " is past the cache's " +
               std::to_string(num_slots) + " slots";
      }
    }
    return "";
  }

  // The layer over rows [0, rows) (the rest are not computed: zeros in out and stream) → out
  // [T, H], stream [T, H] (the residual stream), and this step's keys and values written into
  // k_cache, v_cache [N, Hkv, bs, D] in place (float32, or fp8::E4M3: an FP8 KV cache). The
  // threads are `par`'s (parallel.h).
  template <typename Parallel, typename cache_t>
  void run(const Parallel& par, int64_t rows, float* out, float* stream, cache_t* k_cache,
           cache_t* v_cache) const {
    const int64_t T = shape.num_tokens, H = hidden, R = rows, q_width = q_size();
    const Weights& w = weights;
    // Scratch rows, each product's output as wide as its padded tiles, in one buffer kept by the
    // calling thread and grown as needed: fresh allocations of a prefill's megabytes in every
    // layer (page faults, zeroing) cost more than the glue itself.
    const int64_t qkv_width = q_width + 2 * kv_size();
    const int64_t ld_qkv = w.qkv.width(qkv_width), ld_o = w.o.width(H);
    static thread_local std::vector<float> scratch;
    const int64_t total = R * (H + ld_qkv + q_width + ld_o) + (w.qkv_bias ? ld_qkv : 0) +
                          mlp_scratch(R);
    if (static_cast<int64_t>(scratch.size()) < total) scratch.resize(total);
    float* next = scratch.data();
    auto take = [&](int64_t size) {
      float* part = next;
      next += size;
      return part;
    };
    float* const h = take(R * H);
    float* const qkv = take(R * ld_qkv);
    float* const attn = take(R * q_width);
    float* const o = take(R * ld_o);
    const float* bias = nullptr;  // zero-padded to whole tiles, as run_tiles reads it
    if (w.qkv_bias) {
      float* padded = take(ld_qkv);
      std::fill(std::copy(w.qkv_bias, w.qkv_bias + qkv_width, padded), padded + ld_qkv, 0.f);
      bias = padded;
    }

    // stream = x + residual (one rounded add per element); h = rms_norm(stream)
    for_rows(par, R, H, [&](int64_t r) {
      float* s = stream + r * H;
      const float* xr = x + r * H;
      if (residual) {
        const float* rr = residual + r * H;
        for (int64_t i = 0; i < H; ++i) s[i] = xr[i] + rr[i];
      } else {
        std::copy(xr, xr + H, s);
      }
      cpu_norm::normalize_row(s, w.input_norm, h + r * H, H, eps);
    });
    w.qkv.apply(par, h, H, R, H, qkv_width, bias, qkv, ld_qkv);
    write_heads(par, R, qkv, ld_qkv, k_cache, v_cache);
    AttentionShape computed = shape;  // the query rows [0, R)
    computed.num_tokens = R;
    const cpu_attention::CpuAttention<float, float, cache_t> attention{
        computed, batch, qkv, ld_qkv, shape.head_dim, k_cache, v_cache, attn, sm_scale,
        std::max<int64_t>(sliding_window, 0), /*soft_cap=*/0.f, k_scale, v_scale};
    cpu_attention::run_items(par, attention);
    w.o.apply(par, attn, q_width, R, q_width, H, nullptr, o, ld_o);
    // stream = o + stream; h = rms_norm(stream)
    for_rows(par, R, H, [&](int64_t r) {
      float* s = stream + r * H;
      const float* orow = o + r * ld_o;
      for (int64_t i = 0; i < H; ++i) s[i] = orow[i] + s[i];
      cpu_norm::normalize_row(s, w.post_norm, h + r * H, H, eps);
    });
    if (w.experts.num_experts > 0) {
      moe_mlp(par, h, R, next, out);
    } else {
      dense_mlp(par, h, R, next, out);
    }
    std::fill(out + R * H, out + T * H, 0.f);
    std::fill(stream + R * H, stream + T * H, 0.f);
  }

 private:
  template <typename Parallel, typename RowFn>
  static void for_rows(const Parallel& par, int64_t rows, int64_t width, const RowFn& row_fn) {
    par.for_range(rows, cpu_parallel::row_grain(width), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) row_fn(r);
    });
  }

  // The floats of scratch the MLP of R rows takes.
  int64_t mlp_scratch(int64_t R) const {
    const Weights& w = weights;
    if (w.experts.num_experts > 0) {  // the router's logits, the k weights
      return R * (w.experts.router.width(w.experts.num_experts) + w.experts.top_k);
    }
    return R * (w.gate_up.width(2 * intermediate) + intermediate + w.down.width(hidden));
  }

  // Each of R rows of qkv [R, ld_qkv]: its q and k heads normalised (q_norm, k_norm) and rotated
  // in place, then its k and v heads written to the caches at its slot (none for padding).
  template <typename Parallel, typename cache_t>
  void write_heads(const Parallel& par, int64_t R, float* qkv, int64_t ld_qkv, cache_t* k_cache,
                   cache_t* v_cache) const {
    const int64_t D = shape.head_dim, Hq = shape.num_q_heads, Hkv = shape.num_kv_heads;
    const int64_t q_width = q_size(), kv_width = kv_size(), block_size = shape.block_size;
    const Weights& w = weights;
    for_rows(par, R, ld_qkv, [&](int64_t t) {
      float* row = qkv + t * ld_qkv;
      if (w.q_norm) {  // each head as the rms_norm op normalises a row of D
        for (int64_t head = 0; head < Hq + Hkv; ++head) {
          float* v = row + head * D;
          cpu_norm::normalize_row(v, head < Hq ? w.q_norm : w.k_norm, v, D, eps);
        }
      }
      cpu_norm::rotate_heads(row, Hq + Hkv, D, D, cos + t * D, sin + t * D);
      const int64_t slot = slot_mapping[t];
      if (slot < 0) return;  // a padding row
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t head = 0; head < Hkv; ++head) {
        const int64_t dst = ((block * Hkv + head) * block_size + offset) * D;
        const float* k_row = row + q_width + head * D;
        fp8::store_row(k_row, k_cache + dst, D, k_scale);
        fp8::store_row(k_row + kv_width, v_cache + dst, D, v_scale);
      }
    });
  }

  // out [R, H] = (silu(gate) * up)(h @ gate_up) @ down, over mlp_scratch(R) floats of scratch.
  template <typename Parallel>
  void dense_mlp(const Parallel& par, const float* h, int64_t R, float* scratch,
                 float* out) const {
    const Weights& w = weights;
    const int64_t H = hidden, I = intermediate;
    const int64_t ld_gu = w.gate_up.width(2 * I), ld_down = w.down.width(H);
    float* const gate_up = scratch;
    float* const act = gate_up + R * ld_gu;
    float* const down = act + R * I;
    w.gate_up.apply(par, h, H, R, H, 2 * I, nullptr, gate_up, ld_gu);
    for_rows(par, R, I, [&](int64_t r) {
      const float* row = gate_up + r * ld_gu;
      cpu_norm::silu_and_mul_row(row, row + I, act + r * I, I);
    });
    if (ld_down == H) {  // straight into out
      w.down.apply(par, act, I, R, I, H, nullptr, out, H);
      return;
    }
    w.down.apply(par, act, I, R, I, H, nullptr, down, ld_down);
    for (int64_t r = 0; r < R; ++r) {
      std::copy(down + r * ld_down, down + r * ld_down + H, out + r * H);
    }
  }

  // out [R, H]: each row's top k experts of the softmax of h @ router (route_rows), through
  // them (MoeExperts), over mlp_scratch(R) floats of scratch.
  template <typename Parallel>
  void moe_mlp(const Parallel& par, const float* h, int64_t R, float* scratch,
               float* out) const {
    const Experts& ex = weights.experts;
    const int64_t E = ex.num_experts, k = ex.top_k, ld = ex.router.width(E);
    float* const logits = scratch;
    float* const topk_weights = logits + R * ld;
    static thread_local std::vector<int32_t> topk_ids;
    if (static_cast<int64_t>(topk_ids.size()) < R * k) topk_ids.resize(R * k);
    ex.router.apply(par, h, hidden, R, hidden, E, nullptr, logits, ld);
    cpu_moe::route_rows(par, logits, ld, R, E, k, ex.renormalize, topk_weights,
                        topk_ids.data());
    const cpu_moe::MoeExperts<int32_t> experts{hidden, intermediate, E, k, h, topk_ids.data(),
                                               topk_weights, ex.w13, ex.w2};
    experts.run(par, R, R, out);
  }
};

}  // namespace pagedjax::cpu_layer
