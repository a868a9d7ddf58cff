"""End-to-end tests of train_and_evaluate on configs/tiny.py."""

import functools
import hashlib
import importlib
import json
import math
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import optax
import pytest

from recsys_jax import checkpoint as checkpoint_lib
from recsys_jax import train
from recsys_jax.data import synthetic
from recsys_jax.launch.supervisor import EXIT_CONFIG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tree_digest(path):
  h = hashlib.sha256()
  for dirpath, dirnames, filenames in sorted(os.walk(path)):
    dirnames.sort()
    for name in sorted(filenames):
      p = os.path.join(dirpath, name)
      h.update(p[len(path) :].encode())
      with open(p, "rb") as f:
        h.update(f.read())
  return h.hexdigest()


@pytest.fixture(scope="module")
def uninterrupted(tiny_run):
  """One full tiny run at k = 0 (tests/conftest.py's, trained with every host<->device copy
  explicit), shared by the tests that compare against it."""
  return tiny_run


def test_on_metrics_sees_every_record_of_metrics_jsonl(uninterrupted):
  summary, workdir = uninterrupted
  written = train.read_metrics(workdir)
  assert [(r["step"], r["kind"], {k: v for k, v in r.items() if k not in ("step", "kind")}) for r in written] == [
    (step, kind, json.loads(json.dumps(values))) for step, kind, values in summary["_on_metrics"]
  ]
  kinds = {r["kind"] for r in written}
  assert kinds == {"train", "eval", "ps", "progressive"}, kinds
  assert [r["step"] for r in train.read_metrics(workdir, "eval")][-1] == summary["steps"]
  assert train.read_metrics(workdir, "eval")[-1]["auc"] == pytest.approx(summary["auc"], abs=0)


def test_read_metrics_of_a_run_being_written_and_of_a_damaged_file(tmp_path):
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.write('{"step": 20, "kind": "train", "loss": 0.5}\n{"step": 40, "kind": "tr')
  assert train.read_metrics(str(tmp_path)) == [{"step": 20, "kind": "train", "loss": 0.5}]
  with open(tmp_path / "metrics.jsonl", "w") as f:
    f.write('{"step": 20, "kind": "train", "loss": 0.5}\nnot json\n{"step": 40, "kind": "train"}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
    train.read_metrics(str(tmp_path))


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]


def test_tiny_trains_well_above_chance_quickly(uninterrupted):
  summary, workdir = uninterrupted
  assert summary["auc"] > 0.6, summary
  assert summary["auc"] <= summary["oracle_auc"] + 0.01
  assert summary["wall_s"] < 60
  for key in ("auc", "logloss", "oracle_auc", "samples_per_sec", "steps", "wall_s"):
    assert key in json.load(open(os.path.join(workdir, "summary.json")))
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(workdir, "tensorboard")))
  # Loss goes down: last logged train loss below the first.
  losses = _losses(workdir)
  assert losses[-1] < losses[0]


def _tensorboard_scalars(workdir):
  """{(tag, step): value} of every scalar in the run's TensorBoard event files (TFRecord framing:
  length, its crc, the serialized Event, its crc)."""
  import struct

  from tensorboardX.proto.event_pb2 import Event

  out = {}
  tb = os.path.join(workdir, "tensorboard")
  for name in sorted(os.listdir(tb)):
    with open(os.path.join(tb, name), "rb") as f:
      data = f.read()
    at = 0
    while at < len(data):
      (n,) = struct.unpack_from("<Q", data, at)
      event = Event.FromString(data[at + 12 : at + 12 + n])
      at += 12 + n + 4
      for v in event.summary.value:
        out[(v.tag, event.step)] = v.simple_value
  return out


