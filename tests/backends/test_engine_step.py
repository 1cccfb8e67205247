"""The step contract: one device call per engine step (drafting included), outputs shaped
[L, K+1] and tagged with sequence ids, every step's shape one of the engine's closed set."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.core.batch import ModelInput, ModelOutput
from tests.support.prompts import make_prompts

BACKENDS = ["jax", "torch"]


def spec_llm(tiny_model, backend: str, **kwargs) -> LLM:
    spec = {"model": tiny_model("draft"), "num_speculative_tokens": 3, "adaptive": False}
    kwargs = {"num_gpu_blocks_override": 128, "max_num_batched_tokens": 128, "max_model_len": 256,
              "speculative_config": spec, **kwargs}
    return LLM(tiny_model("llama"), backend=backend, **kwargs)


def record_steps(llm: LLM) -> list[tuple[ModelInput, ModelOutput]]:
    runner, steps = llm.engine.runner, []
    execute_async = runner.execute_async

    def recording_execute(model_input: ModelInput) -> Callable[[], ModelOutput]:
        wait = execute_async(model_input)

        def recorded() -> ModelOutput:
            output = wait()
            steps.append((model_input, output))
            return output

        return recorded

    runner.execute_async = recording_execute
    return steps


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_device_call_per_step_with_drafts(tiny_model, backend: str) -> None:
    """Each engine step is one runner call; inside it the draft's k passes, verification and
    sampling make one device computation (JAX: one call of the jitted step; torch: one transfer
    back to the host), however many drafts were proposed."""
    llm = spec_llm(tiny_model, backend)
    runner, engine = llm.engine.runner, llm.engine
    prompts = [{"prompt_token_ids": p} for p in make_prompts(512)[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compiles
    device_calls = []
    if backend == "jax":
        inner = runner.launch
        runner.launch = lambda *a, **kw: device_calls.append(1) or inner(*a, **kw)
        draft_apply = runner.draft.module.apply
        draft_calls = []
        object.__setattr__(runner.draft.module, "apply",
                           lambda *a, **kw: draft_calls.append(1) or draft_apply(*a, **kw))
    else:
        wait = runner._wait
        runner._wait = lambda *a: device_calls.append(1) or wait(*a)
    steps = record_steps(llm)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    num_engine_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_engine_steps += 1
    # jax: a call may run nothing and hand over the last step's outputs, which it builds while
    # the device runs the next step (async output processing), or a step launched ahead whose
    # successor cannot be (near max_tokens, a speculative one cannot launch ahead)
    assert len(steps) == len(device_calls)
    assert (len(steps) == num_engine_steps if backend == "torch"
            else len(steps) < num_engine_steps)
    drafting = [i for i, _ in steps if i.layout.num_spec_tokens]
    assert len(drafting) >= len(steps) - 2  # every decode step but the last drafted
    assert [i.num_spec_tokens for i in drafting[:3]] == [3] * 3  # k = 3 until max_tokens nears
    if backend == "jax":
        assert not draft_calls  # the draft ran only inside the compiled step
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] >= 3 * len(drafting)


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_are_rows_of_k_plus_one_tagged_with_sequences(tiny_model, backend: str) -> None:
    llm = spec_llm(tiny_model, backend)
    steps = record_steps(llm)
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in make_prompts(512)[:2]], params,
                 use_tqdm=False)
    for model_input, output in steps:
        k = model_input.layout.num_spec_tokens
        assert output.sampled_token_ids.shape == (model_input.num_logits, k + 1)
        assert output.sampled_logprobs.shape == output.sampled_token_ids.shape
        assert output.seq_ids == model_input.seq_ids
        assert len(set(output.seq_ids)) == len(output.seq_ids)
        for row in output.sampled_token_ids:  # tokens, then -1 padding, at least one token
            n = int((row >= 0).sum())
            assert n >= 1 and (row[:n] >= 0).all() and (row[n:] == -1).all()
    assert any(m.layout.num_spec_tokens for m, _ in steps)
    assert any(m.num_logits > m.num_seqs for m, _ in steps)  # the n=2 fork step


def _varied_workload(seed: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 120, 14)
    prompts = [{"prompt_token_ids": rng.integers(1, 500, int(n)).tolist()} for n in lengths]
    params = [SamplingParams(n=int(rng.integers(1, 3)), temperature=float(rng.choice([0, 0.8])),
                             top_p=float(rng.choice([1.0, 0.9])),
                             max_tokens=int(rng.integers(1, 24)),
                             logprobs=int(rng.choice([0, 2])) or None, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    return prompts, params


@pytest.mark.slow
@pytest.mark.usefixtures("compile_at_startup")
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_step_is_one_of_the_closed_set(tiny_model, backend: str) -> None:
    """Over a varied workload (prompt lengths 1-120, chunked prefill, n = 1-2, greedy and sampled
    rows, logprobs, speculation) every step's layout is one the engine built at startup, and
    nothing compiled (JAX) or was captured (CUDA graphs) after it."""
    llm = spec_llm(tiny_model, backend, max_num_batched_tokens=64, max_num_seqs=8)
    steps = record_steps(llm)
    prompts, params = _varied_workload(0)
    llm.generate(prompts, params, use_tqdm=False)
    layouts = {m.layout for m, _ in steps}
    assert layouts <= set(llm.engine.shapes.layouts())
    assert {layout.num_spec_tokens for layout in layouts} >= {0, 3}
    assert {m.flags.sampled for m, _ in steps} == {True, False}
    assert llm.get_metrics()["num_compiles_after_startup"] == 0
