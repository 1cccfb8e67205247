"""notebooks/explore.ipynb runs headless on the CPU (nbclient), every cell without error, and
its saved copy carries the outputs and pictures it shows."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "explore.ipynb"


@pytest.mark.slow
def test_the_notebook_runs_and_its_saved_copy_has_its_pictures() -> None:
    saved = nbformat.read(NOTEBOOK, as_version=4)
    code_cells = [c for c in saved.cells if c.cell_type == "code"]
    assert all(c.outputs for c in code_cells), "save the notebook executed, with its outputs"
    assert sum("image/png" in o.get("data", {}) for c in code_cells for o in c.outputs) >= 5

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    pictures = [c for c in notebook.cells if c.cell_type == "code"
                and any("image/png" in o.get("data", {}) for o in c.outputs)]
    assert len(pictures) == 7  # block tables, copy-on-write, beams, drafts, benchmark,
    # structured mask, expert load