def test_tensorboard_holds_every_record_and_the_ps_per_table(uninterrupted):
  """Every finite number of every metrics.jsonl record is a TensorBoard scalar at its step (as
  float32), and each PS table has its own scalars beside the totals."""
  summary, workdir = uninterrupted
  scalars = _tensorboard_scalars(workdir)
  records = train.read_metrics(workdir)
  checked = 0
  for r in records:
    prefix = "progressive" if r["kind"] == "progressive" and "source" not in r else r["kind"]
    if r["kind"] == "progressive" and "source" in r:
      prefix = f"progressive/{r['source']}"
    for k, v in r.items():
      if k in ("step", "kind") or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        continue
      assert scalars[(f"{prefix}/{k}", r["step"])] == np.float32(v), (prefix, k, r["step"])
      checked += 1
  assert checked > 50, checked
  steps = [r["step"] for r in records if r["kind"] == "ps"]
  tables = {tag.split("/")[1] for tag, _ in scalars if tag.startswith("ps/") and tag.count("/") == 2}
  assert len(tables) >= 2, tables
  for t in tables:
    assert all((f"ps/{t}/rows", s) in scalars for s in steps), t


def test_step_is_traced_a_bounded_number_of_times(uninterrupted):
  summary, _ = uninterrupted
  # One trace per shape of the step's inputs: the rows' shapes never shrink but once, at the first
  # choice of the hot rows (training/hot_rows.py), so the step compiles before it and after it.
  assert len(summary["hot"]["choices"]) > 1
  assert 1 <= summary["train_step_traces"] <= 2
  assert 1 <= summary["eval_step_traces"] <= 2


SHIPPED = sorted(n[:-3] for n in os.listdir(os.path.join(ROOT, "configs")) if n.endswith(".py") and n[0] != "_")
SHIPPED.remove("fields")  # the fields' descriptions, not a config


@pytest.mark.slow  # every shipped config's main job (dlrm_gpu's first 60 steps of 65,536): about 15 minutes
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_compiles_its_train_step_at_most_twice(name, tmp_path, movielens_dir):
  c = importlib.import_module(f"configs.{name}").get_config()
  if name == "dlrm_gpu":  # on a CPU a step of 65,536 takes about a second: past the first choices
    c.num_steps, c.eval_samples = 60, c.eval_batch_size
  c.progress_bar = False
  summary = train.train_and_evaluate(c, str(tmp_path / "run"))
  assert summary["train_step_traces"] <= 2, (name, summary["train_step_traces"], summary.get("hot"))


def test_two_runs_at_k0_are_identical(uninterrupted, tiny_config, tmp_path):
  first, first_dir = uninterrupted
  second = train.train_and_evaluate(tiny_config, str(tmp_path))
  assert second["auc"] == first["auc"]
  assert second["logloss"] == first["logloss"]
  assert _losses(str(tmp_path)) == _losses(first_dir)


def test_stop_and_resume_at_k0_equals_uninterrupted(uninterrupted, tiny_config, tmp_path):
  full, _ = uninterrupted
  half = tiny_config.copy_and_resolve_references()
  half.num_steps = tiny_config.num_steps // 2
  part = train.train_and_evaluate(half, str(tmp_path))
  assert part["steps_this_run"] == half.num_steps
  resumed = train.train_and_evaluate(tiny_config, str(tmp_path))
  assert resumed["resumed_from"] == half.num_steps
  assert resumed["steps_this_run"] == tiny_config.num_steps - half.num_steps
  assert resumed["auc"] == full["auc"]
  assert resumed["logloss"] == full["logloss"]
  assert resumed["ps_rows"] == full["ps_rows"]


def _staleness_record(workdir):
  """The staleness the trainer logged last (over every lookup of the run so far)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    last = [r for r in map(json.loads, f) if r["kind"] == "train"][-1]
  return last["staleness_mean"], last["staleness_max"]


def test_hybrid_staleness_trains_within_its_bound(tiny_config, tmp_path):
  """Unpaced k = 2: how stale each lookup is depends on the threads' timing, never past k."""
  tiny_config.staleness = 2
  s = train.train_and_evaluate(tiny_config, str(tmp_path))
  assert s["auc"] > 0.6
  mean, most = _staleness_record(str(tmp_path))
  assert 0 <= mean <= most <= 2, (mean, most)


