// The torch-free core of the top-k / top-p / min-p filter on the CPU, shared by the torch op
// (../torch/filter_cpu.cpp) and the JAX FFI handler (../xla_ffi/cpu_ffi.cpp). The samplers'
// sort-based version (backends/*/sampler.py, filter_logits) is the reference; this one sorts only
// what top-p needs.
//
// Why hand-written: XLA's CPU sort and cumulative sum make the sort-based filter take 70 ms for
// 64 rows of 4,096 logits (torch's CPU sort 13 ms) where this takes well under one, and the
// sort-based filter is also what makes a compiled step slowest to compile
// (benchmarks/results/RESULTS.md).
//
// Semantics, per row of logits (already divided by the temperature), with V the vocabulary:
//   sorted = the row, largest first; k = top_k if 0 < top_k < V, else V
//   p_i = softmax over sorted[0:k]; with top_p < 1, keep the first n entries, n the most whose
//   mass before them is < top_p (n >= 1: top_p <= 0 keeps the first); else n = k
//   threshold = sorted[n - 1], raised to sorted[0] + log(min_p) when min_p > 0
//   out = the row where it is >= threshold, -inf elsewhere.
// Ties: entries equal to the threshold are all kept (the sorted version keeps them too: it
// compares against the threshold's value). Each exp is float32, as the sorted version's (exp8 on
// AVX2, ~1 ulp apart); the masses accumulate in double (its float32 cumulative sum can round a
// peaked row's mass to 1 early); rows split across threads are independent.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "simd_math.h"

namespace pagedjax::cpu_filter {

constexpr float kNearTop = 16.0f;  // logits this far under the largest weigh < 1.2e-7 of it

// An entry of a row: its logit and its unnormalized probability exp(logit - max), computed once.
struct Entry {
  float logit;
  float weight;
};

// The logit at which the mass of the larger entries first reaches top_p: among entries[0, n),
// the smallest logit whose mass before it (of the entries above it, each weight / total) is
// still < top_p. A quickselect weighted by mass: each round partitions around a pivot and keeps
// the side that holds the boundary, so a row costs O(n) expected (a sort: O(n log n)).
inline float top_p_cutoff(Entry* entries, int64_t n, double total, double top_p) {
  double before = 0.0;  // mass of the entries known to be above the range [lo, hi)
  int64_t lo = 0, hi = n;
  for (;;) {
    const float pivot = entries[lo + (hi - lo) / 2].logit;
    Entry* mid = std::partition(entries + lo, entries + hi,
                                [&](const Entry& e) { return e.logit > pivot; });
    double above = 0.0;
    for (Entry* e = entries + lo; e < mid; ++e) above += e->weight;
    above /= total;
    if (before + above >= top_p) {  // the boundary is among the entries above the pivot
      hi = mid - entries;
      continue;
    }
    // The pivot's copies are next: the mass before the first is before + above < top_p.
    Entry* rest = std::partition(mid, entries + hi,
                                 [&](const Entry& e) { return e.logit == pivot; });
    double copies = 0.0;
    for (Entry* e = mid; e < rest; ++e) copies += e->weight;
    before += above + copies / total;
    if (before >= top_p || rest == entries + hi) return pivot;
    lo = rest - entries;
  }
}

#if defined(__x86_64__)
// set_weights' first n - n % 8 entries (*done set to their count, *near to how many of them lie
// within kNearTop of top) → their weights' sum.
__attribute__((target("avx2,fma"))) inline double set_weights_avx2(Entry* entries, int64_t n,
                                                                  float top, int64_t* done,
                                                                  int64_t* near) {
  static_assert(sizeof(Entry) == 2 * sizeof(float), "Entry is a (logit, weight) pair of floats");
  float* pairs = reinterpret_cast<float*>(entries);
  const __m256 shift = _mm256_set1_ps(top), bound = _mm256_set1_ps(top - kNearTop);
  int64_t count = 0;
  __m256d sum_low = _mm256_setzero_pd(), sum_high = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(pairs + 2 * i), b = _mm256_loadu_ps(pairs + 2 * i + 8);
    const __m256 logits = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 weights = exp8(_mm256_sub_ps(logits, shift));
    count += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(logits, bound, _CMP_GE_OQ)));
    _mm256_storeu_ps(pairs + 2 * i, _mm256_unpacklo_ps(logits, weights));
    _mm256_storeu_ps(pairs + 2 * i + 8, _mm256_unpackhi_ps(logits, weights));
    sum_low = _mm256_add_pd(sum_low, _mm256_cvtps_pd(_mm256_castps256_ps128(weights)));
    sum_high = _mm256_add_pd(sum_high, _mm256_cvtps_pd(_mm256_extractf128_ps(weights, 1)));
  }
  double lanes[4];
  _mm256_storeu_pd(lanes, _mm256_add_pd(sum_low, sum_high));
  *done = i;
  *near = count;
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}
#endif

