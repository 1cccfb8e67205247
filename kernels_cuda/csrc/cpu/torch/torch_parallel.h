// The torch ops' policy for the framework-free kernels' parallel loops (../kernels/parallel.h):
// ATen's intra-op thread pool through at::parallel_for.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace pagedjax {

struct TorchParallel {
  int64_t num_threads() const { return at::get_num_threads(); }

  template <typename Fn>
  void for_range(int64_t n, int64_t grain, const Fn& fn) const {
    at::parallel_for(0, n, grain, fn);
  }
};

}  // namespace pagedjax
