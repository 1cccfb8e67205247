"""Faults handled as trusted servers handle them, each provoked against `pagedjax serve` in a
subprocess: a client that stops reading during a shutdown, a huge prompt, half-sent requests and
a flood of connections, and an engine step that raises."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pagedjax.entrypoints.openai.errors import ENGINE_DEAD, ENGINE_FAILED
from pagedjax.testing.checkpoints import make_tiny_checkpoint
from tests.conftest import TINY_MODELS
from tests.entrypoints.openai.test_errors import assert_error_shape
from tests.support.recorders import wait_until
from tests.support.serve_process import serve_process

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
READ_TIMEOUT_S, MAX_CONNECTIONS = 2, 16
SHUTDOWN_TIMEOUT_S = 3


def completion(**fields: Any) -> dict:
    return {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True,
            **fields}


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def call(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """(status, parsed JSON body or, for a stream, its text)."""
    conn = http.client.HTTPConnection(*address(url), timeout=60)
    conn.request(method, path, None if body is None else json.dumps(body).encode(),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    if response.getheader("content-type", "").startswith("text/event-stream"):
        return response.status, text
    return response.status, json.loads(text) if text else None


def raw_post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    """POST as a client that sends the whole body whatever the server says meanwhile, then
    reads the answer (a server may answer and close before the body is in)."""
    with socket.create_connection(address(url), timeout=30) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body)))
        try:
            sock.sendall(body)
        except OSError:  # answered and closed early: the answer is still there to read
            pass
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())


class Stream:
    """A streaming completion read line by line."""

    def __init__(self, url: str, body: dict) -> None:
        self.conn = http.client.HTTPConnection(*address(url), timeout=60)
        self.conn.request("POST", CMPL, json.dumps(body).encode(),
                          {"Content-Type": "application/json"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        self.first = self.response.readline().decode()  # a token: the request is in flight

    def rest(self) -> str:
        text = self.first + self.response.read().decode()
        self.conn.close()
        return text


def events(text: str) -> list[Any]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in text.splitlines() if line.startswith("data: ")]


def assert_no_internals(body: Any) -> None:
    text = json.dumps(body)
    for internal in ("Traceback", 'File \\"', ".py", "/tmp", "/work", "RuntimeError"):
        assert internal not in text, text


# ---- a client that stops reading does not hold the shutdown ------------------------------------

LONG_CONTEXT = 16384


@pytest.fixture(scope="module")
def long_model(tokenizer, tmp_path_factory) -> str:
    """The tiny llama with a context long enough for streams that outlast the shutdown timeout
    (16k tokens take seconds)."""
    architecture, overrides = TINY_MODELS["llama"]
    out = tmp_path_factory.mktemp("tiny-long")
    return str(make_tiny_checkpoint(out, architecture, tokenizer=tokenizer,
                                    **{**overrides, "max_position_embeddings": LONG_CONTEXT}))


def test_sigterm_drains_reading_streams_ends_the_rest_and_exits_0(long_model, tokenizer,
                                                                   tmp_path) -> None:
    args = ["--backend", "torch", "--served-model-name", "tiny", "--max-model-len",
            str(LONG_CONTEXT), "--num-gpu-blocks-override", "2048", "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT_S), "--uvicorn-log-level", "warning"]
    log_path = tmp_path / "serve.log"
    with serve_process(long_model, args, log_path) as (url, process):
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its buffers fill soon
        stuck.connect(address(url))
        # 32 choices, each echoing a prompt of 10k of the longest token: 7 MB of first chunks,
        # more than the sockets hold
        longest = max(tokenizer.get_vocab().items(), key=lambda item: len(item[0]))[1]
        body = json.dumps(completion(stream=True, prompt=[longest] * 10_000, echo=True, n=32))
        stuck.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}".encode())  # never read
        long = Stream(url, completion(stream=True, max_tokens=LONG_CONTEXT - 16))
        assert wait_until(lambda: send_queue_is_full(address(url)[1], stuck.getsockname()[1]))
        short = Stream(url, completion(stream=True, max_tokens=20))
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        short_events, long_events = events(short.rest()), events(long.rest())
        code = process.wait(timeout=SHUTDOWN_TIMEOUT_S + 30)
        elapsed = time.monotonic() - start
        stuck.close()
    assert code == 0 and elapsed < SHUTDOWN_TIMEOUT_S + 5, (code, elapsed)
    # a stream that ends in time ends as usual
    assert short_events[-1] == "[DONE]" and short_events[-2]["choices"][0]["finish_reason"]
    assert not any("error" in e for e in short_events[:-1])
    # one that does not gets an error event, then [DONE]
    assert long_events[-1] == "[DONE]" and "choices" in long_events[0]
    assert_error_shape(long_events[-2])
    assert "shutting down" in long_events[-2]["error"]["message"]
    log = log_path.read_text()
    assert "not reading" in log and "The engine is shut down." in log, log[-3000:]
    assert "Traceback" not in log


def send_queue_is_full(server_port: int, client_port: int) -> bool:
    """Whether the server's socket to this client holds a megabyte or more unsent, unchanged
    for half a second: its send buffer is full and the server's writes to it wait (Linux's
    /proc/net/tcp, tx_queue in hex)."""

    def queued() -> int:
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, queues = fields[1], fields[2], fields[4]
            if (int(local.split(":")[1], 16), int(remote.split(":")[1], 16)) == (
                    server_port, client_port):
                return int(queues.split(":")[0], 16)
        return 0

    before = queued()
    time.sleep(0.5)
    return before >= 2**20 and queued() == before


# ---- huge prompts, half-sent requests, too many connections ------------------------------------


@pytest.fixture(scope="module")
def limited(tiny_model, tmp_path_factory):
    """(URL, log path) of a server with a short read deadline and few connections."""
    log_path = tmp_path_factory.mktemp("limited") / "serve.log"
    args = ["--backend", "torch", "--served-model-name", "tiny", "--max-model-len", "512",
            "--num-gpu-blocks-override", "64", "--request-read-timeout", str(READ_TIMEOUT_S),
            "--max-connections", str(MAX_CONNECTIONS), "--uvicorn-log-level", "warning"]
    with serve_process(tiny_model("llama"), args, log_path) as (url, _):
        yield url, log_path


class Bystanders:
    """Other clients while a test runs: a /health poller and small completions, each timed."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.health: list[float] = []
        self.completions: list[float] = []

    def _loop(self, path: str, body: Any, times: list[float]) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            assert call(self.url, "POST" if body else "GET", path, body)[0] == 200
            times.append(time.monotonic() - start)
            time.sleep(0.01)

    def __enter__(self) -> Bystanders:
        self.threads = [threading.Thread(target=self._loop, args=args, daemon=True) for args in
                        (("/health", None, self.health), (CMPL, completion(), self.completions))]
        for thread in self.threads:
            thread.start()
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