class _Paced:
  """Paces a run's pusher so that the staleness bound k is reached at every step: the push of
  step s waits until the lookup of step s + k was made. Records the rows each training lookup
  read, and every row of the PS just after each step's push was applied (in the pusher thread,
  before the next push)."""

  def __init__(self, k, num_steps, monkeypatch):
    from recsys_jax.training.host import HostPipeline

    self.cond = threading.Condition()
    self.looked_up, self.read, self.after, self.late = set(), {}, {}, []
    real_lookup, real_push = HostPipeline.lookup, HostPipeline.push_step

    def lookup(host, p, create, **kw):
      p = real_lookup(host, p, create, **kw)
      if create:
        with self.cond:
          self.read[p.step] = {
            name: (ids.copy(), p.rows[dim][off : off + ids.shape[0]].copy())
            for dim, g in p.groups.items()
            for name, ids, off in g.tables
          }
          self.looked_up.add(p.step)
          self.cond.notify_all()
      return p

    def push_step(host, step, payload):
      with self.cond:  # under a gate that never lets the lookup of s + k run, this times out (once)
        if step + k < num_steps and not self.late and not self.cond.wait_for(lambda: step + k in self.looked_up, 10):
          self.late.append(step)
      metrics = real_push(host, step, payload)
      snap = host.ps.snapshot()
      self.after[step] = {(t, int(i)): w for t, a in snap.items() for i, w in zip(a["ids"], a["weights"])}
      return metrics

    monkeypatch.setattr(HostPipeline, "lookup", lookup)
    monkeypatch.setattr(HostPipeline, "push_step", push_step)


