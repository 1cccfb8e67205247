"""record_expert_load: every real token of a generate call counted k times per layer (prefill
and decode, no padding row), the counts HF's router gives, and what it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedjax import LLM, SamplingParams
from pagedjax.utils.expert_load import plot_expert_load, record_expert_load
from tests.support.prompts import make_prompts

SMALL = dict(max_model_len=256, num_gpu_blocks_override=64)


def test_every_computed_token_is_counted_once_per_layer(tiny_model) -> None:
    """Three sequences of different lengths and a token budget that chunks the long prompt
    into steps beside the others' decodes, one step padded (20 real tokens in a 32-token
    layout): each layer counts sum(prompt + generated - 1) tokens, k choices each."""
    llm = LLM(tiny_model("mixtral"), backend="torch", max_num_batched_tokens=32,
              enable_prefix_caching=False, **SMALL)
    prompts = [p for p in make_prompts(512) if len(p) in (7, 17, 120)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 9, 2)]
    with record_expert_load(llm) as load:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
    # the last generated token is never fed back
    want = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outputs)
    assert want == 7 + 17 + 120 + (5 + 9 + 2) - 3
    assert load.layers == [0, 1] and load.counts.shape == (2, 8)
    assert load.counts.sum(axis=1).tolist() == [want * 2] * 2
    assert load.num_tokens == want
    np.testing.assert_allclose(load.shares().sum(axis=1), 1.0)
    with record_expert_load(llm) as idle:  # a new record starts at zero; hooks were removed
        pass
    assert not idle.counts.any()


def hf_counts(model_dir: str, prompts: list[list[int]], k: int) -> np.ndarray:
    """[num_moe_layers, E]: the top k of HF's router logits for every prompt token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = 0
    for prompt in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([prompt]), output_router_logits=True).router_logits
        total = total + np.stack([np.bincount(torch.topk(layer, k).indices.flatten().numpy(),
                                              minlength=layer.shape[-1]) for layer in logits])
    return total


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_the_counts_are_hf_routers(tiny_model, name: str) -> None:
    """Prefill only (max_tokens=1: no token fed back): the per-layer, per-expert counts equal
    a recount of HF transformers' router logits over the same prompt tokens."""
    llm = LLM(tiny_model(name), backend="torch", **SMALL)
    prompts = make_prompts(512)[:6]
    with record_expert_load(llm) as load:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert load.layers == ([1] if name == "qwen3_moe" else [0, 1])  # qwen3_moe: layer 0 dense
    np.testing.assert_array_equal(load.counts, hf_counts(tiny_model(name), prompts, 2))


def test_what_it_refuses_is_named(tiny_model) -> None:
    with pytest.raises(ValueError, match="is dense.*use a mixture of experts"):
        with record_expert_load(LLM(tiny_model("llama"), backend="torch", **SMALL)):
            pass
    # bfloat16: no CPU FFI library to build for an engine that never steps
    jax = LLM(tiny_model("qwen3_moe"), backend="jax", dtype="bfloat16", **SMALL)
    with pytest.raises(ValueError, match="backend='jax'.*backend='torch'"):
        with record_expert_load(jax):
            pass
    shut = LLM(tiny_model("qwen3_moe"), backend="torch", **SMALL)
    shut.shutdown()
    with pytest.raises(ValueError, match="multiprocess=False"):
        with record_expert_load(shut):
            pass


def test_the_heatmap_is_titled_with_the_model_and_prompt_count(tiny_model) -> None:
    import matplotlib

    matplotlib.use("Agg")
    llm = LLM(tiny_model("mixtral"), backend="torch", **SMALL)
    with record_expert_load(llm) as load:
        llm.generate("def f(x):", SamplingParams(max_tokens=3), use_tqdm=False)
    ax = plot_expert_load(load, num_prompts=1)
    assert ax.get_title().startswith("tiny-mixtral")
    assert ": 1 prompt," in ax.get_title()
    np.testing.assert_allclose(ax.images[0].get_array().sum(axis=1), 1.0)
    assert len(ax.figure.axes) == 2  # the heatmap and its colorbar
