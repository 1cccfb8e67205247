"""GGUF mixtures of experts: a tiny Qwen3-MoE written as llama.cpp writes it ("qwen3moe", experts
stacked per layer) loads on both backends with HF transformers' greedy tokens, from F32 (HF on
the original checkpoint) and from Q8_0 (HF on the weights the file dequantizes to); Mixtral-style
files ("llama" with experts), architectures pagedjax does not load and quantization= are refused
by name."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.config import ModelConfig
from pagedjax.model_loader.gguf import convert_gguf, resolve_model_source
from pagedjax.testing.checkpoints import make_tiny_checkpoint
from tests.support.gguf_files import dequantized_checkpoint, write_gguf
from tests.support.hf_reference import hf_greedy

MAX_TOKENS = 8
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny Qwen3-MoE with every layer sparse: a GGUF cannot hold a dense one (gguf-py's
    qwen3moe tensor names have no dense ffn, and llama.cpp wants a router in every layer)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe-src"), "qwen3_moe",
                                tokenizer=tokenizer, mlp_only_layers=[])


@pytest.fixture(scope="module")
def moe_files(moe_dir, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """File type → (the GGUF file, the checkpoint HF's reference runs on)."""
    out = tmp_path_factory.mktemp("moe-gguf")
    return {"F32": (write_gguf(moe_dir, out / "moe-f32.gguf"), moe_dir),
            "Q8_0": (write_gguf(moe_dir, out / "moe-q8_0.gguf", dtype=Q8_0),
                     dequantized_checkpoint(moe_dir, out / "moe-q8_0-hf", Q8_0))}


@pytest.mark.parametrize("file_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_moe_gguf_generates_hfs_greedy_tokens(moe_files, backend: str, file_type: str) -> None:
    path, reference = moe_files[file_type]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, n).tolist() for n in (5, 23)]
    llm = LLM(str(path), backend=backend, max_model_len=64, num_gpu_blocks_override=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert ([o.outputs[0].token_ids for o in outputs] ==
            hf_greedy(str(reference), prompts, MAX_TOKENS))


def test_float32_moe_gguf_round_trips_exactly(moe_files, moe_dir) -> None:
    from safetensors.numpy import load_file

    out = Path(resolve_model_source(str(moe_files["F32"][0])))
    want, got = load_file(moe_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[name], want[name]) for name in want)
    config = ModelConfig.from_pretrained(out)
    # the experts' width is metadata transformers' reader leaves out
    assert (config.architecture, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, config.renormalize_topk) == (
                "Qwen3MoeForCausalLM", 8, 2, 32, True)


def test_mixtral_and_unsupported_moe_ggufs_are_refused(tiny_model, moe_dir, tmp_path,
                                                       monkeypatch) -> None:
    mixtral = write_gguf(tiny_model("mixtral"), tmp_path / "mixtral.gguf")
    with pytest.raises(ValueError, match=r"mixture of 8 experts in GGUF architecture 'llama' "
                                         r".*Hugging Face checkpoint.*load: qwen3moe\."):
        convert_gguf(mixtral, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    for architecture in ("qwen2moe", "olmoe"):
        path = write_gguf(moe_dir, tmp_path / f"{architecture}.gguf", architecture=architecture)
        with pytest.raises(ValueError, match=rf"is a '{architecture}' model; .*qwen3moe"):
            resolve_model_source(str(path))
    # without that check, transformers would read a dense Llama missing its MLPs: still refused
    monkeypatch.setattr("pagedjax.model_loader.gguf._check_experts", lambda *args: None)
    with pytest.raises(ValueError, match=r"found no weights .* for model\.layers\.0\.mlp\."):
        convert_gguf(mixtral, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_moe_gguf_with_quantization_is_refused(moe_files, monkeypatch) -> None:
    """From the file's metadata, before the (on a large file, long) conversion starts."""
    def no_conversion(*args):
        raise AssertionError("converted before refusing")

    monkeypatch.setattr("pagedjax.model_loader.gguf.convert_gguf", no_conversion)
    with pytest.raises(ValueError, match=r"\(qwen3moe\) \(a mixture of experts\) runs "
                                         r"unquantized.*quantization=None"):
        LLM(str(moe_files["Q8_0"][0]), backend="torch", quantization="gguf")
