"""The embedded demo model pair (trained by benchmarks/train_demo_models.py, shipped in the
package): a ~9M-parameter Llama target and a ~1M-parameter draft sharing its tokenizer."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "demo_models"


def demo_model_dirs() -> tuple[str, str]:
    """(target dir, draft dir) of the demo pair."""
    target, draft = DEMO_DIR / "target", DEMO_DIR / "draft"
    if not ((target / "config.json").is_file() and (draft / "config.json").is_file()):
        raise ValueError(f"the demo models are missing from {DEMO_DIR}; reinstall pagedjax or "
                         "train them with benchmarks/train_demo_models.py.")
    return str(target), str(draft)
