"""The core is backend-free: no module under pagedjax/core imports a framework or a tokenizer
library, directly (any import statement, lazy ones included) or through what it imports. The
kernel folders hold kernels: they import no backend (backends import kernels, never the
reverse), and the JAX ones, with the JAX backend's FFI glue, no torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pagedjax.core

FORBIDDEN = ("jax", "jaxlib", "flax", "torch", "transformers", "tokenizers")
CORE = Path(pagedjax.core.__file__).parent
ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement in `path` names (`from m import a`: m and m.a)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return modules


def imported_roots(path: Path) -> set[str]:
    """The top-level package of every module an import statement in `path` names."""
    return {module.split(".")[0] for module in imported_modules(path)}


def test_no_core_module_names_a_framework() -> None:
    modules = sorted(CORE.glob("*.py"))
    assert len(modules) > 10  # the walk sees the core
    offenders = {p.name: sorted(imported_roots(p) & set(FORBIDDEN)) for p in modules}
    assert {name: roots for name, roots in offenders.items() if roots} == {}


def test_importing_the_core_loads_no_framework() -> None:
    """In a fresh process: every core module imported, then what sys.modules holds."""
    names = [f"pagedjax.core.{p.stem}" for p in sorted(CORE.glob("*.py"))]
    code = (f"import importlib, json, sys\nfor n in {names!r}: importlib.import_module(n)\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True,
                                       capture_output=True, text=True).stdout)
    assert "pagedjax" in loaded
    assert sorted(set(loaded) & set(FORBIDDEN)) == []


def test_the_checks_see_a_framework_import(tmp_path: Path) -> None:
    """The AST walk catches a lazy import inside a function."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from torch import nn\n    import jax.numpy as jnp\n")
    assert imported_roots(module) == {"torch", "jax"}


def test_kernel_folders_import_no_backend() -> None:
    """kernels_pallas/ and kernels_cuda/ hold kernels; which one runs where, and the glue that
    binds C++ to a framework other than the kernels' own (XLA's FFI: backends/jax/cpu_ffi.py),
    are the backends'."""
    modules = sorted((ROOT / "kernels_pallas").rglob("*.py")) + sorted(
        (ROOT / "kernels_cuda").rglob("*.py"))
    assert len(modules) > 5
    offenders = {p.name: sorted(m for m in imported_modules(p)
                                if m.startswith("pagedjax.backends")) for p in modules}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_jax_kernels_and_their_ffi_glue_name_no_torch() -> None:
    """The JAX backend's kernels and its C++ glue find the C++ sources without importing
    pagedjax.kernels_cuda (which imports torch)."""
    modules = [*sorted((ROOT / "kernels_pallas").rglob("*.py")),
               ROOT / "backends" / "jax" / "cpu_ffi.py", ROOT / "backends" / "jax" / "attention.py"]
    offenders = {p.name: sorted(m for m in imported_modules(p)
                                if m.split(".")[0] == "torch" or m == "pagedjax.kernels_cuda"
                                or m.startswith("pagedjax.kernels_cuda."))
                 for p in modules}
    assert {name: found for name, found in offenders.items() if found} == {}
