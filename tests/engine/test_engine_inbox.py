"""LLMEngine's inbox: add_request and abort_request queue commands that step() applies first, so
other threads may call them while one thread steps; an abort lands within one step."""

from __future__ import annotations

import threading

import pytest

from pagedjax import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams

DELTA = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                       output_kind=RequestOutputKind.DELTA)


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_model("llama"), max_model_len=64,
                                                 num_gpu_blocks_override=32))


def run_to_end(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_an_abort_lands_at_the_top_of_the_next_step(engine: LLMEngine) -> None:
    engine.add_request("a", "def f():", DELTA)
    engine.add_request("b", "class A:", DELTA)
    assert engine.has_unfinished_requests() and not engine.scheduler.waiting  # still queued
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    outputs = engine.step()
    # the abort last, after the outputs of "a"'s steps still in flight or being built (jax
    # launches a step before the last one's tokens are back, and builds outputs meanwhile)
    *earlier, aborted = [o for o in outputs if o.request_id == "a"]
    assert not any(o.finished for o in earlier)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) <= 2  # what those steps generated, if anything
    assert len(engine.block_manager.get_block_table(0)) == 0  # "a" (seq 0) holds no block
    assert [o.outputs[0].finish_reason for o in run_to_end(engine)][-1] == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_queued_request_that_is_aborted_never_starts(engine: LLMEngine) -> None:
    engine.add_request("q", "import os", DELTA)
    assert engine.abort_request("q") is True
    assert not engine.has_unfinished_requests() and engine.step() == []
    engine.add_request("q", "import os", DELTA)  # the id is free again
    assert engine.abort_request("q") and not engine.has_unfinished_requests()


def test_other_threads_add_and_abort_while_one_steps(engine: LLMEngine) -> None:
    stop, finished = threading.Event(), {}

    def step_loop() -> None:
        while not stop.is_set() or engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output.outputs[0].finish_reason

    stepper = threading.Thread(target=step_loop)
    stepper.start()
    ids = [f"t{i}" for i in range(24)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, f"x = {i}", SamplingParams(max_tokens=12,
                                                                  ignore_eos=True))
        if i % 3 == 2:
            engine.abort_request(ids[i - 1])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(ids[0], "again", DELTA)  # queued or running: still taken
    stop.set()
    stepper.join(timeout=300)
    aborted = {ids[i - 1] for i in range(len(ids)) if i % 3 == 2}
    assert set(finished) | aborted == set(ids)
    assert all(finished[r] == "length" for r in ids if r not in aborted)
    # an abort lands unless the request finished first (12 steps: rare, but threads race)
    reasons = [finished.get(r, "abort") for r in aborted]
    assert set(reasons) <= {"abort", "length"} and "abort" in reasons
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
