"""The notebooks in notebooks/ run end to end, as a user would run them, so they cannot rot.

Each is executed top to bottom in a fresh Jupyter kernel (nbclient); a cell that raises fails the
test with the cell's source and error. Committed notebooks carry no outputs: outputs depend on the
machine and the day, would go stale silently next to the code, and their images bloat every diff;
the test suite is what shows the notebooks still run, and Colab shows the outputs when run.
"""

from __future__ import annotations

import pathlib
from concurrent.futures import ThreadPoolExecutor

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


def _execute(path):
  """The notebook run top to bottom in a fresh kernel: (its cells with their outputs, the failure or None)."""
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
  try:
    client.execute()
  except CellExecutionError as e:
    return nb, e
  return nb, None


@pytest.fixture(scope="module")
def executed(request):
  """The selected notebooks' runs, both at once from the first test that asks (path -> future): each
  kernel is a process of its own that keeps one core busy, and the suite's machine has two. Each
  notebook writes under runs/ in folders of its own (runs/quickstart, runs/notebooks)."""
  paths = [
    i.callspec.params["path"]
    for i in request.session.items
    if getattr(i, "originalname", None) == "test_notebook_runs_end_to_end" and i.module is request.module
  ]
  pool = ThreadPoolExecutor(max_workers=2)
  yield {p: pool.submit(_execute, p) for p in paths}
  pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_end_to_end(path, executed):
  nb, failed = executed[path].result()
  if failed is not None:
    pytest.fail(f"{path.name}: a cell failed:\n{failed}")
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
  assert not errors, f"{path.name}: {errors}"
