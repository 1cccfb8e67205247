"""Every PAGEDJAX_* environment variable in one place, read when asked (vLLM's vllm/envs.py):
`pagedjax.envs.PAGEDJAX_COMPILE_AT_STARTUP` is the variable's value now, parsed.

- PAGEDJAX_CACHE_DIR: where pagedjax keeps what it builds once (compiled steps, the C++ FFI
  library, the speculation policy's step times); default `$XDG_CACHE_HOME/pagedjax`, else
  `~/.cache/pagedjax`.
- PAGEDJAX_DISABLE_COMPILE_CACHE=1: every process compiles its steps anew.
- PAGEDJAX_COMPILE_AT_STARTUP=0: each step shape compiles (or is captured) when a step first
  needs it, not all at startup (a quick start, paid for while serving).
- PAGEDJAX_FREEZE_GC_HEAP=0: an engine leaves the garbage collector's heap alone at startup.
- PAGEDJAX_ENGINE_CORE_PROCESS=0/1: the engine core in a process of its own or not, where the
  caller does not say (AsyncLLM: in its own by default; LLM: in this one).
- PAGEDJAX_STACK_LAYER_PARAMS=1: the jax step takes each per-layer weight stacked over the
  layers (a few arrays a call instead of one per weight; unpacked weights, one device); off by
  default until a GPU measures it (backends/jax/stacked_params.py).
- PAGEDJAX_ASYNC_SPECULATION=0/1: with a draft model, whether a speculative decode step may
  launch before the last one's tokens reach the host, as plain decode steps do
  (engine/overlap.py), on a runner that can; unset: on jax, not on torch (on a GPU only, not run
  on one yet).
- PAGEDJAX_TEST_FAIL_STEP_AFTER=N (tests only): an engine core in its own process raises after
  N good steps, as a bug in a step would (the server's failure path); 0 or unset: never.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

_FALSE = ("0", "false", "no", "off")


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in _FALSE


def _cache_dir() -> Path:
    explicit = os.environ.get("PAGEDJAX_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedjax"


def _optional_flag(name: str) -> bool | None:
    return _flag(name, False) if os.environ.get(name, "").strip() else None


def _int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; set it to one, or unset it."
                         ) from None


environment_variables: dict[str, Callable[[], Any]] = {
    "PAGEDJAX_CACHE_DIR": _cache_dir,
    "PAGEDJAX_DISABLE_COMPILE_CACHE": lambda: _flag("PAGEDJAX_DISABLE_COMPILE_CACHE", False),
    "PAGEDJAX_COMPILE_AT_STARTUP": lambda: _flag("PAGEDJAX_COMPILE_AT_STARTUP", True),
    "PAGEDJAX_FREEZE_GC_HEAP": lambda: _flag("PAGEDJAX_FREEZE_GC_HEAP", True),
    "PAGEDJAX_ENGINE_CORE_PROCESS": lambda: _optional_flag("PAGEDJAX_ENGINE_CORE_PROCESS"),
    "PAGEDJAX_STACK_LAYER_PARAMS": lambda: _flag("PAGEDJAX_STACK_LAYER_PARAMS", False),
    "PAGEDJAX_ASYNC_SPECULATION": lambda: _optional_flag("PAGEDJAX_ASYNC_SPECULATION"),
    "PAGEDJAX_TEST_FAIL_STEP_AFTER": lambda: _int("PAGEDJAX_TEST_FAIL_STEP_AFTER", 0),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
