"""Async scheduling: a decode step is scheduled and launched before the last one's tokens reach
the host, its input tokens read on the device (forced on here, on the CPU). Users get the same
tokens, text and finish reasons as from the synchronous engine, a step later; requests added,
aborted or finishing mid-flight leak nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedjax import EngineArgs, LLMEngine, SamplingParams
from pagedjax.core.spec_policy import AdaptiveSpeculation

PROMPTS = ["def f(x):", "class A:", "import os", "for i in range(3):", "x = [1, 2", "y ="]


def make_engine(model_dir: str, async_scheduling: bool, **kwargs) -> LLMEngine:
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model_dir, max_model_len=96, num_gpu_blocks_override=64,
        async_scheduling=async_scheduling, **kwargs))
    engine.runner.async_launch = True  # as on an accelerator (a CPU computes as it is called)
    return engine


def params(i: int) -> SamplingParams:
    """Greedy and seeded sampling, token limits from 1 up, a stop string, logprobs, EOS."""
    return SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i,
                          max_tokens=[30, 2, 17, 24, 1, 12][i], ignore_eos=i != 5,
                          stop=["\n\n"] if i == 2 else None, logprobs=1 if i == 3 else None)


def run(engine: LLMEngine, late: int = 3, abort_at: int = 5,
        params: Callable[[int], SamplingParams] = params) -> tuple[dict, int]:
    """PROMPTS[:late] at once, the rest added after `late` steps, request "0" aborted at step
    abort_at → ({request id: (text, token ids, finish reason)}, steps launched ahead)."""
    launched_ahead = 0
    schedule_next = engine.scheduler.schedule_next

    def counted(last, *args):
        nonlocal launched_ahead
        out = schedule_next(last, *args)
        launched_ahead += out is not None
        return out

    engine.scheduler.schedule_next = counted
    for i in range(late):
        engine.add_request(str(i), PROMPTS[i], params(i))
    final, step = {}, 0
    while engine.has_unfinished_requests() or step <= late:
        if step == late:
            for i in range(late, len(PROMPTS)):
                engine.add_request(str(i), PROMPTS[i], params(i))
        if step == abort_at:
            engine.abort_request("0")
        for out in engine.step():
            assert out.request_id not in final, "a request finished twice"
            if out.finished:
                c = out.outputs[0]
                final[out.request_id] = (c.text, c.token_ids, c.finish_reason)
        step += 1
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks  # nothing leaked
    assert not engine.scheduler.seqs and engine.engine_core.overlap.in_flight is None
    return final, launched_ahead


@pytest.mark.parametrize("backend,prefix_caching",
                         [("jax", True), ("jax", False), ("torch", True)])
def test_outputs_match_the_synchronous_engine(tiny_model, backend: str,
                                              prefix_caching: bool) -> None:
    results, ahead = {}, {}
    for on in (False, True):
        engine = make_engine(tiny_model("llama"), on, backend=backend,
                             enable_prefix_caching=prefix_caching)
        results[on], ahead[on] = run(engine)
        engine.shutdown()
    assert ahead[False] == 0 and ahead[True] >= 20  # most decode steps were launched ahead
    assert results[True].keys() == results[False].keys() == {str(i) for i in range(6)}
    assert results[True] == results[False]
    assert results[True]["0"][2] == "abort"
    assert len(results[True]["3"][1]) == 24  # max_tokens, with logprobs on


def test_a_speculative_engine_runs_ahead_while_its_policy_drafts_nothing(tiny_model) -> None:
    """A draft that is never accepted (the random "draft" beside "llama"), and a step-time table
    (the tests build none) where drafts cost a quarter of a step each, and steps timed as
    scripted (k = 2 5x k = 0's): the policy drafts until it has measured the acceptance, then
    keeps k = 0 bar its probes and tries, and those k = 0 steps launch ahead as a plain
    engine's do. Greedy outputs equal the synchronous engine's; nothing leaks."""
    results, ahead = {}, {}
    for on in (False, True):
        engine = make_engine(tiny_model("llama"), on, backend="jax", speculative_config={
            "model": tiny_model("draft"), "num_speculative_tokens": 2})
        core = engine.engine_core
        shapes = core.speculation.shapes
        table = {s: {k: 2e-3 * (1 + 0.25 * k) for k in (0, *shapes.spec_ks)}
                 for s in shapes.seq_buckets}
        core.speculation = AdaptiveSpeculation(core.config.speculative_config, shapes, table)
        observe = core.speculation.observe  # steps timed as scripted: k = 0 the fastest

        def scripted(out, sampled, seconds=None, shape_k=None, launched_ahead=False,
                     observe=observe):
            seconds = None if seconds is None else 1e-3 * (1 + 2 * (shape_k or 0))
            observe(out, sampled, seconds, shape_k, launched_ahead)

        core.speculation.observe = scripted
        results[on], ahead[on] = run(engine, params=lambda i: SamplingParams(
            temperature=0.0, max_tokens=[60, 2, 40, 50, 1, 30][i], ignore_eos=True))
        steps_per_k = core.speculation.steps_per_k
        assert steps_per_k[0] > 0 and steps_per_k[2] > 0  # k = 2 first, then probes only
        engine.shutdown()
    assert ahead[False] == 0 and ahead[True] >= 30  # of ~50 k = 0 steps
    assert results[True] == results[False]
    assert results[True].keys() == {str(i) for i in range(6)}


@pytest.mark.parametrize("backend,method", [("jax", "ngram"), ("jax", "suffix"),
                                            ("torch", "ngram")])
def test_host_drafts_after_a_plain_step_launch_ahead(backend: str, method: str) -> None:
    """With n-gram or suffix drafts, a step after a plain one launches before that one's
    tokens reach the host, its drafts proposed from the tokens before them (the first of k + 1,
    a guess of the token in flight, dropped). Greedy and seeded sampled outputs, logprobs, stop
    strings, max_tokens mid-draft, late adds and an abort: as the synchronous engine's; nothing
    leaks."""
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False,
            **({"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {})}
    from pagedjax.model_loader.demo import demo_model_dirs

    results, ahead = {}, {}
    for on in (False, True):  # the demo target repeats itself: its drafts are accepted
        engine = make_engine(demo_model_dirs()[0], on, backend=backend, speculative_config=spec)
        results[on], _ = run(engine)
        ahead[on] = engine.engine_core.overlap.num_speculative_ahead  # verifying steps
        assert engine.get_metrics()["spec_decode_num_accepted_tokens"] > 0
        engine.shutdown()
    assert ahead[False] == 0 and ahead[True] > 0
    assert results[True].keys() == {str(i) for i in range(6)}
    assert results[True] == results[False]


def test_a_step_in_flight_is_collected_before_adds_aborts_and_shutdown(tiny_model) -> None:
    """step() returns a step late: the last decode step stays in flight until the next call,
    which collects it first when requests were added or aborted meanwhile; shutdown waits for
    it."""
    engine = make_engine(tiny_model("llama"), True)
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True))
    while engine.engine_core.overlap.in_flight is None:
        engine.step()
    in_flight = engine.engine_core.overlap.in_flight.out.seq_ids[0]
    engine.abort_request("a")
    outputs = engine.step()  # the step in flight collected first, then the abort
    reasons = [o.finish_reason for r in outputs for o in r.outputs]
    assert reasons[-1] == "abort" and not any(reasons[:-1])
    # the final output carries the tokens of every step, the one in flight's too
    assert len(outputs[-1].outputs[0].token_ids) >= 2
    assert engine.engine_core.overlap.in_flight is None and in_flight not in engine.scheduler.seqs
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True))
    while engine.engine_core.overlap.in_flight is None:
        engine.step()
    engine.shutdown()  # waits for the step in flight, then frees the device arrays
    assert engine.engine_core.overlap.in_flight is None


def test_torch_on_a_cpu_and_penalties_do_not_schedule_ahead(tiny_model) -> None:
    """torch computes on a CPU as it is called (nothing to overlap: it launches synchronously
    there, on CUDA not); a request with penalties needs every token on the host before its
    next step: both run synchronously."""
    torch_engine = LLMEngine.from_engine_args(EngineArgs(
        model=tiny_model("llama"), backend="torch", max_model_len=96,
        num_gpu_blocks_override=64, async_scheduling=True))
    assert torch_engine.runner.async_scheduling and not torch_engine.runner.async_launch
    torch_engine.add_request("t", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4,
                                                             ignore_eos=True))
    while torch_engine.has_unfinished_requests():
        torch_engine.step()
        assert torch_engine.engine_core.overlap.in_flight is None
    torch_engine.shutdown()
    engine = make_engine(tiny_model("llama"), True)
    engine.add_request("p", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6,
                                                       ignore_eos=True,
                                                       repetition_penalty=1.3))
    while engine.has_unfinished_requests():
        engine.step()
        assert engine.engine_core.overlap.in_flight is None
    engine.shutdown()
