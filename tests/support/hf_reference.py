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


def hf_beam_search(model_dir: str, prompt: list[int], num_beams: int, max_new_tokens: int,
                   length_penalty: float = 1.0, early_stopping: bool | str = False,
                   eos_token_id: int | None = None) -> list[tuple[list[int], float | None]]:
    """HF's generate(num_beams=...) on one prompt: its num_beams hypotheses best first, as
    (generated ids with EOS, length-normalised score); num_beams=1 is HF's greedy search
    (score None). eos_token_id=None ignores EOS."""
    return [(list(ids), score) for ids, score in _hf_beam_search_one(
        model_dir, tuple(prompt), num_beams, max_new_tokens, length_penalty, early_stopping,
        eos_token_id)]


@functools.lru_cache(maxsize=256)
def _hf_beam_search_one(model_dir: str, ids: tuple[int, ...], num_beams: int,
                        max_new_tokens: int, length_penalty: float, early_stopping: bool | str,
                        eos_token_id: int | None) -> tuple:
    import torch

    beam_kwargs = {} if num_beams == 1 else dict(
        num_return_sequences=num_beams, length_penalty=length_penalty,
        early_stopping=early_stopping, output_scores=True)
    with torch.no_grad():
        out = _hf_model(model_dir).generate(
            torch.tensor([ids]), num_beams=num_beams, do_sample=False,
            max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0,
            return_dict_in_generate=True, **beam_kwargs)
    if num_beams == 1:
        return ((tuple(out.sequences[0, len(ids):].tolist()), None),)
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()  # generated ids of each hypothesis
    return tuple((tuple(out.sequences[i, len(ids) : len(ids) + n].tolist()),
                  float(out.sequences_scores[i])) for i, n in enumerate(lengths))