@pytest.mark.parametrize("k", [0, 1, 4])
def test_observed_staleness_and_the_rows_read_are_those_k_implies(k, tiny_config, tmp_path, monkeypatch):
  """With the pusher as slow as the bound allows, the lookup of step t sees the pushes of steps
  <= t - k - 1 and no later one: its observed staleness is min(t, k), so the logged mean over n
  steps is sum(min(t, k)) / n and the max min(n - 1, k); and every row it reads is bit for bit
  the row as it was right after the push of step t - k - 1 (its initial value if no step up to
  then created it)."""
  n = 10
  c = tiny_config
  c.num_steps, c.staleness = n, k
  c.prefetch_depth = k + 2  # the loop may wait for the push of t while the lookup of t + k must run
  c.eval_samples = c.eval_batch_size = 4096
  c.embeddings.optimizer, c.embeddings.learning_rate = "sgd", 2.0  # every push moves its rows
  c.hot_rows_bytes = 0  # every row through the PS: its staleness gate is what is checked
  paced = _Paced(k, n, monkeypatch)
  train.train_and_evaluate(c, str(tmp_path / "run"))
  assert paced.late == [] and sorted(paced.read) == list(range(n))
  stale = [min(t, k) for t in range(n)]
  assert _staleness_record(str(tmp_path / "run")) == (sum(stale) / n, max(stale))

  fresh = train.build_ps(c, train.build_job(c, str(tmp_path / "probe")).tables)  # initial rows only
  changed = 0
  for t in range(n):
    before = paced.after.get(t - k - 1, {})  # the PS after the push of step t - k - 1
    for table, (ids, rows) in paced.read[t].items():
      want = fresh.lookup_many({table: ids}, create=False)[table]
      for j, i in enumerate(ids):
        if (table, int(i)) in before:
          want[j] = before[(table, int(i))]
      np.testing.assert_array_equal(rows, want, err_msg=f"step {t}, table {table}")
      changed += int(np.any(rows != fresh.lookup_many({table: ids}, create=False)[table], axis=1).sum())
  fresh.close()
  assert changed > 100  # most rows read had been pushed to: the comparison is not of initial values


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tiny_config, tmp_path, monkeypatch):
  tiny_config.checkpoint_every = 40
  real_batch = synthetic.SyntheticData.batch

  def poisoned(self, split, index, batch_size):
    b = real_batch(self, split, index, batch_size)
    if split == synthetic.TRAIN and index >= 50:
      b["dense"] = np.full_like(b["dense"], np.nan)
    return b

  monkeypatch.setattr(synthetic.SyntheticData, "batch", poisoned)
  with pytest.raises(train.NonFiniteLossError, match=r"at step 50.*checkpoints/40 \(left intact\)"):
    train.train_and_evaluate(tiny_config, str(tmp_path))
  ckpt_dir = os.path.join(str(tmp_path), "checkpoints")
  assert sorted(os.listdir(ckpt_dir)) == ["40"]
  before = _tree_digest(ckpt_dir)
  # A second attempt fails the same way and does not touch the good checkpoint.
  with pytest.raises(train.NonFiniteLossError):
    train.train_and_evaluate(tiny_config, str(tmp_path))
  assert _tree_digest(ckpt_dir) == before
  # And that checkpoint still restores: without the poison the run completes from it.
  monkeypatch.setattr(synthetic.SyntheticData, "batch", real_batch)
  s = train.train_and_evaluate(tiny_config, str(tmp_path))
  assert s["resumed_from"] == 40 and np.isfinite(s["logloss"])


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("staleness", -1, "config.staleness"),
    ("batch_size", 0, "config.batch_size"),
    ("model.name", "nope", "config.model.name"),
    ("optimizer.name", "lamb", "config.optimizer.name"),
    ("mesh.replica", 3, "config.mesh"),
    ("eval_samples", 10, "config.eval_samples"),
    ("micro_steps", 0, "config.micro_steps"),
    ("host_workers", -2, "config.host_workers"),
    ("micro_steps", 3, "config.batch_size"),  # 256 examples do not split into 3 micro-batches
    ("mesh.rules", (("mlp", "replica"),), "config.mesh.rules"),
    ("data.name", "kaggle", "config.data.name"),
    ("data.on_bad_record", "ignore", "config.data.on_bad_record"),
    ("embeddings.features", {"nope": {"table": "x"}}, "config.embeddings.features.nope"),
    ("embeddings.features", {"cat_01": {"tabel": "x"}}, "config.embeddings.features.cat_01.tabel"),
    ("embeddings.features", {"cat_01": {"table": "cat_00", "dim": 4}}, "table 'cat_00' is read at dim 8"),
    ("embeddings.features", {"cat_01": {"combiner": "max"}}, "config.embeddings.features.cat_01.combiner"),
    ("embeddings.combiner", "max", "config.embeddings.combiner"),
  ],
)
def test_bad_config_values_name_the_field(tiny_config, tmp_path, field, value, match):
  node, _, leaf = field.rpartition(".")
  (tiny_config[node] if node else tiny_config)[leaf] = value
  with pytest.raises(ValueError, match=match.replace(".", r"\.")):
    train.train_and_evaluate(tiny_config, str(tmp_path))


def _garble_state(step_dir):
  """Overwrites every file of a checkpoint's dense state with a few bytes of garbage."""
  for dirpath, _, filenames in os.walk(os.path.join(step_dir, "state")):
    for name in filenames:
      with open(os.path.join(dirpath, name), "wb") as f:
        f.write(b"garbage")


