"""Greedy parity of both backends with HF transformers on a tiny model and a tiny mixture of
experts, on whatever device each backend picks (the GPU when there is one: gpu_suite.py's
correctness part runs this file there).

float32: token-identical to HF's float32 greedy. bfloat16 weights and caches: greedy may drift
from float32, but the first token where it does is among bf16's top 5 at that position.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from tests.support.hf_reference import hf_greedy

MAX_TOKENS = 12
PROMPT_LENS = (1, 17, 40)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def model_and_reference(tiny_model, request) -> tuple[str, list[list[int]], list[list[int]]]:
    """(checkpoint, prompts, HF float32 greedy continuations)."""
    model_dir = tiny_model(request.param)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, n).tolist() for n in PROMPT_LENS]
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_greedy_parity_with_hf(model_and_reference, backend: str, dtype: str) -> None:
    model_dir, prompts, expected = model_and_reference
    llm = LLM(model_dir, backend=backend, dtype=dtype, max_model_len=128,
              num_gpu_blocks_override=32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for output, want in zip(outputs, expected, strict=True):
        got = output.outputs[0]
        if dtype == "float32":
            assert got.token_ids == want
            continue
        assert len(got.token_ids) == MAX_TOKENS
        diverged = [i for i, (a, b) in enumerate(zip(got.token_ids, want)) if a != b]
        if diverged:
            first = diverged[0]
            assert want[first] in got.logprobs[first], (first, got.logprobs[first], want[first])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_users_default_engine_on_the_gpu(model_and_reference, compile_at_startup,
                                         backend: str) -> None:
    """What users get on a GPU: the KV pool sized from device memory after a trial step, every
    step shape compiled (jax) or its CUDA graph captured (torch) at startup; float32 greedy is
    HF's, and no step compiles after startup."""
    model_dir, prompts, expected = model_and_reference
    llm = LLM(model_dir, backend=backend, dtype="float32", max_model_len=128,
              gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.get_metrics()["num_compiles_after_startup"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_speculative_steps_launched_ahead_match_hf_on_the_gpu(model_and_reference,
                                                              compile_at_startup,
                                                              backend: str) -> None:
    """A draft model's speculative steps launched before the last one's tokens reach the host
    (PAGEDJAX_ASYNC_SPECULATION=1; torch replays them from CUDA graphs), moved on the device by
    the drafts accepted: float32 greedy is still HF's, and steps did launch ahead. The draft is
    the target, so every draft is accepted and each step's draft catches up on two tokens."""
    import os
    from unittest import mock

    model_dir, prompts, expected = model_and_reference
    with mock.patch.dict(os.environ, {"PAGEDJAX_ASYNC_SPECULATION": "1"}):
        llm = LLM(model_dir, backend=backend, dtype="float32", max_model_len=128,
                  gpu_memory_utilization=0.3, speculative_config={
                      "model": model_dir, "num_speculative_tokens": 2, "adaptive": False})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.engine_core.overlap.num_speculative_ahead > 0
    assert llm.engine.get_metrics()["num_compiles_after_startup"] == 0
