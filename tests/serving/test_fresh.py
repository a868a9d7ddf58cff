"""Fresh rows to serving without reloads: the trainer publishes row deltas, the server applies them.

One tiny run (``configs/tiny.py``, k = 0, hot rows on and chosen again every 2 steps) publishes
after every step and checkpoints every 3 steps (kept: 3, 6, 9). Its checkpoint 9 is the trainer's
own state after step 9 (rows and dense parameters), the reference: a server that starts from
checkpoint 6 (9 taken away, as if it started before 9 was written) and applies the deltas 7..9
must score every record exactly as checkpoint 9 does, read exactly its rows, and name each
version it scores with.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import jax
import numpy as np
import pytest

from recsys_jax.async_ps.snapshot import published
from recsys_jax.online.publish import Publisher
from recsys_jax.serving import scorer as scorer_lib
from recsys_jax.serving.batcher import Batcher
from recsys_jax.serving.fresh import FreshModelHolder

STEPS, EVERY = 9, 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  from configs import tiny
  from recsys_jax import train

  c = tiny.get_config()
  c.num_steps, c.checkpoint_every, c.max_checkpoints = STEPS, EVERY, 3
  c.eval_samples = c.eval_batch_size = 1024
  c.publish_every_s = c.publish_dense_every_s = 1e-9  # every step
  c.hot_every = 2  # hot rows chosen again at 7 and 9: rows leave the device between deltas
  w = str(tmp_path_factory.mktemp("fresh") / "run")
  train.train_and_evaluate(c, w)
  return w


def _late_copy(run, dst, keep_newest=False):
  """A copy of the run as a server that started when checkpoint 6 was the newest finds it."""
  shutil.copytree(run, dst)
  if not keep_newest:
    shutil.move(os.path.join(dst, "checkpoints", str(STEPS)), os.path.join(os.path.dirname(dst), "aside"))
  return str(dst)


def _holder(w, **kw):
  return FreshModelHolder(
    w, scorer_lib.load_scorer, scorer_lib.newest_step, os.path.join(w, "publish"), steps=scorer_lib.complete_steps, **kw
  )


def _records(sc, w, n=64, seed=0):
  """Records whose every id is one the published deltas carry (a row trained since step 6)."""
  rng = np.random.default_rng(seed)
  pub = os.path.join(w, "publish")
  ids = {}
  for d in published.read_index(pub)["deltas"]:
    for t, a in published.read_delta(pub, d).items():
      ids[t] = np.union1d(ids.get(t, np.zeros(0, np.uint64)), a["ids"])
  tables = {f.name: f.table for f in sc.features}
  out = []
  for _ in range(n):
    r = {}
    for f, k in sc.fields().items():
      r[f] = float(rng.exponential()) if k == "float" else int(rng.choice(ids[tables[f]]))
    out.append(r)
  return out


def _index(w):
  return published.read_index(os.path.join(w, "publish"))


def test_published_deltas_are_the_ones_past_the_covered_checkpoint(run):
  index = _index(run)
  steps = [d["step"] for d in index["deltas"]]
  assert steps == [7, 8, 9]  # 6 = the older of the two newest checkpoints covers the rest: pruned
  names = {d["name"] for d in index["deltas"]}
  assert set(os.listdir(os.path.join(run, "publish", published.ROWS))) == names
  assert [d["parent"] for d in index["deltas"][1:]] == [d["seq"] for d in index["deltas"][:-1]]
  assert [e["step"] for e in index["dense"]] == [8, 9]


def test_late_server_catches_up_to_the_trainers_rows_and_scores(run, tmp_path):
  w = _late_copy(run, tmp_path / "w")
  h = _holder(w)
  sc = h.current()
  assert (sc.row_version, sc.dense_version, sc.base.checkpoint.step, sc.version) == (9, 9, 6, "step-9")
  ref, old = scorer_lib.load_scorer(run, STEPS), scorer_lib.load_scorer(run, 6)
  recs = _records(sc, run)
  want = ref.predict(recs)
  np.testing.assert_array_equal(sc.predict(recs), want)  # the trainer's evaluation of them, bit for bit
  assert (old.predict(recs) != want).all()
  # Every row the deltas carry is the trainer's row after step 9, and many moved since step 6.
  moved = 0
  for t, (ids, rows) in sc.rows.overlay.items():
    np.testing.assert_array_equal(rows, ref.rows.lookup_many({t: ids})[t], err_msg=t)
    np.testing.assert_array_equal(sc.rows.lookup_many({t: ids})[t], rows, err_msg=t)
    moved += int((old.rows.lookup_many({t: ids})[t] != rows).any(axis=1).sum())
  assert moved > 100
  # And no row is missing: every id with a row after step 9 (or after 6) reads the trainer's row.
  for t, tr in ref.rows.tables.items():
    ids = np.union1d(tr.ids, old.rows.tables[t].ids)
    np.testing.assert_array_equal(sc.rows.lookup_many({t: ids})[t], ref.rows.lookup_many({t: ids})[t], err_msg=t)


def test_rows_alone_move_the_scores(run, tmp_path):
  """No dense publish: the server scores step 6's dense parameters with step 9's rows."""
  w = _late_copy(run, tmp_path / "w")
  index = _index(w)
  index["dense"] = []
  published.write_index(os.path.join(w, "publish"), index)
  sc = _holder(w).current()
  assert (sc.row_version, sc.dense_version, sc.version) == (9, 6, "rows-9.dense-6")
  ref, old = scorer_lib.load_scorer(run, STEPS), scorer_lib.load_scorer(run, 6)
  recs = _records(sc, run)
  want = old.derive("rows of 9", rows=ref.rows).predict(recs)
  np.testing.assert_array_equal(sc.predict(recs), want)
  assert (old.predict(recs) != want).sum() > len(recs) // 2


@pytest.mark.parametrize("damage", ["truncated", "deleted", "flipped"])
def test_damaged_delta_is_named_and_the_server_catches_up_from_the_chain(run, tmp_path, damage, caplog):
  w = _late_copy(run, tmp_path / "w")
  d8 = next(d for d in _index(w)["deltas"] if d["step"] == 8)
  path = os.path.join(w, "publish", published.ROWS, d8["name"])
  if damage == "deleted":
    os.remove(path)
  else:
    with open(path, "r+b") as fh:
      if damage == "truncated":
        fh.truncate(os.path.getsize(path) // 2)
      else:  # one byte of a row changed: the size is right, the CRC32 is not
        fh.seek(os.path.getsize(path) // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x10]))
  h = _holder(w)
  sc = h.current()
  # It applies delta 7 and stops before the damaged one: never rows of 8 or 9 with 8's missing.
  assert sc.row_version == 7, sc.version
  assert any(d8["name"] in why for why in h.bad.values()), h.bad
  assert any(d8["name"] in r.getMessage() for r in caplog.records), "the damaged delta is not named in the log"
  assert not h.check() and h.current() is sc  # no checkpoint past it yet: it keeps what it has
  shutil.move(os.path.join(tmp_path, "aside"), os.path.join(w, "checkpoints", str(STEPS)))
  assert h.check()
  sc = h.current()
  assert (sc.row_version, sc.base.checkpoint.step, h.catch_ups) == (9, 9, 1)
  recs = _records(sc, run)
  np.testing.assert_array_equal(sc.predict(recs), scorer_lib.load_scorer(run, STEPS).predict(recs))


def test_delta_rows_in_ram_are_bounded_by_a_rebuild_on_a_newer_checkpoint(run, tmp_path):
  w = _late_copy(run, tmp_path / "w")
  h = _holder(w, max_overlay_rows=100, reload_every_s=0)
  sc = h.current()
  assert (sc.row_version, sc.base.checkpoint.step) == (9, 6) and sc.rows.num_overlay_rows() > 100
  assert not h.check()  # no checkpoint newer than its base: it keeps the rows it has
  shutil.move(os.path.join(tmp_path, "aside"), os.path.join(w, "checkpoints", str(STEPS)))
  assert h.check()
  sc = h.current()
  assert (sc.row_version, sc.base.checkpoint.step, sc.rows.num_overlay_rows(), sc.version) == (9, 9, 0, "step-9")
  recs = _records(sc, run)
  np.testing.assert_array_equal(sc.predict(recs), scorer_lib.load_scorer(run, STEPS).predict(recs))


def test_a_delta_applied_mid_stream_never_mixes_versions(run, tmp_path):
  """Requests scored while deltas are applied: each answer is the reference of the versions it names."""
  w = _late_copy(run, tmp_path / "w")
  pub = os.path.join(w, "publish")
  os.rename(pub, pub + ".later")  # the server starts before anything is published
  a, b = _holder(w), _holder(w)
  os.rename(pub + ".later", pub)
  recs = _records(a.current(), run, n=8)
  ref = {(6, 6): a.current().predict(recs)}
  while a.check(limit=1):  # one delta at a time (the dense parameters of 9 come with the first)
    sc = a.current()
    ref[(sc.row_version, sc.dense_version)] = sc.predict(recs)
  assert sorted(ref) == [(6, 6), (7, 9), (8, 9), (9, 9)]
  for x in ref:  # each version scores the records its own way: an answer mixing two would show
    assert all((ref[x] != ref[y]).any() for y in ref if y != x), x
  batcher = Batcher(b.current, max_batch=64, max_wait_s=0.0005)
  batcher.predict(recs)  # compiled before the clients start
  got, stop = [[], []], threading.Event()

  def client(mine):
    while not stop.is_set():
      p = batcher.predict(recs, timeout=30)
      mine.append((p.row_version, p.dense_version, p.version, np.asarray(p.scores, np.float32)))

  threads = [threading.Thread(target=client, args=(g,)) for g in got]
  for t in threads:
    t.start()

  def answered(version):  # every client has had an answer of this version
    end = time.monotonic() + 30
    while not all(m and m[-1][:2] == version for m in got):
      assert time.monotonic() < end, "no answer of the new version"
      time.sleep(0.01)

  try:
    answered((6, 6))
    while b.check(limit=1):
      answered((b.current().row_version, b.current().dense_version))
  finally:
    stop.set()
    for t in threads:
      t.join()
    batcher.close()
  for mine in got:
    seen = [(r, d) for r, d, _, _ in mine]
    assert sorted(set(seen)) == sorted(ref), set(seen)
    assert all(x <= y for x, y in zip(seen, seen[1:])), f"versions went back: {seen}"
    for r, d, version, scores in mine:
      np.testing.assert_array_equal(scores, ref[(r, d)], err_msg=f"{version}: scores of another version")


def _config(**fields):
  """The default config with ``fields`` set."""
  from configs import default

  c = default.get_config()
  c.update(fields)
  return c


def test_a_restarted_trainer_drops_the_deltas_past_its_checkpoint(tmp_path):
  """The steps after the checkpoint it resumes from are trained again: their old deltas go, seq goes on."""
  d = str(tmp_path / "publish")
  os.makedirs(d)
  index = published.empty_index()
  for seq, step in enumerate(range(4, 10)):
    e = published.write_delta(
      d,
      seq,
      step,
      seq - 1 if seq else None,
      step - 1,
      {"t": {"ids": np.array([step], np.uint64), "weights": np.ones((1, 2), np.float32)}},
    )
    index["deltas"].append(e)
  index["next_seq"] = 6
  published.write_index(d, index)
  p = Publisher(_config(publish_every_s=1.0, publish_dir=d), str(tmp_path), ps=None, start=6)
  p.close()
  after = published.read_index(d)
  assert [e["step"] for e in after["deltas"]] == [4, 5, 6] and after["next_seq"] == 6
  assert sorted(os.listdir(os.path.join(d, published.ROWS))) == sorted(e["name"] for e in after["deltas"])
  got = published.read_delta(d, after["deltas"][-1])
  assert got["t"]["ids"].tolist() == [6]
  with open(os.path.join(d, published.INDEX)) as f:
    assert json.load(f) == after


def test_a_publish_waits_for_the_push_of_its_cut_step(tmp_path):
  """A delta published at the cut after step t carries the rows as step t's push left them, however
  late that push is applied (above all for ids only step t touched). The pusher applies each
  step's push only once someone waits for it (``flush`` up to that step): a publish that read the
  PS without waiting for its cut step's push would always read the rows from before it."""
  from types import SimpleNamespace

  from recsys_jax.async_ps.store.ps import ParameterServer
  from recsys_jax.embeddings.specs import TableSpec
  from recsys_jax.training.pipeline import Pusher, StalenessGate

  ps = ParameterServer([TableSpec(name="t", dim=4)], seed=0)
  released = {}  # step -> event: set once the pushes up to it are waited for

  def apply(t, grads):
    assert released[t].wait(30), f"nobody waited for the push of step {t}"
    ps.apply_many(grads)

  class WaitedPusher(Pusher):
    def flush(self, step):
      for t, e in released.items():
        if t <= step:
          e.set()
      super().flush(step)

  gate = StalenessGate(last_applied=-1)
  pusher = WaitedPusher(apply, gate)
  pub_dir = str(tmp_path / "publish")
  ticks = iter(range(1000))
  publisher = Publisher(
    _config(publish_every_s=1.0, publish_dense_every_s=0.0, publish_dir=pub_dir),
    str(tmp_path),
    ps,
    clock=lambda: float(next(ticks)) * 10,  # every cut is due
  )
  rng = np.random.default_rng(0)
  want = {}
  try:
    for t in range(4):
      ids = np.unique(np.concatenate([[100 + t, 101 + t], rng.integers(0, 8, 3)])).astype(np.uint64)  # some only here
      ps.lookup_many({"t": ids})  # the step's lookup creates its rows
      released[t] = threading.Event()
      prepared = SimpleNamespace(groups={4: SimpleNamespace(tables=[("t", ids, None)])}, hot_idx=None)
      assert publisher.step(prepared, t + 1, gate)
      gate.decide(t + 1)
      pusher.push(t, {"t": (ids, rng.normal(size=(ids.shape[0], 4)).astype(np.float32))})
      publisher.cut(t + 1, None, pusher)
      pusher.flush(t)  # the push applied whatever the publish did: the rows the cut must carry
      want[t + 1] = (ids, ps.lookup_many({"t": ids}, create=False)["t"].copy())
    publisher.close()
  finally:
    pusher.close()
    ps.close()
  deltas = published.read_index(pub_dir)["deltas"]
  assert [d["step"] for d in deltas] == [1, 2, 3, 4]
  for d in deltas:
    got = published.read_delta(pub_dir, d)["t"]
    ids, rows = want[d["step"]]
    order = np.argsort(got["ids"])
    np.testing.assert_array_equal(got["ids"][order], ids)
    np.testing.assert_array_equal(got["weights"][order], rows, err_msg=f"the delta of step {d['step']}")


