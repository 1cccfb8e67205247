// The C++ CPU kernels of the torch ops as XLA FFI handlers, in float32 (no torch headers): the
// JAX backend's attention (attention_cpu_kernel.h) and packed linear (linear_cpu_kernel.h) on
// CPU. Built and registered by backends/jax/cpu_ffi.py. Parallel on XLA's own intra-op thread
// pool: an OpenMP team of its own, started from an XLA thread, made libgomp count more threads
// than cores and stop spinning, which slowed every torch op in the process (RESULTS.md).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../kernels/attention_cpu_kernel.h"
#include "../kernels/filter_cpu_kernel.h"
#include "../kernels/logits_cpu_kernel.h"
#include "../kernels/linear_cpu_kernel.h"
#include "../kernels/norm_act_cpu_kernel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pagedjax {
namespace {

// Runs run_part(p) for p in [0, parts): the caller takes parts until none is left, and so do
// the parts - 1 tasks it schedules on XLA's pool (a task that starts late finds none and
// touches nothing but the shared counters); returns once every part has run. The caller, done
// with its share, spins up to kSpinMicros for the rest before it sleeps: a layer's parallel
// regions last 0.05-2 ms, and a condition variable's wake-up costs tens of microseconds each.
constexpr int64_t kSpinMicros = 200;

template <typename RunPart>
void run_parts(ffi::ThreadPool& pool, int64_t parts, const RunPart& run_part) {
  struct Progress {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mutex;
    std::condition_variable finished;
  };
  auto progress = std::make_shared<Progress>();
  auto work = [&run_part, parts](Progress& state) {
    for (int64_t p; (p = state.next.fetch_add(1)) < parts;) {
      run_part(p);
      if (state.done.fetch_add(1) + 1 == parts) {
        std::lock_guard<std::mutex> lock(state.mutex);
        state.finished.notify_one();
      }
    }
  };
  for (int64_t i = 1; i < parts; ++i) {
    pool.Schedule([progress, work] { work(*progress); });
  }
  work(*progress);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
  while (progress->done.load(std::memory_order_acquire) != parts &&
         std::chrono::steady_clock::now() < deadline) {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }
  std::unique_lock<std::mutex> lock(progress->mutex);
  progress->finished.wait(lock, [&] { return progress->done.load() == parts; });
}

// How many parts to split n items into: one per pool thread, at least 1.
int64_t num_parts(ffi::ThreadPool& pool, int64_t n) {
  return std::clamp<int64_t>(pool.num_threads(), 1, std::max<int64_t>(n, 1));
}

// y [M, num_tiles * 16] (ldy floats a row) = x [M, K] (ldx) @ packed, tiles across the pool.
void run_linear(ffi::ThreadPool& pool, const float* x, int64_t ldx, int64_t M, const float* packed,
                int64_t K, int64_t num_tiles, float* y, int64_t ldy) {
  if (M == 0) return;
  const int64_t parts = num_parts(pool, num_tiles / cpu_linear::tile_grain(M, K));
  run_parts(pool, parts, [&](int64_t p) {
    cpu_linear::run_tiles(x, ldx, M, packed, K, nullptr, y, ldy, num_tiles * p / parts,
                          num_tiles * (p + 1) / parts);
  });
}

// The attention's shape from T query rows of num_q_heads heads, the caches' [N, Hkv, bs, D]
// dimensions and the block tables' [S, M].
template <typename Dims>
AttentionShape attention_shape(int64_t num_tokens, int64_t num_q_heads, const Dims& cache,
                               const Dims& tables) {
  AttentionShape shape{};
  shape.num_tokens = num_tokens;
  shape.num_q_heads = num_q_heads;
  shape.head_dim = cache[3];
  shape.num_blocks = cache[0];
  shape.num_kv_heads = cache[1];
  shape.block_size = cache[2];
  shape.group = num_q_heads / shape.num_kv_heads;
  shape.num_seqs = tables[0];
  shape.max_blocks = tables[1];
  return shape;
}

// The attention of every (query row, KV head) item, in contiguous ranges of equal cost per part.
void run_attention(ffi::ThreadPool& pool,
                   const cpu_attention::CpuAttention<float, float>& attention,
                   const AttentionShape& shape) {
  const int64_t parts = num_parts(pool, shape.num_tokens * shape.num_kv_heads);
  const std::vector<int64_t> bounds = attention.split_items(parts);
  run_parts(pool, parts, [&](int64_t p) {
    cpu_attention::Scratch<float> scratch(shape.group, shape.block_size, shape.head_dim,
                                          shape.max_blocks * shape.block_size);
    for (int64_t item = bounds[p]; item < bounds[p + 1]; ++item) {
      attention.run(item / shape.num_kv_heads, item % shape.num_kv_heads, scratch);
    }
  });
}

ffi::Error ragged_paged_attention_f32(
    ffi::ThreadPool pool,
    ffi::Buffer<ffi::F32> q,                  // [T, Hq, D]
    ffi::Buffer<ffi::F32> k_cache,            // [N, Hkv, bs, D]
    ffi::Buffer<ffi::F32> v_cache,            // [N, Hkv, bs, D]
    ffi::Buffer<ffi::S32> kv_lens,            // [S]
    ffi::Buffer<ffi::S32> block_tables,       // [S, M]
    ffi::Buffer<ffi::S32> query_start_loc,    // [S+1]
    ffi::ResultBuffer<ffi::F32> out,          // [T, Hq, D]
    float sm_scale,
    int64_t sliding_window,  // 0: none
    float soft_cap) {        // scores soft_cap * tanh(s / soft_cap); 0: none
  const auto qd = q.dimensions(), cd = k_cache.dimensions(), td = block_tables.dimensions();
  const auto vd = v_cache.dimensions();
  if (qd.size() != 3 || cd.size() != 4 || td.size() != 2 || cd[3] != qd[2] ||
      !std::equal(cd.begin(), cd.end(), vd.begin(), vd.end()) || cd[1] <= 0 ||
      qd[1] % cd[1] != 0 ||
      static_cast<int64_t>(kv_lens.element_count()) != td[0] ||
      static_cast<int64_t>(query_start_loc.element_count()) != td[0] + 1) {
    return ffi::Error::InvalidArgument(
        "ragged_paged_attention (FFI): expected q [T, Hq, D], caches [N, Hkv, bs, D] with Hkv "
        "dividing Hq, kv_lens [S], block_tables [S, M], query_start_loc [S+1]");
  }
  const AttentionShape shape = attention_shape(qd[0], qd[1], cd, td);
  const cpu_attention::RaggedBatch batch{kv_lens.typed_data(), block_tables.typed_data(),
                                         query_start_loc.typed_data()};
  if (const std::string error = cpu_attention::metadata_error(shape, batch); !error.empty()) {
    return ffi::Error::InvalidArgument(error);
  }
  const cpu_attention::CpuAttention<float, float> attention{
      shape, batch, q.typed_data(), shape.num_q_heads * shape.head_dim, shape.head_dim,
      k_cache.typed_data(), v_cache.typed_data(), out->typed_data(), sm_scale,
      std::max<int64_t>(sliding_window, 0), std::max(soft_cap, 0.f)};
  run_attention(pool, attention, shape);
  return ffi::Error::Success();
}

// Rows [num_rows, M) of y are zeros, not computed (a step's padding rows).
ffi::Error linear_f32(ffi::ThreadPool pool,
                      ffi::Buffer<ffi::F32> x,          // [M, K]
                      ffi::Buffer<ffi::F32> packed,     // [ceil(N / 16), K, 16]
                      ffi::Buffer<ffi::S32> num_rows,   // [1]: rows computed, clamped to [0, M]
                      ffi::ResultBuffer<ffi::F32> y) {  // [M, ceil(N / 16) * 16]
  const auto xd = x.dimensions(), wd = packed.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != cpu_linear::kTile || wd[1] != xd[1] ||
      yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0] * cpu_linear::kTile) {
    return ffi::Error::InvalidArgument(
        "linear (FFI): expected x [M, K], packed [ceil(N/16), K, 16], y [M, ceil(N/16) * 16]");
  }
  const int64_t K = xd[1], num_tiles = wd[0], ldy = num_tiles * cpu_linear::kTile;
  const int64_t M = std::clamp<int64_t>(num_rows.typed_data()[0], 0, xd[0]);
  run_linear(pool, x.typed_data(), K, M, packed.typed_data(), K, num_tiles, y->typed_data(), ldy);
  std::fill(y->typed_data() + M * ldy, y->typed_data() + xd[0] * ldy, 0.f);
  return ffi::Error::Success();
}

