// The experts of a mixture-of-experts MLP on the CPU in float32, torch-free, shared by the torch
// op pagedjax::moe_experts (../torch/moe_cpu.cpp) and the JAX FFI handler (../xla_ffi/cpu_ffi.cpp),
// so that the two backends compute the same bits:
//   y[t] = sum over t's k chosen experts e, in expert order, of w[t, e] * (silu(x[t] G_e) *
//          (x[t] U_e)) D_e
// with each expert's gate_up [H, 2I] (its gate columns, then its up columns) and down [I, H]
// packed as the packed linear packs a weight (linear_cpu_kernel.h). The sum runs as HF's loop
// over experts does: from zero, each weight * output rounded, then added.
//
// The T k (token, expert) pairs are grouped by expert (a stable counting sort), each expert's
// rows gathered into one block, and each expert's two products run as the linear's tile loop
// (run_tiles) over its block: an expert's weights are read once per call, those of an expert no
// token chose not at all (llama.cpp's MUL_MAT_ID idea). The tiles of every chosen expert form one
// list split among the threads by cost, so a decode step's two experts share the threads as one
// wide product would, and a prefill's busy expert is not left to one thread (side by side with
// a parallel region per expert, benchmarks/moe.py's shape on 2 cores: 5-15 % faster at 1 and 4
// tokens, the same at 32 and 256).
//
// Each output element is the linear's FMA chain in k order, then the fixed sum above: a token's
// result depends neither on the other tokens of the batch nor on the threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "linear_cpu_kernel.h"
#include "norm_act_cpu_kernel.h"
#include "parallel.h"

namespace pagedjax::cpu_moe {

using cpu_linear::kTile;

inline int64_t tiles_of(int64_t columns) { return (columns + kTile - 1) / kTile; }

inline std::string dims_string(const std::vector<int64_t>& dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

// What is wrong with the bindings' shapes ("" when nothing): x [T, H], topk_ids and
// topk_weights [T, k], w13 [E, ceil(2I / 16), H, 16], w2 [E, ceil(H / 16), I, 16].
inline std::string shape_error(const std::string& op, const std::vector<int64_t>& x,
                               const std::vector<int64_t>& topk_ids,
                               const std::vector<int64_t>& topk_weights,
                               const std::vector<int64_t>& w13, const std::vector<int64_t>& w2,
                               int64_t intermediate_size) {
  auto bad = [&](const char* name, const std::string& want, const std::vector<int64_t>& got) {
    return op + ": " + name + " must be " + want + ", got shape " + dims_string(got);
  };
  const auto n = [](int64_t v) { return std::to_string(v); };
  if (x.size() != 2) return bad("x", "[num_tokens, hidden]", x);
  const int64_t T = x[0], H = x[1], I = intermediate_size;
  if (topk_ids.size() != 2 || topk_ids[0] != T || topk_ids[1] < 1) {
    return bad("topk_ids", "[num_tokens=" + n(T) + ", top_k >= 1]", topk_ids);
  }
  if (topk_weights != topk_ids) {
    return bad("topk_weights", "topk_ids' " + dims_string(topk_ids), topk_weights);
  }
  if (I < 1) return op + ": intermediate_size must be >= 1, got " + n(I);
  if (w13.size() != 4 || w13[0] < 1 || w13[1] != tiles_of(2 * I) || w13[2] != H ||
      w13[3] != kTile) {
    return bad("w13_packed",
               "[num_experts, ceil(2 * intermediate_size / 16)=" + n(tiles_of(2 * I)) +
                   ", hidden=" + n(H) + ", 16] (each expert's gate_up [H, 2I] packed)",
               w13);
  }
  if (w2.size() != 4 || w2[0] != w13[0] || w2[1] != tiles_of(H) || w2[2] != I ||
      w2[3] != kTile) {
    return bad("w2_packed",
               "[num_experts=" + n(w13[0]) + ", ceil(hidden / 16)=" + n(tiles_of(H)) +
                   ", intermediate_size=" + n(I) + ", 16] (each expert's down [I, H] packed)",
               w2);
  }
  return "";
}

// The routing of rows tokens (the torch op pagedjax::moe_routing's and the fused decoder layer's,
// so that the op-by-op path and the fused one choose the same experts with the same weights):
// each row of logits [rows, ld] (its first E router logits) → its k experts ids [rows, k] and
// weights [rows, k]: the softmax over all E in float32 (the max subtracted, exp, the sum in
// expert order, each divided by it), its k largest, largest first, ties to the lower expert
// (jax.lax.top_k's order; torch.topk leaves ties' order unspecified: with float logits they
// have measure zero, and within the k only the order of the sum below would change, as the
// experts' block adds in expert order), divided by their sum (largest first) where renormalize.
// Overwrites logits' first E columns with the probabilities. A NaN never leaves an id unset.
template <typename Parallel, typename index_t>
void route_rows(const Parallel& par, float* logits, int64_t ld, int64_t rows, int64_t E,
                int64_t k, bool renormalize, float* weights, index_t* ids) {
  par.for_range(rows, cpu_parallel::row_grain(E * 8), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* p = logits + r * ld;
      float max = p[0], sum = 0.f;
      for (int64_t e = 1; e < E; ++e) max = std::max(max, p[e]);
      for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - max));
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
      float* w = weights + r * k;
      index_t* id = ids + r * k;
      int64_t n = 0;  // kept so far, sorted: w[0] >= w[1] >= ...
      for (int64_t e = 0; e < E; ++e) {
        if (n == k && !(p[e] > w[k - 1])) continue;  // not above the k-th
        int64_t j = std::min(n, k - 1);  // slide smaller ones down; equal ones stay ahead
        for (; j > 0 && p[e] > w[j - 1]; --j) {
          w[j] = w[j - 1];
          id[j] = id[j - 1];
        }
        w[j] = p[e];
        id[j] = static_cast<index_t>(e);
        n = std::min(n + 1, k);
      }
      if (!renormalize) continue;
      float total = 0.f;
      for (int64_t j = 0; j < k; ++j) total += w[j];
      for (int64_t j = 0; j < k; ++j) w[j] /= total;
    }
  });
}