def test_http_and_grpc_answers_name_the_dense_and_row_versions(run, tmp_path):
  from recsys_jax.serving.client import GrpcClient, HttpClient
  from recsys_jax.serving.server import ServerOptions, Serving

  w = _late_copy(run, tmp_path / "w")
  s = Serving(
    w,
    scorer_lib.load_scorer,
    scorer_lib.newest_step,
    ServerOptions(publish_dir=os.path.join(w, "publish"), deltas_every_s=0.05),
    steps=scorer_lib.complete_steps,
  )
  try:
    recs = _records(s.holder.current(), run, n=5)
    want = scorer_lib.load_scorer(run, STEPS).predict(recs)
    for c in (HttpClient("127.0.0.1", s.http_port), GrpcClient(f"127.0.0.1:{s.grpc_port}")):
      a = c.predict(recs)
      assert (a["version"], a["dense_version"], a["row_version"]) == ("step-9", 9, 9), a
      np.testing.assert_allclose(a["scores"], want, rtol=1e-6)
      assert c.model()["fresh"]["base_step"] == 6 and c.health()["row_version"] == 9
  finally:
    s.stop()


def test_a_trainer_restart_never_moves_the_versions_back(run, tmp_path):
  """The trainer resumes from checkpoint 6 while the server serves rows of step 9 (of the steps it
  trains again): the server stays at 9 until the new line passes it through a checkpoint, never
  answering with rows of 7 or 8, nor with the new line's deltas over the old line's rows."""
  w = _late_copy(run, tmp_path / "w")
  h = _holder(w, reload_every_s=0)
  assert h.current().row_version == 9
  pub = os.path.join(w, "publish")
  Publisher(_config(publish_every_s=1.0, publish_dir=pub), w, ps=None, start=6).close()
  index = _index(w)
  assert index["deltas"] == []  # every delta was past 6
  rows = {"cat_00": {"ids": np.array([1], np.uint64), "weights": np.zeros((1, 8), np.float32)}}
  seq, parent, parent_step = index["next_seq"], None, 6
  for step in (7, 8, 10):
    index["deltas"].append(published.write_delta(pub, seq, step, parent, parent_step, rows))
    index["next_seq"], parent, parent_step, seq = seq + 1, seq, step, seq + 1
    published.write_index(pub, index)
    h.check()
    assert h.current().row_version == 9, h.current().version
  assert any("gone" in why for why in h.bad.values()), h.bad


