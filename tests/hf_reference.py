"""HF transformers' own greedy generation: the oracle every backend must match token for token."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt, one at a time (no padding), EOS ignored."""
    return [list(_hf_greedy_one(model_dir, tuple(ids), max_new_tokens)) for ids in prompts]


@functools.lru_cache(maxsize=256)
def _hf_greedy_one(model_dir: str, ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    import torch

    with torch.no_grad():
        out = _hf_model(model_dir).generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=None, pad_token_id=0)
    return tuple(out[0, len(ids):].tolist())