// The k largest values of each row of x [R, V] (k <= V), largest first, ties to the lower index
// (jax.lax.top_k's order), with their indices: one pass per row, keeping a sorted list of k.
ffi::Error top_k_f32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                     ffi::ResultBuffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> indices) {
  const auto xd = x.dimensions(), vd = values->dimensions();
  if (xd.size() != 2 || vd.size() != 2 || vd[0] != xd[0] || vd[1] > xd[1] || vd[1] < 1 ||
      indices->dimensions()[0] != vd[0] || indices->dimensions()[1] != vd[1]) {
    return ffi::Error::InvalidArgument("top_k (FFI): expected x [R, V], outputs [R, k], k <= V");
  }
  const int64_t rows = xd[0], V = xd[1], k = vd[1];
  const float* src = x.typed_data();
  float* top = values->typed_data();
  int32_t* ids = indices->typed_data();
  const int64_t parts = num_parts(pool, rows * V / (1 << 15));
  run_parts(pool, parts, [&](int64_t p) {
    for (int64_t r = rows * p / parts; r < rows * (p + 1) / parts; ++r) {
      const float* row = src + r * V;
      float* tv = top + r * k;
      int32_t* ti = ids + r * k;
      int64_t n = 0;  // kept so far, sorted: tv[0] >= tv[1] >= ...
      for (int64_t i = 0; i < V; ++i) {
        const float v = row[i];
        if (n == k && !(v > tv[k - 1])) continue;  // not above the k-th (NaN never enters)
        int64_t j = std::min(n, k - 1);  // slide smaller ones down; equal ones stay ahead
        while (j > 0 && v > tv[j - 1]) {
          tv[j] = tv[j - 1];
          ti[j] = ti[j - 1];
          --j;
        }
        tv[j] = v;
        ti[j] = static_cast<int32_t>(i);
        n = std::min(n + 1, k);
      }
    }
  });
  return ffi::Error::Success();
}

