"""Torch backend parity with the JAX backend: the same tokens (greedy, float32, and seeded
sampling), the same logprobs, and the same scheduler decisions, through chunked prefill, preemption,
prefix-cache hits and n > 1 forks (copy-on-write)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedjax.backends.jax.runner import JaxModelRunner
from pagedjax.backends.torch.model import DecoderLayer, FusedStack
from pagedjax.backends.torch.runner import GRAPH_FLAGS, TorchModelRunner
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.core.batch_reference import describe
from pagedjax.core.kv_cache import num_kv_blocks_for_budget, warm_up_input
from pagedjax.core.scheduler_output import ScheduledBatch
from pagedjax.core.step_shapes import StepShapes
from pagedjax.entrypoints.llm import LLM
from pagedjax.sampling_params import SamplingParams
from tests.backends.test_engine_step import record_steps

BLOCK_SIZE = 16
MAX_TOKENS = 12
ARCHS = ("llama", "mistral", "qwen2")
# Synchronous steps on both backends, so that their decisions compare step for step (jax's
# async scheduling decides a decode step ahead; test_async_scheduling.py checks its outputs)
COMMON = dict(block_size=BLOCK_SIZE, max_model_len=256, enable_prefix_caching=True,
              async_scheduling=False)
# One step prefills everything; then every step decodes every sequence.
BASIC = dict(COMMON, num_gpu_blocks_override=64, max_num_batched_tokens=512)
BASIC_MAX_BLOCKS = 256 // BLOCK_SIZE
# A 64-token budget (chunked prefill); 20 blocks (320 slots) for ~560 slots of demand
# (preemption).
STRESS = dict(COMMON, num_gpu_blocks_override=20, max_num_batched_tokens=64)


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Basic prompts (lengths 1, bs-1, bs, bs+1, ..., 100+) and stress prompts (shared prefixes)."""
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(1, 500, n).tolist()
    basic = [ids(n) for n in (1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 5, 33, 64, 130)]
    prefix = ids(3 * BLOCK_SIZE + 3)
    stress = [prefix + ids(n) for n in (9, 1, 20)] + [ids(n) for n in (100, 7, 40)]
    stress += [prefix[:40] + ids(30), ids(2 * BLOCK_SIZE)]
    return basic, stress


BASIC_PROMPTS, STRESS_PROMPTS = _prompts()


@dataclass
class Run:
    token_ids: list[list[list[int]]]  # [prompt][completion] -> generated ids
    logprobs: list[list[list[float]]]  # [prompt][completion] -> per generated id (if requested)
    metrics: dict[str, int]
    schedule: list[tuple]  # one summary per step (see _record_schedule)


def _record_schedule(llm: LLM) -> list[tuple[ScheduledBatch, list[int]]]:
    """Keep each step as the engine prepares it, spelled out, and the sequences it preempted
    (see _summary)."""
    engine, log = llm.engine, []
    prepare = engine.engine_core._prepare

    def recording_prepare(out):
        log.append((describe(out, engine.scheduler.seqs, engine.block_manager,
                             engine.eos_token_ids), out.preempted_seq_ids))
        return prepare(out)

    engine.engine_core._prepare = recording_prepare
    return log


def _summary(logged: tuple[ScheduledBatch, list[int]]) -> tuple:
    """(scheduled, block copies, preempted ids) of a step, with the sample rows the request
    policies added to it (n > 1 forks) before it ran."""
    step, preempted = logged
    return ([(e.seq_id, e.start_pos, e.num_new_tokens, tuple(e.block_table),
              tuple(s.seq_id for s in e.samples)) for e in step.scheduled],
            [tuple(c) for c in step.block_copies], list(preempted))


