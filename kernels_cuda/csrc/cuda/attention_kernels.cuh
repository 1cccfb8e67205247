// CUDA kernels of ragged paged attention: fp32, bf16 and fp16 inputs, fp32 accumulation (the
// kernels and their launch; the ops in attention_cuda.cu).
//
// One thread block serves one (sequence, query tile, KV head, KV split). A query tile packs kRows
// rows of the sequence's flattened (query token, query head of the GQA group) index, so every K/V
// tile staged in shared memory is read from HBM once for the whole group. Four warps; warp w owns
// the tile rows w, w + 4, ... (interleaved, so a small group still spreads over the warps).
// Per 32-key tile (lane j <-> key j): Q.K^T (K rows by 16-byte shared loads, Q rows pre-widened to
// fp32 and broadcast), soft cap, causal / sliding-window mask, online softmax, then P.V with each
// lane owning the output columns lane, lane + 32, ... The math runs on CUDA cores (fp32 FMA, no
// tensor-core MMA). K/V tiles are double-buffered with 16-byte cp.async copies, zero-filled past
// the last key the tile can see, so unwritten cache slots are never read.
//   decode path:      kRows = 8, when max_query_len == 1 or max_query_len * G <= 8.
//   multi-token path: kRows = 64 (32 for head_dim 256) otherwise.
// Split-K: when the grid has too few blocks to fill the GPU, each tile's KV range is split over
// blockIdx.z; splits write normalised fp32 partial outputs plus their log-sum-exp, and
// merge_splits_kernel combines them. Padding rows are zeroed by the blocks of grid row y = S.
// Fused decode (decode_attention_with_kv_write_out, attention_impl="cuda_fused"): one launch stores
// a decode step's new K/V and attends, in place of write_kv's kernel and this one. The block whose
// key range holds a sequence's last key (its new token) stores it before staging any tile; the
// barrier orders that store before its own copies of the tile, and no other block reads the slot.
// FP8 KV cache (kv_cache_dtype="fp8"): float8_e4m3fn caches are staged in shared memory as bytes
// (16 keys' elements per cp.async vector) and widened to fp32 where read; k_scale is folded into
// sm_scale and v_scale into the final normalisation, so no element is scaled.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../attention.h"
#include "cuda_utils.h"

