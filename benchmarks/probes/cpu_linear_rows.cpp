// The packed float32 linear's kernel alone (kernels_cuda/csrc/cpu/kernels/linear_cpu_kernel.h),
// per number of rows, with no framework around it: a model's projections (the demo target's,
// cpu_linear_workload.h), every layer's four products a pass, on OpenMP threads split as the
// torch op splits them. With 8 layers (33 MB) the weights are partly in a 32 MB L3 between
// passes, as the demo target's are in the engine; with 24 (100 MB) they come from memory, as a
// larger model's do.
// Prints the best of 7 groups of 50 passes, in microseconds a pass, per row count. To compare two
// versions of the header, use cpu_linear_ab.cpp (one process: the host's speed drifts).
//
//   g++ -O3 -fopenmp -std=c++17 benchmarks/probes/cpu_linear_rows.cpp -o /tmp/linear_rows
//   OMP_NUM_THREADS=2 /tmp/linear_rows [layers=8]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "../../kernels_cuda/csrc/cpu/kernels/linear_cpu_kernel.h"
#include "cpu_linear_workload.h"

int main(int argc, char** argv) {
  using namespace pagedjax::cpu_linear;
  using linear_probe::OmpParallel, linear_probe::Packed;
  const int layers = argc > 1 ? std::atoi(argv[1]) : 8;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  const std::vector<Packed> weights = linear_probe::demo_projections(layers, rng);
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
