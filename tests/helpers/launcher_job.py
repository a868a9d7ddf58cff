"""Test helper: ``python -m recsys_jax.launch`` in the background, its lines collected and parsed.

Used by tests/e2e/test_cluster.py, tests/e2e/test_chaos.py and tests/launch/test_launch.py (not a test module itself).
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTED = re.compile(r"^\[launch\] started (\S+) \(pid (\d+)\)")
RESTART = re.compile(r"^\[launch\] (.*); restart (\d+)/(\d+) from the last checkpoint$")


def running(pid):
  """Whether a process exists and is not a zombie (killed, not reaped yet)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
  except (FileNotFoundError, ProcessLookupError, IndexError):
    return False


class LauncherJob:
  """``python -m recsys_jax.launch`` (2 servers, 2 trainers on configs/tiny.py) with its lines collected.

  Args:
    workdir: the run directory.
    *args: further launcher arguments (``--config.<field>=...`` included).
    num_steps: ``--config.num_steps`` (default: endless); None: the config's own.
  """

  def __init__(self, workdir, *args, num_steps=1000000):
    self.workdir = workdir
    argv = [sys.executable, "-m", "recsys_jax.launch", "--config=configs/tiny.py", "--num_ps=2", "--num_workers=2"]
    argv += [f"--workdir={workdir}", *([f"--config.num_steps={num_steps}"] if num_steps is not None else []), *args]
    self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.lines = []
    self._reader = threading.Thread(target=self._read)
    self._reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line.rstrip("\n"))

  def tail(self, n=60):
    """The last ``n`` lines (None: all; a trainer's traceback can push the lines a test looks for out of 60)."""
    return "\n".join(self.lines[-n:] if n else self.lines)

  def wait_for(self, pattern, timeout=240, count=1):
    """The ``count``-th line matching ``pattern`` (a regex), waiting for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      found = [m for line in list(self.lines) if (m := re.search(pattern, line))]
      if len(found) >= count:
        return found[count - 1]
      if self.proc.poll() is not None and not self._reader.is_alive():
        break
      time.sleep(0.02)
    pytest.fail(f"no line {pattern!r} (number {count}) from the launcher:\n{self.tail()}")

  def started(self):
    """[(child name, pid)] from the launcher's 'started' lines, in order (restarts start them again)."""
    return [(m[1], int(m[2])) for ln in list(self.lines) if (m := STARTED.match(ln))]

  def pids(self):
    """{child name: pid} of the latest 'started' line of each child."""
    return dict(self.started())

  def restarts(self):
    """The launcher's restart lines, as (what failed, i, N)."""
    return [(m[1], int(m[2]), int(m[3])) for ln in list(self.lines) if (m := RESTART.match(ln))]

  def wait_training(self, timeout=240):
    """Waits until process 0 logged its first training metrics (the trainers are past their start)."""
    path = os.path.join(self.workdir, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and self.proc.poll() is None:
      if os.path.exists(path) and '"train"' in open(path).read():
        return
      time.sleep(0.1)
    pytest.fail(f"the job did not train:\n{self.tail()}")

  def end(self):
    """Kills the launcher and whatever of its children is left (a test's finally)."""
    pids = [pid for _, pid in self.started()]
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()
    for pid in pids:
      if running(pid):
        try:
          os.kill(pid, signal.SIGKILL)  # a stopped process too
        except ProcessLookupError:
          pass
    self._reader.join(10)


def reference_run(workdir, *args):
  """An uninterrupted job to compare against: ``LauncherJob(workdir, *args)`` with the config's own
  ``num_steps``, waited for (it must exit 0). Returns (its summary.json, the seconds it took)."""
  t0 = time.monotonic()
  job = LauncherJob(workdir, *args, num_steps=None)
  try:
    assert job.proc.wait(300) == 0, job.tail()
  finally:
    job.end()
  took = time.monotonic() - t0
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f), took
