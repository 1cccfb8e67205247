"""The runner contract between the core and a backend, and the one backend registry.

A runner owns the device: weights, KV caches (the draft model's too) and compiled steps. It
executes one whole step per call (the forward and sampling; with drafts, the draft catch-up, k
draft steps, verification and rejection sampling) and returns host arrays only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable
from typing import Protocol

from pagedjax.config import DTYPES, EngineConfig, ModelConfig
from pagedjax.core.batch import ModelInput, ModelOutput
from pagedjax.core.step_shapes import BatchLayout, StepShapes

# backend name → "module:class" of its runner, imported only when chosen (a backend's framework
# never loads for the other one).
BACKENDS = {
    "jax": "pagedjax.backends.jax.runner:JaxModelRunner",
    "torch": "pagedjax.backends.torch.runner:TorchModelRunner",
    # No model: a fixed token per row, for measuring the engine's host work alone and for
    # end-to-end tests of the core (fixed_token_runner.py)
    "fixed-tokens": "pagedjax.core.fixed_token_runner:FixedTokenRunner",
}


class ModelRunner(Protocol):
    """What the engine needs from a backend."""

    num_kv_blocks: int  # blocks in the pool; each holds the target's (and draft's) KV

    @property
    def num_compiles(self) -> int:
        """Step shapes compiled (jit) or captured (CUDA graphs) after `compile`: a shape
        outside the closed set, logged; 0 while the set holds."""
        ...

    def cache_key(self) -> str:
        """What the runner's compiled steps, and so their timings, depend on: the device, the
        framework's version, pagedjax's code, the models' and KV caches' shapes."""
        ...

    @property
    def num_cache_hits(self) -> int:
        """Compiled steps loaded from a persistent cache instead of compiled."""
        ...

    def compile_plan(self, layouts: list[BatchLayout]) -> list[Hashable]:
        """What `compile` will compile or capture for these layouts (possibly nothing)."""
        ...

    def compile(self, layouts: list[BatchLayout], on_compiled: Callable[[], None]) -> None:
        """Compile or capture every step of these layouts before the first request;
        on_compiled() after each item of compile_plan."""
        ...

    def execute(self, model_input: ModelInput) -> ModelOutput:
        """Run one step: copy-on-write copies, the forward(s) and sampling."""
        ...

    # Whether execute_async returns before the device has finished the step (the engine then
    # builds the last step's outputs meanwhile).
    async_launch: bool
    # Whether a step may take its input tokens from the last launched step's sampled tokens
    # on the device (ModelInput's input_rows), so the engine can launch it before those reach
    # the host (async scheduling).
    async_scheduling: bool
    # Whether a draft model's speculative step may be launched before the last one's tokens
    # reach the host, moving on the device by the drafts that step accepted (ModelInput's
    # input_rows; backends/*/spec_step.shift_ahead): True, by default; None, where
    # PAGEDJAX_ASYNC_SPECULATION=1 asks; False, never.
    async_speculation: bool | None
    # Whether the host's other cores idle while the engine thread runs the Python between two
    # steps: the next step's grammar masks are then filled there, on a thread of their own
    # (StructuredOutputManager.fill_ahead).
    idle_cores_between_steps: bool

    def execute_async(self, model_input: ModelInput) -> Callable[[], ModelOutput]:
        """Start one step; the function returned waits for it and returns its output."""
        ...

    def shutdown(self) -> None:
        """Free the device memory (and worker processes); no step runs afterwards."""
        ...


class RunnerFactory(Protocol):
    def __call__(self, config: EngineConfig, model_config: ModelConfig,
                 draft_model_config: ModelConfig | None, shapes: StepShapes) -> ModelRunner:
        """A runner for config.model, plus the draft model of config.speculative_config (whose
        config is draft_model_config) sharing its block ids, for steps of these shapes."""
        ...

    def default_dtype(self, model_config: ModelConfig) -> str:
        """What dtype="auto" means on this backend's device for this checkpoint."""
        ...

    def min_decode_rows(self) -> int:
        """The fewest sequences a decode-shaped step is padded to (its smallest sequence
        bucket): 1, or more where this backend's products of a few rows are slow."""
        ...


def auto_dtype(model_config: ModelConfig, on_accelerator: bool) -> str:
    """The checkpoint's dtype on an accelerator; float32 on CPU, or if it names none."""
    if on_accelerator and model_config.dtype in DTYPES:
        return model_config.dtype
    return "float32"


def get_runner_cls(backend: str) -> RunnerFactory:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; use one of {tuple(BACKENDS)}.")
    module, name = BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module), name)
