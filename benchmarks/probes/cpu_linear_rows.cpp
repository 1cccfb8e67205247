// The packed float32 linear's kernel alone (kernels_cuda/csrc/cpu/kernels/linear_cpu_kernel.h),
// per number of rows, with no framework around it: a model's projections (the demo target's
// qkv 256x512, o 256x256, gate_up 256x2048 and down 1024x256 a layer; each layer its own
// weights), every layer's four products a pass, on OpenMP threads split as the torch op splits
// them. With 8 layers (33 MB) the weights are partly in a 32 MB L3 between passes, as the demo
// target's are in the engine; with 24 (100 MB) they come from memory, as a larger model's do.
// Prints the best of 7 groups of 50 passes, in microseconds a pass, per row count. To compare two
// versions of the header, build each and run them in turns (the host's speed drifts).
//
//   g++ -O3 -fopenmp -std=c++17 benchmarks/probes/cpu_linear_rows.cpp -o /tmp/linear_rows
//   OMP_NUM_THREADS=2 /tmp/linear_rows [layers=8]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "../../kernels_cuda/csrc/cpu/kernels/linear_cpu_kernel.h"

namespace {

struct OmpParallel {  // parallel.h's policy on OpenMP: contiguous ranges of >= grain items
  int64_t num_threads() const { return omp_get_max_threads(); }
  template <typename Fn>
  void for_range(int64_t n, int64_t grain, const Fn& fn) const {
    const int64_t threads = std::clamp<int64_t>(n / std::max<int64_t>(grain, 1), 1,
                                                omp_get_max_threads());
    if (threads == 1) return fn(0, n);
#pragma omp parallel num_threads(threads)
    {
      const int64_t chunk = (n + threads - 1) / threads, begin = omp_get_thread_num() * chunk;
      if (begin < n) fn(begin, std::min(n, begin + chunk));
    }
  }
};

struct Packed {  // one projection's weight, packed: [tiles, K, 16]
  int64_t in, out, tiles;
  std::vector<float> w;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace pagedjax::cpu_linear;
  const int layers = argc > 1 ? std::atoi(argv[1]) : 8;
  const int64_t shapes[4][2] = {{256, 512}, {256, 256}, {256, 2048}, {1024, 256}};  // in, out
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  std::vector<Packed> weights;
  for (int l = 0; l < layers; ++l) {
    for (const auto& s : shapes) {
      Packed p{s[0], s[1], (s[1] + kTile - 1) / kTile, {}};
      p.w.resize(p.tiles * p.in * kTile);
      for (float& v : p.w) v = normal(rng);
      weights.push_back(std::move(p));
    }
  }
  constexpr int64_t kMaxRows = 64;
  std::vector<float> x(kMaxRows * 1024), y(kMaxRows * 2048);
  for (float& v : x) v = normal(rng);
  const OmpParallel par;
  for (int64_t rows : {1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64}) {
    double best = 1e30;
    for (int group = 0; group < 7; ++group) {
      const auto start = std::chrono::steady_clock::now();
      for (int pass = 0; pass < 50; ++pass) {
        for (const Packed& p : weights) {
          linear(par, x.data(), p.in, rows, p.w.data(), p.in, p.tiles, nullptr, y.data(),
                 p.tiles * kTile);
        }
      }
      const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
      best = std::min(best, seconds.count() / 50);
    }
    std::printf("rows=%ld %.1f us\n", static_cast<long>(rows), best * 1e6);
  }
  return 0;
}
