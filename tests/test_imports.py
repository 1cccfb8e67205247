"""The package's import graph has no circles, and every name the README imports still imports
from where the README says."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Installed name → source folder (pyproject's package-dir).
PACKAGE_DIRS = {"pagedjax": ROOT / "pagedjax", "pagedjax.backends": ROOT / "backends",
                "pagedjax.kernels_pallas": ROOT / "kernels_pallas",
                "pagedjax.kernels_cuda": ROOT / "kernels_cuda"}


def package_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the package modules it imports (lazy imports included). `from package import
    submodule` names the submodule only: Python runs the package's __init__ first anyway."""
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = {f"{node.module}.{alias.name}" for alias in node.names}
                edges |= subs & modules.keys()
                if not subs <= modules.keys():
                    edges.add(node.module)
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_circles() -> None:
    modules = package_modules()
    assert {"pagedjax.config", "pagedjax.distributed.tensor_parallel", "pagedjax.core.scheduler",
            "pagedjax.backends.torch.runner"} <= modules.keys()
    assert circles(import_graph(modules)) == []


def test_a_circle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]


def readme_imports() -> list[tuple[str, str]]:
    """(module, name) of every `from X import a, b` in the README and the pages of docs/
    (examples and inline code), and (dotted path, "") of every other pagedjax name they mention
    in code."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md",
                                              *sorted((ROOT / "docs").glob("*.md"))])
    found = set()
    for module, names in re.findall(r"from (pagedjax[\w.]*) import ([\w, ]+)", text):
        found |= {(module, n.strip()) for n in names.split(",") if n.strip()}
    found |= {(path, "") for path in re.findall(r"`(pagedjax(?:\.\w+)+)", text)}
    return sorted(found)


@pytest.mark.parametrize("module,name", readme_imports())
def test_readme_names_import_from_where_it_says(module: str, name: str) -> None:
    if name:
        assert hasattr(importlib.import_module(module), name)
        return
    # a dotted path: the longest importable module prefix, then attributes
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[i:]:
            obj = getattr(obj, attribute)
        return
    raise AssertionError(module)


def test_readme_examples_are_seen() -> None:
    found = readme_imports()
    assert {"LLM", "SamplingParams", "AsyncLLM", "BeamSearchParams", "EngineArgs"} <= {
        name for module, name in found if module == "pagedjax"}
    assert ("pagedjax.distributed.cleanup_dist_env_and_memory", "") in found


def test_no_module_is_named_like_a_standard_one() -> None:
    """A module named like the standard library's (random.py, tokenize.py) reads as that one
    in an import line."""
    import sys

    folders = [ROOT / name for name in ("pagedjax", "backends", "kernels_pallas", "kernels_cuda")]
    names = {path.stem for folder in folders for path in folder.rglob("*.py")}
    assert names & set(sys.stdlib_module_names) <= {"__init__"}


def test_the_backends_have_the_same_files_for_the_same_jobs() -> None:
    """docs/architecture.md's table: each job in a file of the same name in both backends, and
    what they share (naming no framework) in backends/common/."""
    jobs = {"model", "params", "attention", "step", "spec_step", "sampler", "rejection_sampler",
            "parallel", "runner"}
    for backend in ("jax", "torch"):
        files = {path.stem for path in (ROOT / "backends" / backend).glob("*.py")}
        assert jobs <= files, (backend, sorted(jobs - files))
    common = ROOT / "backends" / "common"
    for path in common.glob("*.py"):
        text = path.read_text()
        assert "import jax" not in text and "import torch" not in text, path.name


CSRC_CPU = ROOT / "kernels_cuda" / "csrc" / "cpu"
_INCLUDE = re.compile(r'^#include [<"]([^>"]+)[>"]', re.M)
_FRAMEWORKS = {"torch": ("ATen/", "c10/", "torch/"), "xla": ("xla/",)}


def includes(path: Path) -> list[str]:
    return _INCLUDE.findall(path.read_text())


def test_cpu_kernel_folders_say_what_runs_where() -> None:
    """csrc/cpu/: framework-free kernels (kernels/*.h), their torch bindings (torch/) and their
    XLA FFI handlers (xla_ffi/), nothing else; each includes no other framework's headers."""
    assert sorted(p.name for p in CSRC_CPU.iterdir()) == ["kernels", "torch", "xla_ffi"]
    assert {p.suffix for p in (CSRC_CPU / "kernels").iterdir()} == {".h"}
    others = {"kernels": ("torch", "xla"), "torch": ("xla",), "xla_ffi": ("torch",)}
    for folder, frameworks in others.items():
        for path in sorted((CSRC_CPU / folder).iterdir()):
            found = [name for name in includes(path)
                     for framework in frameworks if name.startswith(_FRAMEWORKS[framework])]
            assert found == [], f"{folder}/{path.name} includes {found}"


def test_the_builds_compile_the_bindings_they_own() -> None:
    """The torch extension compiles every torch binding (and no FFI handler); the FFI library is
    the one handler file."""
    from pagedjax.backends.jax import cpu_ffi
    from pagedjax.kernels_cuda import ops

    torch_sources = {f"cpu/torch/{p.name}" for p in (CSRC_CPU / "torch").glob("*.cpp")}
    assert {s for s in ops._CPU_SOURCES if s.startswith("cpu/")} == torch_sources
    assert cpu_ffi._HANDLERS == "cpu/xla_ffi/cpu_ffi.cpp"
    assert [p.name for p in (CSRC_CPU / "xla_ffi").iterdir()] == ["cpu_ffi.cpp"]


def test_the_decoder_layer_is_composed_once() -> None:
    """Both bindings of the fused decoder layer call the one framework-free composition
    (kernels/decoder_layer_kernel.h) and run none of its steps themselves."""
    bindings = [CSRC_CPU / "torch" / "decoder_layer_cpu.cpp", CSRC_CPU / "xla_ffi" / "cpu_ffi.cpp"]
    steps = re.compile(r"\b(normalize_row|rotate_heads|silu_and_mul\w*|run_tiles|find_op)\b")
    for path in bindings:
        assert "../kernels/decoder_layer_kernel.h" in includes(path), path.name
        assert "cpu_layer::DecoderLayer" in path.read_text(), path.name
        assert steps.findall(path.read_text()) == [], path.name
