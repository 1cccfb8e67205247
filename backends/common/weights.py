"""HF checkpoint → canonical weight names, shared by both backends.

Canonical names (Llama family), linear weights kept in HF's [out, in] layout:
    embed_tokens [V, H], norm [H], lm_head [V, H]
    layers.{i}.{input_layernorm, post_attention_layernorm} [H] (norm_layout "pre")
    layers.{i}.{post_attention_layernorm, post_feedforward_layernorm} [H] (norm_layout "post"),
        and input_layernorm, pre_feedforward_layernorm too (norm_layout "sandwich")
    layers.{i}.{q,k}_norm [D] (qk_norm "head") or [Hq * D], [Hkv * D] (qk_norm "full")
    layers.{i}.{q,k,v,o}_proj.weight, layers.{i}.{q,k,v}_proj.bias (attention_bias)
    layers.{i}.{gate,up,down}_proj.weight (a dense layer)
    layers.{i}.router.weight [E, H], layers.{i}.experts.gate_up_proj [E, 2I, H] (each expert's
        gate rows, then its up rows), layers.{i}.experts.down_proj [E, H, I] (a mixture of
        experts' layer: from per-expert tensors, Mixtral's w1/w3/w2, or the fused ones newer
        transformers and Granite-MoE write)
A checkpoint's fused projections (Phi-3's qkv_proj, gate_up_proj) are split into these.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from pagedjax.config import ModelConfig
from pagedjax.model_loader.architectures import architecture

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}

_LAYER_RE = re.compile(
    r"model\.layers\.(\d+)\.(?:self_attn|mlp)?\.?"
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|input_layernorm|"
    r"post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm|q_norm|"
    r"k_norm)\.(weight|bias)$"
)
_TOP_LEVEL = {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm",
              "lm_head.weight": "lm_head"}
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm", "q_norm", "k_norm")
_LAYER_NORMS = {"pre": ("input_layernorm", "post_attention_layernorm"),
                "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
                "sandwich": ("input_layernorm", "post_attention_layernorm",
                             "pre_feedforward_layernorm", "post_feedforward_layernorm")}


_ROUTER_RE = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp\.gate|block_sparse_moe\.gate|block_sparse_moe\.router\.layer)"
    r"\.weight$")
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                        r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED_EXPERTS_RE = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?"
    r"|block_sparse_moe\.(input_linear|output_linear)\.weight)$")
_EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                 "down_proj": "down", "w2": "down"}
_FUSED_EXPERTS = {"gate_up_proj": "gate_up_proj", "input_linear": "gate_up_proj",
                  "down_proj": "down_proj", "output_linear": "down_proj"}


def canonical_name(hf_name: str) -> str | None:
    """Our name for an HF tensor name, or None for tensors we do not use (e.g. rotary buffers)."""
    if hf_name in _TOP_LEVEL:
        return _TOP_LEVEL[hf_name]
    match = _LAYER_RE.match(hf_name)
    if match is None:
        return None
    layer, module, kind = match.groups()
    if module in _NORMS:
        return f"layers.{layer}.{module}"
    return f"layers.{layer}.{module}.{kind}"


def iter_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for each tensor of one .safetensors file, memory-mapped (bf16 included)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        yield name, data[start:end].view(dtype).reshape(info["shape"])


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: one file, or the shards listed by the index."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={str(model_dir)!r} holds no *.safetensors weights; save the "
                         "checkpoint with save_pretrained(..., safe_serialization=True).")
    return files


def load_weights(model_dir: str | Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """All canonical weights as (memory-mapped) arrays; lm_head filled in for tied embeddings,
    fused projections split."""
    weights: dict[str, np.ndarray] = {}
    fused = architecture(config.architecture).fused_weights
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}  # (layer, part) → expert → W
    for path in checkpoint_files(model_dir):
        for hf_name, array in iter_safetensors(path):
            if config.num_experts and _expert_weight(hf_name, array, weights, experts):
                continue
            split = _split_fused(hf_name, array, fused, config)
            for name, part in split or [(canonical_name(hf_name), array)]:
                if name is not None:
                    weights[name] = part
    weights.update(_stack_experts(experts, config))
    if "lm_head" not in weights or config.tie_word_embeddings:
        weights["lm_head"] = weights.get("embed_tokens")
    missing = [n for n in expected_names(config) if weights.get(n) is None]
    if missing:
        raise ValueError(f"checkpoint {str(model_dir)!r} lacks weights {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}; is it a {config.architecture}?")
    return weights


def _expert_weight(hf_name: str, array: np.ndarray, weights: dict[str, np.ndarray],
                   experts: dict[tuple[int, str], dict[int, np.ndarray]]) -> bool:
    """Take a router or expert tensor (into weights, or experts to stack); False for others."""
    if match := _ROUTER_RE.match(hf_name):
        weights[f"layers.{match.group(1)}.router.weight"] = array
    elif match := _EXPERT_RE.match(hf_name):
        layer, expert, part = match.groups()
        experts.setdefault((int(layer), _EXPERT_PARTS[part]), {})[int(expert)] = array
    elif match := _FUSED_EXPERTS_RE.match(hf_name):
        layer, v5_name, granite_name = match.groups()
        weights[f"layers.{layer}.experts.{_FUSED_EXPERTS[v5_name or granite_name]}"] = array
    else:
        return False
    return True


def _stack_experts(experts: dict[tuple[int, str], dict[int, np.ndarray]],
                   config: ModelConfig) -> dict[str, np.ndarray]:
    """Per-expert tensors → layers.{i}.experts.gate_up_proj [E, 2I, H] and down_proj
    [E, H, I]."""
    out = {}
    for layer in sorted({layer for layer, _ in experts}):
        parts = {part: experts.get((layer, part), {}) for part in ("gate", "up", "down")}
        if any(sorted(p) != list(range(config.num_experts)) for p in parts.values()):
            raise ValueError(f"layer {layer} holds experts {sorted(parts['gate'])} (gate), "
                             f"{sorted(parts['up'])} (up), {sorted(parts['down'])} (down); "
                             f"config.json gives num_experts={config.num_experts}.")
        out[f"layers.{layer}.experts.gate_up_proj"] = np.stack([
            np.concatenate([parts["gate"][e], parts["up"][e]])
            for e in range(config.num_experts)])
        out[f"layers.{layer}.experts.down_proj"] = np.stack(
            [parts["down"][e] for e in range(config.num_experts)])
    return out


_FUSED_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight$")


def _split_fused(hf_name: str, array: np.ndarray, fused: dict[str, tuple[str, ...]],
                 config: ModelConfig) -> list[tuple[str, np.ndarray]] | None:
    """A fused projection's canonical parts (rows in order), or None for any other tensor."""
    match = _FUSED_RE.match(hf_name)
    if match is None or match.group(2) not in fused:
        return None
    layer, parts = match.group(1), fused[match.group(2)]
    d = config.head_dim
    rows = {"q_proj": config.num_q_heads * d, "k_proj": config.num_kv_heads * d,
            "v_proj": config.num_kv_heads * d, "gate_proj": config.intermediate_size,
            "up_proj": config.intermediate_size}
    bounds = np.cumsum([0] + [rows[p] for p in parts])
    if bounds[-1] != array.shape[0]:
        raise ValueError(f"{hf_name} has {array.shape[0]} rows; {config.architecture}'s config "
                         f"gives {bounds[-1]} for {parts}.")
    return [(f"layers.{layer}.{p}.weight", array[a:b])
            for p, a, b in zip(parts, bounds[:-1], bounds[1:])]


