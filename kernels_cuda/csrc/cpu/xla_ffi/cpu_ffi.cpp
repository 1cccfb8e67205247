// The XLA FFI handlers of the C++ CPU kernels (../kernels/, no torch headers), in float32 (KV
// caches float32 or float8_e4m3fn: an FP8 KV cache, with per-layer k_scale / v_scale): the
// JAX backend's attention (attention_cpu_kernel.h), packed linear (linear_cpu_kernel.h),
// quantized linear (quant_linear_kernel.h: weights in GGML blocks), mixture-of-experts block
// (moe_experts_kernel.h), top-k, samplers' passes and whole decoder layer
// (decoder_layer_kernel.h: dense or with experts) on CPU. Built and registered
// by backends/jax/cpu_ffi.py. Parallel on XLA's own intra-op thread pool: an OpenMP team of its
// own, started from an XLA thread, made libgomp count more threads than cores and stop spinning,
// which slowed every torch op in the process (RESULTS.md).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../kernels/attention_cpu_kernel.h"
#include "../kernels/decoder_layer_kernel.h"
#include "../kernels/fp8_e4m3.h"
#include "../kernels/filter_cpu_kernel.h"
#include "../kernels/linear_cpu_kernel.h"
#include "../kernels/logits_cpu_kernel.h"
#include "../kernels/moe_experts_kernel.h"
#include "../kernels/quant_linear_kernel.h"
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

// The kernels' parallel policy (../kernels/parallel.h) on XLA's pool.
struct PoolParallel {
  ffi::ThreadPool& pool;

  int64_t num_threads() const { return pool.num_threads(); }

  template <typename Fn>
  void for_range(int64_t n, int64_t grain, const Fn& fn) const {
    const int64_t parts = num_parts(pool, n / std::max<int64_t>(grain, 1));
    run_parts(pool, parts, [&](int64_t p) { fn(n * p / parts, n * (p + 1) / parts); });
  }
};

// Calls fn with a null pointer of the caches' element type: float (F32) or fp8::E4M3
// (F8E4M3FN, an FP8 KV cache); an error for any other, or for k and v of different types.
template <typename Fn>
ffi::Error with_cache_type(const ffi::AnyBuffer& k_cache, const ffi::AnyBuffer& v_cache,
                           const char* op, const Fn& fn) {
  const ffi::DataType type = k_cache.element_type();
  if (v_cache.element_type() == type && type == ffi::DataType::F32) return fn((float*)nullptr);
  if (v_cache.element_type() == type && type == ffi::DataType::F8E4M3FN) {
    return fn((fp8::E4M3*)nullptr);
  }
  return ffi::Error::InvalidArgument(std::string(op) +
                                     " (FFI): the caches must both be float32 or float8_e4m3fn");
}

ffi::Error ragged_paged_attention_f32(
    ffi::ThreadPool pool,
    ffi::Buffer<ffi::F32> q,                  // [T, Hq, D]
    ffi::AnyBuffer k_cache,                   // [N, Hkv, bs, D] float32 or float8_e4m3fn
    ffi::AnyBuffer v_cache,                   // [N, Hkv, bs, D], k_cache's dtype
    ffi::Buffer<ffi::S32> kv_lens,            // [S]
    ffi::Buffer<ffi::S32> block_tables,       // [S, M]
    ffi::Buffer<ffi::S32> query_start_loc,    // [S+1]
    ffi::ResultBuffer<ffi::F32> out,          // [T, Hq, D]
    float sm_scale,
    int64_t sliding_window,  // 0: none
    float soft_cap,          // scores soft_cap * tanh(s / soft_cap); 0: none
    float k_scale,           // an fp8 cache's values are code * scale; unused for float32
    float v_scale) {
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
  const AttentionShape shape = cpu_attention::attention_shape(qd[0], qd[1], cd, td);
  const cpu_attention::RaggedBatch batch{kv_lens.typed_data(), block_tables.typed_data(),
                                         query_start_loc.typed_data()};
  if (const std::string error = cpu_attention::metadata_error(shape, batch); !error.empty()) {
    return ffi::Error::InvalidArgument(error);
  }
  return with_cache_type(k_cache, v_cache, "ragged_paged_attention", [&](auto* type) {
    using cache_t = std::remove_pointer_t<decltype(type)>;
    const cpu_attention::CpuAttention<float, float, cache_t> attention{
        shape, batch, q.typed_data(), shape.num_q_heads * shape.head_dim, shape.head_dim,
        static_cast<const cache_t*>(k_cache.untyped_data()),
        static_cast<const cache_t*>(v_cache.untyped_data()), out->typed_data(), sm_scale,
        std::max<int64_t>(sliding_window, 0), std::max(soft_cap, 0.f), k_scale, v_scale};
    cpu_attention::run_items(PoolParallel{pool}, attention);
    return ffi::Error::Success();
  });
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
  cpu_linear::linear(PoolParallel{pool}, x.typed_data(), K, M, packed.typed_data(), K, num_tiles,
                     nullptr, y->typed_data(), ldy);
  std::fill(y->typed_data() + M * ldy, y->typed_data() + xd[0] * ldy, 0.f);
  return ffi::Error::Success();
}

