"""Two JAX processes x 4 devices on loopback train the dense part like one process x 8."""

import os
import socket
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 5

# Five steps of the trainer's own pieces (host pipeline, jitted step, mesh) on the same global
# batches, each process reading its half; rows come from a PS server (two processes) or the
# in-process PS (one), without pushes, so what is compared is the dense part synchronised over
# the mesh. A large staleness lets lookups run without waiting for pushes that never come.
_WORKER = r"""
import os, sys
out, nproc, pid, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
import jax
from recsys_jax.parallel import distributed
if nproc > 1:
  distributed.initialize(f"127.0.0.1:{port}", nproc, pid)
import numpy as np
from absl import logging; logging.set_verbosity(logging.WARNING)
from configs import tiny
from recsys_jax import train
c = tiny.get_config()
c.mesh.replica, c.mesh.fsdp = 2, 4
c.micro_steps = int(sys.argv[6])
c.staleness = 1000
if nproc > 1:
  c.ps.kind, c.ps.addresses = "remote", sys.argv[7]
job = train.build_job(c)
assert jax.device_count() == 8 and jax.local_device_count() == 8 // nproc
if nproc > 1:  # each fsdp group (mesh row) lives on one process
  for row in job.mesh.devices:
    assert len({d.process_index for d in row}) == 1
state, hot = job.state, job.hot.tables
batches = job.reader.train()  # this process's half of every global batch
init = distributed.to_host(state.params)
for t in range(int(sys.argv[5])):
  batch, position = next(batches)
  p = job.host.lookup(job.host.prepare(t, batch, position), create=True)
  _, rows, batch = job.host.place(p)
  state, hot, _, _ = job.train_step(state, hot, rows, batch)
params = distributed.to_host(state.params)
flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
flat.update({"init" + jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(init)[0]})
if pid == 0:
  np.savez(os.path.join(out, f"p{nproc}.npz"), **flat)
print("ok", pid)
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(tmp_path, nproc, micro_steps, ps_address=""):
  port = str(_free_port())
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        "-c",
        _WORKER,
        str(tmp_path),
        str(nproc),
        str(pid),
        port,
        str(STEPS),
        str(micro_steps),
        ps_address,
      ],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for pid in range(nproc)
  ]
  for pr in procs:
    try:
      out, err = pr.communicate(timeout=300)
    finally:
      for other in procs:
        if other.poll() is None and pr.returncode is None:
          other.kill()
    assert pr.returncode == 0, err[-3000:]
  return dict(np.load(tmp_path / f"p{nproc}.npz"))


def test_two_processes_match_one_process_with_eight_devices(tmp_path):
  """The replica axis spans the processes; the two-process run also accumulates 2 micro-steps."""
  one = _run(tmp_path, 1, 1)
  server = subprocess.Popen(
    [sys.executable, "-m", "recsys_jax.async_ps.server", "--port=0"], cwd=ROOT, stdout=subprocess.PIPE, text=True
  )
  try:
    ready = server.stdout.readline().split()
    assert ready[:1] == ["ready"], ready
    two = _run(tmp_path, 2, 2, ready[1])
  finally:
    server.kill()
    server.wait()
  assert one.keys() == two.keys() and len(one) > 0
  err = max(float(np.max(np.abs(one[k] - two[k]))) for k in one if not k.startswith("init"))
  assert err <= 1e-5, err
  # The five steps really moved the parameters (the comparison is not of two initial states).
  moved = max(float(np.max(np.abs(one[k] - one["init" + k]))) for k in one if not k.startswith("init"))
  assert moved > 1e-3, moved
