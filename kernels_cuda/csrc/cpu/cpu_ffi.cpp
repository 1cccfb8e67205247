// The C++ CPU kernels of the torch ops as XLA FFI handlers, in float32 (no torch headers): the
// JAX backend's attention (attention_cpu_kernel.h) and packed linear (linear_cpu_kernel.h) on
// CPU. Built and registered by kernels_pallas/cpu_ffi.py. Parallel on XLA's own intra-op thread
// pool: an OpenMP team of its own, started from an XLA thread, made libgomp count more threads
// than cores and stop spinning, which slowed every torch op in the process (RESULTS.md).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "attention_cpu_kernel.h"
#include "filter_cpu_kernel.h"
#include "linear_cpu_kernel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace pagedjax {
namespace {

// Runs run_part(p) for p in [0, parts): the caller takes parts until none is left, and so do
// the parts - 1 tasks it schedules on XLA's pool (a task that starts late finds none and
// touches nothing but the shared counters); returns once every part has run.
template <typename RunPart>
void run_parts(ffi::ThreadPool& pool, int64_t parts, const RunPart& run_part) {
  struct Progress {
    std::atomic<int64_t> next{0};
    int64_t done = 0;
    std::mutex mutex;
    std::condition_variable finished;
  };
  auto progress = std::make_shared<Progress>();
  auto work = [&run_part, parts](Progress& state) {
    for (int64_t p; (p = state.next.fetch_add(1)) < parts;) {
      run_part(p);
      std::lock_guard<std::mutex> lock(state.mutex);
      if (++state.done == parts) state.finished.notify_one();
    }
  };
  for (int64_t i = 1; i < parts; ++i) {
    pool.Schedule([progress, work] { work(*progress); });
  }
  work(*progress);
  std::unique_lock<std::mutex> lock(progress->mutex);
  progress->finished.wait(lock, [&] { return progress->done == parts; });
}

// How many parts to split n items into: one per pool thread, at least 1.
int64_t num_parts(ffi::ThreadPool& pool, int64_t n) {
  return std::clamp<int64_t>(pool.num_threads(), 1, std::max<int64_t>(n, 1));
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
  AttentionShape shape{};
  shape.num_tokens = qd[0];
  shape.num_q_heads = qd[1];
  shape.head_dim = qd[2];
  shape.num_blocks = cd[0];
  shape.num_kv_heads = cd[1];
  shape.block_size = cd[2];
  shape.group = shape.num_q_heads / shape.num_kv_heads;
  shape.num_seqs = td[0];
  shape.max_blocks = td[1];
  const cpu_attention::RaggedBatch batch{kv_lens.typed_data(), block_tables.typed_data(),
                                         query_start_loc.typed_data()};
  if (const std::string error = cpu_attention::metadata_error(shape, batch); !error.empty()) {
    return ffi::Error::InvalidArgument(error);
  }
  const cpu_attention::CpuAttention<float, float> attention{
      shape, batch, q.typed_data(), shape.num_q_heads * shape.head_dim, shape.head_dim,
      k_cache.typed_data(), v_cache.typed_data(), out->typed_data(), sm_scale,
      std::max<int64_t>(sliding_window, 0), std::max(soft_cap, 0.f)};
  // One item per (query row, KV head), in contiguous ranges of equal cost.
  const int64_t parts = num_parts(pool, shape.num_tokens * shape.num_kv_heads);
  const std::vector<int64_t> bounds = attention.split_items(parts);
  run_parts(pool, parts, [&](int64_t p) {
    cpu_attention::Scratch<float> scratch(shape.group, shape.block_size, shape.head_dim,
                                          shape.max_blocks * shape.block_size);
    for (int64_t item = bounds[p]; item < bounds[p + 1]; ++item) {
      attention.run(item / shape.num_kv_heads, item % shape.num_kv_heads, scratch);
    }
  });
  return ffi::Error::Success();
}

ffi::Error linear_f32(ffi::ThreadPool pool,
                      ffi::Buffer<ffi::F32> x,          // [M, K]
                      ffi::Buffer<ffi::F32> packed,     // [ceil(N / 16), K, 16]
                      ffi::ResultBuffer<ffi::F32> y) {  // [M, ceil(N / 16) * 16]
  const auto xd = x.dimensions(), wd = packed.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != cpu_linear::kTile || wd[1] != xd[1] ||
      yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0] * cpu_linear::kTile) {
    return ffi::Error::InvalidArgument(
        "linear (FFI): expected x [M, K], packed [ceil(N/16), K, 16], y [M, ceil(N/16) * 16]");
  }
  const int64_t M = xd[0], K = xd[1], num_tiles = wd[0];
  if (M == 0) return ffi::Error::Success();
  const int64_t groups = cpu_linear::num_tile_groups(num_tiles);
  const int64_t parts = num_parts(pool, groups / cpu_linear::tile_group_grain(M, K));
  run_parts(pool, parts, [&](int64_t p) {
    cpu_linear::run_tile_groups(x.typed_data(), K, M, packed.typed_data(), K, num_tiles, nullptr,
                                y->typed_data(), num_tiles * cpu_linear::kTile,
                                groups * p / parts, groups * (p + 1) / parts);
  });
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
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxTopKF32, pagedjax::top_k_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
