"""Tensor parallelism: the same greedy tokens at TP = 1, 2, 4 (JAX on 4 fake CPU devices, torch
on 2 gloo processes), with KV heads split and, past their count, repeated; Orbax restoring into
the sharded layout; speculative decoding under TP; what the sharded step all-reduces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE_DEVICES = ("--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 "
                "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false "
                "--xla_cpu_parallel_codegen_split_count=1")  # conftest.py's, 4 devices
PROMPTS = [np.random.default_rng(0).integers(1, 500, n).tolist() for n in (3, 17, 40)]


def on_cpu_devices(scenario: str, **kwargs) -> dict:
    """Run tests/support/tp_scenarios.py's `scenario` in a process with 4 CPU devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAKE_DEVICES)
    done = subprocess.run([sys.executable, "-m", "tests.support.tp_scenarios", scenario,
                           json.dumps(kwargs)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_same_greedy(got: list[dict], want: list[dict]) -> None:
    """Token for token; a first divergence only where the reference's top two logprobs are
    within 1e-4 (an all-reduce in another order can round a near-tie the other way)."""
    for g, w in zip(got, want, strict=True):
        diverged = [i for i, (a, b) in enumerate(zip(g["tokens"], w["tokens"])) if a != b]
        if diverged:
            first, second = w["top2"][diverged[0]]
            assert first - second < 1e-4, (g["tokens"], w["tokens"])
        else:
            assert g["tokens"] == w["tokens"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe"])
def test_jax_tp_1_2_4_give_the_same_tokens(tiny_model, arch: str) -> None:
    """4 query heads, 2 KV heads: TP=2 splits both, TP=4 repeats each KV head twice. A mixture
    of experts (with a dense layer first) splits each expert's intermediate columns."""
    out = on_cpu_devices("greedy", model=tiny_model(arch), sizes=[1, 2, 4], prompts=PROMPTS)
    assert_same_greedy(out["2"], out["1"])
    assert_same_greedy(out["4"], out["1"])


def test_jax_orbax_restores_into_the_sharded_layout(tiny_model, tmp_path) -> None:
    import shutil

    model = shutil.copytree(tiny_model("llama"), tmp_path / "m")
    out = on_cpu_devices("orbax", model=str(model), prompts=PROMPTS)
    assert_same_greedy(out["2"], out["fresh"])
    assert_same_greedy(out["4"], out["fresh"])


@pytest.mark.slow
def test_jax_speculative_decoding_under_tp(tiny_model) -> None:
    """The draft split like the target, and replicated (vLLM's draft_tensor_parallel_size=1)."""
    out = on_cpu_devices("greedy", model=tiny_model("llama"), sizes=[1, 2], prompts=PROMPTS,
                         draft=tiny_model("draft"))
    assert_same_greedy(out["2"], out["1"])
    assert out["2_drafts"] > 0
    replicated = on_cpu_devices("greedy", model=tiny_model("llama"), sizes=[2], prompts=PROMPTS,
                                draft=tiny_model("draft"), draft_tensor_parallel_size=1)
    assert_same_greedy(replicated["2"], out["1"])
    assert replicated["2_drafts"] > 0


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_jax_step_all_reduces_what_the_plan_counts(tiny_model, arch: str) -> None:
    """Two [T, H] all-reduces per layer (after o_proj and down_proj, a mixture of experts' too:
    its tokens never leave their device); the rest (sampling over vocabulary-split logits, in
    the sampler's branches) carries one value per row or per logit entry: never a vocabulary's
    or a hidden state's worth."""
    out = on_cpu_devices("comm", model=tiny_model(arch), size=2)
    t, h = out["num_tokens"], out["hidden_size"]
    layer_reduces = [s for s in out["all_reduces"] if s == ["f32", [t, h]]]
    assert len(layer_reduces) == 2 * out["num_layers"]
    assert 4 * t * h * len(layer_reduces) == out["num_layers"] * out["planned_bytes_per_layer"]
    others = [int(np.prod(s[1])) for s in out["all_reduces"] if s not in layer_reduces]
    assert others and max(others) <= max(t, out["num_logit_entries"])


def test_bad_tensor_parallel_sizes(tiny_model, tmp_path) -> None:
    out = on_cpu_devices("errors", model=tiny_model("llama"), tmp_dir=str(tmp_path / "m8"))
    assert "tensor_parallel_size=3 does not split this model" in out["3"]
    assert "num_attention_heads=4 is not a multiple of 3" in out["3"]
    assert "tensor_parallel_size=8 exceeds the 4 cpu device(s)" in out["8"]


def test_torch_tp_2_gives_the_same_tokens_and_its_workers_exit(tiny_model) -> None:
    """TP=2 through the public LLM: rank 0 here, rank 1 a process the engine starts (gloo); with
    and without a draft (split like the target), a mixture of experts with one; the worker exits
    when the engine is closed."""
    from tests.support.tp_scenarios import greedy

    for arch, draft in (("qwen2", None), ("llama", tiny_model("draft")),
                        ("mixtral", tiny_model("draft"))):
        out = greedy(tiny_model(arch), [1, 2], PROMPTS, draft=draft, backend="torch",
                     keep_workers=True)
        assert_same_greedy(out[2], out[1])
        assert all(process.poll() == 0 for process in out["2_workers"])  # exited, cleanly
        if draft is not None:
            assert out["2_drafts"] > 0


def test_torch_workers_die_with_the_engine_process(tiny_model) -> None:
    """An engine process killed outright (SIGKILL, no cleanup) takes its workers with it."""
    code = ("import os, sys; from pagedjax import LLM; "
            f"llm = LLM({tiny_model('llama')!r}, backend='torch', tensor_parallel_size=2, "
            "max_model_len=128, num_gpu_blocks_override=40); "
            "print(*[p.pid for p in llm.engine.runner.workers.processes], flush=True); "
            "os.kill(os.getpid(), 9)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    pids = [int(p) for p in done.stdout.split()]
    assert done.returncode == -9 and pids
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0  # not a zombie
