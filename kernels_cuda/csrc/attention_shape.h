// The sizes of one ragged paged attention call, shared by the torch ops, the CUDA kernels and
// the JAX FFI handler (no torch or XLA headers).
#pragma once

#include <cstdint>

namespace pagedjax {

// Sizes of one ragged paged attention call, read off validated arguments.
struct AttentionShape {
  int64_t num_tokens;      // T: rows of q (including padding rows)
  int64_t num_q_heads;     // Hq
  int64_t num_kv_heads;    // Hkv; Hq = group * Hkv
  int64_t group;           // query heads per KV head
  int64_t head_dim;        // D
  int64_t num_blocks;      // N: blocks in the cache
  int64_t block_size;      // tokens per block
  int64_t num_seqs;        // S
  int64_t max_blocks;      // M: columns of block_tables
};

}  // namespace pagedjax