// The k largest of row[0, V) as a min-heap in heap[0, k) (heap[0] the k-th largest), for a k
// much smaller than V: one pass that compares each entry with the heap's minimum (few enter: about
// k ln(V / k) over a row in random order), where nth_element moves every entry several times.
inline void k_largest(const float* row, int64_t V, int64_t k, std::vector<float>& heap) {
  heap.assign(row, row + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  for (int64_t i = k; i < V; ++i) {
    if (row[i] > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
      heap.back() = row[i];
      std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    }
  }
}

// How many entries top_p_cutoff needs to read: where the near ones (within kNearTop of the
// largest logit, counted by set_weights) are a small part of n, they are moved first, and if they
// hold top_p of the mass (every other entry then has at least that much mass above it, so the
// boundary is among them) only they are read. A peaked row's few candidates then take the
// quickselect's passes instead of the whole vocabulary.
inline int64_t near_top(Entry* entries, int64_t n, float top, double total, double top_p,
                        int64_t near) {
  if (near * 4 > n) return n;
  const float bound = top - kNearTop;
  Entry* end =
      std::partition(entries, entries + n, [&](const Entry& e) { return e.logit >= bound; });
  double mass = 0.0;
  for (const Entry* e = entries; e < end; ++e) mass += e->weight;
  return mass / total >= top_p ? end - entries : n;
}

// entries[i].weight = exp(entries[i].logit - top) for i < n → their sum, in double, and how many
// lie within kNearTop of top. AVX2: 8 entries a step (simd_math.h's exp8, ~1 ulp of std::exp),
// their logits taken out of the pairs and the weights put back by one shuffle each way.
inline double set_weights(Entry* entries, int64_t n, float top, int64_t* near) {
  int64_t i = 0;
  double total = 0.0;
  *near = 0;
#if defined(__x86_64__)
  if (cpu_has_avx2_fma()) total = set_weights_avx2(entries, n, top, &i, near);
#endif
  for (; i < n; ++i) {
    entries[i].weight = std::exp(entries[i].logit - top);
    total += entries[i].weight;
    *near += entries[i].logit >= top - kNearTop;
  }
  return total;
}

constexpr int64_t kHeapTopK = 1024;  // a top_k up to this, and under V / 8, takes k_largest

// The threshold of one row (see above); scratch and heap are reused across rows.
inline float threshold(const float* row, int64_t V, int64_t top_k, float top_p, float min_p,
                       std::vector<Entry>& scratch, std::vector<float>& heap) {
  const int64_t k = (top_k > 0 && top_k < V) ? top_k : V;
  float result = -std::numeric_limits<float>::infinity();
  float top;
  if (k <= kHeapTopK && k * 8 < V) {
    k_largest(row, V, k, heap);  // the softmax's support: the same values as sorted[0:k]
    top = *std::max_element(heap.begin(), heap.end());
    result = heap.front();
    scratch.resize(k);
    for (int64_t i = 0; i < k; ++i) scratch[i] = {heap[i], 0.0f};
  } else {
    top = *std::max_element(row, row + V);
    if (k < V || top_p < 1.0f) {
      scratch.resize(V);
      for (int64_t i = 0; i < V; ++i) scratch[i] = {row[i], 0.0f};
      auto larger = [](const Entry& a, const Entry& b) { return a.logit > b.logit; };
      if (k < V) {  // the k largest first, in any order: the softmax's support
        std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), larger);
        result = scratch[k - 1].logit;  // the k-th largest
      }
    }
  }
  if (top_p <= 0.0f) {  // n = 1 (padding rows carry 0): the quickselect would not end
    result = top;
  } else if (top_p < 1.0f) {
    int64_t near;
    const double total = set_weights(scratch.data(), k, top, &near);
    result = top_p_cutoff(scratch.data(), near_top(scratch.data(), k, top, total, top_p, near),
                          total, top_p);
  }
  if (min_p > 0.0f) result = std::max(result, top + std::log(min_p));
  return result;
}

// out[r] = row r where >= its threshold, -inf elsewhere, for rows [begin, end) of x [R, V].
inline void filter_rows(const float* x, int64_t V, const int32_t* top_k, const float* top_p,
                        const float* min_p, float* out, int64_t begin, int64_t end) {
  std::vector<Entry> scratch;
  std::vector<float> heap;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = begin; r < end; ++r) {
    const float* row = x + r * V;
    float* dst = out + r * V;
    const float bound = threshold(row, V, top_k[r], top_p[r], min_p[r], scratch, heap);
    for (int64_t i = 0; i < V; ++i) dst[i] = row[i] >= bound ? row[i] : minus_inf;
  }
}

}  // namespace pagedjax::cpu_filter