def _main_cli(workdir, *overrides):
  """python -m recsys_jax.main on configs/tiny.py in ``workdir``, as a user runs it."""
  return subprocess.run(
    [sys.executable, "-m", "recsys_jax.main", "--config=configs/tiny.py", f"--workdir={workdir}", *overrides],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_corrupt_checkpoint_is_reported_and_left_alone(tiny_config, tmp_path):
  tiny_config.num_steps = 20
  train.train_and_evaluate(tiny_config, str(tmp_path))
  _garble_state(tmp_path / "checkpoints" / "20")
  before = _tree_digest(str(tmp_path / "checkpoints"))
  tiny_config.num_steps = 40
  with pytest.raises(checkpoint_lib.CheckpointError, match="checkpoints/20"):
    train.train_and_evaluate(tiny_config, str(tmp_path))
  assert _tree_digest(str(tmp_path / "checkpoints")) == before


def _flip_bytes_of_state_data(step_dir, n=64):
  """Inverts n bytes in the middle of every data file of a checkpoint's dense state."""
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state")) if d.endswith("/d") for f in fs]
  assert files, step_dir
  for path in files:
    with open(path, "r+b") as f:
      data = bytearray(f.read())
      mid = len(data) // 2
      data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
      f.seek(0)
      f.write(data)
  return files


@pytest.fixture(scope="module")
def uninterrupted_40(tmp_path_factory):
  from configs import tiny

  c = tiny.get_config()
  c.num_steps = 40
  return train.train_and_evaluate(c, str(tmp_path_factory.mktemp("tiny40")))


def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tiny_config, tmp_path, capsys, uninterrupted_40):
  """Bit flips inside the newest dense checkpoint: named in one line, set aside, and the run
  resumes from the checkpoint before, ending as if it had never stopped (k = 0)."""
  tiny_config.num_steps = 30
  tiny_config.checkpoint_every = 10
  train.train_and_evaluate(tiny_config, str(tmp_path))
  ckpt_dir = tmp_path / "checkpoints"
  assert sorted(os.listdir(ckpt_dir)) == ["20", "30"]
  _flip_bytes_of_state_data(str(ckpt_dir / "30"))
  capsys.readouterr()
  tiny_config.num_steps = 40
  s = train.train_and_evaluate(tiny_config, str(tmp_path))
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if "checkpoints/30" in line]
  assert len(lines) == 1 and ("damaged" in lines[0] or "cannot be restored" in lines[0]), err[-2000:]
  assert "resuming from checkpoint 20" in lines[0]
  assert s["resumed_from"] == 20
  assert os.listdir(tmp_path / "checkpoints_damaged") == ["30"]  # kept for a look, out of the way
  assert s["auc"] == uninterrupted_40["auc"] and s["logloss"] == uninterrupted_40["logloss"]
  assert sorted(os.listdir(ckpt_dir)) == ["30", "40"]  # 20 was deleted only once 40 read back intact


def test_a_checkpoint_whose_arrays_do_not_match_their_checksums_is_not_used(tiny_config, tmp_path, capsys):
  tiny_config.num_steps = 20
  tiny_config.checkpoint_every = 10
  train.train_and_evaluate(tiny_config, str(tmp_path))
  meta_path = tmp_path / "checkpoints" / "20" / "meta" / "metadata"
  meta = json.loads(meta_path.read_text())
  name = ".params['top']['dense_0']['kernel']"
  meta["state_crc32"][name] = "%08x" % (int(meta["state_crc32"][name], 16) ^ 1)  # as if the data had changed
  meta["meta_crc32"] = checkpoint_lib.meta_checksum(meta)  # ... and not the meta (whose own damage has a test)
  meta_path.write_text(json.dumps(meta))
  capsys.readouterr()
  tiny_config.num_steps = 30
  s = train.train_and_evaluate(tiny_config, str(tmp_path))
  err = capsys.readouterr().err
  assert s["resumed_from"] == 10
  assert f"checkpoints/20 is damaged: {name} (written" in err and "resuming from checkpoint 10" in err, err[-2000:]


