"""A served version keeps what it reads (issue 25): storage going away changes no score.

One tiny synthetic DLRM run (three checkpoints, ``checkpoint_full_every=3``: the newest reads a
full snapshot and two incremental ones). The reference is the same scorer's answers before
anything was deleted; a deletion must leave them equal bit for bit, or fail loudly, never change
them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from recsys_jax import train
from recsys_jax import workdir as workdir_lib
from recsys_jax.serving import scorer


def _tiny(steps=12):
  from configs import tiny

  c = tiny.get_config()
  c.num_steps, c.batch_size, c.checkpoint_every, c.checkpoint_full_every = steps, 128, steps // 3, 3
  c.max_checkpoints = 3
  c.eval_samples, c.eval_batch_size = 256, 256
  c.data.vocab_sizes = (500, 200, 50, 1000)
  c.data.num_dense = 5
  return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  w = tmp_path_factory.mktemp("storage") / "run"
  train.train_and_evaluate(_tiny(), str(w))
  return str(w)


def _records(sc, n, seed=0):
  """``n`` records whose ids all have rows in the chain (drawn from the scorer's index)."""
  rng = np.random.default_rng(seed)
  ids = {t: sc.rows.tables[t].ids for t in sc.rows.tables}
  assert all(v.shape[0] > 20 for v in ids.values())
  return [
    {
      **{f"dense_{j:02d}": float(rng.random() * 3) for j in range(5)},
      **{t: int(rng.choice(v)) for t, v in ids.items()},
    }
    for _ in range(n)
  ]


def _copy(run, tmp_path):
  w = str(tmp_path / "w")
  shutil.copytree(run, w)
  return w


def test_deleting_the_served_snapshots_changes_no_score(run, tmp_path):
  w = _copy(run, tmp_path)
  sc = scorer.load_scorer(w, cache_bytes=10 << 10)  # 10 KiB: most rows are read from disk at each batch
  recs = _records(sc, 512)
  before = sc.predict(sc.encode(recs))
  for name in scorer.read_meta(w, sc.checkpoint.step)["ps_chain"]:
    shutil.rmtree(os.path.join(w, "ps_snapshots", name))
  after = sc.predict(sc.encode(recs))
  np.testing.assert_array_equal(after, before)


def test_a_missing_chunk_is_an_error_never_zeros(run, tmp_path):
  from recsys_jax.serving.api import SnapshotGone

  w = _copy(run, tmp_path)
  sc = scorer.load_scorer(w, cache_bytes=0, verify=False)  # no CRC pass at load: reads are the only check
  recs = _records(sc, 64)
  sc.predict(sc.encode(recs))
  held = sc.rows.held_dir
  assert held and held.startswith(os.path.join(w, "serving_held")) and os.path.isdir(held)
  chunks = [os.path.join(r, f) for r, _, fs in os.walk(held) for f in fs if "/weights/c/" in os.path.join(r, f)]
  assert chunks
  for c in chunks:  # what an operator's cleanup would do to the held files: the version cannot score
    os.remove(c)
  with pytest.raises(SnapshotGone, match="cannot be read"):
    sc.predict(sc.encode(recs))


def test_the_held_files_go_with_the_version(run, tmp_path):
  import gc

  w = _copy(run, tmp_path)
  sc = scorer.load_scorer(w)
  held = sc.rows.held_dir
  assert os.path.isdir(held)
  names = scorer.read_meta(w, sc.checkpoint.step)["ps_chain"]
  assert sorted(os.listdir(os.path.join(held, "ps_snapshots"))) == sorted(names)
  assert os.listdir(os.path.join(held, "checkpoints")) == [str(sc.checkpoint.step)]
  del sc
  gc.collect()
  assert not os.path.exists(held)
  assert all(os.path.isdir(os.path.join(w, "ps_snapshots", n)) for n in names)  # the trainer's are untouched


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_server_stops_at_once_on_a_signal_and_removes_its_held_files(run, tmp_path, sig):
  """``python -m recsys_jax.serve`` on a real run, idle, stopped by SIGTERM (or SIGINT, Ctrl-C): it exits
  0 at once (2 s leaves room for a loaded machine) and its held directory is gone, not left for the
  next server on the host to remove."""
  w = _copy(run, tmp_path)
  p, _, _, _ = _start_server(w)
  try:
    mine = os.path.join(w, workdir_lib.SERVING_HELD, f"{socket.gethostname()}-{p.pid}")
    assert os.path.isdir(mine) and os.listdir(mine), "the version served holds its files there"
    t = time.monotonic()
    p.send_signal(sig)
    try:
      rc = p.wait(timeout=2)
    except subprocess.TimeoutExpired:
      pytest.fail(f"still running {time.monotonic() - t:.1f} s after {sig.name}")
    assert rc == 0, p.stderr.read()[-2000:]
    assert not os.path.exists(mine), os.listdir(mine)
  finally:
    p.kill()
    p.wait()
    p.stdout.close()
    p.stderr.close()


def test_the_dense_parameters_are_read_from_the_held_copy(run, tmp_path, monkeypatch):
  """A version reads its dense parameters (and meta) from its held copy of the checkpoint, not from
  the trainer's checkpoint directory: the trainer's ``checkpoints/<step>`` removed right after the
  version linked its files (a rotation at that moment), the newest step is still the one served,
  with the same dense parameters and scores, bit for bit, as a load that nothing disturbed."""
  import jax

  from recsys_jax.serving.rows import held as held_lib

  ref = scorer.load_scorer(_copy(run, tmp_path / "ref"))
  recs = _records(ref, 256)
  want = ref.predict(ref.encode(recs))
  w = _copy(run, tmp_path)
  step = ref.checkpoint.step
  real = held_lib.hold
  removed = []

  def hold_then_rotate(sources, root, label):
    dest = real(sources, root, label)
    mine = os.path.join(w, "checkpoints", str(step))
    if label == f"step-{step}" and os.path.isdir(mine):
      shutil.rmtree(mine)
      removed.append(mine)
    return dest

  monkeypatch.setattr(held_lib, "hold", hold_then_rotate)
  sc = scorer.load_scorer(w)
  assert removed and not os.path.exists(removed[0])
  assert sc.version == ref.version == f"step-{step}" and sc.checkpoint.step == step
  got_leaves = jax.tree_util.tree_leaves_with_path(sc.params)
  want_leaves = jax.tree_util.tree_leaves_with_path(ref.params)
  assert [k for k, _ in got_leaves] == [k for k, _ in want_leaves] and got_leaves
  for (k, a), (_, b) in zip(got_leaves, want_leaves):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(k))
  np.testing.assert_array_equal(sc.predict(sc.encode(recs)), want)


