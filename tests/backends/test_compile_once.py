"""The JAX backend compiles every step shape before the first request and nothing after it:
counted with jax.monitoring over a varied workload (benchmarks/varied_workload.py's), plain and
speculative; and a second process loads the compiled steps from the persistent cache."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.monitoring
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.config import ModelConfig
from pagedjax.core.batch import padding_input
from pagedjax.core.step_shapes import BatchLayout

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("varied_workload",
                                               REPO / "benchmarks" / "varied_workload.py")
workload = importlib.util.module_from_spec(_spec)
sys.modules["varied_workload"] = workload  # dataclasses look their module up while it loads
_spec.loader.exec_module(workload)

SMALL = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
             num_gpu_blocks_override=96)
_COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, seconds, **_: _COMPILES.append(name) if name == workload.BACKEND_COMPILE
    else None)


pytestmark = pytest.mark.usefixtures("compile_at_startup")


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [None, "draft_model", "suffix"])
def test_a_varied_workload_compiles_nothing_after_startup(tiny_model, speculative: str | None
                                                          ) -> None:
    """Prompts of 1 to max_model_len - 16 tokens, prefix-cache hits, n = 2, logprobs and
    prompt_logprobs, penalties, logit_bias, min_tokens, greedy and sampled rows, structured
    outputs (a choice, a regex), requests arriving while others run; speculative: an adaptive
    draft, or adaptive suffix decoding (drafts from the host)."""
    spec = {None: None, "draft_model": {"model": tiny_model("draft"), "num_speculative_tokens": 4},
            "suffix": {"method": "suffix", "num_speculative_tokens": 4}}[speculative]
    llm = LLM(tiny_model("llama"), backend="jax", speculative_config=spec, **SMALL)
    compiled_at_startup = len(_COMPILES)
    vocab = ModelConfig.from_pretrained(tiny_model("llama")).vocab_size
    requests = workload.varied_workload(vocab, SMALL["max_model_len"], 24, seed=1)
    outputs = workload.run_workload(llm, requests)
    assert len(outputs) == len(requests)
    assert _COMPILES[compiled_at_startup:] == []
    metrics = llm.get_metrics()
    assert metrics["num_compiles_after_startup"] == 0 and metrics["prefix_cache_hits"] > 0
    assert metrics["structured_output_requests_total"] == len(requests) // 5
    if speculative:
        assert metrics["spec_decode_num_draft_tokens"] > 0
    # the set is what step_shapes.py says: 4 sequence buckets (1-8), 3 token buckets (16-64),
    # and with a draft the compiled ks 2 and 4 of every sequence bucket
    assert metrics["num_step_shapes"] == 4 + 3 + (4 * 2 if speculative else 0)


@pytest.mark.slow
def test_a_second_process_loads_the_compiled_steps(tiny_model, tmp_path) -> None:
    """Two processes on one cache folder: the first compiles and stores every step, the second
    compiles none of them."""
    script = ("import json, jax.monitoring; from pagedjax import LLM; compiles = []; "
              "jax.monitoring.register_event_duration_secs_listener(lambda n, s, **k: "
              f"compiles.append(n) if n == {workload.BACKEND_COMPILE!r} else None); "
              f"llm = LLM({tiny_model('llama')!r}, backend='jax', **{SMALL!r}); "
              "print(json.dumps({'hits': llm.get_metrics()['compile_cache_hits'], "
              "'compiles': len(compiles), 'shapes': llm.get_metrics()['num_step_shapes']}))")
    env = {**os.environ, "PAGEDJAX_CACHE_DIR": str(tmp_path), "PAGEDJAX_COMPILE_AT_STARTUP": "1"}
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], env=env, check=True,
                                      capture_output=True, text=True).stdout.splitlines()[-1])
            for _ in range(2)]
    cold, warm = runs
    assert cold["hits"] == 0 and cold["compiles"] >= cold["shapes"]
    assert warm["hits"] == warm["shapes"] + 1  # every step shape, and the block copy
    assert warm["compiles"] < cold["compiles"] - warm["shapes"]  # none of the steps compiled


def test_a_shape_outside_the_set_is_counted_and_logged(tiny_model, caplog) -> None:
    """What the tests above would catch: a step of a shape the engine did not build compiles,
    counted in get_metrics() and logged with its layout."""
    llm = LLM(tiny_model("llama"), backend="jax", **SMALL)
    before = len(_COMPILES)
    odd = BatchLayout(num_tokens=3, num_seqs=2,
                      max_blocks_per_seq=llm.engine.shapes.max_blocks_per_seq)
    assert odd not in llm.engine.shapes.layouts()
    with caplog.at_level("WARNING"):
        llm.engine.runner.execute(padding_input(odd))
    assert len(_COMPILES) > before
    assert llm.get_metrics()["num_compiles_after_startup"] == 1
    assert "num_tokens=3, num_seqs=2" in caplog.text and "after startup" in caplog.text


def test_a_step_compiled_on_first_use_is_stored_for_the_next_engine(tiny_model, tmp_path,
                                                                     monkeypatch) -> None:
    """With PAGEDJAX_COMPILE_AT_STARTUP=0 each step shape compiles when first needed, and is
    stored: an engine of the same configuration loads it instead (still counted as built after
    startup)."""
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PAGEDJAX_COMPILE_AT_STARTUP", "0")
    built = []
    for _ in range(2):
        llm = LLM(tiny_model("llama"), backend="jax", **SMALL)
        before = len(_COMPILES)
        llm.generate(["def f(x):", "import os"], SamplingParams(temperature=0.0, max_tokens=4))
        runner = llm.engine.runner
        built.append((runner.num_compiles, runner.num_cache_hits, len(_COMPILES) - before))
        llm.shutdown()
    (first_built, first_hits, first_compiles), (second_built, second_hits, second_compiles) = built
    assert first_built >= 2 and first_hits == 0 and first_compiles >= first_built
    assert second_built == first_built and second_hits == first_built  # every one loaded
    assert second_compiles < first_compiles - first_built + 1
