"""kv_cache_dtype="fp8" (vLLM's option) end to end: the KV pool holds float8 e4m3 (4x the blocks
of float32 for one budget, 2x those of bfloat16), greedy tokens stay close to the float KV
engine's on the demo target, both backends generate the same tokens from it, prefix caching,
copy-on-write and preemption keep working over fp8 blocks, and unsupported values are refused
by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from pagedjax import LLM, EngineArgs, SamplingParams
from pagedjax.backends.common.kv_cache_scales import kv_cache_scales
from pagedjax.config import EngineConfig, ModelConfig
from pagedjax.core.kv_cache import num_kv_blocks_for_budget
from pagedjax.model_loader.demo import demo_model_dirs
from pagedjax.utils import FlexibleArgumentParser
from tests.backends.test_torch_backend import MAX_TOKENS, STRESS, STRESS_PROMPTS
from tests.e2e.test_quantization import PROMPTS, agreement

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# a small KV budget (CPU: gpu_memory_utilization of 4 GiB) that sets the pool's size
BUDGET = dict(max_model_len=256, gpu_memory_utilization=0.001)


def _generate(backend: str, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(demo_model_dirs()[0], backend=backend, **kwargs)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def test_fp8_pool_holds_4x_the_blocks_and_keeps_the_tokens() -> None:
    """torch, float32: the demo target's greedy tokens agree with the float32 cache's at 0.57
    (the 4 completions leave it after 7, 32, 2 and 32 tokens; bfloat16 weights and cache agree
    at 0.77: the demo model's margins are thin)."""
    runs, blocks = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        runs[kv_cache_dtype], llm = _generate("torch", kv_cache_dtype=kv_cache_dtype, **BUDGET)
        blocks[kv_cache_dtype] = llm.engine.block_manager.num_blocks
        pool = llm.engine.runner.models[0].kv_pool
        assert pool.dtype == (torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.float32)
        if kv_cache_dtype == "fp8":
            again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in again] == runs["fp8"]  # deterministic
        llm.shutdown()
    assert 4 * blocks["auto"] <= blocks["fp8"] < 4 * (blocks["auto"] + 1)
    rate = agreement(runs["fp8"], runs["auto"])
    print(f"fp8 KV greedy agreement with float32 KV: {rate:.3f}; blocks {blocks}")
    assert rate >= 0.45
    assert all(got[:2] == want[:2] for got, want in zip(runs["fp8"], runs["auto"]))


def test_jax_fp8_generates_the_torch_tokens() -> None:
    """The same C++ kernels under both backends on CPU: the same fp8 bytes, the same tokens."""
    small = dict(max_model_len=128, num_gpu_blocks_override=64, max_num_seqs=4,
                 max_num_batched_tokens=64, kv_cache_dtype="fp8")
    tokens = {}
    for backend in ("torch", "jax"):
        tokens[backend], llm = _generate(backend, **small)
        if backend == "jax":
            caches = llm.engine.runner.kv_caches
            assert all(k.dtype == v.dtype == "float8_e4m3fn" for k, v in caches)
        llm.shutdown()
    assert tokens["jax"] == tokens["torch"]


@pytest.mark.parametrize("dtype,ratio", [("float32", 4), ("bfloat16", 2), ("float16", 2)])
def test_the_budget_rule_counts_one_byte_an_element(dtype: str, ratio: int) -> None:
    model_dir = demo_model_dirs()[0]
    model_config = ModelConfig.from_pretrained(model_dir)
    blocks, per_block = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        config = EngineConfig(model=model_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                              max_model_len=256, max_num_seqs=4096, gpu_memory_utilization=0.05)
        config.validate(model_config)
        per_block[kv_cache_dtype] = model_config.kv_bytes_per_block(
            16, config.kv_cache_dtype_bytes)
        blocks[kv_cache_dtype] = num_kv_blocks_for_budget(per_block[kv_cache_dtype], config,
                                                          None)
    assert per_block["auto"] == ratio * per_block["fp8"]
    assert ratio * blocks["auto"] <= blocks["fp8"] < ratio * (blocks["auto"] + 1)