// A mixture of experts' expert block (moe_experts_kernel.h, the torch op pagedjax::moe_experts's
// kernel) → y [T, H]; rows [num_rows, T) of y are zeros, not computed (a step's padding rows,
// whose routes would otherwise wake experts no real token chose).
ffi::Error moe_experts_f32(ffi::ThreadPool pool,
                           ffi::Buffer<ffi::F32> x,             // [T, H]
                           ffi::Buffer<ffi::S32> topk_ids,      // [T, k]
                           ffi::Buffer<ffi::F32> topk_weights,  // [T, k]
                           ffi::Buffer<ffi::F32> w13,           // [E, ceil(2I / 16), H, 16]
                           ffi::Buffer<ffi::F32> w2,            // [E, ceil(H / 16), I, 16]
                           ffi::Buffer<ffi::S32> num_rows,      // [1]: clamped to [0, T]
                           ffi::ResultBuffer<ffi::F32> y,       // [T, H]
                           int64_t intermediate_size) {
  const char* op = "moe_experts (FFI)";
  auto dims = [](auto buffer) {
    const auto d = buffer.dimensions();
    return std::vector<int64_t>(d.begin(), d.end());
  };
  std::string error = cpu_moe::shape_error(op, dims(x), dims(topk_ids), dims(topk_weights),
                                           dims(w13), dims(w2), intermediate_size);
  if (error.empty() && dims(*y) != dims(x)) error = std::string(op) + ": y must be x's shape";
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const auto xd = x.dimensions();
  const cpu_moe::MoeExperts<int32_t> experts{
      xd[1], intermediate_size, w13.dimensions()[0], topk_ids.dimensions()[1], x.typed_data(),
      topk_ids.typed_data(), topk_weights.typed_data(), w13.typed_data(), w2.typed_data()};
  const int64_t rows = std::clamp<int64_t>(num_rows.typed_data()[0], 0, xd[0]);
  if (error = experts.error(op, rows); !error.empty()) return ffi::Error::InvalidArgument(error);
  experts.run(PoolParallel{pool}, rows, xd[0], y->typed_data());
  return ffi::Error::Success();
}

// y = x @ W^T with W kept in GGML blocks of qtype (quant_linear_kernel.h, the torch op
// pagedjax::quant_linear's kernel); rows [num_rows, M) of y are zeros, not computed.
ffi::Error quant_linear_f32(ffi::ThreadPool pool,
                            ffi::Buffer<ffi::F32> x,          // [M, K]
                            ffi::Buffer<ffi::U8> blocks,      // [N, K / 32 * bytes] or [N / 8, 8 x]
                            ffi::Buffer<ffi::S32> num_rows,   // [1]: clamped to [0, M]
                            ffi::ResultBuffer<ffi::F32> y,    // [M, N]
                            int64_t qtype) {
  const auto xd = x.dimensions(), wd = blocks.dimensions(), yd = y->dimensions();
  bool interleaved = false;
  const int64_t N = xd.size() == 2 && wd.size() == 2
                        ? cpu_quant::rows_of_blocks(qtype, xd[1], wd[0], wd[1], &interleaved)
                        : -1;
  if (N < 0 || yd.size() != 2 || yd[0] != xd[0] || yd[1] != N) {
    return ffi::Error::InvalidArgument(
        "quant_linear (FFI): expected x [M, K] (K a multiple of 32), blocks [N, K / 32 * block "
        "bytes] (or interleaved [N / 8, 8 x that]) of qtype 8 (Q8_0), 2 (Q4_0) or 3 (Q4_1), "
        "y [M, N]; got qtype=" + std::to_string(qtype));
  }
  const int64_t K = xd[1];
  const int64_t M = std::clamp<int64_t>(num_rows.typed_data()[0], 0, xd[0]);
  if (M > 0 && N > 0) {
    cpu_quant::quant_linear(PoolParallel{pool}, x.typed_data(), K, M, qtype,
                            blocks.typed_data(), interleaved, N, K, nullptr, y->typed_data(), N);
  }
  std::fill(y->typed_data() + M * N, y->typed_data() + xd[0] * N, 0.f);
  return ffi::Error::Success();
}

