"""Dense parameters sharded over fsdp and replicated over replica match a single device."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from recsys_jax import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 5


def _dense_params(workdir, step=STEPS, template=None):
  """The dense parameters of checkpoint ``step``, by tree path. A checkpoint written on another
  topology (several processes) is read onto this one's through ``template`` (a job's state)."""
  state = ocp.StandardCheckpointer().restore(os.path.join(workdir, "checkpoints", str(step), "state"), template)
  flat = jax.tree_util.tree_flatten_with_path(state["params"] if template is None else state.params)[0]
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def _on_8_devices(code, *args):
  """Runs ``code`` in a fresh process with 8 simulated CPU devices (XLA reads the flag at start)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )


_MESH_RUN = r"""
import json, os, sys
import numpy as np
from absl import logging; logging.set_verbosity(logging.WARNING)
import jax
from configs import tiny
from recsys_jax import train
from tests.parallel.test_mesh import _dense_params
out, report = sys.argv[1], {}
from recsys_jax.data import synthetic
from recsys_jax.parallel import mics
for r, p in [(1, 8), (2, 4), (4, 2), (8, 1)]:
  for s in (1, 4):
    c = tiny.get_config()
    c.num_steps = int(sys.argv[2]); c.eval_samples = c.eval_batch_size = 4096
    c.mesh.replica, c.mesh.fsdp, c.micro_steps = r, p, s
    d = os.path.join(out, f"{r}x{p}x{s}")
    train.train_and_evaluate(c, d)
    np.savez(os.path.join(out, f"{r}x{p}x{s}.npz"), **_dense_params(d))
    job = train.build_job(c, d, restore=False)  # the topology only: a fresh state, as before the restore existed
    k = job.state.params["bottom"]["dense_0"]["kernel"]
    last = job.state.params["top"]["dense_1"]["kernel"]  # [32, 1]: 'mlp' of size 1 cannot be split
    # The trainer's compiled step: bytes per device inside and across groups.
    placed = job.host.place(job.host.lookup(job.host.prepare(0, job.reader.data.batch(synthetic.TRAIN, 0, c.batch_size)), create=True))
    with jax.transfer_guard("allow"):
      hlo = job.train_step.lower(job.state, job.hot.tables, placed[1], placed[2]).compile().as_text()
    vol = mics.comm_volume(hlo, job.mesh)
    report[f"{r}x{p}x{s}"] = {"last_spec": list(last.sharding.spec), "spec": list(k.sharding.spec),
                              "shard": list(k.addressable_shards[0].data.shape), "full": list(k.shape),
                              "devices": jax.device_count(), "inside": vol["inside"], "cross_group": vol["cross_group"],
                              "by_op": vol["by_op"]}
    job.ps.close()
print(json.dumps(report))
"""


