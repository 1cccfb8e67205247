"""Loading and layout: a checkpoint's canonical weights (backends/common/weights.py) → this
rank's shard of the torch module tree (q/k/v and gate/up fused, linear weights [in, out]), and
DeviceModel: one model on this rank's device, as a runner holds it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

from pagedjax.backends.common.attention_metadata import AttentionMetadata
from pagedjax.backends.common.kv_cache_scales import kv_cache_scales
from pagedjax.backends.common.rope import rope_cos_sin
from pagedjax.backends.common.weight_quantizer import WeightQuantizer
from pagedjax.backends.common.weights import layer_norm_names, load_weights, repeat_kv_heads
from pagedjax.backends.torch.attention import resolve_attention, uses_cpu_linear
from pagedjax.backends.torch.model import KVCache, LayerOps, LlamaForCausalLM
from pagedjax.backends.torch.parallel import Shard
from pagedjax.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class DeviceModel:
    """One model on this rank's device: its shard, rope tables and KV caches."""

    module: LlamaForCausalLM
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin: [max_model_len, D]
    config: ModelConfig  # as the devices hold it (KV heads repeated under tensor parallelism)
    shard: Shard
    kv_caches: list[KVCache]  # views of kv_pool: (K, V) per layer, [N, Hkv, bs, D] each
    kv_pool: torch.Tensor | None = None  # [num_layers, 2, N, Hkv, bs, D]
    kv_cache_dtype: torch.dtype | None = None  # None: the weights' dtype; else float8_e4m3fn

    @classmethod
    def load(cls, model_dir: str, model_config: ModelConfig, config: EngineConfig,
             device: torch.device, shard: Shard) -> DeviceModel:
        shard_config = shard.plan.shard_config(model_config)
        dtype = getattr(torch, config.dtype)
        module = load_model(model_dir, shard_config, dtype, device,
                            resolve_attention(config.attention_impl), shard=shard)
        if config.quantization == "fp8":
            module.keep_fp8(pack_rest=uses_cpu_linear(config.attention_impl, device, dtype))
        elif config.quantization is not None:
            if device.type != "cpu":
                raise ValueError(f"quantization={config.quantization!r} runs on the CPU kernels "
                                 f"(pagedjax::quant_linear), not on {device.type}; use "
                                 f"quantization=None there.")
            module.keep_quantized(WeightQuantizer(config.quantization, shard_config,
                                                  config.gguf_path))
        elif uses_cpu_linear(config.attention_impl, device, dtype):
            module.pack_linears()
        cos, sin = rope_cos_sin(model_config, config.max_model_len)  # [max_model_len, D] each
        rope = (torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device))
        kv_cache_dtype = None
        if config.fp8_kv_cache:
            kv_cache_dtype = torch.float8_e4m3fn
            module.set_kv_cache_scales(kv_cache_scales(model_dir, model_config.num_layers))
        return cls(module, rope, shard_config, shard, [], kv_cache_dtype=kv_cache_dtype)

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> None:
        """Zeroed caches for this rank's KV heads: one pool, so that a copy-on-write is one
        gather and one scatter for every layer at once."""
        cfg, weight = self.config, self.module.norm.weight
        shape = (num_blocks, self.shard.part(cfg.num_kv_heads), block_size, cfg.head_dim)
        self.kv_pool = torch.zeros((cfg.num_layers, 2, *shape),
                                   dtype=self.kv_cache_dtype or weight.dtype, device=weight.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_pool]  # contiguous views

    def kv_bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        """KV bytes of one block on this rank."""
        return self.config.kv_bytes_per_block(block_size, dtype_bytes) // self.shard.size

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids, kv_caches, meta, logits_indices)

    def greedy_decode(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, block_tables: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """J single-token greedy steps over this model's caches in one C++ op → (tokens, their
        logprobs) [J, S] (LlamaForCausalLM.greedy_decode); None where the op does not compute
        this model."""
        return self.module.greedy_decode(input_ids, positions, slot_mapping, block_tables,
                                         self.kv_caches, self.rope)


def load_model(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
               device: torch.device, ops: LayerOps, shard: Shard) -> LlamaForCausalLM:
    """This shard of the checkpoint's weights in `dtype` on `device` (modules built on meta: no
    random init). config: the model as the devices hold it (KV heads repeated, see
    pagedjax.distributed.tensor_parallel)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ops, shard)
    weights = load_weights(model_dir, config)
    state = {name: _to_tensor(array, dtype, device)
             for name, array in _fused_state_dict(weights, config, shard).items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _fused_state_dict(weights: dict[str, np.ndarray], config: ModelConfig,
                      shard: Shard) -> dict[str, np.ndarray]:
    """Canonical names (backends/common/weights.py) → this module tree: q/k/v and gate/up
    fused, linear weights transposed to [in, out], each cut to this shard's heads, columns and
    vocabulary."""
    d, replicas = config.head_dim, shard.plan.kv_replicas
    q_rows, kv_rows = shard.part(config.num_q_heads) * d, shard.part(config.num_kv_heads) * d
    inter = shard.part(config.intermediate_size)
    vocab = slice(*shard.vocab_range(config.vocab_size))
    state = {"embed_tokens.weight": weights["embed_tokens"][vocab], "norm.weight": weights["norm"]}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = weights["lm_head"][vocab].T  # [H, V / shards]

    def kv(name: str):  # the k/v rows of this shard, heads repeated past their count first
        return shard.cut(repeat_kv_heads(weights[name], replicas, d), "k_proj", kv_rows)

    for i in range(config.num_layers):
        layer = f"layers.{i}"  # the same prefix in both trees
        q, k, v = (f"{layer}.{p}_proj" for p in "qkv")
        state[f"{layer}.self_attn.qkv_proj.weight"] = np.concatenate(
            [shard.cut(weights[f"{q}.weight"], "q_proj", q_rows), kv(f"{k}.weight"),
             kv(f"{v}.weight")]).T  # [H, (Hq + 2 Hkv) D / shards]
        if config.attention_bias:
            state[f"{layer}.self_attn.qkv_proj.bias"] = np.concatenate(
                [shard.cut(weights[f"{q}.bias"], "q_proj", q_rows), kv(f"{k}.bias"),
                 kv(f"{v}.bias")])
        state[f"{layer}.self_attn.o_proj.weight"] = shard.cut(
            weights[f"{layer}.o_proj.weight"], "o_proj", q_rows).T
        if config.is_moe_layer(i):  # each expert cut as a dense MLP is; the router whole
            state[f"{layer}.mlp.router.weight"] = weights[f"{layer}.router.weight"].T  # [H, E]
            moe_inter, experts = shard.part(config.moe_intermediate_size), f"{layer}.experts"
            gate, up = np.split(np.asarray(weights[f"{experts}.gate_up_proj"]), 2, axis=1)
            state[f"{layer}.mlp.gate_up_proj"] = np.concatenate(
                [shard.cut(w, "gate_proj", moe_inter, stacked=True) for w in (gate, up)],
                axis=1)  # [E, 2I / shards, H]
            state[f"{layer}.mlp.down_proj"] = shard.cut(
                weights[f"{experts}.down_proj"], "down_proj", moe_inter,
                stacked=True)  # [E, H, I / shards]
        else:
            state[f"{layer}.mlp.gate_up_proj.weight"] = np.concatenate(
                [shard.cut(weights[f"{layer}.{p}_proj.weight"], f"{p}_proj", inter)
                 for p in ("gate", "up")]
            ).T  # [H, 2I / shards]
            state[f"{layer}.mlp.down_proj.weight"] = shard.cut(
                weights[f"{layer}.down_proj.weight"], "down_proj", inter).T
        for norm in layer_norm_names(config):
            module = f"self_attn.{norm}" if norm in ("q_norm", "k_norm") else norm
            state[f"{layer}.{module}.weight"] = weights[f"{layer}.{norm}"]
    return state


def _to_tensor(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (possibly memory-mapped, possibly ml_dtypes bfloat16) array → an owned device tensor."""
    array = np.array(array, order="C")  # own, writable, C-contiguous (transposes laid out)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16).to(device, dtype)
    return torch.from_numpy(array).to(device, dtype)
