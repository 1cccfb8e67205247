"""Tiny GGUF files for the tests, written with gguf-py's GGUFWriter as llama.cpp's
convert_hf_to_gguf.py writes them: config as metadata, GGUF tensor names, a byte-level BPE
("gpt2") tokenizer. A Llama or Mixtral is architecture "llama" with its q/k rows permuted to
llama.cpp's rotary layout; a Qwen3-MoE is "qwen3moe" (q/k rows as they are, q/k norms). A
mixture's experts are stacked per layer into ffn_{gate,up,down}_exps [E, ...], its router is
ffn_gate_inp, kept in float32 as llama.cpp keeps it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

# HF model_type -> (GGUF architecture, whether llama.cpp permutes the q/k rows)
GGUF_ARCHITECTURES = {"llama": ("llama", True), "mixtral": ("llama", True),
                      "qwen3_moe": ("qwen3moe", False)}
_EXPERT = re.compile(r"(?P<base>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight")


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF's rotary layout → llama.cpp's (transformers' GGUF reader undoes it)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(hf_dir: str | Path, path: str | Path, *, architecture: str | None = None,
               dtype: object = np.float32, first_tensor_dtype: type | None = None) -> Path:
    """The Llama, Mixtral or Qwen3-MoE checkpoint `hf_dir` as a GGUF file. `dtype`: np.float32
    → F32, np.float16 → F16, or a gguf.GGMLQuantizationType (Q8_0) that gguf-py quantizes every
    matrix but the router to (norms stay F32); `architecture` and `first_tensor_dtype` forge
    unsupported files."""
    import gguf

    hf_dir, path = Path(hf_dir), Path(path)
    config = json.loads((hf_dir / "config.json").read_text())
    gguf_arch, permuted = GGUF_ARCHITECTURES[config["model_type"]]
    writer = gguf.GGUFWriter(path, architecture or gguf_arch)
    _add_config(writer, config)
    _add_tokenizer(writer, hf_dir, config["eos_token_id"])
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == gguf_arch)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for i, (name, tensor) in enumerate(sorted(_stacked_experts(hf_dir).items())):
        base, suffix = name.rsplit(".", 1)
        if permuted and (proj := base.rsplit(".", 1)[-1]) in heads:
            tensor = _permute(tensor, heads[proj])
        gguf_name = f"{names.get_name(base)}.{suffix}"
        wanted = first_tensor_dtype if i == 0 and first_tensor_dtype else dtype
        if not is_quantized(gguf_name, tensor):
            writer.add_tensor(gguf_name, tensor.astype(np.float32))
        elif isinstance(wanted, gguf.GGMLQuantizationType):
            writer.add_tensor(gguf_name, gguf.quants.quantize(tensor, wanted), raw_dtype=wanted)
        else:
            writer.add_tensor(gguf_name, tensor.astype(wanted))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def is_quantized(gguf_name: str, tensor: np.ndarray) -> bool:
    """Whether llama.cpp's converter stores this tensor in the file's type: not norms (1-D) nor
    a router (ffn_gate_inp), which stay float32."""
    return tensor.ndim > 1 and ".ffn_gate_inp." not in gguf_name


def dequantized_checkpoint(hf_dir: str | Path, out_dir: str | Path, qtype: object) -> Path:
    """A copy of the checkpoint `hf_dir` whose weights are what a `qtype` GGUF of it
    (write_gguf) holds, dequantized by gguf-py: the reference HF runs for a quantized file."""
    import gguf
    from safetensors.numpy import load_file, save_file
    from transformers import AutoTokenizer

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(hf_dir / "model.safetensors")
    routers = (".mlp.gate.weight", ".block_sparse_moe.gate.weight")
    save_file({name: tensor if tensor.ndim == 1 or name.endswith(routers) else
               gguf.quants.dequantize(gguf.quants.quantize(tensor, qtype), qtype)
               for name, tensor in tensors.items()}, out_dir / "model.safetensors",
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
    return out_dir


def _add_config(writer, config: dict) -> None:
    """The metadata convert_hf_to_gguf.py writes (TextModel, and Qwen2MoeModel's expert
    width)."""
    writer.add_name("tiny")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta")
                              or config["rope_parameters"]["rope_theta"])
    if experts := config.get("num_local_experts") or config.get("num_experts"):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _stacked_experts(hf_dir: Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors, each layer's per-expert projections stacked into one [E, ...]
    tensor per projection (named `...experts.{proj}.weight`), as llama.cpp's converter does."""
    from safetensors.numpy import load_file

    tensors, experts = {}, {}
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        if m := _EXPERT.fullmatch(name):
            experts.setdefault(f"{m['base']}.{m['proj']}.weight", {})[int(m["expert"])] = tensor
        else:
            tensors[name] = tensor
    for name, by_expert in experts.items():
        tensors[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return tensors


def _add_tokenizer(writer, hf_dir: Path, eos_token_id: int) -> None:
    import gguf

    model = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = model["model"]["vocab"]
    special = {t["id"] for t in model["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(sorted(vocab, key=vocab.get))
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(vocab))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in model["model"]["merges"]])
    writer.add_eos_token_id(eos_token_id)
    writer.add_add_bos_token(False)
