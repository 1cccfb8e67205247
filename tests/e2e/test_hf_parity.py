"""Greedy float32 tokens identical to HF transformers' generate, for every architecture row of
pagedjax/model_loader/architectures.py on both backends, with prefills whole (a second pass
served from the prefix cache) and chunked under a pool small enough to preempt. The one place
HF greedy parity is asserted for the model families; other tests compare a feature's tokens to
HF where the feature is what they check."""

from __future__ import annotations

import pytest

from pagedjax import LLM, SamplingParams
from tests.support.hf_reference import hf_greedy
from tests.support.prompts import make_prompts

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "phi3", "gemma2",
                 "gemma3", "qwen3_moe", "mixtral", "olmoe", "granitemoe"]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# "whole": one step prefills everything, so the first pass computes every block and a second
# pass is served from the prefix cache. "chunked": 32-token prefill chunks and 24 blocks for
# ~36 blocks of demand: sequences are preempted, then re-find their own blocks in the cache.
PREFILL = {
    "whole": dict(max_num_batched_tokens=512, num_gpu_blocks_override=128),
    "chunked": dict(max_num_batched_tokens=32, num_gpu_blocks_override=24),
}
# Phi-3's LongRoPE: HF switches to the long factors once a sequence passes
# original_max_position_embeddings (64 in the tiny checkpoint); pagedjax, as vLLM, picks the
# tables from max_model_len. Parity holds within the original context: its prompts that fit,
# and a pool of 6 blocks for ~12 blocks of demand.
SHORT_CONTEXT = {"phi3": (64, 6)}


@pytest.mark.parametrize("prefill", PREFILL)
@pytest.mark.parametrize("backend", ["jax", "torch"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_matches_hf(tiny_model, name: str, backend: str, prefill: str) -> None:
    model_dir = tiny_model(name)
    max_model_len, options = 256, dict(PREFILL[prefill])
    if name in SHORT_CONTEXT:
        max_model_len, chunked_blocks = SHORT_CONTEXT[name]
        if prefill == "chunked":
            options["num_gpu_blocks_override"] = chunked_blocks
    llm = LLM(model_dir, backend=backend, max_model_len=max_model_len,
              enable_prefix_caching=True, **options)
    prompts = [p for p in make_prompts(llm.engine.model_config.vocab_size)
               if len(p) + MAX_TOKENS <= max_model_len]
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert len({t for tokens in expected for t in tokens}) > 3, "a degenerate tiny model"
    inputs = [{"prompt_token_ids": p} for p in prompts]

    outputs = llm.generate(inputs, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    again = llm.generate(inputs, GREEDY, use_tqdm=False)  # served partly from the prefix cache
    assert [o.outputs[0].token_ids for o in again] == expected
    compiles = llm.engine.runner.num_compiles
    llm.generate(inputs, GREEDY, use_tqdm=False)  # the same shapes as the pass before
    assert llm.engine.runner.num_compiles == compiles, "a repeated workload must not recompile"

    metrics = llm.get_metrics()
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]
    assert metrics["prefix_cache_hits"] > 0
    if prefill == "whole":
        assert [o.num_cached_tokens for o in outputs] == [0] * len(prompts)
        assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 16 * 16 for p in prompts]
    else:
        assert metrics["num_preemptions_total"] > 0
    llm.shutdown()
