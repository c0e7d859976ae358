"""The notebooks in notebooks/ run headless from top to bottom and really draw their plots."""

from __future__ import annotations

from pathlib import Path

import pytest

# the test extras install both; a machine without them (the GPU machine, running `-m gpu tests`) skips the module
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["tree_anatomy.ipynb", "acceptance_profiling.ipynb"]


def _code_cells(nb) -> list:
    return [cell for cell in nb.cells if cell.cell_type == "code"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for cell in _code_cells(nb):
        assert not cell.outputs and cell.execution_count is None, f"{name}: strip the outputs before committing"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_and_plots(name, default_model_dir):
    # default_model_dir converts the default model once and points MEDUSA_CACHE at it;
    # the kernel is started with a copy of os.environ, so it loads that same folder.
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError, naming the cell, on the first error

    outputs = [out for cell in _code_cells(nb) for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert images, f"{name} drew no plots"
    stderr = "".join(out.text for out in outputs if out.output_type == "stream" and out.name == "stderr")
    assert "converting" not in stderr, "the kernel did not see the session's MEDUSA_CACHE and converted again"
