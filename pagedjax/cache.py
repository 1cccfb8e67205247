"""Where pagedjax keeps what it builds once: the JAX backend's compiled steps (steps/) and the C++
FFI library. `$PAGEDJAX_CACHE_DIR`, else `$XDG_CACHE_HOME/pagedjax`, else `~/.cache/pagedjax`.
`PAGEDJAX_DISABLE_COMPILE_CACHE=1` turns the compiled steps' cache off (every process then
compiles its steps anew).

And when the steps compile: all at startup by default. `PAGEDJAX_COMPILE_AT_STARTUP=0` compiles
(or captures) each step shape when a step first needs it instead: a faster start for a quick
experiment or a test, paid for by compiles while serving (adaptive speculation then keeps k
fixed: its step-time table would compile every speculative shape)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path


def cache_dir() -> Path:
    explicit = os.environ.get("PAGEDJAX_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedjax"


def compile_cache_enabled() -> bool:
    return os.environ.get("PAGEDJAX_DISABLE_COMPILE_CACHE", "0").lower() in ("", "0", "false")


def compile_at_startup() -> bool:
    return os.environ.get("PAGEDJAX_COMPILE_AT_STARTUP", "1").lower() not in ("0", "false")


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