def layer_norm_names(config: ModelConfig) -> tuple[str, ...]:
    """The norms of one decoder layer, by their canonical names (without layers.{i}.)."""
    qk = ("q_norm", "k_norm") if config.qk_norm else ()
    return _LAYER_NORMS[config.norm_layout] + qk


def expected_names(config: ModelConfig) -> list[str]:
    names = ["embed_tokens", "norm", "lm_head"]
    for i in range(config.num_layers):
        names += [f"layers.{i}.{n}" for n in layer_norm_names(config)]
        names += [f"layers.{i}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if config.is_moe_layer(i):
            names += [f"layers.{i}.router.weight", f"layers.{i}.experts.gate_up_proj",
                      f"layers.{i}.experts.down_proj"]
        else:
            names += [f"layers.{i}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        if config.attention_bias:
            names += [f"layers.{i}.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")]
    return names


def repeat_kv_heads(array, replicas: int, head_dim: int, axis: int = 0):
    """Each KV head of a k/v projection repeated `replicas` times along `axis` (the heads axis:
    0 for HF's [Hkv * D, H] weights and [Hkv * D] biases, -1 for [H, Hkv * D] kernels), for
    tensor parallelism past the KV head count (pagedjax.distributed.tensor_parallel). NumPy,
    jax or torch arrays."""
    if replicas == 1:
        return array
    axis = axis % array.ndim
    shape = array.shape
    heads = array.reshape(*shape[:axis], -1, head_dim, *shape[axis + 1:])
    repeated = (heads.repeat_interleave(replicas, dim=axis) if hasattr(heads, "repeat_interleave")
                else heads.repeat(replicas, axis=axis))
    return repeated.reshape(*shape[:axis], -1, *shape[axis + 1:])