@pytest.mark.slow  # -m slow: tests/test_checkpoint.py fails saves at each write in the default run, older checkpoints kept
def test_a_save_that_does_not_read_back_deletes_no_older_checkpoint(tiny_config, tmp_path, monkeypatch):
  tiny_config.num_steps = 20
  tiny_config.checkpoint_every = 10
  train.train_and_evaluate(tiny_config, str(tmp_path))
  ckpt_dir = tmp_path / "checkpoints"
  assert sorted(os.listdir(ckpt_dir)) == ["10", "20"]
  before = _tree_digest(str(ckpt_dir / "10")), _tree_digest(str(ckpt_dir / "20"))
  real = checkpoint_lib.Checkpointer._read_state

  def bad_disk(self, step, template):  # checkpoint 30 reads back with one weight changed
    state = real(self, step, template)
    if step != 30:
      return state
    return state.replace(params=jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1.0) if x.size else x, state.params))

  monkeypatch.setattr(checkpoint_lib.Checkpointer, "_read_state", bad_disk)
  tiny_config.num_steps = 30
  with pytest.raises(checkpoint_lib.CheckpointError, match=r"checkpoints/30 is damaged: .*params"):
    train.train_and_evaluate(tiny_config, str(tmp_path))
  assert (_tree_digest(str(ckpt_dir / "10")), _tree_digest(str(ckpt_dir / "20"))) == before


def test_main_cli_names_an_unreadable_checkpoint_in_one_line(tiny_config, tmp_path):
  tiny_config.num_steps = 20
  train.train_and_evaluate(tiny_config, str(tmp_path))
  _garble_state(tmp_path / "checkpoints" / "20")
  out = _main_cli(tmp_path, "--config.num_steps=40")
  assert out.returncode == EXIT_CONFIG  # a restart would meet the same checkpoint: the launcher does not
  lines = out.stderr.strip().splitlines()
  assert lines[-1].startswith(f"error: checkpoint {tmp_path}/checkpoints/20 cannot be restored"), out.stderr[-3000:]
  assert "Traceback" not in out.stderr


def test_main_cli_runs_and_writes_summary(tmp_path):
  workdir = tmp_path / "run"
  out = _main_cli(workdir, "--config.num_steps=30", "--config.eval_samples=4096")
  assert out.returncode == 0, out.stderr[-3000:]
  assert "eval AUC" in out.stdout
  summary = json.load(open(workdir / "summary.json"))
  assert summary["steps"] == 30


def test_main_cli_rejects_bad_override(tmp_path):
  # EXIT_CONFIG: the launcher does not restart a job that would fail the same way (recsys_jax/launch/restarts.py).
  out = _main_cli(tmp_path, "--config.staleness=-3")
  assert out.returncode == EXIT_CONFIG
  assert "config.staleness" in out.stderr
  for bad, says in (
    ("--config.no_such_field=1", "no_such_field"),
    ("--config.num_steps=many", "--config.num_steps=many"),
    ("--config=configs/no_such_config.py", "no_such_config.py"),
  ):
    out = _main_cli(tmp_path, bad)
    assert out.returncode == EXIT_CONFIG and says in out.stderr, (bad, out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, bad


@pytest.mark.slow  # -m slow: tests/parallel/test_mesh.py compares every weight and row on 8 devices with one in the default run
def test_eight_simulated_devices_match_one_device(uninterrupted, tmp_path):
  """The batch split over 8 CPU devices trains to the single-device metrics."""
  single, _ = uninterrupted
  code = (
    "import json, sys; from absl import logging; logging.set_verbosity(logging.WARNING);"
    "from configs import tiny; from recsys_jax import train;"
    f"s = train.train_and_evaluate(tiny.get_config(), {str(tmp_path)!r});"
    "print(json.dumps({k: s[k] for k in ('auc', 'logloss', 'devices')}))"
  )
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  multi = json.loads(out.stdout.strip().splitlines()[-1])
  assert multi["devices"] == 8
  # Same math, different reduction order: equal to float32 round-off over 120 steps.
  assert abs(multi["auc"] - single["auc"]) < 2e-3
  assert abs(multi["logloss"] - single["logloss"]) < 2e-3


def test_dense_staleness_applies_each_gradient_that_many_steps_late(tiny_config, tmp_path):
  """Persia's fully asynchronous baseline: with SGD and d = 2, after 3 steps the dense parameters
  are those of one synchronous step (zeros, zeros, then step 0's gradient), and after 2 still
  the initial ones."""
  from tests.parallel.test_mesh import _dense_params

  tiny_config.optimizer.name = "sgd"
  tiny_config.optimizer.learning_rate = 0.5
  tiny_config.eval_samples = tiny_config.eval_batch_size = 4096

  def dense_after(steps, delay, name):
    c = tiny_config.copy_and_resolve_references()
    c.num_steps, c.dense_staleness = steps, delay
    train.train_and_evaluate(c, str(tmp_path / name))
    return _dense_params(str(tmp_path / name), steps)

  one_sync = dense_after(1, 0, "sync1")
  two_late = dense_after(2, 2, "late2")
  three_late = dense_after(3, 2, "late3")
  init = train.build_job(tiny_config, str(tmp_path / "probe")).state.params
  init = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(init)[0]}
  for k in one_sync:
    np.testing.assert_array_equal(two_late[k], init[k], err_msg=k)
    np.testing.assert_allclose(three_late[k], one_sync[k], rtol=1e-6, atol=1e-7, err_msg=k)
  assert max(float(np.max(np.abs(one_sync[k] - init[k]))) for k in one_sync) > 1e-3  # the step moved them


