"""EngineArgs: vLLM's option names, `vllm serve`'s flags, and the errors for what pagedjax
cannot honour."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedjax import LLM
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine_args import EngineArgs
from pagedjax.utils import FlexibleArgumentParser


def parse(argv: list[str]) -> EngineArgs:
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser())
                                    .parse_args(argv))


def test_flags_round_trip(tmp_path) -> None:
    spec = {"model": str(tmp_path), "num_speculative_tokens": 3}
    argv = ["--model", "m", "--backend", "torch", "--dtype", "bfloat16", "--max_model_len", "512",
            "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching", "--enforce-eager",
            "-tp", "1", "--speculative-config", json.dumps(spec), "--num-gpu-blocks-override",
            "40", "--max-num-seqs", "8"]
    args = parse(argv)
    assert (args.model, args.backend, args.dtype, args.max_model_len) == ("m", "torch",
                                                                          "bfloat16", 512)
    assert args.gpu_memory_utilization == 0.5 and not args.enable_prefix_caching
    assert args.enforce_eager and args.speculative_config == spec
    assert args.num_gpu_blocks_override == 40 and args.max_num_seqs == 8
    assert parse(args.to_cli_args()) == args  # and back
    assert parse(["--model", "m"]) == EngineArgs(model="m")  # defaults are EngineArgs'


def test_llm_and_engine_take_the_same_names(tiny_model) -> None:
    model = tiny_model("llama")
    args = EngineArgs(model=model, max_model_len=128, num_gpu_blocks_override=24,
                      gpu_memory_utilization=0.5, max_num_seqs=4, seed=3)
    engine = LLMEngine.from_engine_args(args)
    assert args.dtype == "auto" and engine.config.dtype == "float32"  # auto on CPU; a copy
    llm = LLM(**dataclasses.asdict(args))
    assert llm.engine.config == engine.config
    assert engine.get_metrics()["kv_blocks_total"] == 24


@pytest.mark.parametrize("kwargs,match", [
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
    (dict(tensor_parallel_size=2), r"tensor_parallel_size=2 exceeds the 1 cpu device\(s\)"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not split this model"),
    (dict(dtype="int8"), "dtype='int8' is unsupported; use one of"),
    (dict(max_num_seqs=0), "max_num_seqs=0 must be >= 1"),
    (dict(speculative_config={"model": "x", "method": "eagle"}), "method='eagle'"),
    (dict(speculative_config={"model": "DRAFT", "draft_tensor_parallel_size": 2}),
     r"draft_tensor_parallel_size=2 must be 1 \(the draft replicated on every device\) or"),
    (dict(gpu_memory_util=0.5), r"unknown engine option\(s\) \['gpu_memory_util'\]"),
    (dict(backend="tpu"), "backend='tpu' is unknown"),
])
def test_bad_options_name_the_option(tiny_model, kwargs: dict, match: str) -> None:
    if kwargs.get("speculative_config", {}).get("model") == "DRAFT":
        kwargs["speculative_config"]["model"] = tiny_model("draft")
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model("llama"), **kwargs)


def test_custom_code_is_refused_with_trust_remote_code(tiny_model, tmp_path) -> None:
    import shutil

    model = tmp_path / "custom"
    shutil.copytree(tiny_model("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.Custom"}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="needs its own code"):
        LLM(str(model), trust_remote_code=True)
    llm = LLM(tiny_model("llama"), trust_remote_code=True, enforce_eager=True,
              max_model_len=64, num_gpu_blocks_override=8)  # harmless where there is no code
    assert llm.engine.config.trust_remote_code
