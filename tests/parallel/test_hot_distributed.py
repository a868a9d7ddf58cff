"""Two trainer processes with hot rows: both hold the same hot rows, bit for bit, after every step.

Each process reads its half of every batch, so each counts and touches its own ids; the counts
are summed before every choice, the hot rows' gradients summed over every device, and rows move
through one shared PS server. A hot set that diverged between the processes would train two
different models under one name.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WORKER = r"""
import hashlib, json, os, sys
out, pid, port, ps_address = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
from recsys_jax.parallel import distributed
distributed.initialize(f"127.0.0.1:{port}", 2, pid)
import numpy as np
from absl import logging; logging.set_verbosity(logging.WARNING)
from configs import tiny
from recsys_jax import train

c = tiny.get_config()
c.num_steps, c.staleness, c.log_every = 24, 1, 8
c.eval_samples, c.eval_batch_size = 4096, 2048
c.host_workers = 1
c.ps.kind, c.ps.addresses = "remote", ps_address
c.hot_rows_bytes, c.hot_warmup_steps, c.hot_every, c.hot_min_count = 1 << 14, 3, 5, 1
digests = []
build = train.build_job

def build_job(config, workdir=None, restore=True):
  job = build(config, workdir, restore)
  step = job.train_step

  def recorded(state, hot, rows, batch):
    state, hot, g, m = step(state, hot, rows, batch)
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(distributed.local_copy(hot)):
      h.update(np.ascontiguousarray(leaf).tobytes())
    for t in sorted(job.hot.set.group_of):
      for a in job.hot.set.hot(t):
        h.update(a.tobytes())
    digests.append(h.hexdigest())
    return state, hot, g, m

  job.train_step = recorded
  return job

train.build_job = build_job
s = train.train_and_evaluate(c, os.path.join(out, "work"))  # one workdir, as a launched job has
with open(os.path.join(out, f"p{pid}.json"), "w") as f:
  json.dump({"digests": digests, "hot": s["hot"]}, f)
print("ok", pid)
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_hold_identical_hot_rows_after_every_step(tmp_path, servers):
  ((address, _),) = servers.start(1)
  port = str(_free_port())
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _WORKER, str(tmp_path), str(pid), port, address],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for pid in range(2)
  ]
  for pr in procs:
    try:
      _, err = pr.communicate(timeout=600)
    finally:
      for other in procs:
        if other.poll() is None and pr.returncode is None:
          other.kill()
    assert pr.returncode == 0, err[-4000:]
  a, b = (json.load(open(tmp_path / f"p{pid}.json")) for pid in range(2))
  assert len(a["digests"]) == 24
  assert a["digests"] == b["digests"]
  # From the first choice (before step 3) on, the hot rows changed at every step: not a vacuous equality.
  assert len(set(a["digests"][3:])) == 21
  hot = a["hot"]
  assert [c["step"] for c in hot["choices"]] == [3, 8, 13, 18, 23]
  assert hot["hot_rows_held"] > 0 and hot["hot_hit_rate"] > 0.3, hot
