// One Llama decoder layer (ModelConfig.plain_decoder_layer) on the CPU in float32, composed once
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
#include "linear_cpu_kernel.h"
#include "norm_act_cpu_kernel.h"
#include "parallel.h"

namespace pagedjax::cpu_layer {

using cpu_linear::kTile;

// The layer's float32 weights, the linear ones packed into tiles (linear_cpu_kernel.h).
struct Weights {
  const float* input_norm;  // [H]
  const float* qkv;         // [qkv_tiles, H, 16]: (Hq + 2 Hkv) D columns
  int64_t qkv_tiles;
  const float* qkv_bias;    // [(Hq + 2 Hkv) D], or null: none
  const float* o;           // [o_tiles, Hq D, 16]: H columns
  int64_t o_tiles;
  const float* post_norm;   // [H]
  const float* gate_up;     // [gate_up_tiles, H, 16]: 2 I columns
  int64_t gate_up_tiles;
  const float* down;        // [down_tiles, I, 16]: H columns
  int64_t down_tiles;
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

  int64_t q_size() const { return shape.num_q_heads * shape.head_dim; }
  int64_t kv_size() const { return shape.num_kv_heads * shape.head_dim; }

  // What is wrong with the sizes or the metadata values, which run() then trusts, for the first
  // `rows` rows ("" when nothing).
  std::string error(int64_t rows) const {
    const Weights& w = weights;
    if (w.qkv_tiles * kTile < q_size() + 2 * kv_size() || w.o_tiles * kTile < hidden ||
        w.gate_up_tiles * kTile < 2 * intermediate || w.down_tiles * kTile < hidden) {
      return "decoder_layer: packed weights with too few tiles for their columns";
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
  // k_cache, v_cache [N, Hkv, bs, D] in place. The threads are `par`'s (parallel.h).
  template <typename Parallel>
  void run(const Parallel& par, int64_t rows, float* out, float* stream, float* k_cache,
           float* v_cache) const {
    const int64_t T = shape.num_tokens, H = hidden, I = intermediate, D = shape.head_dim;
    const int64_t R = rows, Hq = shape.num_q_heads, Hkv = shape.num_kv_heads;
    const int64_t q_width = q_size(), kv_width = kv_size();
    const Weights& w = weights;
    // Scratch rows, each product's output as wide as its padded tiles, in one buffer kept by the
    // calling thread and grown as needed: fresh allocations of a prefill's megabytes in every
    // layer (page faults, zeroing) cost more than the glue itself.
    const int64_t ld_qkv = w.qkv_tiles * kTile, ld_o = w.o_tiles * kTile;
    const int64_t ld_gu = w.gate_up_tiles * kTile, ld_down = w.down_tiles * kTile;
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
      std::fill(std::copy(w.qkv_bias, w.qkv_bias + q_width + 2 * kv_width, padded),
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
    cpu_linear::linear(par, h, H, R, w.qkv, H, w.qkv_tiles, bias, qkv, ld_qkv);
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
        std::copy(k_row, k_row + D, k_cache + dst);
        std::copy(k_row + kv_width, k_row + kv_width + D, v_cache + dst);
      }
    });
    AttentionShape computed = shape;  // the query rows [0, R)
    computed.num_tokens = R;
    const cpu_attention::CpuAttention<float, float> attention{
        computed, batch, qkv, ld_qkv, D, k_cache, v_cache, attn, sm_scale,
        std::max<int64_t>(sliding_window, 0), /*soft_cap=*/0.f};
    cpu_attention::run_items(par, attention);
    cpu_linear::linear(par, attn, q_width, R, w.o, q_width, w.o_tiles, nullptr, o, ld_o);
    // stream = o + stream; h = rms_norm(stream)
    for_rows(H, [&](int64_t r) {
      float* s = stream + r * H;
      const float* orow = o + r * ld_o;
      for (int64_t i = 0; i < H; ++i) s[i] = orow[i] + s[i];
      cpu_norm::normalize_row(s, w.post_norm, h + r * H, H, eps);
    });
    cpu_linear::linear(par, h, H, R, w.gate_up, H, w.gate_up_tiles, nullptr, gate_up, ld_gu);
    for_rows(I, [&](int64_t r) {
      const float* row = gate_up + r * ld_gu;
      cpu_norm::silu_and_mul_row(row, row + I, act + r * I, I);
    });
    if (ld_down == H) {  // straight into out
      cpu_linear::linear(par, act, I, R, w.down, I, w.down_tiles, nullptr, out, H);
    } else {
      cpu_linear::linear(par, act, I, R, w.down, I, w.down_tiles, nullptr, down, ld_down);
      for (int64_t r = 0; r < R; ++r) {
        std::copy(down + r * ld_down, down + r * ld_down + H, out + r * H);
      }
    }
    std::fill(out + R * H, out + T * H, 0.f);
    std::fill(stream + R * H, stream + T * H, 0.f);
  }
};

}  // namespace pagedjax::cpu_layer
