"""`pagedjax serve` as a user runs it (a subprocess: speculative decoding, an API key, a chat
template file, the startup and periodic log lines), and `pagedjax bench serve` against it."""

from __future__ import annotations

import json
import signal
import urllib.request

import openai
import pytest

from pagedjax.engine.async_llm import AsyncEngineArgs
from pagedjax.entrypoints.cli import _parser, main
from pagedjax.entrypoints.openai.api_server import engine_args_from_cli
from tests.entrypoints.openai.conftest import CHAT_TEMPLATE
from tests.support.recorders import wait_until
from tests.support.serve_process import serve_process

API_KEY = "sk-cli"


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics") as response:
        return response.read().decode()


def test_serve_flags_make_async_engine_args(capsys) -> None:
    args = _parser().parse_args(["serve", "/ckpt", "--max_model_len", "256", "--backend",
                                 "torch", "--speculative-model", "/draft",
                                 "--num-speculative-tokens", "3", "--port", "9000"])
    engine_args = engine_args_from_cli(args)
    assert isinstance(engine_args, AsyncEngineArgs) and args.port == 9000
    assert (engine_args.model, engine_args.max_model_len, engine_args.backend) == (
        "/ckpt", 256, "torch")
    assert engine_args.speculative_config == {"model": "/draft", "num_speculative_tokens": 3}
    both = _parser().parse_args(["serve", "/ckpt", "--speculative-model", "/d",
                                 "--speculative-config", '{"model": "/d"}'])
    with pytest.raises(ValueError, match="not both"):
        engine_args_from_cli(both)
    assert main(["serve"]) == 2 and "error: no model" in capsys.readouterr().err


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """(base URL, the server's log file, its process) of `pagedjax serve` in a subprocess."""
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
    log_path = tmp / "serve.log"
    args = ["--backend", "torch", "--served-model-name", "tiny", "--api-key", API_KEY,
            "--chat-template", str(tmp / "chat.jinja"), "--speculative-model",
            tiny_model("draft"), "--num-speculative-tokens", "2", "--max-model-len", "128",
            "--num-gpu-blocks-override", "64", "--log-stats-interval", "0.5",
            "--uvicorn-log-level", "warning"]
    with serve_process(tiny_model("llama"), args, log_path) as (url, process):
        yield url, log_path, process


def test_serve_answers_the_openai_client_and_speculates(served) -> None:
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    completion = client.completions.create(model="tiny", prompt="def main():", max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 12
    reply = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    text = metrics(url)
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens"):
        (line,) = [line for line in text.splitlines()
                   if line.startswith(f"pagedjax:{name}_total")]
        assert float(line.split()[-1]) >= (1 if name != "spec_decode_num_accepted_tokens" else 0)


def test_bench_serve_reports_vllms_metrics(served, tmp_path) -> None:
    url, _, _ = served
    result = tmp_path / "bench.json"
    assert main(["bench", "serve", "--url", url, "--api-key", API_KEY, "--num-prompts", "8",
                 "--max-concurrency", "4", "--request-rate", "50", "--input-len", "8",
                 "--output-len", "8", "--ignore-eos", "--result-file", str(result)]) == 0
    summary = json.loads(result.read_text())
    assert (summary["completed"], summary["failed"]) == (8, 0)
    assert summary["total_output_tokens"] == 64 and summary["total_input_tokens"] > 0
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert summary[f"median_{name}_ms"] > 0 and f"p99_{name}_ms" in summary
    assert summary["p99_e2el_ms"] >= summary["median_e2el_ms"] >= summary["median_ttft_ms"]
    assert summary["output_throughput"] > 0


def test_bench_serve_requests_carry_its_temperature() -> None:
    """Greedy unless told (every served benchmark so far); --temperature 1 samples as a request
    that sets none does."""
    import argparse

    from pagedjax.benchmarks import serve as bench_serve

    parser = bench_serve.add_cli_args(argparse.ArgumentParser())
    for argv, want in (([], 0.0), (["--temperature", "1"], 1.0)):
        body = bench_serve._payload(parser.parse_args(argv), "tiny", "hello")
        assert body["temperature"] == want and body["prompt"] == "hello"


def test_startup_and_periodic_log_lines_then_a_clean_exit(served) -> None:
    url, log_path, process = served
    openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0).completions.create(
        model="tiny", prompt="x", max_tokens=40, extra_body={"ignore_eos": True})
    # the periodic line comes every 0.5 s after activity
    assert wait_until(lambda: "Avg generation throughput:" in log_path.read_text())
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0
    log = log_path.read_text()
    assert "Loaded " in log and " in " in log.split("Loaded ")[1].splitlines()[0]
    assert "KV cache: 64 blocks of 16 tokens = 1024 tokens" in log
    assert "maximum concurrency for 128 tokens per request: 8.00x" in log
    assert "Avg generation throughput:" in log and "KV cache usage:" in log
    assert "Traceback" not in log
