"""A write the trainer cannot make ends the run, never hangs it: a full disk (a real tmpfs filled
while a run with TensorBoard and publishing on writes to it) is one ``error:`` line naming the
file, and exit 2; SIGTERM ends a run whose TensorBoard writes do not finish; a run's log keeps
what the runs before it wrote there."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENOUGH = ("--config.num_steps=100000000", "--config.eval_samples=512", "--config.eval_batch_size=512")
PUBLISH = ("--config.publish_every_s=0.5", "--config.publish_dense_every_s=0.5", "--config.checkpoint_every=200")


def _start(workdir, *args, prelude: str = ""):
  """``python -m recsys_jax.main`` on configs/tiny.py (``prelude``: Python run first, in the same process)."""
  argv = ["-m", "recsys_jax.main"] if not prelude else ["-c", prelude + _RUN_MAIN]
  return subprocess.Popen(
    [sys.executable, *argv, "--config=configs/tiny.py", f"--workdir={workdir}", *args],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


_RUN_MAIN = (
  "\nimport runpy, sys\nsys.argv[0] = 'recsys_jax.main'\nrunpy.run_module('recsys_jax.main', run_name='__main__')\n"
)


def _wait_for_records(proc, workdir, n: int, timeout: float = 120.0) -> None:
  """Until ``metrics.jsonl`` holds ``n`` records (the run is training)."""
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert proc.poll() is None, proc.communicate()
    if os.path.exists(path):
      with open(path) as f:
        if sum(1 for _ in f) >= n:
          return
    time.sleep(0.1)
  proc.kill()
  pytest.fail(f"no {n} records in {path} within {timeout} s: {proc.communicate()}")


def _ended(proc, within: float):
  """``(exit status, stdout, stderr)`` if ``proc`` ends within ``within`` s; else kills it and fails."""
  try:
    out, err = proc.communicate(timeout=within)
  except subprocess.TimeoutExpired:
    os.kill(proc.pid, signal.SIGUSR1)  # its threads' stacks, for the failure's message
    time.sleep(1)
    proc.kill()
    out, err = proc.communicate()
    pytest.fail(f"still running {within} s later; stderr:\n{err[-6000:]}")
  return proc.returncode, out, err


@pytest.fixture
def tmpfs():
  """A 40 MB tmpfs, unmounted after the test."""
  if os.geteuid() != 0:
    pytest.skip("mounting a tmpfs needs root (this test fills a real small disk)")
  d = tempfile.mkdtemp(prefix="full_disk_")
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", d], capture_output=True, text=True)
  if r.returncode != 0:
    os.rmdir(d)
    pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip()}")
  try:
    yield d
  finally:
    subprocess.run(["umount", "-l", d], check=False)
    os.rmdir(d)


def _fill(directory) -> str:
  """Fills the disk of ``directory`` (a file as large as it takes); returns the file."""
  path = os.path.join(directory, "filler")
  subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M"], capture_output=True)
  return path


def _errors(err: str):
  return [line for line in err.splitlines() if line.startswith("error:")]


def test_a_full_disk_ends_a_publishing_run_with_one_error_line_and_exit_2(tmpfs):
  workdir = os.path.join(tmpfs, "run")
  proc = _start(workdir, *ENOUGH, *PUBLISH)
  _wait_for_records(proc, workdir, 4)
  _fill(tmpfs)
  code, _, err = _ended(proc, within=30)
  errors = _errors(err)
  assert code == 2, err[-4000:]
  assert len(errors) == 1, err[-4000:]
  (line,) = errors
  assert "No space left on device" in line, line
  assert f"{tmpfs}/run/" in line, line  # the file or directory that could not be written
  assert "last good checkpoint: " in line, line
  assert not glob.glob(os.path.join(workdir, "publish", "**", "*.tmp"), recursive=True)


def test_a_second_run_keeps_the_first_runs_log(tmpfs):
  """The first run fails on a full disk: its traceback is in its log all the same, and the next run
  (on the same workdir, space freed) adds its own beside it."""
  workdir = os.path.join(tmpfs, "run")
  proc = _start(workdir, *ENOUGH, *PUBLISH)
  _wait_for_records(proc, workdir, 4)
  filler = _fill(tmpfs)
  code, _, err = _ended(proc, within=30)
  assert code == 2, err[-4000:]
  os.remove(filler)
  (log,) = glob.glob(os.path.join(workdir, "trainer_p*.log"))
  with open(log) as f:
    first = f.read()
  assert "Traceback" in first and "No space left on device" in first, first[-3000:]
  proc = _start(workdir, "--config.num_steps=2", "--config.eval_samples=512", "--config.eval_batch_size=512")
  code, _, err = _ended(proc, within=120)
  with open(log) as f:
    both = f.read()
  assert both.startswith(first), both[:3000]
  assert both.count("run started") == 2, both[-3000:]


# The event file's writes never finish (a disk that hangs): the queue of events fills.
_STUCK_TENSORBOARD = """
import threading
import tensorboardX.event_file_writer as w
_first = w.EventsWriter.write_event
def _stuck(self, event, _n=[0]):
  _n[0] += 1
  if _n[0] > 2:
    threading.Event().wait()
  return _first(self, event)
