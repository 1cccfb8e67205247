"""The core is backend-free: no module under pagedjax/core imports a framework or a tokenizer
library, directly (any import statement, lazy ones included) or through what it imports."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pagedjax.core

FORBIDDEN = ("jax", "jaxlib", "flax", "torch", "transformers", "tokenizers")
CORE = Path(pagedjax.core.__file__).parent


def imported_roots(path: Path) -> set[str]:
    """The top-level package of every module an import statement in `path` names."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    return roots


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
