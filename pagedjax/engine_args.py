"""EngineArgs: the engine's options under vLLM's names, on the command line with `vllm serve`'s
flag spellings."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedjax.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATION_METHODS, EngineConfig
from pagedjax.core.model_runner import BACKENDS

# option → (help, extra argparse keywords); the flag is --option-with-dashes
_FLAGS: dict[str, tuple[str, dict]] = {
    "model": ("HF checkpoint directory", {}),
    "tokenizer": ("tokenizer directory (default: the model's)", {}),
    "backend": ("pagedjax backend", {"choices": tuple(BACKENDS)}),
    "dtype": ("weights and KV cache dtype; auto: the checkpoint's on a GPU, float32 on CPU",
              {"choices": ("auto", *DTYPES)}),
    "seed": ("seed of requests that give none", {"type": int}),
    "max_model_len": ("longest prompt + output (default: the model's, at most 4096); "
                      "widens every compiled step's block tables and logit-entry buffer",
                      {"type": int}),
    "block_size": ("tokens per KV block", {"type": int, "choices": (8, 16, 32)}),
    "gpu_memory_utilization": ("share of the accelerator's memory to use (on CPU: of a 4 GiB "
                               "KV budget)", {"type": float}),
    "num_gpu_blocks_override": ("KV pool size in blocks (instead of measuring memory)",
                                {"type": int}),
    "max_num_seqs": ("most sequences per step; each doubling adds a batch bucket: 1 + the "
                     "number of speculative ks more steps to compile at startup",
                     {"type": int}),
    "max_num_batched_tokens": ("token budget per step; each doubling adds a prefill step to "
                               "compile at startup", {"type": int}),
    "enable_prefix_caching": ("reuse cached prompt blocks",
                              {"action": argparse.BooleanOptionalAction}),
    "enforce_eager": ("no CUDA graphs", {"action": "store_true"}),
    "disable_async_output_proc": ("build each step's outputs before the next step runs (jax "
                                  "builds them while the device runs it)",
                                  {"action": "store_true"}),
    "async_scheduling": ("launch each decode step before the last one's tokens reach the host "
                         "(jax; step() returns a step late)",
                         {"action": argparse.BooleanOptionalAction}),
    "tensor_parallel_size": ("devices to shard the model over", {"type": int}),
    "speculative_config": ("JSON, e.g. '{\"model\": DIR, \"num_speculative_tokens\": 4}'; "
                           "each k compiled (2, 4, 8, 16 below num_speculative_tokens, and it) "
                           "adds a step per batch bucket to compile at startup",
                           {"type": json.loads}),
    "trust_remote_code": ("accepted; checkpoints with custom code are refused",
                          {"action": "store_true"}),
    "attention_impl": ("attention implementation (auto: the backend's fastest)", {}),
    "quantization": ("weights kept quantized: int8 (per output channel, at load) or gguf (a "
                     "GGUF file's Q8_0/Q4_x blocks) on CPUs; fp8 (W8A8, dynamic; FP8 GEMMs on "
                     "Hopper)",
                     {"choices": tuple(m for m in QUANTIZATION_METHODS if m)}),
    "kv_cache_dtype": ("KV cache storage: auto (the model's dtype) or fp8 / fp8_e4m3 (float8 "
                       "e4m3 with a per-layer scale: half bf16's bytes, twice the blocks)",
                       {"choices": KV_CACHE_DTYPES}),
    "reasoning_parser": ("the model's reasoning format (deepseek_r1, qwen3): structured outputs "
                         "constrain the answer after </think>; the server fills "
                         "reasoning_content", {}),
}


@dataclass
class EngineArgs(EngineConfig):
    """The engine's options (EngineConfig's fields) with a command-line side."""

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser,
                     skip: Sequence[str] = ()) -> argparse.ArgumentParser:
        """Add a flag per option (defaults: EngineArgs'); `skip` leaves some to the caller."""
        defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)
                    if f.default is not dataclasses.MISSING}
        for name, (help_text, extra) in _FLAGS.items():
            if name in skip:
                continue
            flag = "--" + name.replace("_", "-")
            kwargs = {"default": defaults.get(name), "help": help_text, **extra}
            if name == "tensor_parallel_size":
                parser.add_argument(flag, "-tp", dest=name, **kwargs)
                continue
            parser.add_argument(flag, dest=name, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if hasattr(args, f.name)})

    def to_cli_args(self) -> list[str]:
        """Flags that parse back to these EngineArgs (options left at their defaults omitted)."""
        argv = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value == field.default:
                continue
            flag = "--" + field.name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
        return argv

    def create_engine_config(self) -> EngineConfig:
        """A copy as a plain EngineConfig (validated again: the caller's stay as given)."""
        return EngineConfig(**{f.name: getattr(self, f.name)
                               for f in dataclasses.fields(EngineConfig)})

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        """EngineArgs(model, **kwargs), naming an unknown option and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; pagedjax takes "
                             f"{sorted(known - {'model'})}.")
        return cls(model=str(model), **kwargs)
