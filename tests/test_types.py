"""The type checker passes over the parameter server and everything that holds one (async_ps,
training, online, serving, checkpoint.py, train.py, and the commands main, serve and predict:
pyproject.toml's [tool.mypy]). The seams are typed with the PS's Protocol
(``async_ps.protocol.RowStore``), so a holder that calls what a PS does not offer, or a PS that
drifts from the Protocol, fails here, not in a run."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mypy(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_mypy_passes_over_the_ps_and_its_holders():
  p = _mypy()
  assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
  assert "Success: no issues found" in p.stdout, p.stdout


def test_the_ps_holders_are_typed_with_the_protocol(tmp_path):
  """A holder that calls a method RowStore does not have fails the check: the seam is checked,
  not just annotated."""
  probe = tmp_path / "probe.py"
  probe.write_text(
    "from recsys_jax.async_ps.protocol import RowStore\n"
    "from recsys_jax.training.job import Job\n\n\n"
    "def f(ps: RowStore, job: Job) -> None:\n"
    "  ps.lookup_many({}, create=False)\n"
    "  job.ps.not_a_ps_method()\n"
  )
  p = _mypy(str(probe))
  assert p.returncode == 1 and "not_a_ps_method" in p.stdout and p.stdout.count("error:") == 1, p.stdout
