"""The notebooks in notebooks/ run end to end, as a user would run them, so they cannot rot.

Each is executed top to bottom in a fresh Jupyter kernel (nbclient); a cell that raises fails the
test with the cell's source and error. Committed notebooks carry no outputs: outputs depend on the
machine and the day, would go stale silently next to the code, and their images bloat every diff;
the test suite is what shows the notebooks still run, and Colab shows the outputs when run.
"""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
  assert {p.name for p in NOTEBOOKS} >= {"papers.ipynb", "quickstart.ipynb"}, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_has_no_outputs(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  with_outputs = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
  assert not with_outputs, f"{path.name}: cells {with_outputs} hold outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_end_to_end(path):
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
  try:
    client.execute()
  except CellExecutionError as e:
    pytest.fail(f"{path.name}: a cell failed:\n{e}")
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
  assert not errors, f"{path.name}: {errors}"
