"""AsyncLLM without HTTP: output kinds, a lagging consumer, aborts, bad input, shutdown, and
speculative decoding through the engine loop."""

from __future__ import annotations

import asyncio

import pytest

from pagedjax import LLM, RequestOutputKind, SamplingParams
from pagedjax.engine.async_llm import AsyncEngineArgs, AsyncLLM, EngineDeadError
from tests.support.recorders import FinishedRecorder, wait_until

SMALL = dict(max_model_len=128, num_gpu_blocks_override=32)
PROMPTS = ["def fibonacci(n):", "import os\n", "class Config(object):"]
# max_tokens of a request the test aborts: the engine core, a process of its own, decodes on
# while the test process (maybe slowed by a neighbour) gets round to the abort
LONG = 480


def greedy(kind: RequestOutputKind, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=kind)


def make(model: str, **kwargs) -> tuple[AsyncLLM, FinishedRecorder]:
    recorder = FinishedRecorder()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **{**SMALL, **kwargs}),
                                    log_stats=False, stat_loggers=[lambda config: recorder])
    return llm, recorder


@pytest.fixture(scope="module")
def async_llm(tiny_model):
    # room for LONG tokens: an aborted request must still be far from done when its abort lands
    llm, recorder = make(tiny_model("llama"), backend="jax", max_model_len=512)
    llm.recorder = recorder
    yield llm
    llm.shutdown()


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> list:
    return [output async for output in llm.generate(prompt, params, request_id)]


def test_output_kinds_agree_with_the_offline_llm(async_llm, tiny_model) -> None:
    async def run():
        return await asyncio.gather(*[
            collect(async_llm, prompt, greedy(kind), f"{kind.name}-{i}")
            for i, prompt in enumerate(PROMPTS) for kind in RequestOutputKind])

    results = iter(asyncio.run(run()))
    offline = LLM(tiny_model("llama"), backend="jax", **SMALL)
    want = offline.generate(PROMPTS, greedy(RequestOutputKind.FINAL_ONLY), use_tqdm=False)
    offline.shutdown()
    for expected in want:
        cumulative, delta, final = next(results), next(results), next(results)
        completion = expected.outputs[0]
        assert "".join(o.outputs[0].text for o in delta) == completion.text
        assert sum((o.outputs[0].token_ids for o in delta), []) == completion.token_ids
        assert cumulative[-1].outputs[0].token_ids == completion.token_ids
        assert [len(o.outputs[0].token_ids) for o in cumulative] == sorted(
            len(o.outputs[0].token_ids) for o in cumulative)
        assert len(final) == 1 and final[0].outputs[0].text == completion.text
        assert all(outputs[-1].finished for outputs in (delta, cumulative, final))


def test_a_lagging_consumer_gets_the_outputs_merged(async_llm) -> None:
    num_finished = len(async_llm.recorder.finished)

    async def run():
        outputs = async_llm.generate(PROMPTS[0], greedy(RequestOutputKind.DELTA, 12), "lag")
        assert await asyncio.to_thread(
            wait_until, lambda: len(async_llm.recorder.finished) > num_finished)
        return [o async for o in outputs]

    # 12 steps' deltas arrived while it waited: merged (the last may come on its own)
    outputs = asyncio.run(run())
    assert len(outputs) <= 2 and outputs[-1].finished
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == 12


def test_closing_the_generator_aborts_the_request(async_llm) -> None:
    num_finished = len(async_llm.recorder.finished)

    async def run():
        outputs = async_llm.generate(PROMPTS[1], greedy(RequestOutputKind.DELTA, LONG), "drop")
        await outputs.__anext__()
        await outputs.aclose()

    asyncio.run(run())
    assert wait_until(lambda: len(async_llm.recorder.finished) > num_finished)
    (stats,) = async_llm.recorder.finished[num_finished:]
    assert stats.finish_reason == "abort" and stats.num_generation_tokens < LONG
    metrics = async_llm.get_metrics()
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]


def test_bad_input_raises_at_the_call_and_queues_nothing(async_llm) -> None:
    async def run():
        with pytest.raises(ValueError, match="empty"):
            async_llm.generate("", greedy(RequestOutputKind.DELTA), "bad")
        with pytest.raises(ValueError, match="max_model_len=512"):
            async_llm.generate("x", SamplingParams(max_tokens=600), "long")
        outputs = async_llm.generate(PROMPTS[0], greedy(RequestOutputKind.FINAL_ONLY), "dup")
        with pytest.raises(ValueError, match="already in use"):
            async_llm.generate(PROMPTS[0], greedy(RequestOutputKind.FINAL_ONLY), "dup")
        return [o async for o in outputs]

    assert asyncio.run(run())[-1].finished
    assert not async_llm.client.has_unfinished_requests()


def test_shutdown_fails_what_is_in_flight(tiny_model) -> None:
    llm, _ = make(tiny_model("llama"), backend="torch")

    async def run():
        outputs = llm.generate(PROMPTS[0], greedy(RequestOutputKind.DELTA, 100), "r")
        await outputs.__anext__()
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in outputs:
                pass
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS[0], greedy(RequestOutputKind.DELTA), "after")
        with pytest.raises(EngineDeadError):
            await llm.check_health()

    asyncio.run(run())
    assert llm.errored


def test_speculative_decoding_through_the_engine_loop(tiny_model) -> None:
    spec, _ = make(tiny_model("llama"), backend="torch", speculative_config={
        "model": tiny_model("draft"), "num_speculative_tokens": 3, "adaptive": False})
    plain, _ = make(tiny_model("llama"), backend="torch")

    async def run(llm: AsyncLLM):
        return await asyncio.gather(*[collect(llm, p, greedy(RequestOutputKind.FINAL_ONLY, 16),
                                              str(i)) for i, p in enumerate(PROMPTS)])

    try:
        got, want = asyncio.run(run(spec)), asyncio.run(run(plain))
        assert [o[-1].outputs[0].token_ids for o in got] == \
            [o[-1].outputs[0].token_ids for o in want]
        assert spec.get_metrics()["spec_decode_num_draft_tokens"] > 0
    finally:
        spec.shutdown()
        plain.shutdown()
