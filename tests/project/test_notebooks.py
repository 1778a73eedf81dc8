"""Every notebook runs top to bottom in a fresh kernel, then survives re-running its cells."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

from tests.support import REPO

NOTEBOOKS = sorted(pathlib.Path(REPO, "notebooks").glob("*.ipynb"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_reruns(path):
    notebook = nbformat.read(path, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        f"{path.name} is committed with outputs; clear them"
    client = NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": REPO}})
    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        # Re-run every code cell in the same kernel, as a user re-running cells would.
        for index, cell in enumerate(notebook.cells):
            if cell.get("metadata", {}).get("tags") and "no-rerun" in cell.metadata.tags:
                continue
            client.execute_cell(cell, index)