// The samplers' one pass over the logits (logits_cpu_kernel.h): x [R, V] → argmax [R], lse [R].
ffi::Error logits_stats_f32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::ResultBuffer<ffi::S32> argmax, ffi::ResultBuffer<ffi::F32> lse) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || argmax->dimensions()[0] != xd[0] || lse->dimensions()[0] != xd[0]) {
    return ffi::Error::InvalidArgument("logits_stats (FFI): expected x [R, V], outputs [R]");
  }
  const int64_t rows = xd[0], V = xd[1];
  const int64_t parts = num_parts(pool, rows * V / (1 << 15));
  run_parts(pool, parts, [&](int64_t p) {
    cpu_logits::stats_rows(x.typed_data(), V, argmax->typed_data(), lse->typed_data(),
                           rows * p / parts, rows * (p + 1) / parts);
  });
  return ffi::Error::Success();
}

// The samplers' top-k / top-p / min-p filter (filter_cpu_kernel.h): x [R, V] and knobs [R] →
// x with what the filter drops at -inf.
ffi::Error filter_logits_f32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                             ffi::Buffer<ffi::F32> min_p, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || top_k.dimensions()[0] != xd[0] || top_p.dimensions()[0] != xd[0] ||
      min_p.dimensions()[0] != xd[0]) {
    return ffi::Error::InvalidArgument("filter_logits (FFI): expected x [R, V], knobs [R]");
  }
  const int64_t rows = xd[0], V = xd[1];
  const int64_t parts = num_parts(pool, rows);
  run_parts(pool, parts, [&](int64_t p) {
    cpu_filter::filter_rows(x.typed_data(), V, top_k.typed_data(), top_p.typed_data(),
                            min_p.typed_data(), out->typed_data(), rows * p / parts,
                            rows * (p + 1) / parts);
  });
  return ffi::Error::Success();
}


// fn(r) for each of n rows, in contiguous ranges of at least ~16K elements (of width) a part.
template <typename RowFn>
void for_rows(ffi::ThreadPool& pool, int64_t n, int64_t width, const RowFn& fn) {
  const int64_t parts = num_parts(pool, n * width / 16384);
  run_parts(pool, parts, [&](int64_t p) {
    for (int64_t r = n * p / parts; r < n * (p + 1) / parts; ++r) fn(r);
  });
}

