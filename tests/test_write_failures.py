"""A write the trainer cannot make ends the run, never hangs it: a full disk (a real tmpfs filled
while a run with TensorBoard and publishing on writes to it) is one ``error:`` line naming the
file, and exit 2; SIGTERM ends a run whose TensorBoard writes do not finish, and one whose
checkpoint or publish write hangs in the kernel (a FIFO no one reads) within seconds, with one line
naming the write and the last good checkpoint, from which the workdir resumes; a run's log keeps
what the runs before it wrote there."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import threading
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


# A disk that hangs: a FIFO with no reader where the run is about to write a file. ``open`` of a
# FIFO for writing blocks in the kernel until a reader comes, as a write to a file system whose
# server is gone does; none ever comes here.
HUNG = ("--stop_write_timeout_s=2",)


def _hang_at(path: str) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  os.mkfifo(path)


def _wait_for(proc, path: str, timeout: float = 120.0) -> None:
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    if proc.poll() is not None or time.monotonic() > deadline:
      proc.kill()
      pytest.fail(f"no {path} within {timeout} s: {proc.communicate()[1][-3000:]}")
    time.sleep(0.1)


def _wait_for_step(proc, workdir: str, step: int, timeout: float = 60.0) -> None:
  """Until ``metrics.jsonl`` holds a record of step ``step``."""
  path, deadline = os.path.join(workdir, "metrics.jsonl"), time.monotonic() + timeout
  while True:
    if os.path.exists(path):
      with open(path) as f:
        if f'"step": {step},' in f.read():
          return
    if proc.poll() is not None or time.monotonic() > deadline:
      proc.kill()
      pytest.fail(f"no record of step {step} in {path} within {timeout} s: {proc.communicate()[1][-3000:]}")
    time.sleep(0.1)


def _stopped_within(proc, within: float):
  """SIGTERM, then ``(exit status, stderr, seconds it took)``."""
  t0 = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  code, _, err = _ended(proc, within=within)
  return code, err, time.monotonic() - t0


def _resumes_from(workdir: str, step: int) -> None:
  proc = _start(workdir, f"--config.num_steps={step + 5}", *ENOUGH[1:], "--config.checkpoint_every=20")
  code, out, err = _ended(proc, within=120)
  assert code == 0, err[-3000:]
  assert f"resumed from {workdir}/checkpoints/{step} at step {step}" in err, err[-3000:]
  assert f"steps         {step + 5} (5 this run" in out, out


def test_sigterm_ends_a_run_whose_checkpoint_write_hangs(tmp_path):
  """Checkpoint 40's hot-set part cannot be opened (the training loop's own write hangs): SIGTERM
  ends the run within the bound, naming the part and checkpoint 20; the workdir resumes from 20."""
  workdir = str(tmp_path / "run")
  part = os.path.join(workdir, "checkpoint_parts", "40", "hot_rows_p0.npz.tmp")
  _hang_at(part)
  proc = _start(workdir, *ENOUGH, *HUNG, "--config.checkpoint_every=20", "--config.log_every=10")
  _wait_for(proc, os.path.join(workdir, "checkpoints", "20"))
  _wait_for_step(proc, workdir, 40)  # step 40's record, written before its checkpoint
  code, err, took = _stopped_within(proc, within=25)
  errors = _errors(err)
  assert code == 2 and len(errors) == 1, err[-4000:]
  assert f"checkpoint {workdir}/checkpoints/40" in errors[0] and part.removesuffix(".tmp") in errors[0], errors[0]
  assert f"last good checkpoint: {workdir}/checkpoints/20" in errors[0], errors[0]
  assert took < 15, (took, errors[0])  # 2 s without progress, a final checkpoint at most
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["20"]  # 40 never committed
  os.remove(part)
  _resumes_from(workdir, 20)


def test_sigterm_ends_a_run_whose_publish_write_hangs(tmp_path):
  """The publisher's thread cannot write the index (its queue fills, the training loop waits on
  it): SIGTERM ends the run within the bound, naming the index and the last good checkpoint; the
  workdir resumes from that checkpoint."""
  workdir = str(tmp_path / "run")
  index = os.path.join(workdir, "publish", "PUBLISHED.json")
  proc = _start(workdir, *ENOUGH, *HUNG, "--config.publish_every_s=1000", "--config.checkpoint_every=20")
  _wait_for(proc, index)  # written once as the run starts; the next write (after step 20's delta) hangs
  _hang_at(index + ".tmp")
  _wait_for(proc, os.path.join(workdir, "checkpoints", "20"))
  code, err, took = _stopped_within(proc, within=25)
  errors = _errors(err)
  assert code == 2 and len(errors) == 1, err[-4000:]
  assert f"publish {index}" in errors[0], errors[0]
  assert took < 15, (took, errors[0])  # 2 s without progress, a final checkpoint at most
  last_good = errors[0].split("last good checkpoint: ")[1].split()[0]
  assert last_good.startswith(f"{workdir}/checkpoints/"), errors[0]
  os.remove(index + ".tmp")
  _resumes_from(workdir, int(os.path.basename(last_good)))


def test_a_wait_is_stuck_after_its_limit_without_progress_and_names_the_write_it_waits_for():
  from recsys_jax import write_waits

  me, held, release = threading.current_thread(), threading.Event(), threading.Event()

  def writer():
    with write_waits.writing("publish /p"), write_waits.writing("publish /p/PUBLISHED.json"):
      held.set()
      release.wait()

  thread = threading.Thread(target=writer)
  thread.start()
  held.wait()
  t0 = time.monotonic()
  assert write_waits.stuck(me, t0, 0.0) is None  # this thread waits on nothing
  with write_waits.waiting_for(thread, "publish /p"):
    assert write_waits.stuck(me, t0, 0.2) is None
    time.sleep(0.3)
    what, waited = write_waits.stuck(me, t0, 0.2)
    assert what == "publish /p/PUBLISHED.json" and waited >= 0.2
    assert write_waits.stuck(me, time.monotonic(), 0.2) is None  # counted from SIGTERM's time
  release.set()
  thread.join()
  with write_waits.writing("checkpoint /c/40"):
    time.sleep(0.3)
    with write_waits.writing("checkpoint /c/40 (its part /c/40/p)"):
      pass  # a write inside it ended: progress
    assert write_waits.stuck(me, t0, 0.2) is None
