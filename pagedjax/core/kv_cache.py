"""How many KV blocks fit: one rule for both backends."""

from __future__ import annotations

from pagedjax.config import EngineConfig
from pagedjax.core.batch import ModelInput
from pagedjax.core.batch_reference import build_model_input
from pagedjax.core.scheduler_output import SampleSpec, ScheduledBatch, ScheduledSequence
from pagedjax.core.step_shapes import StepShapes
from pagedjax.sampling_params import MAX_LOGPROBS, SamplingParams

CPU_KV_CACHE_BYTES = 4 << 30  # host memory the CPU backends may give the KV pool at utilization 1


def num_kv_blocks_for_budget(per_block: int, config: EngineConfig,
                             memory_stats: dict | None) -> int:
    """Blocks that fit the memory budget, after weights and a warm-up pass are resident.

    per_block: KV bytes one block takes on a device, every model's (a draft's too) and this
    device's share of the heads under tensor parallelism.
    memory_stats: the accelerator's {"bytes_limit", "bytes_in_use"} (None on CPU), this
    engine's own use, and where known "bytes_free", the device's free bytes (a cap).
    """
    if memory_stats is None:
        budget = int(CPU_KV_CACHE_BYTES * config.gpu_memory_utilization)
        wanted = config.max_num_seqs * config.max_blocks_per_seq
        num_blocks = min(budget // per_block, wanted)
    else:
        limit, used = memory_stats["bytes_limit"], memory_stats["bytes_in_use"]
        budget = int(limit * config.gpu_memory_utilization) - used
        if "bytes_free" in memory_stats:  # others hold the rest of the device
            budget = min(budget, memory_stats["bytes_free"])
        num_blocks = budget // per_block
    if num_blocks < config.max_blocks_per_seq:
        raise ValueError(
            f"the KV pool gets {num_blocks} blocks ({per_block} bytes each, budget {budget} "
            f"bytes) but one sequence of max_model_len={config.max_model_len} needs "
            f"{config.max_blocks_per_seq}; raise gpu_memory_utilization or lower max_model_len.")
    return int(num_blocks)


def warm_up_input(config: EngineConfig, shapes: StepShapes) -> ModelInput:
    """The heaviest step the scheduler can produce: max_num_batched_tokens prompt tokens over up
    to max_num_seqs sequences, every one sampled with filters and top logprobs."""
    block_size = config.block_size
    num_seqs = min(config.max_num_seqs, -(-config.max_num_batched_tokens // block_size))
    q_len = min(-(-config.max_num_batched_tokens // num_seqs), config.max_model_len)
    blocks_per_seq = -(-q_len // block_size)
    params = SamplingParams(temperature=1.0, top_p=0.9, logprobs=MAX_LOGPROBS)
    scheduled = [
        ScheduledSequence(seq_id=s, token_ids=[0] * q_len, start_pos=0,
                          block_table=list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)),
                          samples=[SampleSpec(s, params, rng_seed=0, rng_step=0,
                                              banned_token_ids=[])])
        for s in range(num_seqs)
    ]
    out = ScheduledBatch(scheduled)
    return build_model_input(out, shapes, block_size=block_size)
