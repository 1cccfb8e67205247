// Two versions of the packed linear's kernel (kernels_cuda/csrc/cpu/kernels/linear_cpu_kernel.h)
// in one process, A and B taking turns group by group: on a host whose speed drifts between
// processes (2x on the shared 2-vCPU hosts of RESULTS.md), the only comparison that decides a
// few per cent. Each copy is included under its own namespace (cpu_linear_a, cpu_linear_b); both
// must include the same cpu_features.h (one path), so copy the variant's linear header next to
// the original or point its include at the original's. The workload is cpu_linear_rows.cpp's:
// the demo target's projections, `layers` layers, 30 passes a group. Prints, per row count, the
// median microseconds a pass of each and the median and quartiles of B / A over the groups.
//
//   g++ -O3 -fopenmp -std=c++17 -DHEADER_A='"/path/a/linear_cpu_kernel.h"' \
//       -DHEADER_B='"/path/b/linear_cpu_kernel.h"' benchmarks/probes/cpu_linear_ab.cpp -o /tmp/ab
//   OMP_NUM_THREADS=2 /tmp/ab [layers=8] [groups=15] [rows ...=1 5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cpu_linear_workload.h"

#define cpu_linear cpu_linear_a
#include HEADER_A
#undef cpu_linear
#define cpu_linear cpu_linear_b
#include HEADER_B
#undef cpu_linear

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using linear_probe::kTile, linear_probe::OmpParallel, linear_probe::Packed;
  const int layers = argc > 1 ? std::atoi(argv[1]) : 8;
  const int groups = argc > 2 ? std::atoi(argv[2]) : 15;
  std::vector<int64_t> row_counts;
  for (int i = 3; i < argc; ++i) row_counts.push_back(std::atoi(argv[i]));
  if (row_counts.empty()) row_counts = {1, 5};
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  const std::vector<Packed> weights = linear_probe::demo_projections(layers, rng);
  std::vector<float> x(64 * 1024), y(64 * 2048);
  for (float& v : x) v = normal(rng);
  const OmpParallel par;
  for (int64_t rows : row_counts) {
    std::vector<double> a_us, b_us, ratio;
    for (int g = 0; g < groups; ++g) {
      for (int turn = 0; turn < 2; ++turn) {
        const bool a = (turn == 0) == (g % 2 == 0);  // A first in even groups
        const auto start = std::chrono::steady_clock::now();
        for (int pass = 0; pass < 30; ++pass) {
          for (const Packed& p : weights) {
            if (a) {
              pagedjax::cpu_linear_a::linear(par, x.data(), p.in, rows, p.w.data(), p.in,
                                             p.tiles, nullptr, y.data(), p.tiles * kTile);
            } else {
              pagedjax::cpu_linear_b::linear(par, x.data(), p.in, rows, p.w.data(), p.in,
                                             p.tiles, nullptr, y.data(), p.tiles * kTile);
            }
          }
        }
        const std::chrono::duration<double> s = std::chrono::steady_clock::now() - start;
        (a ? a_us : b_us).push_back(s.count() / 30 * 1e6);
      }
      ratio.push_back(b_us.back() / a_us.back());
    }
    std::vector<double> sorted = ratio;
    std::sort(sorted.begin(), sorted.end());
    std::printf("rows=%ld A %.0f us  B %.0f us  B/A %.3f [%.3f-%.3f]\n", static_cast<long>(rows),
                median(a_us), median(b_us), median(ratio), sorted[groups / 4],
                sorted[3 * groups / 4]);
  }
  return 0;
}