// One expert's rows of the grouped pairs: [first, first + rows).
struct ExpertRows {
  int64_t expert;
  int64_t first;
  int64_t rows;
};

// A tile's cost in rows of multiply-adds: its rows', plus about this many for streaming its
// weights from memory (a decode step's rows are few; its cost is mostly that stream).
constexpr int64_t kWeightRows = 4;

// fn(expert, t0, t1) over the tiles [0, tiles) of every expert's product of depth K (expert
// order, then tile order, as one list), split into contiguous runs of about equal cost, one per
// thread (none for a product too small to share: linear's tile_grain).
template <typename Parallel, typename Fn>
void for_expert_tiles(const Parallel& par, const std::vector<ExpertRows>& experts,
                      int64_t tiles, int64_t K, const Fn& fn) {
  int64_t total = 0, madds = 0;
  for (const ExpertRows& e : experts) {
    total += tiles * (e.rows + kWeightRows);
    madds += tiles * e.rows * K * kTile;
  }
  const int64_t parts = std::clamp<int64_t>(madds >> 16, 1, std::max<int64_t>(
      1, par.num_threads()));
  // a tile goes to the part whose cost range [lo, hi) holds the cost before it
  auto first_tile_from = [tiles](int64_t cost, int64_t per_tile) {
    return cost <= 0 ? 0 : std::min(tiles, (cost + per_tile - 1) / per_tile);
  };
  par.for_range(parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t lo = total * p / parts, hi = total * (p + 1) / parts;
      int64_t start = 0;  // the cost before this expert's tiles
      for (const ExpertRows& e : experts) {
        const int64_t per_tile = e.rows + kWeightRows;
        const int64_t t0 = first_tile_from(lo - start, per_tile);
        const int64_t t1 = first_tile_from(hi - start, per_tile);
        if (t0 < t1) fn(e, t0, t1);
        start += tiles * per_tile;
      }
    }
  });
}

// The call's inputs; the bindings check the shapes (shape_error), then error(), then run().
template <typename index_t>  // topk_ids': int32_t, or int64_t (torch.topk's)
struct MoeExperts {
  int64_t hidden;        // H
  int64_t intermediate;  // I
  int64_t num_experts;   // E
  int64_t top_k;         // k
  const float* x;              // [T, H]
  const index_t* topk_ids;     // [T, k]
  const float* topk_weights;   // [T, k]
  const float* w13;            // [E, ceil(2I / 16), H, 16]
  const float* w2;             // [E, ceil(H / 16), I, 16]

  // What is wrong with the ids of the first `rows` tokens, which run() then trusts ("" if
  // nothing).
  std::string error(const std::string& op, int64_t rows) const {
    for (int64_t p = 0; p < rows * top_k; ++p) {
      if (topk_ids[p] < 0 || topk_ids[p] >= num_experts) {
        return op + ": topk_ids[" + std::to_string(p / top_k) + ", " +
               std::to_string(p % top_k) + "]=" + std::to_string(topk_ids[p]) +
               " is no expert; ids must be in [0, num_experts=" + std::to_string(num_experts) +
               ")";
      }
    }
    return "";
  }

