"""GGUF files as a model source, as vLLM takes them: `model` may be a `.gguf` file, or a directory
holding exactly one `.gguf` and no config.json. transformers' GGUF reader dequantizes it, once,
into a Hugging Face checkpoint directory (weights, config, tokenizer with its chat template)
kept in the cache folder; the engine then loads that directory as any other checkpoint."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from pagedjax.model_loader.gguf_header import GGUFHeader, read_gguf_header

# The tensor types gguf-py dequantizes (all of transformers' GGUF support for pagedjax's models).
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
GGUF_EXTRA = 'pip install "pagedjax[gguf]" (in a checkout: pip install -e ".[gguf]")'
# Bumped when the conversion's output changes: older cached conversions are then redone.
_CONVERSION_VERSION = 2
# GGUF architectures (llama.cpp's names) whose transformers model type is spelled otherwise
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# GGUF metadata transformers' reader leaves out, by the config field it is: without it a
# Qwen3-MoE's experts get Qwen3MoeConfig's default width
_CONFIG_GAPS = {"expert_feed_forward_length": "moe_intermediate_size"}


def gguf_file(model: str | os.PathLike) -> Path | None:
    """The GGUF file `model` names (the file, or the one .gguf of a directory without
    config.json), or None when `model` is no GGUF source."""
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model={str(model)!r}: no such GGUF file.")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"model={str(model)!r} holds {len(found)} .gguf files "
                         f"({', '.join(p.name for p in found)}); pass one of them as the model.")
    return found[0] if found else None


def resolve_model_source(model: str) -> str:
    """The checkpoint directory to load for `model`: `model` itself, or for a GGUF source its
    HF conversion, made once and cached (keyed by the file's path, size and mtime)."""
    path = gguf_file(model)
    if path is None:
        return model
    import transformers

    stat = path.resolve().stat()
    identity = (f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_CONVERSION_VERSION}|"
                f"{transformers.__version__}")
    from pagedjax.cache import cache_dir

    out_dir = (cache_dir() / "gguf" /
               f"{path.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}")
    if not (out_dir / "config.json").is_file():
        convert_gguf(path, out_dir)
    return str(out_dir)


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike,
                 dtype: str | None = None) -> Path:
    """Write the GGUF file `path` as a HF checkpoint directory `out_dir` (built in a temporary
    sibling, then renamed: never half-written). dtype None: float32, or the file's own float16
    or bfloat16 when every tensor is in it (or float32)."""
    path, out_dir = Path(path), Path(out_dir)
    file_dtype = check_gguf(path)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{str(out_dir)!r} exists and is not empty; pass a new output "
                         "directory or delete it.")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    tmp.chmod(0o755)  # mkdtemp's 0700 would outlive the rename
    try:
        _write_hf_checkpoint(path, tmp, dtype or file_dtype)
        try:
            os.replace(tmp, out_dir)  # onto a missing or empty directory only
        except OSError:
            if not (out_dir / "config.json").is_file():  # else another process won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def check_gguf(path: Path) -> str:
    """Refuse (ValueError) a GGUF whose architecture or tensor types pagedjax cannot load; return
    the dtype to save it in."""
    _require_gguf_packages()
    from gguf import GGMLQuantizationType

    header = read_gguf_header(path)
    architecture = header.metadata.get("general.architecture")
    if architecture is None:
        raise ValueError(f"{str(path)!r} has no general.architecture: not a model GGUF file.")
    supported = supported_gguf_architectures()
    if architecture not in supported:
        raise ValueError(f"{str(path)!r} is a {architecture!r} model; pagedjax loads GGUF "
                         f"architectures {', '.join(supported)}. Load a Hugging Face checkpoint "
                         "of it instead if its architecture is in docs/models.md.")
    _check_experts(path, header, architecture)
    types = {GGMLQuantizationType(tensor.type).name for tensor in header.tensors.values()}
    unsupported = sorted(types - set(SUPPORTED_QUANT_TYPES))
    if unsupported:
        raise ValueError(f"{str(path)!r} has tensors of type {', '.join(unsupported)}, which "
                         f"cannot be dequantized; supported: {', '.join(SUPPORTED_QUANT_TYPES)}.")
    halves = types - {"F32"}
    return {frozenset(): "float32", frozenset({"F16"}): "float16",
            frozenset({"BF16"}): "bfloat16"}.get(frozenset(halves), "float32")