def test_k0_equals_a_plain_sequential_loop(tiny_config, tmp_path):
  """The whole PS path at k = 0 against a loop written here: SGD on the dense weights and on
  the rows (SGD sees a gradient's scale, Adagrad and Adam hide it), rows initialised from
  (table, id, seed), gradients of the mean loss summed over each row's occurrences."""
  c = tiny_config
  c.num_steps = 6
  c.optimizer.name, c.optimizer.learning_rate = "sgd", 0.5
  c.embeddings.optimizer, c.embeddings.learning_rate = "sgd", 2.0
  c.eval_samples = c.eval_batch_size
  job = train.build_job(c, str(tmp_path / "reference"))
  assert all(f.max_len == 1 and f.kind == "pooled" for f in job.features)  # one id per feature: pooling = the row
  fresh = train.build_ps(c, job.tables)  # only for the rows' initial values
  model = job.model

  def loss(params, embs, dense, label):
    logits = model.apply({"params": params}, dense, embs)
    return optax.sigmoid_binary_cross_entropy(logits, label).mean()

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  params = jax.device_get(job.state.params)
  rows = {}  # (table, id) -> float64 row
  batches = job.reader.train(None)
  for _ in range(c.num_steps):
    b, _ = next(batches)
    ids = {f.name: b["sparse"][f.name][:, 0] for f in job.features}
    for f in job.features:
      for i in np.unique(ids[f.name]):
        if (f.table, i) not in rows:
          init = fresh.lookup_many({f.table: np.array([i], np.uint64)}, create=True, step=0)[f.table][0]
          rows[(f.table, i)] = init.astype(np.float64)
    embs = {f.name: np.stack([rows[(f.table, i)] for i in ids[f.name]]).astype(np.float32) for f in job.features}
    g_params, g_embs = jax.device_get(grad(params, embs, b["dense"], b["label"]))
    params = jax.tree.map(lambda p, g: p - np.float32(c.optimizer.learning_rate) * g, params, g_params)
    for f in job.features:
      for i, g in zip(ids[f.name], np.asarray(g_embs[f.name], np.float64)):
        rows[(f.table, i)] -= c.embeddings.learning_rate * g
  fresh.close()

  workdir = str(tmp_path / "run")
  train.train_and_evaluate(c, workdir)
  ps = train.build_ps(c, job.tables)
  ckpt = checkpoint_lib.Checkpointer(workdir)
  state, _ = ckpt.restore(c.num_steps, job.state, ps)
  ckpt.close()
  for path, got in jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]:
    want = functools.reduce(lambda t, k: t[k.key], path, params)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  for t in job.tables:
    ids = np.array(sorted(i for (name, i) in rows if name == t.name), np.uint64)
    want = np.stack([rows[(t.name, i)] for i in ids])
    got = ps.lookup_many({t.name: ids}, create=False)[t.name]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=t.name)
  ps.close()
