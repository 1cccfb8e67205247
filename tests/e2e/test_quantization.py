"""Weights kept quantized on the CPU kernels: quantization="int8" (every projection and the LM
head as int8 blocks per output channel, a quarter of the float32 bytes; greedy tokens agreeing
with the float32 engine's on the demo target) and quantization="gguf" (a GGUF file's own
Q4_1/Q8_0 blocks; perplexity on English text beside the file dequantized, on the prompt's path
and on a decode step's), the JAX backend
computing the torch backend's bits through the same kernels, and every unsupported combination
refused by name."""

from __future__ import annotations

import pytest
import torch

from pagedjax import LLM, EngineArgs, SamplingParams
from pagedjax.model_loader.demo import demo_model_dirs
from pagedjax.utils import FlexibleArgumentParser

PROMPTS = ["def quicksort(xs):", "import numpy as np\n", "class Config(object):",
           "    for key, value in"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SMALL = dict(max_model_len=256, num_gpu_blocks_override=64)


def agreement(tokens: list[list[int]], expected: list[list[int]]) -> float:
    """The share of tokens generated before each completion first leaves the expected one."""
    agreed = 0
    for got, want in zip(tokens, expected, strict=True):
        agreed += next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    return agreed / sum(map(len, expected))


def test_int8_keeps_the_weights_quantized_and_the_tokens() -> None:
    target_dir, _ = demo_model_dirs()
    runs = {}
    for method in (None, "int8"):
        llm = LLM(target_dir, backend="torch", quantization=method, **SMALL)
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        runs[method] = [o.outputs[0].token_ids for o in outputs]
        module = llm.engine.runner.models[0].module
        if method == "int8":
            linears = [m for m in module.modules() if getattr(m, "qtype", None) is not None]
            assert len(linears) == 4 * module.config.num_layers + 1  # qkv, o, gate_up, down; head
            assert all(m.weight.dtype == torch.uint8 for m in linears)
            weight_bytes = sum(m.weight.numel() for m in linears)
            float_bytes = 4 * sum(m.weight.shape[0] * m.weight.shape[1] * 32 // 34
                                  for m in linears)
            assert weight_bytes < 0.27 * float_bytes  # 34 bytes a block of 32 weights
            again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in again] == runs["int8"]  # deterministic
        llm.shutdown()
    rate = agreement(runs["int8"], runs[None])
    print(f"int8 greedy agreement with float32: {rate:.3f}")
    assert rate >= 0.9


@pytest.mark.parametrize("kwargs,match", [
    (dict(quantization="awq"),
     r"quantization='awq' is not supported; use one of \(None, 'int8', 'gguf', 'fp8'\)"),
    (dict(quantization="fp8", tensor_parallel_size=2),
     r"quantization='fp8' runs on one device, not tensor_parallel_size=2"),
    (dict(quantization="int8", dtype="bfloat16"),
     r"quantization='int8' runs on the CPU kernels with float32 activations"),
    (dict(quantization="int8", backend="jax", attention_impl="reference"),
     r"quantization='int8' runs on the C\+\+ CPU kernels .* not with attention_impl='reference'"),
    (dict(quantization="gguf"), r"quantization='gguf' keeps a GGUF file's blocks, but model="),
])
def test_unsupported_combinations_are_named(kwargs: dict, match: str) -> None:
    target_dir, _ = demo_model_dirs()
    with pytest.raises(ValueError, match=match):
        LLM(target_dir, **{"backend": "torch", **SMALL, **kwargs})


def test_jax_keeps_the_same_blocks_and_computes_torchs_bits() -> None:
    """The JAX backend holds each projection and the head as the same int8 blocks (uint8
    "blocks" parameters) and runs them through XLA's FFI on the torch op's kernels: the same
    tokens, and logprobs within float32 rounding (the backends' log-softmax differ by ~1e-6 in
    float32 too)."""
    import jax.numpy as jnp

    target_dir, _ = demo_model_dirs()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    runs = {}
    for backend in ("torch", "jax"):
        llm = LLM(target_dir, backend=backend, quantization="int8", **SMALL)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        runs[backend] = [c for o in outputs for c in o.outputs]
        if backend == "jax":
            model = llm.engine.runner.target
            tree = model.params["params"]
            blocks = [leaf for path, leaf in _leaves(tree) if path[-1] == "blocks"]
            assert len(blocks) == 4 * model.config.num_layers + 1
            assert all(b.dtype == jnp.uint8 for b in blocks)
            assert not [path for path, _ in _leaves(tree) if path[-1] == "kernel"]
        llm.shutdown()
    for ours, theirs in zip(runs["jax"], runs["torch"], strict=True):
        assert ours.token_ids == theirs.token_ids
        for step, expected in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert step.keys() == expected.keys()
            for token, logprob in step.items():
                assert logprob.logprob == pytest.approx(expected[token].logprob, abs=1e-5)