// A projection of the decoder layer: float32 packed into tiles [ceil(out / 16), in, 16]
// (qtype 0), or GGML blocks of qtype [out, in / 32 * block bytes] or interleaved [out / 8,
// 8 x that]; "" or what is wrong.
std::string projection(const char* name, const ffi::AnyBuffer& w, int64_t qtype, int64_t in,
                       int64_t out, cpu_layer::Projection* p) {
  const auto wd = w.dimensions();
  if (qtype == 0) {
    if (w.element_type() != ffi::F32 || wd.size() != 3 || wd[1] != in ||
        wd[2] != cpu_linear::kTile || wd[0] * cpu_linear::kTile < out) {
      return std::string("decoder_layer (FFI): ") + name + " must be packed float32 [" +
             std::to_string((out + cpu_linear::kTile - 1) / cpu_linear::kTile) + ", " +
             std::to_string(in) + ", 16]";
    }
    *p = cpu_layer::Projection::of_packed(static_cast<const float*>(w.untyped_data()), wd[0]);
    return "";
  }
  const int64_t bytes = cpu_quant::block_bytes(qtype);
  bool interleaved = false;
  if (w.element_type() != ffi::U8 || wd.size() != 2 ||
      cpu_quant::rows_of_blocks(qtype, in, wd[0], wd[1], &interleaved) != out) {
    return std::string("decoder_layer (FFI): ") + name + " of qtype " + std::to_string(qtype) +
           " must be uint8 blocks [" + std::to_string(out) + ", " +
           std::to_string(in / cpu_quant::kBlock * std::max<int64_t>(bytes, 1)) +
           "] or interleaved [" + std::to_string(out / cpu_quant::kGroup) + ", " +
           std::to_string(cpu_quant::kGroup * (in / cpu_quant::kBlock) *
                          std::max<int64_t>(bytes, 1)) +
           "] (qtype 8, 2 or 3, in_features a multiple of 32)";
  }
  *p = cpu_layer::Projection::of_blocks(static_cast<const uint8_t*>(w.untyped_data()), qtype,
                                        interleaved);
  return "";
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


// The experts of the decoder layer's MLP (router non-empty): router packed float32 [ceil(E / 16),
// H, 16], w13 [E, ceil(2I / 16), H, 16], w2 [E, ceil(H / 16), I, 16]; "" or what is wrong.
std::string experts(const ffi::Buffer<ffi::F32>& router, const ffi::AnyBuffer& w13,
                    const ffi::AnyBuffer& w2, int64_t H, int64_t I, int64_t top_k,
                    int64_t renormalize, cpu_layer::Experts* ex) {
  const auto rd = router.dimensions(), ad = w13.dimensions(), bd = w2.dimensions();
  const int64_t tile = cpu_linear::kTile, E = ad.size() == 4 ? ad[0] : 0;
  if (w13.element_type() != ffi::F32 || w2.element_type() != ffi::F32 || E < 1 ||
      ad[1] != (2 * I + tile - 1) / tile || ad[2] != H || ad[3] != tile || bd.size() != 4 ||
      bd[0] != E || bd[1] != (H + tile - 1) / tile || bd[2] != I || bd[3] != tile ||
      rd.size() != 3 || rd[0] != (E + tile - 1) / tile || rd[1] != H || rd[2] != tile) {
    return "decoder_layer (FFI): experts must be packed float32: router [ceil(E / 16), H, 16], "
           "w13 [E, ceil(2I / 16), H, 16], w2 [E, ceil(H / 16), I, 16]";
  }
  if (top_k < 1 || top_k > E) {
    return "decoder_layer (FFI): top_k=" + std::to_string(top_k) + " must be in [1, " +
           std::to_string(E) + "]";
  }
  *ex = {cpu_layer::Projection::of_packed(router.typed_data(), rd[0]),
         static_cast<const float*>(w13.untyped_data()),
         static_cast<const float*>(w2.untyped_data()), E, top_k, renormalize != 0};
  return "";
}

// One decoder layer as one call (decoder_layer_kernel.h composes it: Llama's, with per-head q/k
// norms and experts where given; the torch op pagedjax::decoder_layer runs the same) → (out
// [T, H], stream [T, H], k_cache, v_cache): the caches are updated in place (the outputs alias
// them; copied first where XLA gave fresh buffers). The rows after the last sequence's
// (query_start_loc[S], padding up to the step's bucket) are not computed: zeros in out and
// stream, as the torch op's eager step never runs them.
ffi::Error decoder_layer_f32(
    ffi::ThreadPool pool,
    ffi::Buffer<ffi::F32> x,                // [T, H]
    ffi::Buffer<ffi::F32> residual,         // [T, H]; read where has_residual
    ffi::Buffer<ffi::F32> input_norm,       // [H]
    // the projections: packed float32 [ceil(out / 16), in, 16], or (qtypes[i] != 0) GGML
    // blocks uint8 [out, in / 32 * block bytes]
    ffi::AnyBuffer qkv_weight,              // out Nqkv = (Hq + 2 Hkv) D, in H
    ffi::Buffer<ffi::F32> qkv_bias,         // [Nqkv], or [0]: none
    ffi::AnyBuffer o_weight,                // out H, in Hq D
    ffi::Buffer<ffi::F32> post_norm,        // [H]
    ffi::AnyBuffer gate_up_weight,          // out 2 I, in H
    ffi::AnyBuffer down_weight,             // out H, in I
    ffi::AnyBuffer k_cache,                 // [N, Hkv, bs, D] float32 or float8_e4m3fn
    ffi::AnyBuffer v_cache,                 // [N, Hkv, bs, D], k_cache's dtype
    ffi::Buffer<ffi::F32> cos,              // [T, D]: at each token's position
    ffi::Buffer<ffi::F32> sin,              // [T, D]
    ffi::Buffer<ffi::S32> slot_mapping,     // [T], -1: padding
    ffi::Buffer<ffi::S32> kv_lens,          // [S]
    ffi::Buffer<ffi::S32> block_tables,     // [S, M]
    ffi::Buffer<ffi::S32> query_start_loc,  // [S+1]
    ffi::Buffer<ffi::F32> q_norm,           // [D], or [0]: none (with k_norm)
    ffi::Buffer<ffi::F32> k_norm,           // [D], or [0]
    ffi::Buffer<ffi::F32> router,           // [ceil(E / 16), H, 16], or [0]: a dense MLP
    ffi::ResultBuffer<ffi::F32> out,        // [T, H]
    ffi::ResultBuffer<ffi::F32> stream,     // [T, H]
    ffi::Result<ffi::AnyBuffer> k_out,      // [N, Hkv, bs, D]: k_cache's buffer
    ffi::Result<ffi::AnyBuffer> v_out,      // [N, Hkv, bs, D]: v_cache's buffer
    int64_t num_q_heads, int64_t intermediate_size, float eps, float sm_scale,
    int64_t sliding_window,  // 0: none
    int64_t has_residual,    // 0: the first layer (x is the embedding)
    ffi::Span<const int64_t> qtypes,  // qkv, o, gate_up, down: 0 packed, else GGML type
    float k_scale,                    // an fp8 cache stores k / k_scale, v / v_scale
    float v_scale,
    int64_t top_k,        // with a router: each token's experts
    int64_t renormalize) {  // with a router: their weights divided by their sum
  const auto xd = x.dimensions(), cd = k_cache.dimensions(), td = block_tables.dimensions();
  if (xd.size() != 2 || cd.size() != 4 || td.size() != 2 || cd[1] <= 0 ||
      num_q_heads % cd[1] != 0 || cos.dimensions()[0] != xd[0] || cos.dimensions()[1] != cd[3] ||
      static_cast<int64_t>(slot_mapping.element_count()) != xd[0] ||
      static_cast<int64_t>(kv_lens.element_count()) != td[0] ||
      static_cast<int64_t>(query_start_loc.element_count()) != td[0] + 1) {
    return ffi::Error::InvalidArgument(
        "decoder_layer (FFI): expected x [T, H], caches [N, Hkv, bs, D] with Hkv dividing Hq, "
        "cos/sin [T, D], slot_mapping [T], kv_lens [S], block_tables [S, M], "
        "query_start_loc [S+1]");
  }
  const int64_t H = xd[1], I = intermediate_size, D = cd[3], q_size = num_q_heads * D;
  const int64_t qkv_size = q_size + 2 * cd[1] * D;
  if (qtypes.size() != 4) {
    return ffi::Error::InvalidArgument("decoder_layer (FFI): qtypes must be 4 ints (qkv, o, "
                                       "gate_up, down; 0: packed float32)");
  }
  cpu_layer::Projection qkv, o, gate_up, down;
  cpu_layer::Experts moe;
  const bool has_experts = router.element_count() > 0;
  for (const std::string& error :
       {projection("qkv_weight", qkv_weight, qtypes[0], H, qkv_size, &qkv),
        projection("o_weight", o_weight, qtypes[1], q_size, H, &o),
        has_experts ? experts(router, gate_up_weight, down_weight, H, I, top_k, renormalize, &moe)
                    : projection("gate_up_weight", gate_up_weight, qtypes[2], H, 2 * I, &gate_up),
        has_experts ? "" : projection("down_weight", down_weight, qtypes[3], I, H, &down)}) {
    if (!error.empty()) return ffi::Error::InvalidArgument(error);
  }
  const int64_t norms = static_cast<int64_t>(q_norm.element_count());
  if (norms != static_cast<int64_t>(k_norm.element_count()) || (norms != 0 && norms != D)) {
    return ffi::Error::InvalidArgument("decoder_layer (FFI): q_norm and k_norm must both be "
                                       "[head_dim] or both [0]");
  }
  const AttentionShape shape = cpu_attention::attention_shape(xd[0], num_q_heads, cd, td);
  const cpu_layer::DecoderLayer<int32_t> layer{
      shape, H, I, eps, sm_scale, sliding_window, x.typed_data(),
      has_residual ? residual.typed_data() : nullptr,
      cpu_layer::Weights{input_norm.typed_data(),
                         qkv,
                         qkv_bias.element_count() > 0 ? qkv_bias.typed_data() : nullptr,
                         o,
                         post_norm.typed_data(),
                         gate_up,
                         down,
                         norms ? q_norm.typed_data() : nullptr,
                         norms ? k_norm.typed_data() : nullptr,
                         moe},
      cos.typed_data(), sin.typed_data(), slot_mapping.typed_data(),
      cpu_attention::RaggedBatch{kv_lens.typed_data(), block_tables.typed_data(),
                                 query_start_loc.typed_data()},
      k_scale, v_scale};
  // a bias of another length than Nqkv would be read past its end
  if (qkv_bias.element_count() > 0 &&
      static_cast<int64_t>(qkv_bias.element_count()) != qkv_size) {
    return ffi::Error::InvalidArgument("decoder_layer (FFI): qkv_bias must be [(Hq + 2 Hkv) D]");
  }
  const int64_t rows = query_start_loc.typed_data()[td[0]];  // the sequences' rows
  if (const std::string error = layer.error(rows); !error.empty()) {
    return ffi::Error::InvalidArgument(error);
  }
  return with_cache_type(k_cache, v_cache, "decoder_layer", [&](auto* type) {
    using cache_t = std::remove_pointer_t<decltype(type)>;
    const size_t cache_bytes = k_cache.size_bytes();
    for (const auto& [cache, result] :
         {std::pair{&k_cache, &k_out}, std::pair{&v_cache, &v_out}}) {
      if ((*result)->untyped_data() != cache->untyped_data()) {
        std::memcpy((*result)->untyped_data(), cache->untyped_data(), cache_bytes);
      }
    }
    layer.run(PoolParallel{pool}, rows, out->typed_data(), stream->typed_data(),
              static_cast<cache_t*>(k_out->untyped_data()),
              static_cast<cache_t*>(v_out->untyped_data()));
    return ffi::Error::Success();
  });
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
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<float>("k_scale")
                                  .Attr<float>("v_scale"));

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
                                  .Arg<ffi::AnyBuffer>()          // qkv_weight
                                  .Arg<ffi::Buffer<ffi::F32>>()   // qkv_bias
                                  .Arg<ffi::AnyBuffer>()          // o_weight
                                  .Arg<ffi::Buffer<ffi::F32>>()   // post_norm
                                  .Arg<ffi::AnyBuffer>()          // gate_up_weight
                                  .Arg<ffi::AnyBuffer>()          // down_weight
                                  .Arg<ffi::AnyBuffer>()          // k_cache
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot_mapping
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q_norm
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_norm
                                  .Arg<ffi::Buffer<ffi::F32>>()   // router
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // stream
                                  .Ret<ffi::AnyBuffer>()          // k_cache
                                  .Ret<ffi::AnyBuffer>()          // v_cache
                                  .Attr<int64_t>("num_q_heads")
                                  .Attr<int64_t>("intermediate_size")
                                  .Attr<float>("eps")
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<int64_t>("has_residual")
                                  .Attr<ffi::Span<const int64_t>>("qtypes")
                                  .Attr<float>("k_scale")
                                  .Attr<float>("v_scale")
                                  .Attr<int64_t>("top_k")
                                  .Attr<int64_t>("renormalize"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxMoeExpertsF32, pagedjax::moe_experts_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_ids
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w13
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w2
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_rows
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Attr<int64_t>("intermediate_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxQuantLinearF32, pagedjax::quant_linear_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::U8>>()    // blocks
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_rows
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Attr<int64_t>("qtype"));
