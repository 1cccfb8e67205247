// The workload of the packed linear's probes (cpu_linear_rows.cpp, cpu_linear_ab.cpp): the demo
// target's projections a layer (qkv 256x512, o 256x256, gate_up 256x2048, down 1024x256; each
// layer its own random weights, packed [tiles, K, 16]) and OpenMP threads split as the torch op
// splits them (parallel.h's policy).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace linear_probe {

constexpr int64_t kTile = 16;  // linear_cpu_kernel.h's columns a tile

struct OmpParallel {  // contiguous ranges of >= grain items
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

// `layers` layers of the demo target's four projections, random normal weights.
inline std::vector<Packed> demo_projections(int layers, std::mt19937& rng) {
  const int64_t shapes[4][2] = {{256, 512}, {256, 256}, {256, 2048}, {1024, 256}};  // in, out
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
  return weights;
}

}  // namespace linear_probe
