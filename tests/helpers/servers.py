"""PS shard server processes for tests: started at once, each waited for its ready line, stopped at close."""

import os
import select
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ServerProcesses:
  """Starts server processes (``python -m recsys_jax.async_ps.server``) and stops them at ``close``."""

  def __init__(self, tmp_path):
    self.tmp_path = tmp_path
    self.procs = []

  def start(self, n, *args):
    """Starts n servers at once; returns their (address, process) once each printed 'ready'."""
    procs = []
    for _ in range(n):
      log = open(self.tmp_path / f"server-{len(self.procs)}.log", "w")
      p = subprocess.Popen(
        [sys.executable, "-m", "recsys_jax.async_ps.server", "--port=0", *args],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=ROOT,
      )
      p.log_path = log.name
      log.close()
      self.procs.append(p)
      procs.append(p)
    out = []
    deadline = time.monotonic() + 60
    for p in procs:
      ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
      line = p.stdout.readline() if ready else ""
      if not line.startswith("ready "):
        with open(p.log_path) as f:
          pytest.fail(f"server did not start (stdout {line!r}):\n{f.read()[-3000:]}")
      out.append((line.split()[1], p))
    return out

  def close(self):
    for p in self.procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    for p in self.procs:
      try:
        p.wait(timeout=5)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
      p.stdout.close()
