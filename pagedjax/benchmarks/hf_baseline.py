"""HF transformers' own `generate` on the same model, device and dtype: the peer every end-to-end
benchmark reports beside pagedjax (greedy, EOS ignored, so both generate the same tokens)."""

from __future__ import annotations

import time


def load_hf(model_dir: str, dtype: str):
    """The checkpoint as an eval-mode HF model on the GPU if there is one, else the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(
        device).eval()


def hf_generate(model, batch: list[list[int]], num_tokens: int) -> float:
    """Seconds for one greedy generate() of num_tokens new tokens over a left-padded batch."""
    import torch

    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                        device=model.device)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=num_tokens,
                       min_new_tokens=num_tokens, do_sample=False, eos_token_id=None,
                       pad_token_id=0)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
