"""Where pagedjax keeps what it builds once (the JAX backend's compiled steps, steps/, and the C++
FFI library), whether compiled steps are cached, and when the steps compile: all at startup by
default, or each when a step first needs it (adaptive speculation then keeps k fixed: its
step-time table would compile every speculative shape). The switches: envs.py."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from pagedjax import envs


def cache_dir() -> Path:
    return envs.PAGEDJAX_CACHE_DIR


def compile_cache_enabled() -> bool:
    return not envs.PAGEDJAX_DISABLE_COMPILE_CACHE


def compile_at_startup() -> bool:
    return envs.PAGEDJAX_COMPILE_AT_STARTUP


def source_digest() -> str:
    """A hash of pagedjax's own code (every Python and C++ source of the installed package and
    its backends and kernels): what a compiled step depends on besides its inputs' shapes."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        digest = hashlib.sha256()
        for package in ("pagedjax", "pagedjax.backends", "pagedjax.kernels_pallas",
                        "pagedjax.kernels_cuda"):  # found, not imported (no torch here)
            folder = Path(importlib.util.find_spec(package).submodule_search_locations[0])
            for path in sorted(folder.rglob("*")):
                if path.suffix in (".py", ".cpp", ".h", ".cu"):
                    digest.update(path.read_bytes())
        _SOURCE_DIGEST = digest.hexdigest()
    return _SOURCE_DIGEST


_SOURCE_DIGEST: str | None = None
