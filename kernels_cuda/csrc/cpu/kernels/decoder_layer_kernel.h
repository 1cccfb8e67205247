// One Llama decoder layer (ModelConfig.plain_decoder_layer) on the CPU in float32 (its
// projections packed, or kept quantized: Projection), composed once
// for both bindings: the torch op pagedjax::decoder_layer (../torch/decoder_layer_cpu.cpp) and
// the JAX FFI handler (../xla_ffi/cpu_ffi.cpp), so the two backends' CPU paths compute the same
// bits. The kernels are the torch ops' (linear, norm, rotary, attention), called in the order of
// backends/torch/model.py's DecoderLayer, so the layer is that module's op-by-op bits too:
//   stream = x + residual (x alone in the first layer); h = rms_norm(stream)
//   q, k, v = h @ qkv (+ bias); q, k rotated; k, v written to the caches at slot_mapping
//   stream += attention(q, caches) @ o; out = (silu(gate) * up)(rms_norm(stream) @ gate_up) @ down
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
  const uint8_t* blocks = nullptr;   // [out, in / 32 * block bytes]; null: packed
  int64_t qtype = 0;                 // blocks' GGML type

  static Projection of_packed(const float* packed, int64_t tiles) { return {packed, tiles}; }
  static Projection of_blocks(const uint8_t* blocks, int64_t qtype) {
    return {nullptr, 0, blocks, qtype};
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
      cpu_quant::quant_linear(par, x, ldx, R, qtype, blocks, out, in, bias, y, ldy);
    } else {
      cpu_linear::linear(par, x, ldx, R, packed, in, tiles, bias, y, ldy);
    }
  }
};

// The layer's weights: the norms' in float32, the projections packed or kept quantized.
struct Weights {
  const float* input_norm;  // [H]
  Projection qkv;           // (Hq + 2 Hkv) D outputs
  const float* qkv_bias;    // [(Hq + 2 Hkv) D], or null: none
  Projection o;             // H outputs
  const float* post_norm;   // [H]
  Projection gate_up;       // 2 I outputs
  Projection down;          // H outputs
};

template <typename index_t>  // slot_mapping's: int32_t or int64_t
struct DecoderLayer {
  const AttentionShape& shape;  // T query rows (padding included), Hq; the caches', the tables'
  int64_t hidden;               // H
  int64_t intermediate;         // I
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
    for (const std::string& error :
         {w.qkv.error("qkv", hidden, q_size() + 2 * kv_size()), w.o.error("o", q_size(), hidden),
          w.gate_up.error("gate_up", hidden, 2 * intermediate),
          w.down.error("down", intermediate, hidden)}) {
      if (!error.empty()) return error;
    }
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
    const int64_t T = shape.num_tokens, H = hidden, I = intermediate, D = shape.head_dim;
    const int64_t R = rows, Hq = shape.num_q_heads, Hkv = shape.num_kv_heads;
    const int64_t q_width = q_size(), kv_width = kv_size();
    const Weights& w = weights;
    // Scratch rows, each product's output as wide as its padded tiles, in one buffer kept by the
    // calling thread and grown as needed: fresh allocations of a prefill's megabytes in every
    // layer (page faults, zeroing) cost more than the glue itself.
    const int64_t qkv_width = q_width + 2 * kv_width;
    const int64_t ld_qkv = w.qkv.width(qkv_width), ld_o = w.o.width(H);
    const int64_t ld_gu = w.gate_up.width(2 * I), ld_down = w.down.width(H);
    static thread_local std::vector<float> scratch;
    const int64_t widths[] = {H, ld_qkv, q_width, ld_o, ld_gu, I, ld_down};
    int64_t total = w.qkv_bias ? ld_qkv : 0;
    for (const int64_t width : widths) total += R * width;
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
    float* const gate_up = take(R * ld_gu);
    float* const act = take(R * I);
    float* const down = take(R * ld_down);
    const float* bias = nullptr;  // zero-padded to whole tiles, as run_tiles reads it
    if (w.qkv_bias) {
      float* padded = take(ld_qkv);
      std::fill(std::copy(w.qkv_bias, w.qkv_bias + qkv_width, padded),
                padded + ld_qkv, 0.f);
      bias = padded;
    }
    auto for_rows = [&](int64_t width, const auto& row_fn) {
      par.for_range(R, cpu_parallel::row_grain(width), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) row_fn(r);
      });
    };

    // stream = x + residual (one rounded add per element); h = rms_norm(stream)
    for_rows(H, [&](int64_t r) {
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
    // rope of q and k, then k and v into the caches
    const int64_t block_size = shape.block_size;
    for_rows(ld_qkv, [&](int64_t t) {
      float* row = qkv + t * ld_qkv;
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
    AttentionShape computed = shape;  // the query rows [0, R)
    computed.num_tokens = R;
    const cpu_attention::CpuAttention<float, float, cache_t> attention{
        computed, batch, qkv, ld_qkv, D, k_cache, v_cache, attn, sm_scale,
        std::max<int64_t>(sliding_window, 0), /*soft_cap=*/0.f, k_scale, v_scale};
    cpu_attention::run_items(par, attention);
    w.o.apply(par, attn, q_width, R, q_width, H, nullptr, o, ld_o);
    // stream = o + stream; h = rms_norm(stream)
    for_rows(H, [&](int64_t r) {
      float* s = stream + r * H;
      const float* orow = o + r * ld_o;
      for (int64_t i = 0; i < H; ++i) s[i] = orow[i] + s[i];
      cpu_norm::normalize_row(s, w.post_norm, h + r * H, H, eps);
    });
    w.gate_up.apply(par, h, H, R, H, 2 * I, nullptr, gate_up, ld_gu);
    for_rows(I, [&](int64_t r) {
      const float* row = gate_up + r * ld_gu;
      cpu_norm::silu_and_mul_row(row, row + I, act + r * I, I);
    });
    if (ld_down == H) {  // straight into out
      w.down.apply(par, act, I, R, I, H, nullptr, out, H);
    } else {
      w.down.apply(par, act, I, R, I, H, nullptr, down, ld_down);
      for (int64_t r = 0; r < R; ++r) {
        std::copy(down + r * ld_down, down + r * ld_down + H, out + r * H);
      }
    }
    std::fill(out + R * H, out + T * H, 0.f);
    std::fill(stream + R * H, stream + T * H, 0.f);
  }
};

}  // namespace pagedjax::cpu_layer