def test_a_huge_prompt_is_refused_at_once_and_stalls_no_one(limited) -> None:
    url, _ = limited
    huge, long = "x" * 20_000_000, "x" * 2_000_000  # over the body limit; under it
    cases = [(CMPL, completion(prompt=huge), 413, "request_too_large"),
             (CMPL, completion(prompt=long), 400, "context_length_exceeded"),
             (CMPL, completion(prompt=["a", long]), 400, "context_length_exceeded"),
             (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": long}]}, 400,
              "context_length_exceeded"),
             ("/tokenize", {"model": "tiny", "prompt": long}, 400, "context_length_exceeded")]
    bodies = [json.dumps(body).encode() for _, body, _, _ in cases]  # not while others time
    with Bystanders(url) as others:
        for (path, _, status, code), body in zip(cases, bodies):
            start = time.monotonic()
            got, error = raw_post(url, path, body)
            assert time.monotonic() - start < 1.0
            assert (got, error["error"]["code"]) == (status, code), error
            assert_error_shape(error)
    assert max(others.health) < 0.1, max(others.health)
    assert max(others.completions) < 0.1 + 3 * min(others.completions), others.completions
    assert call(url, "POST", CMPL, completion())[0] == 200


def test_half_sent_requests_are_closed_and_extra_connections_get_503(limited) -> None:
    url, log_path = limited
    halves = [b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Le",  # half the headers
              b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"model\": "]  # half the body
    held = []
    for i in range(MAX_CONNECTIONS):
        sock = socket.create_connection(address(url), timeout=READ_TIMEOUT_S + 5)
        sock.sendall(halves[i % 2])
        held.append(sock)
    start = time.monotonic()
    time.sleep(0.3)  # the server has read what they sent
    status, error = call(url, "GET", "/health")  # one connection too many
    assert (status, error["error"]["code"]) == (503, "too_many_connections"), error
    assert_error_shape(error)
    for sock in held:
        answer = b""
        while chunk := sock.recv(4096):  # until the server closes it
            answer += chunk
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert_error_shape(json.loads(answer.split(b"\r\n\r\n", 1)[1]))
    assert time.monotonic() - start < READ_TIMEOUT_S + 1.5
    assert wait_until(lambda: call(url, "GET", "/health")[0] == 200, timeout=5)
    assert call(url, "POST", CMPL, completion())[0] == 200
    assert "Traceback" not in log_path.read_text()


# ---- an engine step that raises ----------------------------------------------------------------


def test_a_failing_engine_step_fails_requests_in_flight_and_health(tiny_model, tmp_path,
                                                                     monkeypatch) -> None:
    monkeypatch.setenv("PAGEDJAX_TEST_FAIL_STEP_AFTER", "300")
    log_path = tmp_path / "serve.log"
    args = ["--backend", "torch", "--served-model-name", "tiny", "--max-model-len", "512",
            "--num-gpu-blocks-override", "64", "--uvicorn-log-level", "warning"]
    with serve_process(tiny_model("llama"), args, log_path) as (url, _):
        whole: list[tuple[int, Any]] = []
        thread = threading.Thread(target=lambda: whole.append(
            call(url, "POST", CMPL, completion(max_tokens=500))))
        thread.start()
        stream = Stream(url, completion(stream=True, max_tokens=500))
        stream_events = events(stream.rest())
        thread.join(timeout=60)
        (status, error), = whole
        assert (status, error["error"]["message"]) == (500, ENGINE_FAILED)
        assert stream_events[-1] == "[DONE]"
        assert stream_events[-2]["error"]["message"] == ENGINE_FAILED
        assert wait_until(lambda: call(url, "GET", "/health")[0] == 503, timeout=5)
        after = [call(url, "GET", "/health"), call(url, "POST", CMPL, completion())]
        for got, body in after:
            assert (got, body["error"]["message"]) == (503, ENGINE_DEAD)
        for body in [error, stream_events[-2]] + [body for _, body in after]:
            assert_error_shape(body)
            assert_no_internals(body)
    assert "fails on purpose" in log_path.read_text()  # the log keeps the detail