w.EventsWriter.write_event = _stuck
"""


def test_sigterm_ends_a_run_blocked_in_a_tensorboard_write(tmp_path):
  workdir = str(tmp_path / "run")
  proc = _start(workdir, *ENOUGH, "--config.log_every=1", prelude=_STUCK_TENSORBOARD)
  _wait_for_records(proc, workdir, 2)
  time.sleep(3)  # records written since: the event queue is full, the loop waits on it
  proc.send_signal(signal.SIGTERM)
  code, _, err = _ended(proc, within=20)
  assert "SIGTERM" in err, err[-3000:]
  assert code in (0, 2), err[-3000:]


# The first writes of a kind go in, the later ones meet a full disk.
_FULL_AFTER = """
import errno, os
def _full_after(module, name, n, _calls=[0]):
  first = getattr(module, name)
  def write(*a, **k):
    _calls[0] += 1
    if _calls[0] > n:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return first(*a, **k)
  setattr(module, name, write)

import builtins, io
class _Full(io.FileIO):
  def write(self, b):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
def _open_full_after(n, _calls=[0]):
  def open_(path, mode="r", *a, **k):  # a file the delta is written to: created, but takes no bytes
    if "w" in mode and "/rows/" in str(path):
      _calls[0] += 1
      if _calls[0] > n:
        return _Full(path, "wb")
    return builtins.open(path, mode, *a, **k)
  return open_
"""


@pytest.mark.parametrize(
  "where, patch, names",
  [
    (
      "tensorboard",
      "import tensorboardX.record_writer as m\n_full_after(m.RecordWriter, 'write', 20)",
      "TensorBoard events {workdir}/tensorboard/events.out.tfevents.",
    ),
    (
      "publish",
      "import recsys_jax.async_ps.snapshot.published as m\nm.open = _open_full_after(6)",
      "publish {workdir}/publish could not be written: No space left on device ({workdir}/publish/",
    ),
  ],
)
def test_a_full_disk_met_first_by_each_writer_is_one_line_and_exit_2(tmp_path, where, patch, names):
  workdir = str(tmp_path / "run")
  proc = _start(workdir, *ENOUGH, *PUBLISH, prelude=_FULL_AFTER + patch)
  code, _, err = _ended(proc, within=120)
  errors = _errors(err)
  assert code == 2 and len(errors) == 1, err[-4000:]
  assert names.format(workdir=workdir) in errors[0], errors[0]
  assert "No space left on device" in errors[0] and "last good checkpoint: " in errors[0], errors[0]
  assert not glob.glob(os.path.join(workdir, "publish", "**", "*.tmp"), recursive=True)


def test_a_run_removes_the_temporaries_of_a_publish_that_died_and_says_so(tmp_path):
  workdir = tmp_path / "run"
  rows = workdir / "publish" / "rows"
  rows.mkdir(parents=True)
  (rows / "0000000003-0000000040.npz.tmp").write_bytes(b"half a delta")
  proc = _start(str(workdir), "--config.num_steps=2", *PUBLISH[:2], "--config.checkpoint_every=1", *ENOUGH[1:])
  code, _, err = _ended(proc, within=120)
  assert code == 0, err[-3000:]
  assert "publish: removed 1 temporary file(s) an earlier run left" in err, err[-3000:]
  assert not list(rows.glob("*.tmp"))
