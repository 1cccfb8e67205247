"""A real server for each test module: uvicorn in a thread of the test process, on 127.0.0.1 and
a port the OS picked, over an AsyncLLM of a tiny checkpoint whose tokenizer has a chat template."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from pagedjax.engine.async_llm import AsyncEngineArgs, AsyncLLM
from pagedjax.engine.stat_loggers import PrometheusStatLogger
from pagedjax.entrypoints.openai.api_server import ServerConfig, build_app
from tests.support.recorders import FinishedRecorder

CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'bad' %}"
                 "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
                 "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MODEL_NAME = "tiny"


@pytest.fixture(scope="session")
def chat_model(tiny_model, tmp_path_factory) -> str:
    """The tiny llama checkpoint with a chat template beside its tokenizer."""
    out = Path(shutil.copytree(tiny_model("llama"), tmp_path_factory.mktemp("chat") / "m"))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return str(out)


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    engine: AsyncLLM
    recorder: FinishedRecorder
    api_key: str | None
    _uvicorn: uvicorn.Server = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[str, float]:
        """/metrics as {"name{label=value,...}": value} (labels other than model_name)."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics") as response:
            text = response.read().decode()
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                                  if k != "model_name")
                values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return values

    def blocks_free(self) -> tuple[int, int]:
        metrics = self.engine.get_metrics()
        return metrics["kv_blocks_free"], metrics["kv_blocks_total"]

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=30)
        self.engine.shutdown()


def start_server(model: str, *, api_key: str | None = None, multiprocess: bool | None = None,
                 server_config: dict | None = None, **engine_kwargs) -> Server:
    """multiprocess=False: the engine core on a thread of the test process (a test that
    reaches into it); by default in a process of its own, as `pagedjax serve` runs it.
    server_config: ServerConfig's other fields (tool calling, a chat template)."""
    recorder = FinishedRecorder()
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=model, **engine_kwargs), multiprocess=multiprocess,
        log_stats=False,
        stat_loggers=[lambda config: PrometheusStatLogger(MODEL_NAME, config.max_model_len),
                      lambda config: recorder])
    app = build_app(engine, ServerConfig([MODEL_NAME], api_key=api_key,
                                         **(server_config or {})))
    try:
        url, server, thread = serve_app(app)
    except RuntimeError:
        engine.shutdown()
        raise
    return Server(url, engine, recorder, api_key, server, thread)


def serve_app(app) -> tuple[str, uvicorn.Server, threading.Thread]:
    """(URL, server, thread) of uvicorn serving app on 127.0.0.1 and a port the OS picked;
    stop it with `server.should_exit = True` and a join."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread
