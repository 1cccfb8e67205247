"""The README and the pages of docs/ link to files and sections that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target}"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.name}: {target}"


def test_the_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_readme_api_runs(capsys) -> None:
    """The README's API in ten lines and its beam search, as written, on the demo pair (the
    checkpoint paths are the only substitution)."""
    from pagedjax.model_loader.demo import demo_model_dirs

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    api = next(b for b in blocks if "from pagedjax import LLM, SamplingParams" in b
               and "llm.generate" in b)
    beams = next(b for b in blocks if "BeamSearchParams(" in b)
    target_dir, draft_dir = demo_model_dirs()
    namespace = {"target_dir": target_dir, "draft_dir": draft_dir}
    exec(api.replace('"path/to/hf_checkpoint"', repr(target_dir)) + beams, namespace)
    printed = capsys.readouterr().out
    assert "def quicksort(xs):" in printed and "kv_blocks_free" in printed
    assert len(namespace["out"].sequences) == 4
    for name in ("llm", "fast"):
        namespace[name].shutdown()