# -- the load test: a trainer rotating and the test deleting what the server serves -------------

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _archive(w, step, archive):
  """Hard-links checkpoint ``step`` of ``w`` (and its parts, chain and config) into ``archive/<step>``."""
  from tests.helpers.serve_trainer import _link_tree

  dst = os.path.join(archive, str(step))
  _link_tree(os.path.join(w, "checkpoints", str(step)), os.path.join(dst, "checkpoints", str(step)))
  parts = os.path.join(w, "checkpoint_parts", str(step))  # the hot set: a part of the checkpoint
  if os.path.isdir(parts):
    _link_tree(parts, os.path.join(dst, "checkpoint_parts", str(step)))
  for name in scorer.read_meta(w, step)["ps_chain"]:
    _link_tree(os.path.join(w, "ps_snapshots", name), os.path.join(dst, "ps_snapshots", name))
  shutil.copy(os.path.join(w, "config.json"), os.path.join(dst, "config.json"))


def _start_server(w, *args):
  """The real model server on ``w`` (no fake model), once it printed its ready line."""
  from tests.serving.test_serve import start_server

  return start_server(w, *args, model_module=None)


class _Offline:
  """The trainer's path, independent of ``recsys_jax.serving``'s row reads: each archived checkpoint
  restored whole into an in-RAM PS (``RunCheckpoints``), records scored by the jitted eval step,
  the probability in float64."""

  def __init__(self, w):
    from recsys_jax.training import run_config

    self.config = run_config.load(w)
    self.job = train.build_job(self.config, None)
    self.step = None

  def scores(self, archive, step, cols):
    import jax

    from recsys_jax.training.run_checkpoints import RunCheckpoints

    if self.step != step:
      ckpts = RunCheckpoints(os.path.join(archive, str(step)), self.config)
      self.state, start, _ = ckpts.restore_latest(self.job.state, self.job.ps, announce=False)
      ckpts.close()
      assert start == step
      self.step = step
    host = self.job.host
    n = int(cols["dense"].shape[0])
    cols = dict(cols, label=np.zeros(n, np.float32))
    p = host.prepare(0, cols, n_valid=n)
    host.lookup(p, create=False)
    _, rows, batch = host.place(p)
    logits = np.asarray(jax.device_get(self.job.eval_step(self.state.params, rows, batch))["logits"], np.float64)
    return 1.0 / (1.0 + np.exp(-logits[:n]))


