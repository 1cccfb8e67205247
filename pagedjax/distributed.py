"""Releasing engines: vLLM's `cleanup_dist_env_and_memory`, for every engine of this process.

Each LLMEngine registers itself here; LLM.shutdown() releases one, this releases all (and runs at
interpreter exit), so a second engine made after the first fits where one does.

An engine that has started freezes the garbage collector's heap (`freeze_gc_heap`, as vLLM does
after startup): the ~200k objects alive then (torch's, transformers' and jax's modules, the
engine's own) leave the collector's reach, whose full collections scanned them all every few
hundred steps (a torch engine's output phase took 3x jax's). What becomes garbage while frozen
(a dropped engine's cycles) is collected at the next engine's start or at any engine's shutdown,
which unfreeze the heap.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from typing import Protocol

from pagedjax import envs


class _Releasable(Protocol):
    def shutdown(self) -> None: ...


_ENGINES: weakref.WeakSet[_Releasable] = weakref.WeakSet()


def register_engine(engine: _Releasable) -> None:
    _ENGINES.add(engine)


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


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Shut down every engine of this process and return the memory the frameworks cached.

    shutdown_ray: accepted for vLLM's signature; pagedjax uses no Ray.
    """
    del shutdown_ray
    for engine in list(_ENGINES):
        engine.shutdown()
    unfreeze_gc_heap()
    gc.collect()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


atexit.register(cleanup_dist_env_and_memory)