def _check_experts(path: Path, header: GGUFHeader, architecture: str) -> None:
    """Refuse a mixture of experts in an architecture whose transformers GGUF config has no
    experts (llama.cpp writes Mixtral as 'llama' with an expert count): it would be read as a
    dense model without MLP weights. Said here, from the metadata, before any dequantizing."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    num_experts = _expert_count(header, architecture)
    model_type = _MODEL_TYPES.get(architecture, architecture)
    if num_experts and "expert_count" not in GGUF_CONFIG_MAPPING[model_type]:
        moe = [a for a in supported_gguf_architectures()
               if "expert_count" in GGUF_CONFIG_MAPPING[_MODEL_TYPES.get(a, a)]]
        raise ValueError(f"{str(path)!r} is a mixture of {num_experts} experts in GGUF "
                         f"architecture {architecture!r} (llama.cpp writes Mixtral so), which "
                         "transformers' GGUF reader cannot convert; load the model's Hugging "
                         "Face checkpoint directory instead. GGUF mixtures of experts that "
                         f"load: {', '.join(moe)}.")


def gguf_experts(path: str | os.PathLike) -> tuple[str, int]:
    """(architecture, expert count: 0 for a dense model) from a GGUF file's metadata."""
    _require_gguf_packages()
    header = read_gguf_header(path)
    architecture = header.metadata.get("general.architecture", "")
    return architecture, _expert_count(header, architecture)


def _expert_count(header: GGUFHeader, architecture: str) -> int:
    return int(header.metadata.get(f"{architecture}.expert_count", 0))


def supported_gguf_architectures() -> list[str]:
    """GGUF architecture names (llama.cpp's) that both transformers' GGUF reader and pagedjax
    (config.SUPPORTED_ARCHITECTURES) take."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from pagedjax.config import SUPPORTED_ARCHITECTURES

    gguf_names = {model_type: name for name, model_type in _MODEL_TYPES.items()}
    return sorted(gguf_names.get(model_type, model_type)
                  for model_type, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
                  if cls in SUPPORTED_ARCHITECTURES and model_type in GGUF_SUPPORTED_ARCHITECTURES)


def _require_gguf_packages() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"loading a GGUF file needs the {' and '.join(missing)} package(s): "
                          f"{GGUF_EXTRA}.")


def _write_hf_checkpoint(path: Path, out_dir: Path, dtype: str) -> None:
    """transformers' GGUF reader, dequantized (with the config fields it leaves out), saved by
    save_pretrained (without the GGUF quantization_config, so the checkpoint loads as a plain
    one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    metadata = read_gguf_header(path).metadata
    architecture = metadata["general.architecture"]
    gaps = {config_field: metadata[f"{architecture}.{key}"]
            for key, config_field in _CONFIG_GAPS.items() if f"{architecture}.{key}" in metadata}
    folder, name = str(path.parent), path.name
    loaded, info = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, output_loading_info=True, **gaps)
    if missing := sorted(info["missing_keys"]):  # else saved with random weights
        raise ValueError(f"transformers' GGUF reader found no weights in {str(path)!r} for "
                         f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}; load "
                         "the model's Hugging Face checkpoint directory instead.")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.to(getattr(torch, dtype)).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)


# GGUF's names of a decoder layer's projections (llama.cpp's), by pagedjax's canonical ones
GGUF_LINEAR_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                     "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
                     "down_proj": "ffn_down"}


def gguf_linear_blocks(path: str | os.PathLike) -> dict[str, tuple[int, object]]:
    """Every 2-D tensor of the file as it is stored: name → (GGML type id, uint8 or float array
    [rows, row bytes or columns], memory-mapped), for the weights a model keeps in their
    blocks (quantization="gguf")."""
    _require_gguf_packages()
    return {tensor.name: (tensor.type, tensor.data)
            for tensor in read_gguf_header(path).tensors.values() if tensor.data.ndim == 2}


def reverse_permute_rows(rows, num_heads: int):
    """llama.cpp's converter orders each q/k head's rows for its rotary layout (rows of pairs
    interleaved); this is the HF order back (transformers' reverse_permute_weights), for any
    per-row array (float weights or rows of blocks) [num_heads * D, ...]."""
    dim = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)
