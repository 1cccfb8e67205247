"""The model directory's tokenizer and its end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


# tokenizer_config.json's tokenizer_class values that name transformers' generic fast tokenizer:
# loaded by that class directly, which AutoTokenizer would pick too, without importing what
# AutoTokenizer imports (torch among it: ~4 s of an engine's startup)
_GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: str) -> Any | None:
    """transformers' tokenizer for the directory (the class AutoTokenizer picks), or None if it
    ships no tokenizer files."""
    if not any((Path(model_dir) / f).is_file() for f in _TOKENIZER_FILES):
        return None
    config_path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("tokenizer_class") in _GENERIC and (Path(model_dir) / "tokenizer.json").is_file():
        import transformers

        return getattr(transformers, config["tokenizer_class"]).from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def load_eos_token_ids(model_dir: str, tokenizer: Any | None) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (tokenizer.eos_token_id,)
    return ()


# generation_config.json key → SamplingParams field
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                        "min_p": "min_p", "max_new_tokens": "max_tokens"}


def default_sampling_kwargs(model_dir: str) -> dict[str, Any]:
    """The sampling defaults a checkpoint's generation_config.json sets."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {ours: config[theirs] for theirs, ours in _GENERATION_DEFAULTS.items()
            if config.get(theirs) is not None}
