"""Tensor parallelism, decided once for both backends: how a model splits over N devices.

Megatron-style: attention heads and MLP columns split (column-parallel q/k/v and gate/up, row-
parallel o and down, one all-reduce after each of the latter), the LM head split by vocabulary when
it divides. A mixture of experts splits each expert as a dense MLP (every device holds its share of
every expert's intermediate columns; the router is whole), so its tokens never leave their device.
KV heads split too; when there are fewer KV heads than devices, each is stored N / num_kv_heads
times so every device holds the KV heads its query heads read (vLLM's rule): KV memory per device
then stays that of one KV head, at N / num_kv_heads times the total. The scheduler and block
manager are unchanged: every device holds every block, for its heads.

This is the one place that says which weight splits how (LINEAR_SPLITS); each backend lays it
out its own way: JAX as partition specs (backends/jax/parallel.py), torch by cutting each rank's
share of the checkpoint (backends/torch/params.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedjax.config import ModelConfig

# Which axis of a canonical linear weight ([out, in], backends/common/weights.py) a plan splits:
# COLUMN-parallel layers split their outputs (heads, MLP columns; their bias too), ROW-parallel
# ones their inputs, and an all-reduce sums the partial outputs of the latter. The LM head
# splits by vocabulary (its outputs) where plan.split_vocab says.
COLUMN, ROW = 0, 1
LINEAR_SPLITS: dict[str, int] = {
    "q_proj": COLUMN, "k_proj": COLUMN, "v_proj": COLUMN, "o_proj": ROW,
    "gate_proj": COLUMN, "up_proj": COLUMN, "down_proj": ROW, "lm_head": COLUMN,
}


@dataclass(frozen=True)
class TensorParallelPlan:
    size: int  # devices
    kv_replicas: int = 1  # copies of each KV head (size / num_kv_heads when that is > 1)
    shard_heads: bool = True  # False: the whole model is replicated (a draft too small to split)
    split_vocab: bool = True  # the LM head is column-split by vocabulary

    @classmethod
    def for_model(cls, model_config: ModelConfig, size: int, *,
                  replicate_if_indivisible: bool = False) -> TensorParallelPlan:
        """The plan for `size` devices; a model whose shapes do not divide is a ValueError (or,
        with replicate_if_indivisible, replicated whole)."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size={size!r} must be an integer >= 1.")
        problem = _indivisible(model_config, size)
        if problem is None:
            hkv = model_config.num_kv_heads
            return cls(size, kv_replicas=max(1, size // hkv),
                       split_vocab=model_config.vocab_size % size == 0)
        if replicate_if_indivisible:
            return cls(size, shard_heads=False, split_vocab=False)
        raise ValueError(f"tensor_parallel_size={size} does not split this model: {problem}; "
                         f"use a size that divides num_attention_heads="
                         f"{model_config.num_q_heads}.")

    @classmethod
    def for_draft(cls, draft_model_config: ModelConfig, size: int,
                  draft_tensor_parallel_size: int | None) -> TensorParallelPlan:
        """A draft is split like the target (replicated when it does not divide), or replicated
        on every device with draft_tensor_parallel_size=1 (no all-reduce in its k passes)."""
        if size > 1 and draft_tensor_parallel_size == 1:
            return cls(size, shard_heads=False, split_vocab=False)
        return cls.for_model(draft_model_config, size, replicate_if_indivisible=True)

    def shard_config(self, model_config: ModelConfig) -> ModelConfig:
        """The model as the devices hold it: KV heads repeated kv_replicas times."""
        return dataclasses.replace(model_config,
                                   num_kv_heads=model_config.num_kv_heads * self.kv_replicas)

    def kv_bytes_per_block(self, model_config: ModelConfig, block_size: int,
                           dtype_bytes: int) -> int:
        """KV bytes one block takes on each device (its share of the heads)."""
        total = self.shard_config(model_config).kv_bytes_per_block(block_size, dtype_bytes)
        return total // self.size if self.shard_heads else total

    def all_reduce_bytes_per_layer(self, num_tokens: int, hidden_size: int,
                                   dtype_bytes: int) -> int:
        """Payload all-reduced per decoder layer for num_tokens tokens: the row-parallel
        outputs of o_proj and down_proj, [T, H] each (0 on one device or when replicated)."""
        if self.size == 1 or not self.shard_heads:
            return 0
        return 2 * num_tokens * hidden_size * dtype_bytes


def _indivisible(config: ModelConfig, size: int) -> str | None:
    hq, hkv, inter = config.num_q_heads, config.num_kv_heads, config.intermediate_size
    if hq % size:
        return f"num_attention_heads={hq} is not a multiple of {size}"
    if hkv % size and size % hkv:
        return f"num_key_value_heads={hkv} neither divides nor is a multiple of {size}"
    if inter % size:
        return f"intermediate_size={inter} is not a multiple of {size}"
    if config.num_experts and config.moe_intermediate_size % size:
        return f"moe_intermediate_size={config.moe_intermediate_size} is not a multiple of {size}"
    return None
