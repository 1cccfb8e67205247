"""The `pagedjax` command line: generate, convert (Orbax), and errors as one line."""

from __future__ import annotations

import shutil

from pagedjax import LLM, SamplingParams
from pagedjax.entrypoints.cli import main


def test_generate_prints_completions(tiny_model, capsys) -> None:
    rc = main(["generate", "--model", tiny_model("llama"), "--prompt", "def f(x):",
               "--prompt", "import os", "--max-tokens", "5", "--n", "2", "--seed", "1",
               "--temperature", "0.7"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.count("--- prompt: 'def f(x):'") == 2 and "--- prompt: 'import os' [1]" in out
    assert "20 tokens in" in err


def test_user_errors_are_one_line(capsys, tmp_path) -> None:
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: model=")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--max-tokens", "0"]) == 2


def test_convert_to_orbax_and_restore(tiny_model, tmp_path, capsys) -> None:
    model_dir = shutil.copytree(tiny_model("qwen2"), tmp_path / "model")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    fresh = LLM(str(model_dir), max_model_len=64, num_gpu_blocks_override=8)
    assert fresh.engine.runner.target.params_source == "safetensors"
    want = fresh.generate("def main():", params, use_tqdm=False)[0].outputs[0].token_ids

    assert main(["convert", "--model", str(model_dir)]) == 0
    assert "orbax-float32" in capsys.readouterr().out
    restored = LLM(str(model_dir), max_model_len=64, num_gpu_blocks_override=8)
    assert restored.engine.runner.target.params_source == "orbax"
    got = restored.generate("def main():", params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


def test_the_demo_pair_generates_code_with_and_without_speculation(capsys) -> None:
    """`pagedjax generate` without --model serves the shipped demo target (bf16 weights)."""
    assert main(["generate", "--prompt", "def ", "--max-tokens", "24"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "--prompt", "def ", "--max-tokens", "24", "--speculate",
                 "--backend", "torch", "--num-speculative-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == plain  # greedy: speculation and the backend change nothing
    assert "drafts accepted" in err
