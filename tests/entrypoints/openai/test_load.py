"""Load and faults against a real server (torch backend): 200 concurrent requests, streams the
client drops, a client that hangs up while waiting; /metrics counts match and no block leaks."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from pathlib import Path

import openai
import pytest

from tests.entrypoints.openai.conftest import MODEL_NAME, start_server
from tests.support.recorders import wait_until

K = 8  # tokens per request under load
# max_tokens of the requests that clients drop. The engine core steps in a process of its own,
# unpaced by the client and the server, which share the test process: a loaded host has let it
# decode 400 tokens before a client read the two chunks after which it hangs up. 4000 tokens at
# batch 10 take seconds.
LONG = 4000
PROMPTS = [f"def function_{i}(x, y):" for i in range(10)]


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    model = Path(shutil.copytree(chat_model, tmp_path_factory.mktemp("load") / "m"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    server = start_server(str(model), backend="torch", max_model_len=4096,
                          num_gpu_blocks_override=1024, max_num_seqs=64)
    yield server
    server.stop()


def client_for(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                              timeout=600)


def counted(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def assert_idle_and_no_block_held(server) -> None:
    assert wait_until(lambda: server.engine.get_metrics()["num_requests_running"] == 0)
    free, total = server.blocks_free()
    assert free == total
    metrics = server.metrics()
    assert metrics["pagedjax:num_requests_running"] == metrics["pagedjax:num_requests_waiting"] == 0
    assert metrics["pagedjax:kv_cache_usage_perc"] == 0.0


async def one_request(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, int]:
    """(completion tokens, finish reason, prompt tokens): completions and chat, streamed or not."""
    extra = {"ignore_eos": True}
    prompt = PROMPTS[i % len(PROMPTS)]
    messages = [{"role": "user", "content": prompt}]
    stream_options = {"include_usage": True}
    if i % 4 == 0:
        r = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=K,
                                            extra_body=extra)
        return r.usage.completion_tokens, r.choices[0].finish_reason, r.usage.prompt_tokens
    if i % 4 == 1:
        r = await client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                 max_tokens=K, extra_body=extra)
        return r.usage.completion_tokens, r.choices[0].finish_reason, r.usage.prompt_tokens
    if i % 4 == 2:
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=K,
                                                 stream=True, stream_options=stream_options,
                                                 extra_body=extra)
    else:
        stream = await client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                      max_tokens=K, stream=True,
                                                      stream_options=stream_options,
                                                      extra_body=extra)
    chunks = [c async for c in stream]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    return chunks[-1].usage.completion_tokens, reasons[-1], chunks[-1].usage.prompt_tokens


def test_200_concurrent_requests_finish_exactly_and_metrics_match(server) -> None:
    before = server.metrics()

    async def run() -> list[tuple[int, str, int]]:
        client = client_for(server)
        return await asyncio.gather(*[one_request(client, i) for i in range(200)])

    results = asyncio.run(run())
    assert [(n, reason) for n, reason, _ in results] == [(K, "length")] * 200
    after = server.metrics()
    assert counted(after, before, "pagedjax:request_success_total{finished_reason=length}") == 200
    assert counted(after, before, "pagedjax:generation_tokens_total") == 200 * K
    assert counted(after, before, "pagedjax:request_generation_tokens_sum") == 200 * K
    assert counted(after, before, "pagedjax:prompt_tokens_total") == sum(p for *_, p in results)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_time_per_output_token_seconds"):
        assert counted(after, before, f"pagedjax:{histogram}_count") == 200
    # K tokens, the first one timed by TTFT: at most K - 1 gaps per request
    assert 0 < counted(after, before, "pagedjax:inter_token_latency_seconds_count") <= 200 * (K - 1)
    assert_idle_and_no_block_held(server)


def test_dropped_streams_are_aborted_and_the_others_are_exact(server) -> None:
    async def run() -> tuple[dict[str, str], list]:
        client = client_for(server)
        expected = {}
        for prompt in PROMPTS:  # greedy, not streamed: what every kept stream must equal
            r = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12,
                                                temperature=0, extra_body={"ignore_eos": True})
            expected[prompt] = r.choices[0].text

        async def stream(i: int):
            prompt, dropped = PROMPTS[i // 10], i % 10 == 9
            chunks = await client.completions.create(
                model=MODEL_NAME, prompt=prompt, temperature=0, stream=True,
                max_tokens=LONG if dropped else 12, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            if dropped:
                for _ in range(2):
                    await chunks.__anext__()
                await chunks.close()  # the client goes away mid-stream
                return None
            parts = [c async for c in chunks]
            text = "".join(c.choices[0].text for c in parts if c.choices)
            return prompt, text, parts[-1].usage.completion_tokens

        return expected, await asyncio.gather(*[stream(i) for i in range(100)])

    before, num_finished_before = server.metrics(), len(server.recorder.finished)
    expected, results = asyncio.run(run())
    kept = [r for r in results if r is not None]
    assert len(kept) == 90
    assert all(text == expected[prompt] and n == 12 for prompt, text, n in kept)
    abort = "pagedjax:request_success_total{finished_reason=abort}"
    length = "pagedjax:request_success_total{finished_reason=length}"
    others = lambda: [(f.finish_reason, f.num_generation_tokens)  # noqa: E731
                      for f in server.recorder.finished[num_finished_before:]
                      if f.num_generation_tokens != 12]
    assert wait_until(lambda: counted(server.metrics(), before, abort) == 10), (
        f"aborts {counted(server.metrics(), before, abort)}, lengths "
        f"{counted(server.metrics(), before, length)}; finished, not of 12 tokens: {others()}")
    after = server.metrics()
    assert counted(after, before, length) == 100
    aborted = [f for f in server.recorder.finished[num_finished_before:]
               if f.finish_reason == "abort"]
    assert len(aborted) == 10 and all(f.num_generation_tokens < LONG for f in aborted)
    assert_idle_and_no_block_held(server)


def test_a_client_that_hangs_up_while_waiting_aborts_its_request(server) -> None:
    before, num_finished_before = server.metrics(), len(server.recorder.finished)
    body = json.dumps({"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": LONG,
                       "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert wait_until(lambda: server.engine.get_metrics()["num_requests_running"] == 1)
    sock.close()  # not streamed: the client hangs up before its response
    abort = "pagedjax:request_success_total{finished_reason=abort}"
    assert wait_until(lambda: counted(server.metrics(), before, abort) == 1)
    (finished,) = server.recorder.finished[num_finished_before:]
    assert finished.finish_reason == "abort" and finished.num_generation_tokens < LONG
    assert_idle_and_no_block_held(server)