def test_fp8_weights_on_both_backends() -> None:
    """quantization="fp8" (W8A8): every projection float8 e4m3 with a scale per output channel
    (the LM head as it is) on both backends, which then give the same tokens; beside the float32
    engine, greedy tokens agree as e4m3's three mantissa bits allow (0.77 measured on the demo
    target; SmolLM2-135M's perplexity +12.7 %, RESULTS.md)."""
    import jax.numpy as jnp

    target_dir, _ = demo_model_dirs()
    runs = {}
    for backend, method in (("torch", None), ("torch", "fp8"), ("jax", "fp8")):
        llm = LLM(target_dir, backend=backend, quantization=method, **SMALL)
        runs[backend, method] = [o.outputs[0].token_ids
                                 for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        if backend == "torch" and method == "fp8":
            module = llm.engine.runner.models[0].module
            fp8 = [m for m in module.modules()
                   if getattr(m, "weight", None) is not None
                   and m.weight.dtype == torch.float8_e4m3fn]
            assert len(fp8) == 4 * module.config.num_layers
            assert all(m.weight_scale.shape == (1, m.weight.shape[0]) for m in fp8)
            # cuBLASLt's FP8 GEMM takes W^T column-major only: W [out, in] in rows
            assert all(m.weight.is_contiguous() for m in fp8)
            assert module.lm_head.weight.dtype == torch.float32
        if backend == "jax":
            leaves = _leaves(llm.engine.runner.target.params["params"])
            kernels = [leaf for path, leaf in leaves
                       if path[-1] == "kernel" and path[0].startswith("layers_")]
            assert kernels and all(k.dtype == jnp.float8_e4m3fn for k in kernels)
            # [out, in] in rows, as cuBLASLt's FP8 GEMM reads W (fp8_dot): q_proj is square,
            # gate_proj [intermediate, hidden] tells the two layouts apart
            config = llm.engine.model_config
            gates = [leaf for path, leaf in leaves if path[-2:] == ("gate_proj", "kernel")]
            assert gates and all(g.shape == (config.intermediate_size, config.hidden_size)
                                 for g in gates)
            assert len([path for path, _ in leaves if path[-1] == "weight_scale"]) == len(kernels)
        llm.shutdown()
    assert agreement(runs["jax", "fp8"], runs["torch", "fp8"]) >= 0.95
    rate = agreement(runs["torch", "fp8"], runs["torch", None])
    print(f"fp8 greedy agreement with float32: {rate:.3f}")
    assert rate >= 0.6


def _leaves(tree: dict, path: tuple = ()) -> list[tuple[tuple, object]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaves(value, (*path, key))
        else:
            out.append(((*path, key), value))
    return out


def test_the_cli_flag() -> None:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", "--quantization", "int8"]))
    assert args.quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--quantization", "awq"])


@pytest.mark.slow
@pytest.mark.real_model
def test_perplexity_on_english_text(request) -> None:
    """SmolLM2-135M-Instruct on a public-domain English text (tests/data): its Q4_1 blocks
    equal to the same file dequantized to float32 where the prompt's rows go through
    dequantized tiles (the float32 linear's bits), and within +0.5 % where the prompt is read a
    token a step, each row of x in two int8 planes against the blocks, as a batch-1 decode
    step's (+0.16 %; one plane gave +0.49 %); int8 per channel within +2 %: its
    weights' own rounding costs +1.6 % (the prompt's rows read them dequantized, x unrounded;
    issue 46's +1 % is missed: the +0.96 % once measured came from x's int8 rounding offsetting
    part of it, +1.31 % on a CPU without AVX-512); the JAX backend on the file's blocks the torch
    backend's figure (the same kernels)."""
    from pathlib import Path

    from pagedjax.benchmarks.quality import perplexity
    from pagedjax.model_loader.demo import smollm2_instruct_gguf
    from tests.support.background import SMOLLM2_CONVERSION

    conversion = request.config.stash.get(SMOLLM2_CONVERSION, None)
    if conversion is not None:  # started when the session was collected
        conversion.wait(timeout=600)
    text = (Path(__file__).parents[1] / "data" / "declaration_of_independence.txt").read_text()
    results = {}
    for backend, method, step_tokens in ((None, None, None), ("torch", "gguf", None),
                                         ("torch", "gguf", 1), ("torch", "int8", None),
                                         ("jax", "gguf", None)):
        llm = LLM(smollm2_instruct_gguf(), backend=backend or "torch", quantization=method,
                  max_model_len=1024, max_num_seqs=1, num_gpu_blocks_override=80,
                  **({"max_num_batched_tokens": step_tokens} if step_tokens else {}))
        token_ids = llm.get_tokenizer().encode(text)
        assert 500 < len(token_ids) < 1000
        results[backend, method, step_tokens] = perplexity(llm, token_ids)
        llm.shutdown()
    print({k: round(v, 3) for k, v in results.items()})
    base = results[None, None, None]
    assert 1 < base < 50  # English the model reads
    assert results["torch", "gguf", None] == base
    assert results["torch", "gguf", 1] <= base * 1.005
    assert results["torch", "gguf", 1] != results["torch", "gguf", None]  # another path
    assert results["torch", "int8", None] <= base * 1.02
    assert results["jax", "gguf", None] == pytest.approx(results["torch", "gguf", None],
                                                         rel=1e-5)


def test_a_quantized_layer_fused_computes_the_modules_bits(monkeypatch) -> None:
    """Each decoder layer with int8 projections runs as one C++ op (pagedjax::decoder_layer
    over blocks): the same tokens and logprob bits as the layer module by module."""
    from pagedjax.backends.torch.model import DecoderLayer

    target_dir, _ = demo_model_dirs()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)

    def run() -> list:
        llm = LLM(target_dir, backend="torch", quantization="int8", **SMALL)
        layers = llm.engine.runner.models[0].module.layers
        fused = [layer.fused for layer in layers]
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        llm.shutdown()
        return fused, [(c.token_ids, [{t: lp.logprob for t, lp in step.items()}
                                      for step in c.logprobs])
                       for o in outputs for c in o.outputs]

    fused_flags, fused = run()
    assert all(fused_flags)
    monkeypatch.setattr(DecoderLayer, "fuse", lambda self: None)
    unfused_flags, unfused = run()
    assert not any(unfused_flags)
    assert fused == unfused