def _run(model_dir: Path, backend: str, engine_kwargs: dict, prompts: list[list[int]],
         params: list[SamplingParams]) -> Run:
    llm = LLM(str(model_dir), backend=backend, **engine_kwargs)
    log = _record_schedule(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    completions = [o.outputs for o in outs]
    return Run(token_ids=[[c.token_ids for c in cs] for cs in completions],
               logprobs=[[[lp[t].logprob for lp, t in zip(c.logprobs or [], c.token_ids)]
                          for c in cs] for cs in completions],
               metrics=llm.get_metrics(), schedule=[_summary(out) for out in log])


def _greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          logprobs=1)


@pytest.fixture(scope="module")
def checkpoints(tiny_model) -> dict[str, Path]:
    """The shared tiny checkpoints (conftest): llama3 rope, a sliding window, biases + ties."""
    return {name: Path(tiny_model(name)) for name in ARCHS}


def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(n=2, temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=seed,
                          max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)


# "basic": every BASIC prompt greedy, plus the first six again sampled with every filter
# (seeded, n=2), in one batch; "stress": greedy, n=2 on every third prompt.
WORKLOADS = {
    "basic": (BASIC, BASIC_PROMPTS + BASIC_PROMPTS[:6],
              [_greedy()] * len(BASIC_PROMPTS) + [_seeded(i) for i in range(6)]),
    "stress": (STRESS, STRESS_PROMPTS,
               [_greedy(n=2 if i % 3 == 0 else 1) for i in range(len(STRESS_PROMPTS))]),
}


@pytest.fixture(scope="module")
def runs(checkpoints: dict[str, Path]):
    """(arch, backend, workload) → Run, cached: each run is shared by the tests that read it."""
    cache: dict[tuple[str, str, str], Run] = {}

    def get(arch: str, backend: str, workload: str) -> Run:
        key = (arch, backend, workload)
        if key not in cache:
            cache[key] = _run(checkpoints[arch], backend, *WORKLOADS[workload])
        return cache[key]

    return get


def _assert_logprobs_close(torch_run: Run, jax_run: Run) -> None:
    for got, want in zip(torch_run.logprobs, jax_run.logprobs, strict=True):
        for got_c, want_c in zip(got, want, strict=True):
            assert len(got_c) == len(want_c) == MAX_TOKENS
            np.testing.assert_allclose(got_c, want_c, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_jax(arch: str, runs) -> None:
    """(and both HF's: tests/e2e/test_hf_parity.py)"""
    torch_run, jax_run = runs(arch, "torch", "basic"), runs(arch, "jax", "basic")
    assert torch_run.token_ids == jax_run.token_ids
    _assert_logprobs_close(torch_run, jax_run)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_seeded_sampling_matches_jax(arch: str, runs) -> None:
    """Random sampling with every filter: seeded streams give the same tokens on both backends."""
    torch_run, jax_run = runs(arch, "torch", "basic"), runs(arch, "jax", "basic")
    sampled = slice(len(BASIC_PROMPTS), None)
    assert torch_run.token_ids[sampled] == jax_run.token_ids[sampled]
    assert any(len(set(map(tuple, cs))) == 2 for cs in torch_run.token_ids[sampled])  # it sampled


def test_greedy_parity_under_chunking_preemption_prefix_hits(runs) -> None:
    """Mistral: its sliding window crosses chunk, block and cached-prefix boundaries; n = 2
    forks of a greedy request give the same tokens twice."""
    arch = "mistral"
    torch_run, jax_run = runs(arch, "torch", "stress"), runs(arch, "jax", "stress")
    assert torch_run.token_ids == jax_run.token_ids
    assert all(len(set(map(tuple, completions))) == 1 for completions in torch_run.token_ids)
    _assert_logprobs_close(torch_run, jax_run)
    metrics = torch_run.metrics
    assert metrics["num_preemptions_total"] > 0
    assert metrics["prefix_cache_hits"] > 0
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]


