"""HF checkpoint → canonical weight names, shared by both backends.

Canonical names (Llama family), linear weights kept in HF's [out, in] layout:
    embed_tokens [V, H], norm [H], lm_head [V, H]
    layers.{i}.{input_layernorm, post_attention_layernorm} [H]
    layers.{i}.{q,k,v,o}_proj.weight, layers.{i}.{q,k,v}_proj.bias (attention_bias)
    layers.{i}.{gate,up,down}_proj.weight
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

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}

_LAYER_RE = re.compile(
    r"model\.layers\.(\d+)\.(?:self_attn|mlp)?\.?"
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|input_layernorm|"
    r"post_attention_layernorm)\.(weight|bias)$"
)
_TOP_LEVEL = {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm",
              "lm_head.weight": "lm_head"}
_NORMS = ("input_layernorm", "post_attention_layernorm")


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
    """All canonical weights as (memory-mapped) arrays; lm_head filled in for tied embeddings."""
    weights: dict[str, np.ndarray] = {}
    for path in checkpoint_files(model_dir):
        for hf_name, array in iter_safetensors(path):
            name = canonical_name(hf_name)
            if name is not None:
                weights[name] = array
    if "lm_head" not in weights or config.tie_word_embeddings:
        weights["lm_head"] = weights.get("embed_tokens")
    missing = [n for n in expected_names(config) if weights.get(n) is None]
    if missing:
        raise ValueError(f"checkpoint {str(model_dir)!r} lacks weights {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}; is it a {config.architecture}?")
    return weights


def expected_names(config: ModelConfig) -> list[str]:
    names = ["embed_tokens", "norm", "lm_head"]
    for i in range(config.num_layers):
        names += [f"layers.{i}.{n}" for n in _NORMS]
        names += [f"layers.{i}.{p}.weight" for p in
                  ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]
        if config.attention_bias:
            names += [f"layers.{i}.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")]
    return names


def repeat_kv_heads(array, replicas: int, head_dim: int, axis: int = 0):
    """Each KV head of a k/v projection repeated `replicas` times along `axis` (the heads axis:
    0 for HF's [Hkv * D, H] weights and [Hkv * D] biases, -1 for [H, Hkv * D] kernels), for
    tensor parallelism past the KV head count (pagedjax.parallel). NumPy, jax or torch arrays."""
    if replicas == 1:
        return array
    axis = axis % array.ndim
    shape = array.shape
    heads = array.reshape(*shape[:axis], -1, head_dim, *shape[axis + 1:])
    repeated = (heads.repeat_interleave(replicas, dim=axis) if hasattr(heads, "repeat_interleave")
                else heads.repeat(replicas, axis=axis))
    return repeated.reshape(*shape[:axis], -1, *shape[axis + 1:])