@pytest.mark.slow  # about 60 s; test_train and the tests below cover 8 devices against one in the default run
def test_every_group_shape_and_micro_steps_on_8_devices_match_one_device(tiny_config, tmp_path):
  """The trainer's MiCS step on 8 devices, (r, p) x micro_steps, against one device, no accumulation.

  Also reads the collectives of each compiled train step: what leaves a group per optimizer
  step (the across-group all-reduce of the gradient shards and of the row gradients) must not
  grow with micro_steps, while the reduce-scatters inside the group do.
  """
  tiny_config.num_steps = STEPS
  tiny_config.eval_samples = tiny_config.eval_batch_size = 4096
  train.train_and_evaluate(tiny_config, str(tmp_path / "single"))
  ref = _dense_params(str(tmp_path / "single"))
  out = _on_8_devices(_MESH_RUN, str(tmp_path), str(STEPS))
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert len(report) == 8
  for name, info in report.items():
    r, p, s = map(int, name.split("x"))
    assert info["devices"] == 8
    # The bottom kernel [13, 16] is split over fsdp along its 'mlp' axis when p > 1.
    if p > 1:
      assert info["spec"] == [None, "fsdp"], info
      assert info["shard"] == [info["full"][0], info["full"][1] // p], info
    else:
      assert info["shard"] == info["full"], info
    assert info["last_spec"] in ([], [None, None]), info  # not divisible: replicated
    got = dict(np.load(tmp_path / f"{name}.npz"))
    assert got.keys() == ref.keys()
    err = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
    assert err <= 1e-5, (name, err)
  for r, p in [(1, 8), (2, 4), (4, 2), (8, 1)]:
    one, four = report[f"{r}x{p}x1"], report[f"{r}x{p}x4"]
    # r = 1: one group holds every device and nothing leaves it; else the row gradients (summed
    # over every device) and the gradient shards (over replica) do, once per step.
    assert (one["cross_group"] > 0) == (r > 1), one
    assert four["cross_group"] == one["cross_group"], (r, p, one["by_op"], four["by_op"])
    if p > 1:
      rs = "inside/reduce-scatter"  # one per micro-step
      assert four["by_op"][rs] == 4 * one["by_op"][rs] > 0, (r, p, one["by_op"], four["by_op"])


def _sgd(c):
  """SGD on the dense part and the rows: unlike Adagrad and Adam, it shows a gradient's scale."""
  c.num_steps = STEPS
  c.eval_samples = c.eval_batch_size = 4096
  c.optimizer.name, c.optimizer.learning_rate = "sgd", 0.5
  c.embeddings.optimizer, c.embeddings.learning_rate = "sgd", 2.0
  return c


def _rows(c, workdir, ps=None, step=STEPS):
  """Every row of the PS snapshot of checkpoint ``step`` (in-process or remote PS servers'), by
  (table, id), read into ``ps`` (an in-process PS of config ``c``, whose rows it replaces) or a new one."""
  from recsys_jax.async_ps.snapshot import chain as snapshot_chain

  with open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")) as f:
    chain = json.load(f)["ps_chain"]
  job = None if ps is not None else train.build_job(c, workdir + "-probe")
  ps = ps if job is None else job.ps
  snapshot_chain.load_into(ps, [os.path.join(workdir, "ps_snapshots", name) for name in chain])
  snap = ps.snapshot()
  if job is not None:
    ps.close()
  return {(t, int(i)): w for t, s in snap.items() for i, w in zip(s["ids"], s["weights"])}


HOT_STEPS = 14


def _hot(c):
  """Hot rows chosen at step 2 and re-chosen every 3 steps (256 rows of the tiny tables), over
  HOT_STEPS steps."""
  c.num_steps = HOT_STEPS
  c.hot_rows_bytes, c.hot_warmup_steps, c.hot_every, c.hot_min_count = 1 << 13, 2, 3, 1
  return c


_SGD_RUN = r"""
import json, sys
from configs import tiny
from recsys_jax import train
import numpy as np
from tests.parallel.test_mesh import HOT_STEPS, _dense_params, _hot, _sgd
c = _hot(_sgd(tiny.get_config()))
c.mesh.replica, c.mesh.fsdp, c.micro_steps = 2, 4, 2
s = train.train_and_evaluate(c, sys.argv[1])
np.savez(sys.argv[1] + ".npz", **_dense_params(sys.argv[1], HOT_STEPS))  # orbax reads it back on its own topology only
json.dump(s["hot"], open(sys.argv[1] + ".hot.json", "w"))
"""


def test_rows_and_dense_weights_on_8_devices_match_one_device_with_sgd(tiny_config, tmp_path):
  """2 groups x 4 devices x 2 micro-steps with hot rows (chosen and re-chosen: their update, the
  gradient summed over the devices, is checked) against one device without: every dense weight
  and every row."""
  c = _hot(_sgd(tiny_config))
  c.hot_rows_bytes = 0
  train.train_and_evaluate(c, str(tmp_path / "single"))
  out = _on_8_devices(_SGD_RUN, str(tmp_path / "mesh"))
  assert out.returncode == 0, out.stderr[-3000:]
  hot = json.load(open(tmp_path / "mesh.hot.json"))
  assert [x["step"] for x in hot["choices"]] == [2, 5, 8, 11] and hot["hot_hit_rate"] > 0.5, hot
  ref, got = _dense_params(str(tmp_path / "single"), HOT_STEPS), dict(np.load(tmp_path / "mesh.npz"))
  assert got.keys() == ref.keys()
  for k in ref:
    np.testing.assert_allclose(got[k], ref[k], rtol=1e-4, atol=1e-6, err_msg=k)
  ref_rows = _rows(c, str(tmp_path / "single"), step=HOT_STEPS)
  got_rows = _rows(c, str(tmp_path / "mesh"), step=HOT_STEPS)
  assert got_rows.keys() == ref_rows.keys() and len(ref_rows) > 500
  for key, w in ref_rows.items():
    np.testing.assert_allclose(got_rows[key], w, rtol=1e-4, atol=1e-6, err_msg=str(key))


def test_logical_shardings_fall_back_to_replication(tiny_config, tmp_path):
  """On one device every leaf is replicated, whatever the rules say."""
  job = train.build_job(tiny_config, str(tmp_path))
  for leaf in jax.tree.leaves(job.state.params):
    assert leaf.sharding.is_fully_replicated


@pytest.fixture(scope="module")
def uninterrupted_tiny(tiny_run):
  return tiny_run[0]  # the summary of tests/conftest.py's run of configs/tiny.py


def test_optimizer_state_in_host_memory_trains_identically(uninterrupted_tiny, tiny_config, tmp_path):
  """The Cerebras-style option: the dense optimizer state lives in pinned host memory."""
  tiny_config.optimizer.state_memory = "pinned_host"
  job = train.build_job(tiny_config, str(tmp_path / "probe"))
  kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(job.state.opt_state)}
  assert kinds == {"pinned_host"}
  assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(job.state.params)} == {"device"}
  # Half, then resume: the state round-trips through a checkpoint in host memory too.
  half = tiny_config.copy_and_resolve_references()
  half.num_steps = tiny_config.num_steps // 2
  train.train_and_evaluate(half, str(tmp_path / "run"))
  s = train.train_and_evaluate(tiny_config, str(tmp_path / "run"))
  assert s["resumed_from"] == half.num_steps
  assert s["auc"] == uninterrupted_tiny["auc"] and s["logloss"] == uninterrupted_tiny["logloss"]