namespace pagedjax {
namespace attention_impl {

constexpr int kNumWarps = 4;
constexpr int kThreads = kWarpSize * kNumWarps;
constexpr int kKeyTile = 32;     // keys per tile: lane j computes the logit of key j
constexpr int kMaxSplits = 32;   // the merge kernel keeps one split per lane
constexpr int kDecodeRows = 8;   // rows per tile on the decode path

using fp8_t = __nv_fp8_e4m3;  // an FP8 KV cache's element (torch.float8_e4m3fn)

// cache_t: the caches' element, scalar_t or fp8_t.
template <typename scalar_t, typename cache_t = scalar_t>
struct AttentionParams {
  const scalar_t* __restrict__ q;  // [T, Hq, D], strided over T and Hq
  int64_t q_stride_token, q_stride_head;
  const cache_t* __restrict__ k_cache;      // [N, Hkv, bs, D]
  const cache_t* __restrict__ v_cache;      // [N, Hkv, bs, D]
  const int* __restrict__ kv_lens;          // [S]
  const int* __restrict__ block_tables;     // [S, M]
  const int* __restrict__ query_start_loc;  // [S+1]
  scalar_t* __restrict__ out;               // [T, Hq, D]
  float* __restrict__ partial_out;          // [splits, T, Hq, D], only when num_splits > 1
  float* __restrict__ partial_lse;          // [splits, T, Hq], only when num_splits > 1
  int num_tokens, num_seqs, num_q_heads, num_kv_heads, group, head_dim;
  int block_size, max_blocks, num_splits;
  float sm_scale;       // times an fp8 cache's k_scale (keys are code * k_scale)
  float v_scale;        // an fp8 cache's (values are code * v_scale); 1 otherwise
  float soft_cap;      // scores soft_cap * tanh(s / soft_cap); 0: none
  int sliding_window;  // 0: none
  // Fused decode only (null otherwise): this step's keys and values [T, Hkv, D] (one stride
  // pair for both), stored in their slots (-1: none) as write_kv stores them.
  const scalar_t* k_new;
  const scalar_t* v_new;
  int64_t new_stride_token, new_stride_head;
  const int* slot_mapping;  // [T]
  cache_t* k_cache_out;     // k_cache, written
  cache_t* v_cache_out;
  float k_store_scale, v_store_scale;  // an fp8 cache stores x / scale; 1 otherwise
};

// Compile-time tile geometry and the shared-memory layout of one thread block.
template <typename scalar_t, typename cache_t, int HeadDim, int Rows>
struct TileConfig {
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kRows = Rows;                     // query rows per tile
  static constexpr int kVec = 16 / sizeof(scalar_t);    // q elements per 16-byte vector
  static constexpr int kChunks = kHeadDim / kVec;        // 16-byte vectors per q head row
  static constexpr int kKvVec = 16 / sizeof(cache_t);   // K/V elements per 16-byte vector
  static constexpr int kKvChunks = kHeadDim / kKvVec;    // 16-byte vectors per K/V head row
  static constexpr int kKvStride = kHeadDim + kKvVec;    // padded K/V row, in elements
  static constexpr int kRowsPerWarp = kRows / kNumWarps;
  static constexpr int kCols = ceil_div(kHeadDim, kWarpSize);  // output columns per lane
  // Shared memory: q [kRows, D] fp32 (widened once, read by every key tile) |
  // k [2, 32, kKvStride] | v [2, 32, kKvStride] (double-buffered, input dtype) | p [kRows, 32].
  static constexpr int kKvTileElems = kKeyTile * kKvStride;
  static constexpr size_t kQBytes = size_t(kRows) * kHeadDim * sizeof(float);
  static constexpr size_t kKvBytes = 4 * size_t(kKvTileElems) * sizeof(cache_t);
  static constexpr size_t kSmemBytes = kQBytes + kKvBytes + kRows * kKeyTile * sizeof(float);
  static_assert(kHeadDim % kVec == 0 && kHeadDim % kKvVec == 0 && kRows % kNumWarps == 0);
  // An odd number of 16-byte vectors per padded row makes the 8 lanes of each phase of a
  // 128-bit shared load (lane j reads row j) hit distinct bank groups. fp8 rows are read a few
  // bytes at a time, so their padding only keeps the 16-byte alignment of cp.async.
  static_assert(sizeof(cache_t) == 1 || kKvChunks % 2 == 0,
                "padded K rows must span an odd number of 16-byte vectors");
};

// kN consecutive cached elements (kN * sizeof(cache_t) bytes, that aligned) widened to fp32: one
// 16-byte load when they are scalar_t, else fp8 codes converted one by one.
template <int kN, typename cache_t>
__device__ __forceinline__ void load_kv_floats(const cache_t* src, float (&dst)[kN]) {
  if constexpr (std::is_same_v<cache_t, fp8_t>) {
#pragma unroll
    for (int i = 0; i < kN; ++i) dst[i] = static_cast<float>(src[i]);
  } else {
    load_floats(src, dst);
  }
}

// The query rows and the keys one thread block works on.
struct TileRange {
  int q_start;    // row of q holding the sequence's first query token
  int context;    // kv_len - q_len: position of the sequence's first query token
  int row_begin;  // first flattened (token, group member) row of the tile
  int num_rows;   // rows in this tile, <= kRows
  int key_begin;  // first key of this split (a multiple of kKeyTile)
  int key_end;    // one past the last key any row of the tile sees
  int num_key_tiles;
};

// Returns false when the block has no rows (its tile lies past the sequence's queries).
template <typename Params>
__device__ bool tile_range(const Params& p, int rows_per_tile, int split, TileRange& r) {
  const int seq = blockIdx.y;
  r.q_start = p.query_start_loc[seq];
  const int q_len = p.query_start_loc[seq + 1] - r.q_start;
  r.row_begin = blockIdx.x * rows_per_tile;
  r.num_rows = min(rows_per_tile, q_len * p.group - r.row_begin);
  if (r.num_rows <= 0) return false;
  r.context = p.kv_lens[seq] - q_len;
  const int first_pos = r.context + r.row_begin / p.group;
  r.key_end = r.context + (r.row_begin + r.num_rows - 1) / p.group + 1;
  const int lo = p.sliding_window > 0 ? max(0, first_pos - p.sliding_window + 1) : 0;
  const int first_tile_key = lo - lo % kKeyTile;
  const int total_tiles = ceil_div(r.key_end - first_tile_key, kKeyTile);
  const int tiles_per_split = ceil_div(total_tiles, p.num_splits);
  const int tile_begin = min(split * tiles_per_split, total_tiles);
  r.num_key_tiles = min(tile_begin + tiles_per_split, total_tiles) - tile_begin;
  r.key_begin = first_tile_key + tile_begin * kKeyTile;
  return true;
}

// Stages the tile's query rows in fp32, q_s: [kRows, D]; rows past num_rows are zeros.
template <typename Cfg, typename Params>
__device__ void load_q_tile(const Params& p, const TileRange& r, int kv_head, float* q_s) {
  for (int i = threadIdx.x; i < Cfg::kRows * Cfg::kChunks; i += kThreads) {
    const int row = i / Cfg::kChunks, chunk = i % Cfg::kChunks;
    float values[Cfg::kVec] = {};
    if (row < r.num_rows) {
      const int flat = r.row_begin + row;
      const int64_t token = r.q_start + flat / p.group;
      const int head = kv_head * p.group + flat % p.group;
      load_floats(p.q + token * p.q_stride_token + head * p.q_stride_head + chunk * Cfg::kVec,
                  values);
    }
    float4* dst = reinterpret_cast<float4*>(q_s + row * Cfg::kHeadDim + chunk * Cfg::kVec);
#pragma unroll
    for (int e = 0; e < Cfg::kVec / 4; ++e) {
      dst[e] = make_float4(values[4 * e], values[4 * e + 1], values[4 * e + 2], values[4 * e + 3]);
    }
  }
}

// Stages keys/values [key0, key0 + 32) of one KV head: [32, kKvStride] each; keys at or past
// key_end (never visible, maybe not even allocated) are zero-filled.
template <typename Cfg, typename Params, typename cache_t>
__device__ void load_kv_tile(const Params& p, const TileRange& r, int kv_head, int key0,
                             cache_t* k_s, cache_t* v_s) {
  const int* block_table = p.block_tables + int64_t(blockIdx.y) * p.max_blocks;
  for (int i = threadIdx.x; i < kKeyTile * Cfg::kKvChunks; i += kThreads) {
    const int j = i / Cfg::kKvChunks, chunk = i % Cfg::kKvChunks;
    const int key = key0 + j;
    const bool valid = key < r.key_end;
    int64_t offset = 0;
    if (valid) {
      const int64_t block = block_table[key / p.block_size];
      offset = ((block * p.num_kv_heads + kv_head) * p.block_size + key % p.block_size) *
                   p.head_dim + chunk * Cfg::kKvVec;
    }
    const int dst = j * Cfg::kKvStride + chunk * Cfg::kKvVec;
    cp_async_16(k_s + dst, p.k_cache + offset, valid);
    cp_async_16(v_s + dst, p.v_cache + offset, valid);
  }
}

// Online-softmax state of the rows one warp owns (every lane holds the same m and l).
template <typename Cfg>
struct WarpRows {
  int pos[Cfg::kRowsPerWarp];  // absolute position of each row; -1: no row
  float m[Cfg::kRowsPerWarp];  // running max of the logits
  float l[Cfg::kRowsPerWarp];  // running sum of exp(logit - m)
  float acc[Cfg::kRowsPerWarp][Cfg::kCols];  // unnormalised output, column lane + 32 * c