def test_scheduler_decisions_match(runs) -> None:
    """Same workload, same decisions: batches, block tables, copies, preemptions, forks."""
    torch_run, jax_run = runs("mistral", "torch", "stress"), runs("mistral", "jax", "stress")
    assert torch_run.schedule == jax_run.schedule
    scheduled = [e for step, _, _ in torch_run.schedule for e in step]
    assert any(start > 0 and num_new > 1 for _, start, num_new, _, _ in scheduled)  # chunks
    assert any(len(samples) == 2 for *_, samples in scheduled)  # n=2 forks
    assert any(copies for _, copies, _ in torch_run.schedule)  # copy-on-write
    assert any(preempted for _, _, preempted in torch_run.schedule)


@pytest.mark.parametrize("impl", ["reference", "cuda_fused"])
def test_other_attention_impls_match_ops(checkpoints: dict[str, Path], runs, impl) -> None:
    """attention_impl="reference" (pure torch) generates what the custom ops generate; so does
    "cuda_fused" (its decode steps through decode_attention_with_kv_write: off a GPU the two
    ops it fuses)."""
    _, prompts, params = WORKLOADS["stress"]
    run = _run(checkpoints["mistral"], "torch", dict(STRESS, attention_impl=impl),
               prompts, params)
    ops_run = runs("mistral", "torch", "stress")
    assert run.token_ids == ops_run.token_ids
    _assert_logprobs_close(run, ops_run)


# a sliding window; q/k/v bias and a tied head; per-head q/k norms, experts and a dense layer
# (mlp_only_layers); experts without q/k norms
@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3_moe", "mixtral"])
def test_fused_decoder_layer_is_bit_identical(checkpoints: dict[str, Path], runs, tiny_model,
                                              arch: str, monkeypatch) -> None:
    """On the CPU in float32 each decoder layer runs as one C++ op (`pagedjax::decoder_layer`),
    the model's stack of them as one call (`pagedjax::decoder_layers`): the same ops in the
    same order as the layer module by module (q/k norms, router, routing and experts included),
    so the same tokens and the same logprob bits, sampled rows included, whether the stack
    runs in one call or a call a layer."""
    path = checkpoints[arch] if arch in checkpoints else Path(tiny_model(arch))
    llm = LLM(str(path), backend="torch", **BASIC)
    module = llm.engine.runner.models[0].module
    assert all(layer.fused for layer in module.layers) and module.stack is not None
    llm.shutdown()
    _, prompts, params = WORKLOADS["basic"]
    stacked = (runs(arch, "torch", "basic") if arch in checkpoints
               else _run(path, "torch", BASIC, prompts, params))
    monkeypatch.setattr(FusedStack, "of", classmethod(lambda cls, layers: None))
    fused = _run(path, "torch", BASIC, prompts, params)
    monkeypatch.setattr(DecoderLayer, "fuse", lambda self: None)
    unfused = _run(path, "torch", BASIC, prompts, params)
    for run in (fused, unfused):
        assert stacked.token_ids == run.token_ids
        assert stacked.logprobs == run.logprobs


def test_kv_pool_sizing_matches_jax(checkpoints: dict[str, Path]) -> None:
    """Without num_gpu_blocks_override both backends size the pool by the same rule."""
    model_dir = str(checkpoints["qwen2"])
    model_config = ModelConfig.from_pretrained(model_dir)
    config = EngineConfig(model=model_dir, backend="torch", max_model_len=256, max_num_seqs=4)
    config.validate(model_config)
    shapes = StepShapes.for_engine(max_num_seqs=4, max_num_batched_tokens=512,
                                   max_blocks_per_seq=config.max_blocks_per_seq,
                                   max_model_len=256)
    runner = TorchModelRunner(config, model_config, None, shapes)
    expected = num_kv_blocks_for_budget(
        model_config.kv_bytes_per_block(BLOCK_SIZE, config.dtype_bytes), config, None)
    jax_runner = JaxModelRunner(config, model_config, None, shapes)
    assert runner.num_kv_blocks == expected == jax_runner.num_kv_blocks
    assert runner.models[0].kv_caches[0][0].shape == (expected, 2, BLOCK_SIZE,
                                                      model_config.head_dim)
    assert runner.compile_plan(shapes.layouts()) == []  # CPU runs eagerly: no CUDA graphs
    # the step that sizes the pool on CUDA is a valid one
    model_input = warm_up_input(config, shapes)
    output = runner.execute(model_input)
    assert output.sampled_token_ids.shape == (model_input.num_logits, 1)
    assert (output.sampled_token_ids >= 0).all()