  // y [T, H] for the first `rows` tokens; rows [rows, T) are zeros (a step's padding rows, not
  // computed). The threads are `par`'s (parallel.h).
  template <typename Parallel>
  void run(const Parallel& par, int64_t rows, int64_t num_tokens, float* y) const {
    const int64_t H = hidden, I = intermediate, k = top_k, P = rows * k;
    const int64_t tiles13 = tiles_of(2 * I), tiles2 = tiles_of(H);
    const int64_t ld13 = tiles13 * kTile, ld2 = tiles2 * kTile;
    std::fill(y + rows * H, y + num_tokens * H, 0.f);
    if (P == 0) return;

    // The pairs grouped by expert: pair p = t k + j (token t's j-th choice) is row slot[p] of
    // the grouped block, and row s holds token token_of[s]'s pair; stable (token order within
    // an expert), so a token's rows come in expert order.
    static thread_local std::vector<int64_t> ints;
    ints.assign(num_experts + 2 * P, 0);
    int64_t* const first = ints.data();  // [E]: each expert's first row
    int64_t* const slot = first + num_experts;  // [P]
    int64_t* const token_of = slot + P;  // [P]
    for (int64_t p = 0; p < P; ++p) ++first[topk_ids[p]];
    std::vector<ExpertRows> experts;
    experts.reserve(num_experts);
    for (int64_t e = 0, row = 0; e < num_experts; ++e) {
      const int64_t count = first[e];
      if (count > 0) experts.push_back({e, row, count});
      first[e] = row;
      row += count;
    }
    for (int64_t p = 0; p < P; ++p) {
      const int64_t s = first[topk_ids[p]]++;
      slot[p] = s;
      token_of[s] = p / k;
    }

    // Scratch rows in one buffer kept by the calling thread (as the decoder layer's): the
    // gathered x [P, H], gate_up [P, ld13], act [P, I], the experts' outputs [P, ld2].
    static thread_local std::vector<float> scratch;
    scratch.resize(std::max<size_t>(scratch.size(), P * (H + ld13 + I + ld2)));
    float* const xs = scratch.data();
    float* const gate_up = xs + P * H;
    float* const act = gate_up + P * ld13;
    float* const out = act + P * I;
    auto for_rows = [&](int64_t n, int64_t width, const auto& row_fn) {
      par.for_range(n, cpu_parallel::row_grain(width), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) row_fn(r);
      });
    };

    for_rows(P, H, [&](int64_t s) {
      std::copy(x + token_of[s] * H, x + (token_of[s] + 1) * H, xs + s * H);
    });
    for_expert_tiles(par, experts, tiles13, H, [&](const ExpertRows& e, int64_t t0, int64_t t1) {
      cpu_linear::run_tiles(xs + e.first * H, H, e.rows, w13 + e.expert * tiles13 * H * kTile,
                            H, nullptr, gate_up + e.first * ld13, ld13, t0, t1);
    });
    for_rows(P, I, [&](int64_t s) {
      const float* row = gate_up + s * ld13;
      cpu_norm::silu_and_mul_row(row, row + I, act + s * I, I);
    });
    for_expert_tiles(par, experts, tiles2, I, [&](const ExpertRows& e, int64_t t0, int64_t t1) {
      cpu_linear::run_tiles(act + e.first * I, I, e.rows, w2 + e.expert * tiles2 * I * kTile, I,
                            nullptr, out + e.first * ld2, ld2, t0, t1);
    });
    for_rows(rows, k * H, [&](int64_t t) { combine(t, slot, out, ld2, y + t * H); });
  }

  // y_t [H] = sum over token t's pairs in expert order (their rows' order) of weight * output.
  void combine(int64_t t, const int64_t* slot, const float* out, int64_t ld2, float* y_t) const {
    const int64_t* pairs_slot = slot + t * top_k;
    std::fill(y_t, y_t + hidden, 0.f);
    int64_t last = -1;  // the row added last: add the next larger one
    for (int64_t n = 0; n < top_k; ++n) {
      int64_t j = -1;
      for (int64_t i = 0; i < top_k; ++i) {
        if (pairs_slot[i] > last && (j < 0 || pairs_slot[i] < pairs_slot[j])) j = i;
      }
      last = pairs_slot[j];
      const float w = topk_weights[t * top_k + j];
      const float* o = out + last * ld2;
      for (int64_t h = 0; h < hidden; ++h) y_t[h] += w * o[h];  // rounded product, then the add
    }
  }
};

}  // namespace pagedjax::cpu_moe