  __device__ explicit WarpRows(const TileRange& r, int group) {
    const int warp = threadIdx.x / kWarpSize;
#pragma unroll
    for (int i = 0; i < Cfg::kRowsPerWarp; ++i) {
      const int row = warp + i * kNumWarps;
      pos[i] = row < r.num_rows ? r.context + (r.row_begin + row) / group : -1;
      m[i] = -INFINITY;
      l[i] = 0.f;
#pragma unroll
      for (int c = 0; c < Cfg::kCols; ++c) acc[i][c] = 0.f;
    }
  }

  // One key tile: logits for key key0 + lane, online-softmax update, then P.V. p_warp: [rows, 32].
  template <typename Params, typename cache_t>
  __device__ void attend(const Params& p, const float* q_s, const cache_t* k_s,
                         const cache_t* v_s, float* p_warp, int key0) {
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    float logit[Cfg::kRowsPerWarp] = {};
#pragma unroll 2
    for (int chunk = 0; chunk < Cfg::kChunks; ++chunk) {
      float k[Cfg::kVec];
      load_kv_floats(k_s + lane * Cfg::kKvStride + chunk * Cfg::kVec, k);
#pragma unroll
      for (int i = 0; i < Cfg::kRowsPerWarp; ++i) {
        // A broadcast read: the whole warp reads the same query row.
        const float4* q = reinterpret_cast<const float4*>(
            q_s + (warp + i * kNumWarps) * Cfg::kHeadDim + chunk * Cfg::kVec);
#pragma unroll
        for (int e = 0; e < Cfg::kVec / 4; ++e) {
          const float4 qe = q[e];
          logit[i] = fmaf(qe.x, k[4 * e], fmaf(qe.y, k[4 * e + 1],
                     fmaf(qe.z, k[4 * e + 2], fmaf(qe.w, k[4 * e + 3], logit[i]))));
        }
      }
    }
    const int key = key0 + lane;
#pragma unroll
    for (int i = 0; i < Cfg::kRowsPerWarp; ++i) {
      float s = logit[i] * p.sm_scale;
      // Uniform over the grid, so no divergence; a template flag would double the instances.
      if (p.soft_cap > 0.f) s = p.soft_cap * tanhf(s / p.soft_cap);
      const bool visible =
          key <= pos[i] && (p.sliding_window == 0 || pos[i] - key < p.sliding_window);
      const float m_new = fmaxf(m[i], warp_max(visible ? s : -INFINITY));
      const float prob = visible ? expf(s - m_new) : 0.f;
      const float alpha = m[i] == -INFINITY ? 0.f : expf(m[i] - m_new);  // no inf - inf
      l[i] = l[i] * alpha + warp_sum(prob);
      m[i] = m_new;
#pragma unroll
      for (int c = 0; c < Cfg::kCols; ++c) acc[i][c] *= alpha;
      p_warp[i * kKeyTile + lane] = prob;
    }
    __syncwarp();
    accumulate_values(v_s, p_warp);
    __syncwarp();  // p_warp is rewritten by the next tile
  }

