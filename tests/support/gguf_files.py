"""Tiny GGUF files for the tests, written with gguf-py's GGUFWriter as llama.cpp's
convert_hf_to_gguf.py writes a Llama: config as metadata, GGUF tensor names, q/k rows permuted
to llama.cpp's rotary layout, a byte-level BPE ("gpt2") tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF's rotary layout → llama.cpp's (transformers' GGUF reader undoes it)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_llama_gguf(hf_dir: str | Path, path: str | Path, *, architecture: str = "llama",
                     dtype: type = np.float32, first_tensor_dtype: type | None = None) -> Path:
    """The Llama checkpoint `hf_dir` as a GGUF file with `dtype` tensors (np.float32 → F32,
    np.float16 → F16); `architecture` and `first_tensor_dtype` forge unsupported files."""
    import gguf
    from safetensors.numpy import load_file

    hf_dir, path = Path(hf_dir), Path(path)
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(path, architecture)
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
    _add_tokenizer(writer, hf_dir, config["eos_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    for i, (name, tensor) in enumerate(sorted(load_file(hf_dir / "model.safetensors").items())):
        base, suffix = name.rsplit(".", 1)
        if name.endswith("q_proj.weight"):
            tensor = _permute(tensor, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            tensor = _permute(tensor, config["num_key_value_heads"])
        is_norm = tensor.ndim == 1  # llama.cpp keeps norms in float32
        wanted = first_tensor_dtype if i == 0 and first_tensor_dtype else dtype
        writer.add_tensor(f"{names.get_name(base)}.{suffix}",
                          tensor.astype(np.float32 if is_norm else wanted))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