@pytest.mark.slow  # a second training run: about 15 s on 2 shared cores
def test_publishing_changes_nothing_the_run_trains(run, tmp_path):
  """k = 0: the same run without publishing writes the same checkpoint 9, bit for bit (the publisher
  only reads the PS, and the PS's change tracking, which the incremental snapshots use, is its own)."""
  from configs import tiny
  from recsys_jax import train

  c = tiny.get_config()
  c.num_steps, c.checkpoint_every, c.max_checkpoints = STEPS, EVERY, 3
  c.eval_samples = c.eval_batch_size = 1024
  c.hot_every = 2
  w = str(tmp_path / "plain")
  train.train_and_evaluate(c, w)
  assert not os.path.exists(os.path.join(w, "publish"))
  a, b = scorer_lib.load_scorer(run, STEPS), scorer_lib.load_scorer(w, STEPS)
  assert a.chain[-1].endswith("incr") and [os.path.basename(p) for p in a.chain] == [
    os.path.basename(p) for p in b.chain
  ]
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_array_equal(x, y)
  for t in a.rows.tables:
    ids = a.rows.tables[t].ids
    np.testing.assert_array_equal(ids, b.rows.tables[t].ids, err_msg=t)
    np.testing.assert_array_equal(a.rows.lookup_many({t: ids})[t], b.rows.lookup_many({t: ids})[t], err_msg=t)


def test_publishing_without_checkpoints_is_refused_naming_the_field():
  from configs import tiny
  from recsys_jax.training.validation import validate_config

  c = tiny.get_config()
  c.publish_every_s, c.checkpoint_every = 1.0, 0
  with pytest.raises(ValueError, match=r"config.publish_every_s = 1.0: needs config.checkpoint_every > 0"):
    validate_config(c)
  c.publish_every_s = -1.0
  with pytest.raises(ValueError, match=r"config.publish_every_s = -1.0: must be >= 0"):
    validate_config(c)
  c.publish_every_s, c.checkpoint_every = 1.0, 10
  validate_config(c)
