"""Freezing the garbage collector's heap once an engine has started, as vLLM does after startup
(vllm/utils/gc_utils.py).

The ~200k objects alive then (torch's, transformers' and jax's modules, the engine's own) leave
the collector's reach, whose full collections scanned them all every few hundred steps (a torch
engine's output phase took 3x jax's). What becomes garbage while frozen (a dropped engine's
cycles) is collected at the next engine's start or at any engine's shutdown, which unfreeze the
heap.
"""

from __future__ import annotations

import gc

from pagedjax import envs


def freeze_gc_heap() -> None:
    """Collect what is garbage now (frozen garbage included), then freeze what is alive (~0.2 s
    over a quarter of a million objects); PAGEDJAX_FREEZE_GC_HEAP=0 leaves the heap alone."""
    if not envs.PAGEDJAX_FREEZE_GC_HEAP:
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def unfreeze_gc_heap() -> None:
    """Hand every frozen object back to the collector (an engine is shutting down)."""
    gc.unfreeze()