def test_bfloat16_runs(checkpoints: dict[str, Path], runs) -> None:
    """bfloat16 weights and caches: greedy may drift from float32, but the first token where
    it does is among bf16's top 5 there (the GPU parity rule of issue 4)."""
    top5 = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    llm = LLM(str(checkpoints["qwen2"]), backend="torch", dtype="bfloat16", **BASIC)
    outs = llm.generate([{"prompt_token_ids": p} for p in BASIC_PROMPTS[:3]], top5,
                        use_tqdm=False)
    fp32 = runs("qwen2", "torch", "basic").token_ids[:3]
    for out, fp32_tokens in zip(outs, fp32):
        bf16 = out.outputs[0]
        assert len(bf16.token_ids) == MAX_TOKENS
        assert all(np.isfinite(lp.logprob) for entry in bf16.logprobs for lp in entry.values())
        diverged = [i for i, (a, b) in enumerate(zip(bf16.token_ids, fp32_tokens[0])) if a != b]
        if diverged:
            assert fp32_tokens[0][diverged[0]] in bf16.logprobs[diverged[0]]


def test_graph_step_matches_eager(checkpoints: dict[str, Path]) -> None:
    """What a CUDA graph captures (the whole step, with the shape's launch bounds instead of
    the batch's own, and the whole sampler: the "full" variant), run eagerly on CPU, gives the
    eager step's tokens and logprobs; the "plain" variant too for greedy rows. The capture itself
    needs a GPU."""
    llm = LLM(str(checkpoints["llama"]), backend="torch", **BASIC)
    runner, recorded = llm.engine.runner, record_steps(llm)
    # A 1-token prompt with n=2: its first step is decode-shaped and forks (2 samples, 1 row).
    llm.generate({"prompt_token_ids": BASIC_PROMPTS[0]}, _greedy(n=2), use_tqdm=False)
    decode = [(i, o) for i, o in recorded if i.layout.decode]
    assert decode and decode[0][0].num_logits > decode[0][0].num_seqs  # the fork step
    model_input, eager = decode[-1]  # the last decode step: its KV is still in the pool
    n = model_input.num_logits
    for variant in GRAPH_FLAGS:
        with torch.inference_mode():
            out = runner._graph_step(model_input.layout, variant)(
                torch.from_numpy(model_input.ints), torch.from_numpy(model_input.floats))
        assert np.array_equal(out[0][:n].numpy(), eager.sampled_token_ids)
        np.testing.assert_allclose(out[1][:n].numpy(), eager.sampled_logprobs, rtol=0,
                                   atol=1e-6)


def test_cuda_graph_capture_plan(tiny_model) -> None:
    """On CUDA every decode and speculative decode shape of the closed set is captured at
    startup, in both sampler variants, and no mixed one (they run eagerly): checked on CPU,
    where nothing is captured."""
    spec = {"model": tiny_model("draft"), "num_speculative_tokens": 4}
    llm = LLM(tiny_model("llama"), backend="torch", speculative_config=spec, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=128, num_gpu_blocks_override=32)
    layouts = llm.engine.shapes.layouts()
    plan = TorchModelRunner.graph_plan(layouts)
    decode_shaped = [layout for layout in layouts if layout.decode or layout.num_spec_tokens]
    assert len(decode_shaped) == 4 * (1 + 2)  # S 1, 2, 4, 8 by k 0, 2, 4
    assert plan == [(layout, variant) for layout in decode_shaped for variant in GRAPH_FLAGS]
    assert llm.engine.runner.compile_plan(layouts) == []  # CPU: eager, nothing captured