def test_prefix_caching_copy_on_write_and_preemption_over_fp8_blocks(tiny_model) -> None:
    """The stress workload (chunked prefill, preemption, prefix hits, n=2 forks) over fp8 caches:
    forked completions agree, and the tokens are those of a pool large enough for none of it."""
    prompts = [{"prompt_token_ids": p} for p in STRESS_PROMPTS]
    params = [SamplingParams(n=2 if i % 3 == 0 else 1, temperature=0.0, max_tokens=MAX_TOKENS,
                             ignore_eos=True) for i in range(len(prompts))]
    runs = {}
    for name, kwargs in (("stress", STRESS),
                         ("relaxed", dict(STRESS, num_gpu_blocks_override=200,
                                          enable_prefix_caching=False))):
        llm = LLM(tiny_model("mistral"), backend="torch", kv_cache_dtype="fp8", **kwargs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs[name] = [[c.token_ids for c in o.outputs] for o in outputs]
        metrics = llm.get_metrics()
        if name == "stress":
            assert metrics["num_preemptions_total"] > 0 and metrics["prefix_cache_hits"] > 0
        llm.shutdown()
    assert all(len({tuple(c) for c in completions}) == 1 for completions in runs["stress"])
    assert runs["stress"] == runs["relaxed"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_cache_dtype="fp8_e5m2"),
     r"kv_cache_dtype='fp8_e5m2' is not supported; use one of \('auto', 'fp8', 'fp8_e4m3'\)"),
    (dict(kv_cache_dtype="int8"), r"kv_cache_dtype='int8' is not supported"),
])
def test_unsupported_kv_cache_dtypes_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(demo_model_dirs()[0], backend="torch", max_model_len=128, **kwargs)


def test_the_cli_flag() -> None:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    for value in ("fp8", "fp8_e4m3", "auto"):
        args = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", "--kv-cache-dtype",
                                                           value]))
        assert args.kv_cache_dtype == value
    assert EngineArgs(model="m", kv_cache_dtype="fp8").to_cli_args() == [
        "--model", "m", "--kv-cache-dtype", "fp8"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-dtype", "fp8_e5m2"])


def _with_scales(tmp_path: Path, tensors: dict[str, np.ndarray]) -> str:
    """The demo target's files, plus a shard holding `tensors` (a calibrated checkpoint's)."""
    for file in Path(demo_model_dirs()[0]).iterdir():
        (tmp_path / file.name).symlink_to(file)
    save_file(tensors, str(tmp_path / "kv_scales.safetensors"))
    return str(tmp_path)


def test_checkpoint_scales_are_read_per_layer(tmp_path: Path) -> None:
    """self_attn.k_scale / v_scale (or under k_proj / v_proj, as vLLM also reads them); a layer
    without them gets 1.0; the engine stores k / k_scale with them."""
    scale = lambda x: np.array(x, np.float32)  # noqa: E731
    model_dir = _with_scales(tmp_path, {
        "model.layers.0.self_attn.k_scale": scale(0.05),
        "model.layers.0.self_attn.v_scale": scale([0.02]),
        "model.layers.1.self_attn.k_proj.k_scale": scale(0.25)})
    num_layers = ModelConfig.from_pretrained(model_dir).num_layers
    want = [(0.05, 0.02), (0.25, 1.0)] + [(1.0, 1.0)] * (num_layers - 2)
    assert np.allclose(kv_cache_scales(model_dir, num_layers), want)
    llm = LLM(model_dir, backend="torch", kv_cache_dtype="fp8", max_model_len=128,
              num_gpu_blocks_override=64)
    layers = llm.engine.runner.models[0].module.layers
    assert np.allclose([(a.self_attn.k_scale, a.self_attn.v_scale) for a in layers], want)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    scaled_keys = llm.engine.runner.models[0].kv_pool[0, 0].float().abs().max()  # layer 0's k
    llm.shutdown()
    reference, llm = _generate("torch", kv_cache_dtype="fp8", max_model_len=128,
                               num_gpu_blocks_override=64)
    keys = llm.engine.runner.models[0].kv_pool[0, 0].float().abs().max()
    llm.shutdown()
    assert 10 * keys < scaled_keys <= 448  # k / 0.05 stored
    assert all(got[:2] == want[:2] for got, want in zip(tokens, reference))


def test_per_head_scales_are_refused(tmp_path: Path) -> None:
    model_dir = _with_scales(tmp_path, {"model.layers.0.self_attn.k_scale":
                                        np.ones(4, np.float32)})
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_scale .* not one positive "
                                         r"scale per layer"):
        LLM(model_dir, backend="torch", kv_cache_dtype="fp8", max_model_len=128)


@pytest.mark.parametrize("capability,refused", [("8.0", True), ("8.9", False), ("9.0", False),
                                                (None, False)])
def test_pallas_fp8_needs_sm_89(monkeypatch, capability: str | None, refused: bool) -> None:
    """Triton converts e4m3 from sm_89 on: older GPUs are told so before any compile."""
    import types

    import jax

    from pagedjax.backends.jax import params

    device = types.SimpleNamespace(compute_capability=capability)
    monkeypatch.setattr(jax, "devices", lambda *args: [device])
    if refused:
        with pytest.raises(ValueError, match=r"needs an sm_89\+ GPU .* this one is sm_8.0"):
            params.check_fp8_pallas("pallas")
    else:
        params.check_fp8_pallas("pallas")
    params.check_fp8_pallas("cpu")  # the C++ kernels read fp8 anywhere