// One Llama decoder layer (ModelConfig.plain_decoder_layer) as one call, the torch op
// pagedjax::decoder_layer's steps in its order with the same kernels (../torch/decoder_layer_cpu.cpp):
//   stream = x + residual (x alone in the first layer); h = rms_norm(stream)
//   q, k, v = h @ qkv (+ bias); q, k rotated; k, v written to the caches at slot_mapping
//   stream += attention(q, caches) @ o; out = (silu(gate) * up)(rms_norm(stream) @ gate_up) @ down
// → (out [T, H], stream [T, H], k_cache, v_cache): the caches are updated in place (the
// outputs alias them; copied first where XLA gave fresh buffers). The rows after the last
// sequence's (query_start_loc[S], padding up to the step's bucket) are not computed: zeros in
// out and stream, as the torch op's eager step never runs them.
ffi::Error decoder_layer_f32(
    ffi::ThreadPool pool,
    ffi::Buffer<ffi::F32> x,                // [T, H]
    ffi::Buffer<ffi::F32> residual,         // [T, H]; read where has_residual
    ffi::Buffer<ffi::F32> input_norm,       // [H]
    ffi::Buffer<ffi::F32> qkv_weight,       // [ceil(Nqkv / 16), H, 16], Nqkv = (Hq + 2 Hkv) D
    ffi::Buffer<ffi::F32> qkv_bias,         // [Nqkv], or [0]: none
    ffi::Buffer<ffi::F32> o_weight,         // [ceil(H / 16), Hq D, 16]
    ffi::Buffer<ffi::F32> post_norm,        // [H]
    ffi::Buffer<ffi::F32> gate_up_weight,   // [ceil(2 I / 16), H, 16]
    ffi::Buffer<ffi::F32> down_weight,      // [ceil(H / 16), I, 16]
    ffi::Buffer<ffi::F32> k_cache,          // [N, Hkv, bs, D]
    ffi::Buffer<ffi::F32> v_cache,          // [N, Hkv, bs, D]
    ffi::Buffer<ffi::F32> cos,              // [T, D]: at each token's position
    ffi::Buffer<ffi::F32> sin,              // [T, D]
    ffi::Buffer<ffi::S32> slot_mapping,     // [T], -1: padding
    ffi::Buffer<ffi::S32> kv_lens,          // [S]
    ffi::Buffer<ffi::S32> block_tables,     // [S, M]
    ffi::Buffer<ffi::S32> query_start_loc,  // [S+1]
    ffi::ResultBuffer<ffi::F32> out,        // [T, H]
    ffi::ResultBuffer<ffi::F32> stream,     // [T, H]
    ffi::ResultBuffer<ffi::F32> k_out,      // [N, Hkv, bs, D]: k_cache's buffer
    ffi::ResultBuffer<ffi::F32> v_out,      // [N, Hkv, bs, D]: v_cache's buffer
    int64_t num_q_heads, int64_t intermediate_size, float eps, float sm_scale,
    int64_t sliding_window,  // 0: none
    int64_t has_residual) {  // 0: the first layer (x is the embedding)
  const auto xd = x.dimensions(), cd = k_cache.dimensions(), td = block_tables.dimensions();
  if (xd.size() != 2 || cd.size() != 4 || td.size() != 2 || num_q_heads % cd[1] != 0 ||
      cos.dimensions()[0] != xd[0] || cos.dimensions()[1] != cd[3] ||
      static_cast<int64_t>(slot_mapping.element_count()) != xd[0] ||
      static_cast<int64_t>(kv_lens.element_count()) != td[0] ||
      static_cast<int64_t>(query_start_loc.element_count()) != td[0] + 1) {
    return ffi::Error::InvalidArgument(
        "decoder_layer (FFI): expected x [T, H], caches [N, Hkv, bs, D] with Hkv dividing Hq, "
        "cos/sin [T, D], slot_mapping [T], kv_lens [S], block_tables [S, M], "
        "query_start_loc [S+1]");
  }
  const int64_t T = xd[0], H = xd[1], D = cd[3], Hkv = cd[1], I = intermediate_size;
  const int64_t q_size = num_q_heads * D, kv_size = Hkv * D;
  const int64_t qkv_tiles = qkv_weight.dimensions()[0], o_tiles = o_weight.dimensions()[0];
  const int64_t gate_up_tiles = gate_up_weight.dimensions()[0];
  const int64_t down_tiles = down_weight.dimensions()[0];
  if (qkv_tiles * cpu_linear::kTile < q_size + 2 * kv_size || o_tiles * cpu_linear::kTile < H ||
      gate_up_tiles * cpu_linear::kTile < 2 * I || down_tiles * cpu_linear::kTile < H ||
      qkv_weight.dimensions()[1] != H || o_weight.dimensions()[1] != q_size ||
      gate_up_weight.dimensions()[1] != H || down_weight.dimensions()[1] != I) {
    return ffi::Error::InvalidArgument("decoder_layer (FFI): packed weights of the wrong shape");
  }
  const AttentionShape shape = attention_shape(T, num_q_heads, cd, td);
  const cpu_attention::RaggedBatch batch{kv_lens.typed_data(), block_tables.typed_data(),
                                         query_start_loc.typed_data()};
  if (const std::string error = cpu_attention::metadata_error(shape, batch); !error.empty()) {
    return ffi::Error::InvalidArgument(error);
  }
  const int64_t num_slots = shape.num_blocks * shape.block_size;
  const int32_t* slots = slot_mapping.typed_data();
  const int64_t R = query_start_loc.typed_data()[td[0]];  // rows computed: the sequences'
  for (int64_t t = 0; t < R; ++t) {
    if (slots[t] >= num_slots) {
      return ffi::Error::InvalidArgument("decoder_layer (FFI): slot_mapping[" +
                                         std::to_string(t) + "]=" + std::to_string(slots[t]) +
                                         " is past the cache's " + std::to_string(num_slots) +
                                         " slots");
    }
  }
  const size_t cache_bytes = k_cache.size_bytes();
  if (k_out->typed_data() != k_cache.typed_data()) {
    std::memcpy(k_out->typed_data(), k_cache.typed_data(), cache_bytes);
  }
  if (v_out->typed_data() != v_cache.typed_data()) {
    std::memcpy(v_out->typed_data(), v_cache.typed_data(), cache_bytes);
  }
  float* const kc = k_out->typed_data();
  float* const vc = v_out->typed_data();
  float* const s = stream->typed_data();
  const float* const xs = x.typed_data();
  const float* const rs = residual.typed_data();

  // Scratch rows, each product's output as wide as its padded tiles, in one buffer kept by the
  // calling thread and grown as needed: fresh allocations of a prefill's megabytes in every
  // layer (page faults, zeroing) cost more than the glue itself.
  const int64_t ld_qkv = qkv_tiles * cpu_linear::kTile, ld_o = o_tiles * cpu_linear::kTile;
  const int64_t ld_gu = gate_up_tiles * cpu_linear::kTile;
  const int64_t ld_down = down_tiles * cpu_linear::kTile;
  const int64_t widths[] = {H, ld_qkv, q_size, ld_o, ld_gu, I, ld_down};
  static thread_local std::vector<float> scratch;
  int64_t total = 0;
  for (const int64_t width : widths) total += R * width;
  if (static_cast<int64_t>(scratch.size()) < total) scratch.resize(total);
  float* next = scratch.data();
  auto take = [&](int64_t width) {
    float* part = next;
    next += R * width;
    return part;
  };
  float* const h = take(H);
  float* const qkv = take(ld_qkv);
  float* const attn = take(q_size);
  float* const o = take(ld_o);
  float* const gate_up = take(ld_gu);
  float* const act = take(I);
  float* const down = take(ld_down);

  // stream = x + residual; h = rms_norm(stream)
  const float* in_norm = input_norm.typed_data();
  for_rows(pool, R, H, [&](int64_t r) {
    float* sr = s + r * H;
    if (has_residual) {
      for (int64_t i = 0; i < H; ++i) sr[i] = xs[r * H + i] + rs[r * H + i];
    } else {
      std::copy(xs + r * H, xs + (r + 1) * H, sr);
    }
    cpu_norm::normalize_row(sr, in_norm, h + r * H, H, eps);
  });
  run_linear(pool, h, H, R, qkv_weight.typed_data(), H, qkv_tiles, qkv, ld_qkv);
  // bias, rope of q and k, then k and v into the caches
  const bool has_bias = qkv_bias.element_count() > 0;
  const float* bias = qkv_bias.typed_data();
  const int64_t block_size = shape.block_size;
  for_rows(pool, R, ld_qkv, [&](int64_t t) {
    float* row = qkv + t * ld_qkv;
    if (has_bias) {
      for (int64_t i = 0; i < q_size + 2 * kv_size; ++i) row[i] += bias[i];
    }
    cpu_norm::rotate_heads(row, num_q_heads + Hkv, D, D, cos.typed_data() + t * D,
                           sin.typed_data() + t * D);
    const int64_t slot = slots[t];
    if (slot < 0) return;  // a padding row
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (int64_t head = 0; head < Hkv; ++head) {
      const int64_t dst = ((block * Hkv + head) * block_size + offset) * D;
      const float* k_row = row + q_size + head * D;
      std::copy(k_row, k_row + D, kc + dst);
      std::copy(k_row + kv_size, k_row + kv_size + D, vc + dst);
    }
  });
  AttentionShape computed = shape;  // the query rows [0, R)
  computed.num_tokens = R;
  const cpu_attention::CpuAttention<float, float> attention{
      computed, batch, qkv, ld_qkv, D, kc, vc, attn, sm_scale,
      std::max<int64_t>(sliding_window, 0), 0.f};
  run_attention(pool, attention, computed);
  run_linear(pool, attn, q_size, R, o_weight.typed_data(), q_size, o_tiles, o, ld_o);
  // stream += o; h = rms_norm(stream)
  const float* p_norm = post_norm.typed_data();
  for_rows(pool, R, H, [&](int64_t r) {
    float* sr = s + r * H;
    const float* orow = o + r * ld_o;
    for (int64_t i = 0; i < H; ++i) sr[i] = orow[i] + sr[i];
    cpu_norm::normalize_row(sr, p_norm, h + r * H, H, eps);
  });
  run_linear(pool, h, H, R, gate_up_weight.typed_data(), H, gate_up_tiles, gate_up,
             ld_gu);
  for_rows(pool, R, I, [&](int64_t r) {
    const float* row = gate_up + r * ld_gu;
    cpu_norm::silu_and_mul_row(row, row + I, act + r * I, I);
  });
  if (ld_down == H) {  // straight into out
    run_linear(pool, act, I, R, down_weight.typed_data(), I, down_tiles, out->typed_data(), H);
  } else {
    run_linear(pool, act, I, R, down_weight.typed_data(), I, down_tiles, down, ld_down);
    for (int64_t r = 0; r < R; ++r) {
      std::copy(down + r * ld_down, down + r * ld_down + H, out->typed_data() + r * H);
    }
  }
  std::fill(out->typed_data() + R * H, out->typed_data() + T * H, 0.f);
  std::fill(s + R * H, s + T * H, 0.f);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pagedjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxFilterLogitsF32, pagedjax::filter_logits_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxRaggedPagedAttentionF32,
                              pagedjax::ragged_paged_attention_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxLinearF32, pagedjax::linear_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxLogitsStatsF32, pagedjax::logits_stats_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxTopKF32, pagedjax::top_k_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxDecoderLayerF32, pagedjax::decoder_layer_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // residual
                                  .Arg<ffi::Buffer<ffi::F32>>()   // input_norm
                                  .Arg<ffi::Buffer<ffi::F32>>()   // qkv_weight
                                  .Arg<ffi::Buffer<ffi::F32>>()   // qkv_bias
                                  .Arg<ffi::Buffer<ffi::F32>>()   // o_weight
                                  .Arg<ffi::Buffer<ffi::F32>>()   // post_norm
                                  .Arg<ffi::Buffer<ffi::F32>>()   // gate_up_weight
                                  .Arg<ffi::Buffer<ffi::F32>>()   // down_weight
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot_mapping
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // stream
                                  .Ret<ffi::Buffer<ffi::F32>>()   // k_cache
                                  .Ret<ffi::Buffer<ffi::F32>>()   // v_cache
                                  .Attr<int64_t>("num_q_heads")
                                  .Attr<int64_t>("intermediate_size")
                                  .Attr<float>("eps")
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<int64_t>("has_residual"));