  // acc[i] += sum_j p[i, j] * v[j]; four keys per 128-bit read of p.
  template <typename cache_t>
  __device__ void accumulate_values(const cache_t* v_s, const float* p_warp) {
    const int lane = threadIdx.x % kWarpSize;
#pragma unroll 2
    for (int j = 0; j < kKeyTile; j += 4) {
      float v[4][Cfg::kCols];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
        for (int c = 0; c < Cfg::kCols; ++c) {
          const int d = lane + c * kWarpSize;
          v[jj][c] = d < Cfg::kHeadDim
                         ? static_cast<float>(v_s[(j + jj) * Cfg::kKvStride + d]) : 0.f;
        }
      }
#pragma unroll
      for (int i = 0; i < Cfg::kRowsPerWarp; ++i) {
        const float4 pj = *reinterpret_cast<const float4*>(p_warp + i * kKeyTile + j);
#pragma unroll
        for (int c = 0; c < Cfg::kCols; ++c) {
          acc[i][c] = fmaf(pj.x, v[0][c], fmaf(pj.y, v[1][c],
                      fmaf(pj.z, v[2][c], fmaf(pj.w, v[3][c], acc[i][c]))));
        }
      }
    }
  }

  // Final rows to out, or (split-K) normalised partial rows and their log-sum-exp.
  template <typename scalar_t, typename cache_t>
  __device__ void store(const AttentionParams<scalar_t, cache_t>& p, const TileRange& r,
                        int kv_head, int split) const {
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
#pragma unroll
    for (int i = 0; i < Cfg::kRowsPerWarp; ++i) {
      if (pos[i] < 0) continue;
      const int flat = r.row_begin + warp + i * kNumWarps;
      const int64_t row = (int64_t(r.q_start) + flat / p.group) * p.num_q_heads +
                          kv_head * p.group + flat % p.group;  // (token, q head)
      const float inv_l = l[i] > 0.f ? p.v_scale / l[i] : 0.f;  // v_scale 1: 1 / l exactly
      const int64_t split_row = int64_t(split) * p.num_tokens * p.num_q_heads + row;
#pragma unroll
      for (int c = 0; c < Cfg::kCols; ++c) {
        const int d = lane + c * kWarpSize;
        if (d >= Cfg::kHeadDim) continue;
        if (p.num_splits == 1) {
          p.out[row * p.head_dim + d] = static_cast<scalar_t>(acc[i][c] * inv_l);
        } else {
          p.partial_out[split_row * p.head_dim + d] = acc[i][c] * inv_l;
        }
      }
      if (p.num_splits > 1 && lane == 0) {
        p.partial_lse[split_row] = l[i] > 0.f ? m[i] + logf(l[i]) : -INFINITY;
      }
    }
  }
};

// Padding rows [query_start_loc[S], T) become zeros, shared by the blocks of grid row y = S.
template <typename scalar_t, typename cache_t, int kHeadDim>
__device__ void zero_padding_rows(const AttentionParams<scalar_t, cache_t>& p) {
  constexpr int kVec = 16 / sizeof(scalar_t);
  const int64_t vecs_per_row = int64_t(p.num_q_heads) * kHeadDim / kVec;
  const int64_t begin = p.query_start_loc[p.num_seqs] * vecs_per_row;
  const int64_t end = int64_t(p.num_tokens) * vecs_per_row;
  const int64_t block = blockIdx.z * int64_t(gridDim.x) + blockIdx.x;
  uint4* out = reinterpret_cast<uint4*>(p.out);
  for (int64_t i = begin + block * kThreads + threadIdx.x; i < end;
       i += int64_t(gridDim.x) * gridDim.z * kThreads) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

// Fused decode: the block whose keys hold its sequence's last one (the new token's, key_end - 1)
// stores the token's K and V of this KV head in their slot, then waits for every thread, so that
// the tile copies that follow read them. Block-uniform: every return comes before the barrier.
template <typename scalar_t, typename cache_t>
__device__ void store_new_kv(const AttentionParams<scalar_t, cache_t>& p, const TileRange& r,
                             int kv_head) {
  const int last_key = r.key_end - 1;
  if (r.num_key_tiles == 0 || last_key < r.key_begin ||
      last_key >= r.key_begin + r.num_key_tiles * kKeyTile) {
    return;
  }
  const int slot = p.slot_mapping[r.q_start];
  if (slot >= 0) {
    const int64_t dst =
        ((int64_t(slot / p.block_size) * p.num_kv_heads + kv_head) * p.block_size +
         slot % p.block_size) * p.head_dim;
    const int64_t src = r.q_start * p.new_stride_token + kv_head * p.new_stride_head;
    for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
      const float key = static_cast<float>(p.k_new[src + d]);
      const float value = static_cast<float>(p.v_new[src + d]);
      if constexpr (std::is_same_v<cache_t, fp8_t>) {  // write_kv's rounding and saturation
        p.k_cache_out[dst + d] = fp8_t(key / p.k_store_scale);
        p.v_cache_out[dst + d] = fp8_t(value / p.v_store_scale);
      } else {  // exact: the model dtype through float and back
        p.k_cache_out[dst + d] = static_cast<cache_t>(key);
        p.v_cache_out[dst + d] = static_cast<cache_t>(value);
      }
    }
  }
  __syncthreads();
}

// grid: (query tiles, S + 1, Hkv * splits); block: kThreads.
template <typename scalar_t, typename cache_t, int kHeadDim, int kRows>
__global__ void __launch_bounds__(kThreads)
    ragged_paged_attention_kernel(const AttentionParams<scalar_t, cache_t> p) {
  using Cfg = TileConfig<scalar_t, cache_t, kHeadDim, kRows>;
  if (blockIdx.y == p.num_seqs) return zero_padding_rows<scalar_t, cache_t, kHeadDim>(p);
  const int kv_head = blockIdx.z / p.num_splits, split = blockIdx.z % p.num_splits;
  TileRange r;
  if (!tile_range(p, kRows, split, r)) return;
  if (p.slot_mapping != nullptr) store_new_kv(p, r, kv_head);

  extern __shared__ __align__(16) unsigned char smem[];
  float* q_s = reinterpret_cast<float*>(smem);                         // [kRows, D]
  cache_t* k_s = reinterpret_cast<cache_t*>(smem + Cfg::kQBytes);      // [2, 32, kKvStride]
  cache_t* v_s = k_s + 2 * Cfg::kKvTileElems;                         // [2, 32, kKvStride]
  float* p_warp = reinterpret_cast<float*>(v_s + 2 * Cfg::kKvTileElems) +
                  (threadIdx.x / kWarpSize) * Cfg::kRowsPerWarp * kKeyTile;  // [rows, 32]

  if (r.num_key_tiles > 0) load_kv_tile<Cfg>(p, r, kv_head, r.key_begin, k_s, v_s);
  cp_async_commit();
  load_q_tile<Cfg>(p, r, kv_head, q_s);  // overlaps the first K/V tile's copy
  WarpRows<Cfg> rows(r, p.group);
  const bool warp_has_rows = rows.pos[0] >= 0;  // warp-uniform
  for (int tile = 0; tile < r.num_key_tiles; ++tile) {
    const int stage = tile % 2, next = 1 - stage;
    if (tile + 1 < r.num_key_tiles) {
      load_kv_tile<Cfg>(p, r, kv_head, r.key_begin + (tile + 1) * kKeyTile,
                        k_s + next * Cfg::kKvTileElems, v_s + next * Cfg::kKvTileElems);
    }
    cp_async_commit();  // possibly empty, so that wait<1> below always means "tile is ready"
    cp_async_wait<1>();
    __syncthreads();
    if (warp_has_rows) {
      rows.attend(p, q_s, k_s + stage * Cfg::kKvTileElems, v_s + stage * Cfg::kKvTileElems,
                  p_warp, r.key_begin + tile * kKeyTile);
    }
    __syncthreads();  // the stage read here is refilled by the next iteration
  }
  cp_async_wait<0>();
  rows.store(p, r, kv_head, split);
}

// out[t, h] = sum_i exp(lse_i - lse_max) * partial_i / sum_i exp(lse_i - lse_max); one warp per
// (token, q head) row. grid: ceil(T * Hq / kNumWarps); block: kThreads.
template <typename scalar_t, typename cache_t>
__global__ void __launch_bounds__(kThreads)
    merge_splits_kernel(const AttentionParams<scalar_t, cache_t> p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = int64_t(blockIdx.x) * kNumWarps + threadIdx.x / kWarpSize;
  if (row >= int64_t(p.query_start_loc[p.num_seqs]) * p.num_q_heads) return;  // padding rows
  const int64_t split_stride = int64_t(p.num_tokens) * p.num_q_heads;
  const float lse = lane < p.num_splits ? p.partial_lse[lane * split_stride + row] : -INFINITY;
  const float lse_max = warp_max(lse);
  const float weight = lse == -INFINITY ? 0.f : expf(lse - lse_max);
  const float total = warp_sum(weight);
  const float inv_total = total > 0.f ? 1.f / total : 0.f;
  for (int d0 = 0; d0 < p.head_dim; d0 += kWarpSize) {  // warp-uniform trip count
    const int d = d0 + lane;
    float value = 0.f;
    for (int i = 0; i < p.num_splits; ++i) {
      const float w = __shfl_sync(kFullMask, weight, i);
      if (d < p.head_dim) value += w * p.partial_out[(i * split_stride + row) * p.head_dim + d];
    }
    if (d < p.head_dim) p.out[row * p.head_dim + d] = static_cast<scalar_t>(value * inv_total);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

inline void check_cuda_attention_args(const AttentionShape& shape, const at::Tensor& out,
                               const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache) {
  const char* op = "ragged_paged_attention (CUDA)";
  const int64_t vec = 16 / q.element_size();
  TORCH_CHECK(aligned_16(q) && aligned_16(out) && aligned_16(k_cache) && aligned_16(v_cache),
              op, ": q, out, k_cache and v_cache must be 16-byte aligned");
  TORCH_CHECK(q.stride(0) % vec == 0 && q.stride(1) % vec == 0, op,
              ": q's strides must be multiples of ", vec, " elements, got ", q.strides(),
              " (call .contiguous())");
  TORCH_CHECK(shape.num_seqs < 65535, op, ": at most 65534 sequences per call, got ",
              shape.num_seqs);
  TORCH_CHECK(shape.num_tokens * shape.num_q_heads < INT32_MAX, op, ": too many query rows");
}

// Split-K only when the grid leaves SMs idle: up to ~2 blocks per SM, >= 256 keys per split.
// max_context is the block-table capacity, so short contexts may get empty (cheap) splits.
inline int choose_num_splits(int64_t num_blocks, int64_t max_context, int num_sms) {
  constexpr int64_t kMinKeysPerSplit = 256;
  if (num_blocks == 0 || num_blocks >= num_sms) return 1;
  const int64_t splits = std::min({ceil_div(2 * num_sms, num_blocks),
                                   max_context / kMinKeysPerSplit, int64_t(kMaxSplits)});
  return static_cast<int>(std::max<int64_t>(splits, 1));
}

template <typename scalar_t, typename cache_t, int kHeadDim, int kRows>
void launch_attention(AttentionParams<scalar_t, cache_t> params, const AttentionShape& shape,
                      int64_t max_query_len, const at::Tensor& q) {
  using Cfg = TileConfig<scalar_t, cache_t, kHeadDim, kRows>;
  const int num_sms = device_attribute(cudaDevAttrMultiProcessorCount);
  const int max_smem = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  const int64_t q_tiles = std::max<int64_t>(1, ceil_div(max_query_len * shape.group, kRows));
  params.num_splits = choose_num_splits(q_tiles * shape.num_seqs * shape.num_kv_heads,
                                        shape.max_blocks * shape.block_size,
                                        num_sms);
  at::Tensor partial_out, partial_lse;  // fp32 split-K workspaces
  if (params.num_splits > 1) {
    const auto options = q.options().dtype(at::kFloat);
    partial_out = at::empty({params.num_splits, shape.num_tokens, shape.num_q_heads,
                             shape.head_dim}, options);
    partial_lse = at::empty({params.num_splits, shape.num_tokens, shape.num_q_heads}, options);
    params.partial_out = partial_out.mutable_data_ptr<float>();
    params.partial_lse = partial_lse.mutable_data_ptr<float>();
  }
  TORCH_CHECK(Cfg::kSmemBytes <= size_t(max_smem), "ragged_paged_attention (CUDA): needs ",
              Cfg::kSmemBytes, " bytes of shared memory per block, the device has ", max_smem);
  auto* kernel = &ragged_paged_attention_kernel<scalar_t, cache_t, kHeadDim, kRows>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(Cfg::kSmemBytes)));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(q_tiles, shape.num_seqs + 1, shape.num_kv_heads * params.num_splits);
  kernel<<<grid, kThreads, Cfg::kSmemBytes, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (params.num_splits > 1) {
    const int64_t merge_blocks = ceil_div(shape.num_tokens * shape.num_q_heads, kNumWarps);
    merge_splits_kernel<scalar_t, cache_t><<<merge_blocks, kThreads, 0, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// A fused decode step's keys and values [T, Hkv, D] and their slots [T] int32.
struct NewKV {
  const at::Tensor& k;
  const at::Tensor& v;
  const at::Tensor& slot_mapping;
};

template <typename scalar_t, typename cache_t>
void run_attention(const AttentionShape& shape, const at::Tensor& out, const at::Tensor& q,
                   const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& kv_lens, const at::Tensor& block_tables,
                   const at::Tensor& query_start_loc, double sm_scale,
                   std::optional<int64_t> sliding_window, std::optional<double> soft_cap,
                   int64_t max_query_len, double k_scale, double v_scale,
                   const NewKV* new_kv = nullptr) {
  AttentionParams<scalar_t, cache_t> params{};
  if (new_kv != nullptr) {  // fused decode: the kernel stores them (store_new_kv)
    params.k_new = new_kv->k.const_data_ptr<scalar_t>();
    params.v_new = new_kv->v.const_data_ptr<scalar_t>();
    params.new_stride_token = new_kv->k.stride(0);
    params.new_stride_head = new_kv->k.stride(1);
    params.slot_mapping = new_kv->slot_mapping.const_data_ptr<int>();
    params.k_cache_out = static_cast<cache_t*>(k_cache.mutable_data_ptr());
    params.v_cache_out = static_cast<cache_t*>(v_cache.mutable_data_ptr());
    params.k_store_scale = static_cast<float>(k_scale);
    params.v_store_scale = static_cast<float>(v_scale);
  }
  params.q = q.const_data_ptr<scalar_t>();
  params.q_stride_token = q.stride(0);
  params.q_stride_head = q.stride(1);
  params.k_cache = static_cast<const cache_t*>(k_cache.const_data_ptr());
  params.v_cache = static_cast<const cache_t*>(v_cache.const_data_ptr());
  params.kv_lens = kv_lens.const_data_ptr<int>();
  params.block_tables = block_tables.const_data_ptr<int>();
  params.query_start_loc = query_start_loc.const_data_ptr<int>();
  params.out = out.mutable_data_ptr<scalar_t>();
  params.num_tokens = shape.num_tokens;
  params.num_seqs = shape.num_seqs;
  params.num_q_heads = shape.num_q_heads;
  params.num_kv_heads = shape.num_kv_heads;
  params.group = shape.group;
  params.head_dim = shape.head_dim;
  params.block_size = shape.block_size;
  params.max_blocks = shape.max_blocks;
  params.sm_scale = static_cast<float>(sm_scale * k_scale);  // k_scale 1: sm_scale exactly
  params.v_scale = static_cast<float>(v_scale);
  params.soft_cap = static_cast<float>(soft_cap.value_or(0.0));
  params.sliding_window = static_cast<int>(sliding_window.value_or(0));
  dispatch_head_dim(shape.head_dim, [&](auto head_dim) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    constexpr int kMultiTokenRows = kHeadDim <= 128 ? 64 : 32;  // bounds registers and smem
    if (max_query_len == 1 || max_query_len * shape.group <= kDecodeRows) {
      launch_attention<scalar_t, cache_t, kHeadDim, kDecodeRows>(params, shape, max_query_len,
                                                                 q);
    } else {
      launch_attention<scalar_t, cache_t, kHeadDim, kMultiTokenRows>(params, shape,
                                                                     max_query_len, q);
    }
  });
}

// The explicit instantiations of run_attention, one file per input dtype (attention_f32.cu,
// attention_f16.cu, attention_bf16.cu: compiled in parallel, where one file took ~80 s of
// nvcc for sm_90a alone); the ops (attention_cuda.cu) declare them extern.
#define PAGEDJAX_RUN_ATTENTION(scalar_t, cache_t)                                            \
  template void run_attention<scalar_t, cache_t>(                                              \
      const AttentionShape&, const at::Tensor&, const at::Tensor&, const at::Tensor&,          \
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,      \
      std::optional<int64_t>, std::optional<double>, int64_t, double, double, const NewKV*);

}  // namespace attention_impl
}  // namespace pagedjax
