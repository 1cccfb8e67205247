"""The offline LLM with its engine core in a process of its own (LLM(multiprocess=True)): the
same outputs as in-process, bad input refused with the engine still serving, beam search, and a
core that dies fails generate() instead of hanging it."""

from __future__ import annotations

import threading
import time

import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.core.beam_search import BeamSearchParams
from pagedjax.engine.core_client import EngineDeadError, SyncMPClient

SMALL = dict(backend="jax", max_model_len=128, num_gpu_blocks_override=32)
PROMPTS = ["def fibonacci(n):", "import os\n", "class Config(object):", "x = [1, 2"]


def params() -> list[SamplingParams]:
    """Greedy, sampled with a seed, with logprobs and a stop string: every output path."""
    return [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=16, stop=["\n"], n=2, ignore_eos=True)]


@pytest.fixture(scope="module")
def mp_llm(tiny_model):
    llm = LLM(tiny_model("llama"), multiprocess=True, **SMALL)
    yield llm
    llm.shutdown()


def completions(outputs) -> list:
    return [[(c.text, c.token_ids, c.finish_reason, c.cumulative_logprob,
              c.logprobs and [{t: round(lp.logprob, 4) for t, lp in step.items()}
                              for step in c.logprobs])
             for c in o.outputs] for o in outputs]


def test_outputs_match_the_in_process_engine(mp_llm, tiny_model) -> None:
    assert isinstance(mp_llm.engine, SyncMPClient)
    got = mp_llm.generate(PROMPTS, params(), use_tqdm=False)
    local = LLM(tiny_model("llama"), multiprocess=False, **SMALL)
    want = local.generate(PROMPTS, params(), use_tqdm=False)
    local.shutdown()
    assert [o.request_id for o in got] == [o.request_id for o in want]
    assert completions(got) == completions(want)
    assert mp_llm.get_metrics()["generation_tokens_total"] > 0


def test_bad_input_is_refused_and_the_engine_keeps_serving(mp_llm) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        mp_llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=4),
                                      SamplingParams(max_tokens=10_000)], use_tqdm=False)
    out = mp_llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5,
                                                     ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    assert not mp_llm.engine.has_unfinished_requests()


def test_beam_search_through_the_core_process(mp_llm, tiny_model) -> None:
    beams = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    got = mp_llm.beam_search(PROMPTS[:2], beams)
    local = LLM(tiny_model("llama"), multiprocess=False, **SMALL)
    want = local.beam_search(PROMPTS[:2], beams)
    local.shutdown()
    assert [[s.tokens for s in o.sequences] for o in got] == [
        [s.tokens for s in o.sequences] for o in want]


@pytest.mark.parametrize("gone", [False, True])
def test_a_core_that_dies_fails_generate(tiny_model, gone) -> None:
    """Killed just before generate, or gone long enough that its socket is closed (a send to
    it then blocked for ever, as a CI run of 2026-12-04 found): EngineDeadError, no hang."""
    llm = LLM(tiny_model("llama"), multiprocess=True, **SMALL)
    llm.engine.process.kill()
    if gone:
        llm.engine.process.wait()
        time.sleep(0.5)  # ZeroMQ drops the dead peer's pipe
    raised: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(PROMPTS, SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
        except BaseException as error:  # noqa: BLE001 - what the test asserts on
            raised.append(error)

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "generate hung on a dead engine core"
    assert len(raised) == 1 and isinstance(raised[0], EngineDeadError), raised
    llm.shutdown()
