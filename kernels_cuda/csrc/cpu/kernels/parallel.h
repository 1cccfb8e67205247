// How the framework-free kernels run in parallel without naming a thread pool: the functions
// that split work take a policy `par` from their binding (the torch ops: at::parallel_for,
// ../torch/torch_parallel.h; the XLA FFI handlers: XLA's intra-op pool, ../xla_ffi/cpu_ffi.cpp)
// with
//   int64_t num_threads() const;
//   template <typename Fn> void for_range(int64_t n, int64_t grain, const Fn& fn) const;
// for_range calls fn(begin, end) on contiguous ranges that cover [0, n) once, each of at least
// `grain` items where n allows, on the policy's threads, and returns once all have run. How the
// work is split never changes a result: every kernel computes an element the same way in any
// range.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pagedjax::cpu_parallel {

constexpr int64_t kRowElements = 16384;  // elements per thread's share of a row loop, at least

// Rows of `width` elements per range: at least ~kRowElements elements a range.
inline int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, kRowElements / std::max<int64_t>(1, width));
}

}  // namespace pagedjax::cpu_parallel
