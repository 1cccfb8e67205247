"""How many KV blocks fit: one rule for both backends."""

from __future__ import annotations

from pagedjax.config import EngineConfig, ModelConfig

CPU_KV_CACHE_BYTES = 4 << 30  # host memory the CPU backends may give the KV pool at utilization 1


def num_kv_blocks_for_budget(model_config: ModelConfig, config: EngineConfig,
                             memory_stats: dict | None, *,
                             extra_bytes_per_block: int = 0) -> int:
    """Blocks that fit the memory budget, after weights and a warm-up pass are resident.

    memory_stats: the accelerator's {"bytes_limit", "bytes_in_use"} (None on CPU).
    extra_bytes_per_block: what a speculative draft model's KV adds per block.
    """
    per_block = model_config.kv_bytes_per_block(config.block_size, config.dtype_bytes)
    per_block += extra_bytes_per_block
    if memory_stats is None:
        budget = int(CPU_KV_CACHE_BYTES * config.memory_utilization)
        wanted = config.max_num_seqs * config.max_blocks_per_seq
        num_blocks = min(budget // per_block, wanted)
    else:
        limit, used = memory_stats["bytes_limit"], memory_stats["bytes_in_use"]
        budget = int(limit * config.memory_utilization) - used
        num_blocks = budget // per_block
    if num_blocks < config.max_blocks_per_seq:
        raise ValueError(
            f"the KV pool gets {num_blocks} blocks ({per_block} bytes each, budget {budget} "
            f"bytes) but one sequence of max_model_len={config.max_model_len} needs "
            f"{config.max_blocks_per_seq}; raise memory_utilization or lower max_model_len.")
    return int(num_blocks)
