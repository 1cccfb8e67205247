"""Bad input gets the right status and OpenAI's error JSON, never a 5xx or a traceback, and the
server keeps serving: a table of malformed and invalid requests, then a fuzz of request bodies."""

from __future__ import annotations

import http.client
import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedjax.entrypoints.openai.errors import ENGINE_DEAD, ENGINE_FAILED
from pagedjax.entrypoints.openai.protocol import sampling_param_names
from tests.entrypoints.openai.conftest import MODEL_NAME, start_server

API_KEY = "sk-test"
MAX_MODEL_LEN = 64
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "def f(x):"}]


@pytest.fixture(scope="module")
def server(chat_model):
    server = start_server(chat_model, api_key=API_KEY, backend="torch",
                          max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=32)
    yield server
    server.stop()


def request(server, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
            key: str | None = API_KEY) -> tuple[int, Any]:
    """(status, parsed JSON body or, for a stream, its text)."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers=headers)
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    if response.getheader("content-type", "").startswith("text/event-stream"):
        return response.status, text
    return response.status, json.loads(text) if text else None


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, **fields}


def unsupported_status(name: str) -> int:
    """400 until SamplingParams has the field (the sampling work adds some); then it passes."""
    return 200 if name in sampling_param_names() else 400


# (id, path, body or raw bytes, status, the error's param (None: not checked), message part)
CASES = [
    ("not json", CMPL, b"{not json", 400, None, "not valid JSON"),
    ("a json array", CMPL, [1, 2], 400, None, ""),
    ("no prompt", CMPL, {"model": MODEL_NAME}, 400, "prompt", "prompt"),
    ("prompt of a wrong type", CMPL, completion(prompt={"a": 1}), 400, "prompt", ""),
    ("empty prompt", CMPL, completion(prompt=""), 400, "prompt", "empty"),
    ("no prompts", CMPL, completion(prompt=[]), 400, "prompt", "empty"),
    ("token id outside the vocabulary", CMPL, completion(prompt=[1, 10**6]), 400, "prompt",
     "vocabulary"),
    ("negative token id", CMPL, completion(prompt=[-1]), 400, "prompt", "vocabulary"),
    ("n = 0", CMPL, completion(n=0), 400, "n", "n=0"),
    ("n not a number", CMPL, completion(n="two"), 400, "n", ""),
    ("n above max_num_seqs", CMPL, completion(n=1000), 400, "n", "max_num_seqs"),
    ("temperature < 0", CMPL, completion(temperature=-1), 400, "temperature", "temperature"),
    ("top_p = 0", CMPL, completion(top_p=0), 400, "top_p", "top_p"),
    ("top_k < -1", CMPL, completion(top_k=-5), 400, "top_k", "top_k"),
    ("max_tokens = 0", CMPL, completion(max_tokens=0), 400, "max_tokens", "max_tokens"),
    ("max_tokens past the context", CMPL, completion(max_tokens=10**6), 400, "prompt",
     "maximum context length is 64 tokens"),
    ("prompt alone past the context", CMPL, completion(prompt="x " * 200, max_tokens=None), 400,
     "prompt", "maximum context length is 64 tokens"),
    ("logprobs above 20", CMPL, completion(logprobs=50), 400, "logprobs", "logprobs"),
    ("empty stop string", CMPL, completion(stop=[""]), 400, "stop", "stop"),
    ("stop not a string", CMPL, completion(stop=5), 400, "stop", ""),
    ("min_tokens above max_tokens", CMPL, completion(min_tokens=9), 400, "min_tokens", ""),
    ("seed not an integer", CMPL, completion(seed="abc"), 400, "seed", ""),
    ("non-finite temperature", CMPL, {**completion(), "temperature": float("inf")}, 400,
     "temperature", ""),
    ("unknown field", CMPL, completion(foo=1), 400, "foo", "foo"),
    ("suffix", CMPL, completion(suffix="x"), 400, "suffix", "suffix"),
    ("best_of above n", CMPL, completion(best_of=3), 400, "best_of", "best_of"),
    ("unknown stream option", CMPL, completion(stream=True, stream_options={"x": 1}), 400,
     "stream_options", ""),
    ("unknown model", CMPL, completion(model="gpt-4"), 404, "model", "does not exist"),
    ("no messages", CHAT, {"model": MODEL_NAME}, 400, "messages", ""),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages", ""),
    ("message without a role", CHAT, chat(messages=[{"content": "hi"}]), 400, "messages",
     "role"),
    ("image content", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages", "text parts"),
    ("the template refuses a role", CHAT, chat(messages=[{"role": "bad", "content": "x"}]), 400,
     None, "roles must be"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", ""),
    ("top_logprobs above 20", CHAT, chat(logprobs=True, top_logprobs=30), 400, "logprobs", ""),
    ("max_completion_tokens past the context", CHAT, chat(max_completion_tokens=100), 400,
     "messages", "maximum context length"),
    ("auto tools without a parser", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool_choice",
     "--enable-auto-tool-choice"),
    ("a chat template in the request", CHAT, chat(chat_template="{{ 1 }}"), 400,
     "chat_template", "trust-request-chat-template"),
]


@pytest.mark.parametrize("path, body, status, param, message",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_the_right_error(server, path, body, status, param, message) -> None:
    raw = body if isinstance(body, bytes) else None
    got, error = request(server, "POST", path, None if raw else body, raw=raw)
    assert got == status, error
    assert_error_shape(error)
    assert message in error["error"]["message"]
    if param is not None:
        assert error["error"]["param"] == param


@pytest.mark.parametrize("name, value", [("presence_penalty", 0.5), ("frequency_penalty", 0.5),
                                         ("repetition_penalty", 1.3), ("logit_bias", {"5": 10})])
def test_sampling_fields_pass_through_once_samplingparams_has_them(server, name, value) -> None:
    status, body = request(server, "POST", CMPL, completion(**{name: value}))
    assert status == unsupported_status(name), body
    if status == 400:
        assert body["error"]["param"] == name and name in body["error"]["message"]
    neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
               "logit_bias": {}}[name]
    assert request(server, "POST", CMPL, completion(**{name: neutral}))[0] == 200


def test_auth_routes_and_methods(server) -> None:
    for key, code in ((None, "invalid_api_key"), ("sk-wrong", "invalid_api_key")):
        status, error = request(server, "POST", CMPL, completion(), key=key)
        assert (status, error["error"]["code"]) == (401, code)
        assert_error_shape(error)
    assert request(server, "GET", "/health", key=None)[0] == 200  # not behind the key
    for method, path, status in (("POST", "/v1/nope", 404), ("GET", CMPL, 405)):
        got, error = request(server, method, path, {})
        assert got == status and error["error"]["message"]
    assert request(server, "POST", "/tokenize", {"prompt": "a", "messages": USER})[0] == 400
    assert request(server, "POST", "/detokenize", {"tokens": [10**6]})[0] == 400


def test_a_valid_request_succeeds_after_the_bad_ones(server) -> None:
    status, body = request(server, "POST", CMPL, completion(max_tokens=6, ignore_eos=True))
    assert status == 200 and body["usage"]["completion_tokens"] == 6
    status, body = request(server, "POST", CHAT, chat(max_tokens=6, ignore_eos=True))
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    free, total = server.blocks_free()
    assert free == total


def test_a_failing_engine_answers_5xx_and_never_its_internals(chat_model) -> None:
    server = start_server(chat_model, backend="torch", max_model_len=MAX_MODEL_LEN,
                          num_gpu_blocks_override=16, multiprocess=False)
    try:
        def broken_step() -> list:
            raise RuntimeError("injected failure")

        server.engine.client.engine.step = broken_step
        status, text = request(server, "POST", CMPL, completion(stream=True))
        assert status == 200  # the headers went out before the engine failed
        error = json.loads(text.split("data: ")[1])
        assert_error_shape(error) and error["error"]["type"] == "server_error"
        assert text.endswith("data: [DONE]\n\n") and "Traceback" not in text
        assert error["error"]["message"] == ENGINE_FAILED  # the log has "injected failure"
        for method, path, body in (("POST", CMPL, completion()), ("POST", CHAT, chat()),
                                   ("GET", "/health", None)):
            status, error = request(server, method, path, body)
            assert (status, error["error"]["message"]) == (503, ENGINE_DEAD)
            assert_error_shape(error)
    finally:
        server.stop()


def test_a_killed_engine_core_fails_its_streams_and_the_server_turns_unhealthy(
        chat_model) -> None:
    """The engine core's process killed mid-stream: the stream ends with an error event,
    /health answers 503 within seconds, and new requests 503; nothing hangs."""
    server = start_server(chat_model, backend="torch", max_model_len=MAX_MODEL_LEN,
                          num_gpu_blocks_override=16)
    try:
        process = server.engine.client.process
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", CMPL, body=json.dumps(completion(
            stream=True, max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True)).encode(),
                     headers={"Content-Type": "application/json",
                              "Authorization": f"Bearer {API_KEY}"})
        response = conn.getresponse()
        first = response.readline()  # a token streamed: the request is in flight
        process.kill()
        text = first.decode() + response.read().decode()  # ends within the timeout
        status = response.status
        conn.close()
        assert status == 200 and '"server_error"' in text and text.endswith("data: [DONE]\n\n")
        assert "Traceback" not in text
        deadline = time.monotonic() + 5
        while request(server, "GET", "/health")[0] != 503:
            assert time.monotonic() < deadline, "/health stayed healthy"
            time.sleep(0.05)
        status, error = request(server, "POST", CMPL, completion())
        assert (status, error["error"]["message"]) == (503, ENGINE_DEAD)
        assert_error_shape(error)
    finally:
        server.stop()


def assert_error_shape(body: Any) -> bool:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in body["error"]["message"]
    return True


# ---- fuzz -------------------------------------------------------------------------------------

_ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.floats(-5, 5),
                 st.text(max_size=4), st.lists(st.integers(-2, 600), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=20)
_FIELDS = {  # valid values
    "model": st.sampled_from([MODEL_NAME, None]), "n": st.integers(1, 3),
    "max_tokens": st.integers(1, 12), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**31), "min_tokens": st.integers(0, 1),
    "stop": st.one_of(_TEXT, st.lists(_TEXT, max_size=2)),
    "stop_token_ids": st.lists(st.integers(0, 500), max_size=2), "ignore_eos": st.booleans(),
    "stream": st.booleans(), "presence_penalty": st.just(0.0),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
_MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant"]),
    "content": st.one_of(_TEXT, st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": _TEXT}), min_size=1, max_size=2))}),
    min_size=1, max_size=3)
_VALID = {
    CMPL: st.fixed_dictionaries(
        {"prompt": st.one_of(_TEXT, st.lists(st.integers(0, 500), min_size=1, max_size=8),
                             st.lists(_TEXT, min_size=1, max_size=2))},
        optional={**_FIELDS, "logprobs": st.integers(0, 5), "echo": st.booleans()}),
    CHAT: st.fixed_dictionaries(
        {"messages": _MESSAGES},
        optional={**_FIELDS, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
                  "max_completion_tokens": st.integers(1, 12)}),
}
_NAMES = sorted({*_FIELDS, "prompt", "messages", "logprobs", "top_logprobs", "echo",
                 "max_completion_tokens", "logit_bias", "best_of", "suffix", "unknown"})


@st.composite
def bodies(draw) -> tuple[str, dict]:
    """A valid body, half of the time with one to three fields set to anything."""
    path = draw(st.sampled_from([CMPL, CHAT]))
    body = draw(_VALID[path])
    if draw(st.booleans()):
        body.update(draw(st.dictionaries(st.sampled_from(_NAMES), _ANY, min_size=1,
                                         max_size=3)))
    return path, body


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(path_body=bodies())
def test_fuzzed_bodies_never_get_a_5xx(server, path_body) -> None:
    path, body = path_body
    status, response = request(server, "POST", path, body)
    assert status < 500, (body, response)
    if status >= 400:
        assert_error_shape(response)
