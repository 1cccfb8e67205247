"""The official openai client against a real server (JAX backend): completions and chat,
streamed and not, n, seed, stop, logprobs, vLLM's extra fields, echo, several prompts, models,
tokenize, health and metrics."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from pagedjax import LLM, SamplingParams
from tests.entrypoints.openai.conftest import MODEL_NAME, start_server

PROMPTS = ["def fibonacci(n):", "import os\n", "class Config(object):"]
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def add(a, b):"}]
ENGINE = dict(backend="jax", max_model_len=128, num_gpu_blocks_override=64, max_num_seqs=16)


@pytest.fixture(scope="module")
def server(chat_model):
    with pytest.MonkeyPatch.context() as patch:  # as `pagedjax serve` runs: all compiled first
        patch.setenv("PAGEDJAX_COMPILE_AT_STARTUP", "1")
        server = start_server(chat_model, **ENGINE)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def post(server, path: str, body: dict) -> dict:
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())


def greedy(client, prompt, **kwargs):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                     **{"max_tokens": 12, **kwargs})


def test_models_and_health(server, client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].to_dict()["max_model_len"] == 128
    with urllib.request.urlopen(server.url + "/health") as response:
        assert response.status == 200


def test_greedy_completions_equal_the_offline_llm(server, client, chat_model) -> None:
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(chat_model, **ENGINE)
    want = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.shutdown()
    got = [greedy(client, p).choices[0] for p in PROMPTS]
    assert [c.text for c in got] == [w.text for w in want]
    assert [c.finish_reason for c in got] == [w.finish_reason for w in want]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_completion_chunks_join_to_the_whole_text(client, prompt: str) -> None:
    whole = greedy(client, prompt, max_tokens=16)
    chunks = list(greedy(client, prompt, max_tokens=16, stream=True,
                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        whole.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage == whole.usage
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_streamed_chat_chunks_join_to_the_whole_reply(server, client) -> None:
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                           max_completion_tokens=16)
    reply = whole.choices[0]
    assert reply.message.role == "assistant" and reply.message.content
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                            max_completion_tokens=16, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == reply.message.content
    assert chunks[-1].usage == whole.usage
    prompt_tokens = post(server, "/tokenize", {"messages": MESSAGES})["count"]
    assert whole.usage.prompt_tokens == prompt_tokens


def test_n_and_seed_reproduce(client) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], n=3, temperature=1.0, seed=7,
                  max_tokens=8, extra_body={"ignore_eos": True})
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 24


def test_streamed_choices_join_per_index(client) -> None:
    """vLLM's openai_completion_client example: n=2 with logprobs, streamed and not."""
    kwargs = dict(model=MODEL_NAME, prompt="A robot may not injure a human being", n=2,
                  logprobs=3, temperature=0.8, seed=3, max_tokens=8)
    whole = client.completions.create(**kwargs)
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            tokens[choice.index] += choice.logprobs.tokens if choice.logprobs else []
    assert texts == {c.index: c.text for c in whole.choices}
    assert tokens == {c.index: c.logprobs.tokens for c in whole.choices}


def test_stop_string_ends_the_text_before_it(client) -> None:
    text = greedy(client, PROMPTS[2], max_tokens=24, extra_body={"ignore_eos": True}
                  ).choices[0].text
    stop = text[10:12]
    cut = text[: text.index(stop)]
    choice = greedy(client, PROMPTS[2], max_tokens=24, stop=[stop],
                    extra_body={"ignore_eos": True}).choices[0]
    assert (choice.text, choice.finish_reason) == (cut, "stop")
    assert choice.to_dict()["stop_reason"] == stop
    chunks = greedy(client, PROMPTS[2], max_tokens=24, stop=[stop], stream=True,
                    extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == cut


def test_completion_logprobs(client) -> None:
    choice = greedy(client, PROMPTS[0], max_tokens=6, logprobs=3,
                    extra_body={"ignore_eos": True}).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # the top 3 (tokens that decode alike, such as partial characters, share a key)
        assert 1 <= len(top) <= 3 and top[token] == value == max(top.values())  # greedy
    streamed = greedy(client, PROMPTS[0], max_tokens=6, logprobs=3, stream=True,
                      extra_body={"ignore_eos": True})
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens
    assert sum((p.text_offset for p in parts), []) == lp.text_offset


def test_chat_logprobs(client) -> None:
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                           max_tokens=5, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True}).choices[0]
    content = reply.logprobs.content
    assert len(content) == 5 and "".join(e.token for e in content) == reply.message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the top token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_vllm_extras_in_the_body(server, client) -> None:
    choice = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=10, temperature=0.8, seed=1,
        extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.05, "min_tokens": 10}).choices[0]
    assert (choice.finish_reason, len(choice.logprobs or [])) == ("length", 0)
    tokens = greedy(client, PROMPTS[1], logprobs=0, extra_body={"ignore_eos": True}
                    ).choices[0].logprobs.tokens
    ids = [post(server, "/tokenize", {"prompt": t})["tokens"] for t in tokens]
    position = next(i for i, t in enumerate(ids) if len(t) == 1)
    stop_id = ids[position][0]
    stopped = greedy(client, PROMPTS[1], extra_body={"ignore_eos": True,
                                                     "stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].to_dict()["stop_reason"] == stop_id
    assert stopped.usage.completion_tokens == position + 1
    # the stop token's text is not output (vLLM's), unless include_stop_str_in_output
    assert stopped.choices[0].text == "".join(tokens[:position])
    kept = greedy(client, PROMPTS[1], extra_body={"ignore_eos": True, "stop_token_ids": [stop_id],
                                                  "include_stop_str_in_output": True})
    assert kept.choices[0].text == "".join(tokens[: position + 1])


def test_echo_several_prompts_and_token_ids(server, client) -> None:
    singles = [greedy(client, p, max_tokens=6).choices[0].text for p in PROMPTS]
    batch = greedy(client, PROMPTS, max_tokens=6, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [s for s in singles for _ in range(2)]
    echoed = greedy(client, PROMPTS[0], max_tokens=6, echo=True).choices[0].text
    assert echoed == PROMPTS[0] + singles[0]
    ids = post(server, "/tokenize", {"prompt": PROMPTS[0]})["tokens"]
    assert greedy(client, ids, max_tokens=6).choices[0].text == singles[0]


def test_tokenize_and_detokenize(server) -> None:
    tokens = post(server, "/tokenize", {"prompt": PROMPTS[2]})
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 128
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]})["prompt"] == PROMPTS[2]


def test_metrics_use_vllms_names(server, client) -> None:
    greedy(client, PROMPTS[0], max_tokens=4)
    metrics = server.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_time_per_output_token_seconds_count",
                 "request_prompt_tokens_count", "request_generation_tokens_count"):
        assert "pagedjax:" + name in metrics, name
    assert metrics["pagedjax:request_success_total{finished_reason=length}"] >= 1
    assert metrics["pagedjax:prefix_cache_hits_total"] > 0  # the prompts repeat
    assert metrics["pagedjax:num_requests_running"] == 0
    assert metrics["pagedjax:kv_cache_usage_perc"] == 0.0
    assert metrics["pagedjax:compiles_after_startup_total"] == 0  # the closed set holds
