"""Backend registry: a name → the runner class that executes batches for it (imported lazily,
so choosing one backend never imports the other's framework)."""

from __future__ import annotations

import importlib

RUNNERS = {
    "jax": "pagedjax.backends.jax.runner:JaxModelRunner",
    "torch": "pagedjax.backends.torch.runner:TorchModelRunner",
}


def get_runner_cls(backend: str) -> type:
    if backend not in RUNNERS:
        raise ValueError(f"backend={backend!r} is unknown; use one of {tuple(RUNNERS)}.")
    module, name = RUNNERS[backend].split(":")
    return getattr(importlib.import_module(module), name)
