"""An engine's start freezes the garbage collector's heap; what becomes garbage while frozen is
collected at the next engine's start and at shutdown (pagedjax/distributed.py). Off elsewhere
in the suite (conftest.py); PAGEDJAX_FREEZE_GC_HEAP=0 turns it off."""

from __future__ import annotations

import gc
import weakref

from pagedjax import EngineArgs, LLMEngine


class _Node:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_frozen_garbage_is_collected_by_the_next_start_and_shutdown(tiny_model,
                                                                     monkeypatch) -> None:
    monkeypatch.setenv("PAGEDJAX_FREEZE_GC_HEAP", "1")  # the default (conftest turns it off)

    def engine() -> LLMEngine:
        return LLMEngine.from_engine_args(EngineArgs(model=tiny_model("llama"), max_model_len=64,
                                                     num_gpu_blocks_override=16))

    cycle = _Node()
    alive = weakref.ref(cycle)
    first = engine()
    assert gc.get_freeze_count() > 1000  # the modules and the engine, frozen
    del cycle
    gc.collect()
    assert alive() is not None  # frozen: a collection does not scan it

    cycle = _Node()
    alive_too = weakref.ref(cycle)
    second = engine()  # its start unfreezes, collects, freezes again
    assert alive() is None
    del cycle
    gc.collect()
    assert alive_too() is not None  # frozen by the second start

    first.shutdown()  # hands the heap back to the collector
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive_too() is None
    second.shutdown()


def test_the_heap_is_left_alone_when_turned_off(tiny_model, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDJAX_FREEZE_GC_HEAP", "0")
    gc.unfreeze()
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model("llama"), max_model_len=64,
                                                   num_gpu_blocks_override=16))
    assert gc.get_freeze_count() == 0
    engine.shutdown()
