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


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


@pytest.mark.timeout(300)
def test_allocator_explained_where_the_cpu_keeps_no_statistics():
    """Notebook 05's memory cells on the path of a CPU without AVX-512 (an AMD EPYC):
    TF_ENABLE_ONEDNN_OPTS=0 gives TensorFlow's plain CPU allocator, which has no statistics.
    The notebook says so and still measures (a fresh process with the BFC allocator)."""
    import os

    path = pathlib.Path(REPO, "notebooks", "05_choosing_a_strategy.ipynb")
    notebook = nbformat.read(path, as_version=4)
    tagged = {tag: index for index, cell in enumerate(notebook.cells)
              for tag in cell.get("metadata", {}).get("tags", [])}
    client = NotebookClient(notebook, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": REPO}})
    with client.setup_kernel(env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0")):
        client.execute_cell(notebook.cells[1], 1)  # sys.path and the quiet TensorFlow import
        for tag in ("allocator-explained", "allocator-measured"):
            client.execute_cell(notebook.cells[tagged[tag]], tagged[tag])
    explained = _text(notebook.cells[tagged["allocator-explained"]])
    assert "keeps no statistics (Allocator stats not available" in explained, explained
    assert "oneDNN is off here" in explained and "TF_CPU_ALLOCATOR_USE_BFC=1" in explained
    measured = _text(notebook.cells[tagged["allocator-measured"]])
    assert "measured by TensorFlow's BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=1)" in measured
    assert [line.split()[0] for line in measured.splitlines()[1:]] == [
        "parameters", "optimizer", "gradients"], measured