def _load_with_trainer(run, tmp_path, seconds):
  import json
  import signal
  import subprocess
  import sys
  import time

  from recsys_jax.serving.client import HttpClient
  from recsys_jax.serving.encode import Encoder
  from tests.helpers.serve_load_client import id_records

  w = _copy(run, tmp_path)
  archive = str(tmp_path / "archive")
  first = scorer.newest_step(w)
  _archive(w, first, archive)
  sc = scorer.load_scorer(w)
  spec = {"num_dense": 5, "ids": {t: sc.rows.tables[t].ids[::3].tolist() for t in sc.rows.tables}}
  del sc
  with open(tmp_path / "ids.json", "w") as f:
    json.dump(spec, f)
  # A 10 KiB row cache: nearly every row is read from the snapshots at each request.
  server, hp, gp, version = _start_server(w, "--reload_every_s=0.2", "--cache_mb=0.01", "--max_wait_ms=2")
  trainer = subprocess.Popen(
    [sys.executable, os.path.join(ROOT, "tests", "helpers", "serve_trainer.py"), w, archive, "1000000", "4"],
    cwd=ROOT,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  clients = []
  deleted = set()
  try:
    end = time.monotonic() + 300
    while (
      len([n for n in os.listdir(archive) if n.isdigit()]) < 2 and trainer.poll() is None and time.monotonic() < end
    ):
      time.sleep(0.1)  # the trainer resumed (it reads the chain the test is about to delete) and saved once
    assert trainer.poll() is None, trainer.communicate()[1][-3000:]
    clients = [
      subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.serve_load_client", str(hp), str(gp), str(seconds)]
        + [str(tmp_path / f"client{c}.json"), str(c + 1), str(tmp_path / "ids.json")],
        cwd=ROOT,
      )
      for c in range(2)
    ]
    http = HttpClient("127.0.0.1", hp)
    while any(c.poll() is None for c in clients):
      # Deliberate deletions: every snapshot of the version served now, as soon as it is served.
      step = http.model()["step"]
      if step not in deleted:
        try:
          names = scorer.read_meta(w, step)["ps_chain"]
        except Exception:  # noqa: BLE001 - rotated away already
          names = []
        for name in names:
          shutil.rmtree(os.path.join(w, "ps_snapshots", name), ignore_errors=True)
        deleted.add(step)
      time.sleep(0.3)
    assert all(c.wait() == 0 for c in clients)
    model = http.model()
  finally:
    for c in clients:
      c.kill()
    trainer.kill()
    terr = trainer.communicate()[1]
    server.send_signal(signal.SIGTERM)
    _, serr = server.communicate(timeout=120)
  answers, failures = [], []
  for c in range(2):
    with open(tmp_path / f"client{c}.json") as f:
      out = json.load(f)
    failures += out["failures"]
    answers += out["answers"]
  steps = sorted({int(v.split("-")[1]) for _, _, v, _ in answers})
  print("archived", sorted(int(n) for n in os.listdir(archive) if n.isdigit()), "served", steps, "deleted", deleted)
  print("\n".join(line[:300] for line in serr.splitlines() if "I1" not in line[:3] or "reload.py" in line)[-6000:])
  from recsys_jax.training import run_config

  offline = _Offline(w)
  enc = Encoder(run_config.to_dict(offline.config.data))
  wrong = 0
  missing = [s for s in steps if not os.path.isdir(os.path.join(archive, str(s)))]
  for rseed, n, version, got in sorted(answers, key=lambda a: int(a[2].split("-")[1])):
    if int(version.split("-")[1]) in missing:
      continue
    want = offline.scores(archive, int(version.split("-")[1]), enc.encode(id_records(spec, n, rseed)))
    wrong += int(np.sum(np.abs(np.asarray(got, np.float64) - want) > 1e-6))
  deleted_served = len(deleted & set(steps))
  print(
    f"answers {len(answers)} failed {len(failures)} versions {len(steps)} "
    f"deleted-while-served {deleted_served} wrong {wrong}"
  )
  assert not failures, (failures[:5], serr[-3000:])
  assert wrong == 0, wrong
  # Startup and reloads print the server's own lines only: none of orbax's or jax's INFO lines.
  noise = [
    line
    for line in serr.splitlines()
    if line[:1] == "I"
    and (
      "orbax" in line
      or ".py:" in line
      and any(f in line for f in ("checkpoint_manager.py", "xla_bridge.py", "event_tracking.py", "checkpointer.py"))
    )
  ]
  assert not noise, noise[:5]
  least = 2 if seconds < 30 else 4  # versions served: the trainer's checkpoints reached the clients
  assert len(steps) >= least, (steps, model, serr[-3000:], terr[-3000:])
  assert not missing, missing
  # Throughput is not asserted: on a shared 2-core machine it varied 10-573 answers in 8 s (reported below).
  assert deleted_served >= least and len(answers) >= 2 * least, (deleted_served, len(answers))
  return len(answers), steps, wrong


@pytest.mark.slow  # about 50 s (a trainer, a server, two clients); the default suite has the fast tests above
def test_load_with_a_trainer_rotating_and_snapshots_deleted_short(run, tmp_path):
  _load_with_trainer(run, tmp_path, 8)


@pytest.mark.slow
def test_load_with_a_trainer_rotating_and_snapshots_deleted_60s(run, tmp_path):
  _load_with_trainer(run, tmp_path, 60)
