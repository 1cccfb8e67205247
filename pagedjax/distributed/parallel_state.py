"""Releasing engines: vLLM's `cleanup_dist_env_and_memory` (vllm.distributed.parallel_state),
for every engine of this process.

Each engine core registers itself here; LLM.shutdown() releases one, this releases all (and runs
at interpreter exit), so a second engine made after the first fits where one does.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from typing import Protocol

from pagedjax.utils.gc_utils import unfreeze_gc_heap


class _Releasable(Protocol):
    def shutdown(self) -> None: ...


_ENGINES: weakref.WeakSet[_Releasable] = weakref.WeakSet()


def register_engine(engine: _Releasable) -> None:
    _ENGINES.add(engine)


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
