"""The jax decode steps an accelerator runs are branch-free: PLAIN (every sampling feature off)
and FULL (every feature on, over masks: a no-op for the rows that ask nothing), the draft loop
of speculative steps unrolled. Lowered for an NVIDIA GPU here on the CPU, none holds a
stablehlo while, case or if (on a GPU each copies its predicate to the host inside the step and
splits its CUDA graph); run on the CPU, they give the branched steps' tokens and logprobs on
greedy, sampled, filtered, penalized, constrained and padding rows, with and without a draft."""

from __future__ import annotations

import re

import jax
import pytest

from pagedjax import LLMEngine, SamplingParams, StructuredOutputsParams
from pagedjax.backends.jax import runner as jax_runner
from pagedjax.backends.jax import step as jax_step
from pagedjax.engine_args import EngineArgs
from tests.kernels.test_pallas_lowering import _gpu_target

_HOST_SYNCING_OPS = re.compile(r"stablehlo\.(while|case|if)\b")
SMALL = dict(backend="jax", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
             num_gpu_blocks_override=48)


def engine(model_dir: str, branch_free: bool, monkeypatch, **kwargs) -> LLMEngine:
    monkeypatch.setattr(jax_runner, "_branch_free_decode", lambda platform: branch_free)
    return LLMEngine.from_engine_args(EngineArgs(model=model_dir, **{**SMALL, **kwargs}))


def test_every_decode_variant_lowers_for_cuda_without_conditionals(tiny_model,
                                                                   monkeypatch) -> None:
    model_dir = tiny_model("llama")
    llm = engine(model_dir, True, monkeypatch, attention_impl="pallas",
                 speculative_config={"model": model_dir, "num_speculative_tokens": 2})
    runner = llm.runner
    keys = [key for key in runner.compile_plan(llm.shapes.layouts()) if isinstance(key, tuple)]
    variants = {(variant, layout.num_spec_tokens > 0) for layout, variant in keys}
    assert variants == {(jax_step.PLAIN, False), (jax_step.FULL, False),
                        (jax_step.FULL, True)}
    # the GPU's choices where the trace asks the backend: Pallas compiled (not interpreted),
    # XLA's top-k, filter and argmax instead of the C++ CPU kernels
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")

    def lowered(key) -> str:
        args, kwargs = runner._step_args(key)
        args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
        with _gpu_target():
            return runner._step.trace(*args, **kwargs).lower(
                lowering_platforms=("cuda",)).as_text()

    for key in keys:
        text = lowered(key)
        assert not _HOST_SYNCING_OPS.findall(text), key
        assert text.startswith("module @jit_step "), text[:80]  # gpu_suite dumps it by name
    # the branched step a CPU runs keeps its conditionals: the check sees them
    decode = next(layout for layout, variant in keys if variant == jax_step.FULL)
    assert _HOST_SYNCING_OPS.search(lowered(decode))
    llm.shutdown()


def requests() -> list[tuple[str, SamplingParams]]:
    """Rows that use every sampling feature, one by one and together (four at a time: the
    engine's batches of 1-4 rows pad to buckets of 1, 2 and 4)."""
    return [
        # the longest: its last steps are alone, greedy with no feature (PLAIN)
        ("def f(x):", SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)),
        ("class A:", SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True)),
        ("import os", SamplingParams(temperature=0.7, top_k=8, top_p=0.8, min_p=0.05, seed=5,
                                     max_tokens=9, ignore_eos=True, logprobs=3)),
        ("x = [1, 2", SamplingParams(temperature=0.0, max_tokens=8, logit_bias={5: 4.0},
                                     repetition_penalty=1.3, presence_penalty=0.5,
                                     min_tokens=4, logprobs=2)),
        ("answer: ", SamplingParams(temperature=0.8, seed=11, max_tokens=6,
                                    structured_outputs=StructuredOutputsParams(
                                        choice=["yes", "no", "maybe"]))),
        ("for i in", SamplingParams(temperature=0.5, seed=2, n=2, max_tokens=7,
                                    ignore_eos=True, logprobs=1)),
    ]


def generate(llm: LLMEngine) -> dict[str, list]:
    for i, (prompt, params) in enumerate(requests()):
        llm.add_request(str(i), prompt, params)
    done = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = [
                    (c.token_ids, c.text, c.finish_reason,
                     c.logprobs and [{t: (lp.logprob, lp.rank) for t, lp in step.items()}
                                     for step in c.logprobs]) for c in out.outputs]
    llm.shutdown()
    return done


@pytest.mark.parametrize("speculative", [False, True])
def test_branch_free_steps_give_the_branched_steps_outputs(tiny_model, monkeypatch,
                                                           speculative: bool) -> None:
    model_dir = tiny_model("llama")
    spec = ({"speculative_config": {"model": model_dir, "num_speculative_tokens": 2}}
            if speculative else {})
    launched = []
    results = {}
    for branch_free in (False, True):
        llm = engine(model_dir, branch_free, monkeypatch, **spec)
        step_key = llm.runner.step_key
        monkeypatch.setattr(llm.runner, "step_key", lambda model_input, f=step_key: (
            launched.append(f(model_input)), launched[-1])[1])
        results[branch_free] = generate(llm)
    assert results[True] == results[False]
    variants = {key[1] for key in launched if isinstance(key, tuple)}
    # greedy steps with no feature ran PLAIN (a speculative engine's run speculative ones)
    assert variants == ({jax_step.FULL} if speculative else {jax_step.PLAIN, jax_step.FULL})
    layouts = [key[0] if isinstance(key, tuple) else key for key in launched]
    assert any(layout.num_spec_tokens for layout in layouts) == speculative
