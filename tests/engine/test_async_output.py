"""Async output processing: with jax, a step's outputs (text, stop strings, RequestOutputs) are
built during the next step while the device runs it. What users get is the same as building
them before step() returns, stop strings found a step late included; nothing leaks."""

from __future__ import annotations

import pytest

from pagedjax import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams

PROMPTS = ["def f(x):", "class A:", "import os", "for i in range(3):", "x = [1, 2"]


def make_engine(model_dir: str, backend: str = "jax", **kwargs) -> LLMEngine:
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model_dir, backend=backend, max_model_len=96, num_gpu_blocks_override=64,
        **kwargs))
    assert engine.runner.async_launch is (backend == "jax")  # jax launches asynchronously
    return engine


def run(engine: LLMEngine, params: list[SamplingParams]) -> tuple[dict, bool]:
    """Every request to its end → ({request id: (text, token ids, finish reason, stop reason,
    cumulative logprob)}, whether some step deferred its outputs); DELTA outputs are joined."""
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(str(i), prompt, p)
    texts, tokens, final, deferred = {}, {}, {}, False
    while engine.has_unfinished_requests():
        outputs = engine.step()
        deferred |= engine._deferred is not None
        for out in outputs:
            completion = out.outputs[0]
            texts[out.request_id] = texts.get(out.request_id, "") + completion.text
            tokens.setdefault(out.request_id, []).extend(completion.token_ids)
            if out.finished:
                assert out.request_id not in final, "a request finished twice"
                final[out.request_id] = (completion.finish_reason, completion.stop_reason,
                                         completion.cumulative_logprob)
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks  # nothing leaked
    assert not engine.scheduler.seqs and engine._deferred is None
    return {rid: (texts[rid], tokens[rid], *final[rid]) for rid in final}, deferred


@pytest.fixture(scope="module")
def stop_strings(tiny_model) -> list[str]:
    """A piece of each prompt's greedy continuation, so that every request stops on it."""
    engine = make_engine(tiny_model("llama"), disable_async_output_proc=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    done, _ = run(engine, [greedy] * len(PROMPTS))
    engine.shutdown()
    return [done[str(i)][0][6 + i : 9 + i] for i in range(len(PROMPTS))]


def test_outputs_match_building_them_before_step_returns(tiny_model, stop_strings) -> None:
    """Stop strings (finishing a sequence that the next step has already scheduled), a token
    limit, logprobs, DELTA and CUMULATIVE outputs: the same with and without deferral."""
    def params(i: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=24 - i, ignore_eos=True, stop=[stop_strings[i]],
            logprobs=1 if i % 2 else None,
            output_kind=RequestOutputKind.DELTA if i % 2 else RequestOutputKind.CUMULATIVE)

    results = {}
    for disabled in (True, False):
        engine = make_engine(tiny_model("llama"), disable_async_output_proc=disabled)
        results[disabled], deferred = run(engine, [params(i) for i in range(len(PROMPTS))])
        assert deferred != disabled  # the engine deferred, unless told not to
        engine.shutdown()
    assert results[False].keys() == results[True].keys()
    for rid, (text, token_ids, reason, stop, logprob) in results[False].items():
        assert (text, token_ids, reason, stop) == results[True][rid][:4]
        # a row's logprob may move in the last bits: the batches differ by the dropped rows
        expected = results[True][rid][4]
        assert logprob == (None if expected is None else pytest.approx(expected, rel=1e-6))
    stopped = [rid for rid, r in results[False].items() if r[2] == "stop"]
    assert len(stopped) >= 3  # most hit their stop string, and output nothing of it
    assert not any(stop_strings[int(rid)] in results[False][rid][0] for rid in stopped)


def test_torch_builds_outputs_before_step_returns(tiny_model) -> None:
    """The torch runner computes a step as it is called, so nothing is deferred there."""
    engine = make_engine(tiny_model("llama"), backend="torch")
    assert not engine.runner.async_launch
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("0", PROMPTS[0], greedy)
    while engine.has_unfinished_requests():
        engine.step()
        assert engine._deferred is None
    engine.shutdown()
