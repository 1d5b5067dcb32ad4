"""The notebooks in notebooks/ run top to bottom without errors (their cells assert results)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tightfit.fresh_process import children_without_torch

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    # no notebook uses torch, which tvm_ffi would import at the kernel's start (3-4 s)
    with children_without_torch():
        NotebookClient(notebook, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [output for cell in notebook.cells if cell.cell_type == "code"
              for output in cell.get("outputs", []) if output.get("output_type") == "error"]
    assert not errors
