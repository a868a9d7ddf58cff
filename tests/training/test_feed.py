"""The parallel host half: PS lookups straight into the step's buffer; worker counts change nothing."""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest

from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec
from tests.helpers.run_outcome import outcome

# -- lookups into the caller's buffer ---------------------------------------------------------------

_BOUNDED = dict(capacity=40, eviction="lru", admit_after=2)


def _ps(shards, dtype, tmp_path, name):
  specs = [
    TableSpec(name="a", dim=4, storage_dtype=dtype),
    TableSpec(name="b", dim=3, storage_dtype=dtype, **_BOUNDED),
    TableSpec(name="c", dim=4, storage_dtype=dtype, **_BOUNDED),
  ]
  return ParameterServer(specs, num_shards=shards, seed=1, tier={"driver": "file", "path": str(tmp_path / name)})


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lookup_into_out_equals_a_fresh_lookup(shards, dtype, tmp_path):
  """Two PSs, same traffic: rows written into slices of one buffer equal the fresh arrays of the
  other, nothing outside the slices is touched, and the tables stay equal (admission, eviction
  to the tier and back, reads without create)."""
  fresh, into = _ps(shards, dtype, tmp_path, "fresh"), _ps(shards, dtype, tmp_path, "into")
  rng = np.random.default_rng(0)
  dims = {"a": 4, "b": 3, "c": 4}
  for step in range(12):
    ids = {t: np.unique(rng.integers(0, 120, 50).astype(np.uint64)) for t in dims}
    create = step % 4 != 3
    want = fresh.lookup_many(ids, create, step if create else None)
    # One buffer per row width, as HostPipeline.lookup lays it out, with a sentinel around the slices.
    bufs, out, off = (
      {3: np.full((80, 3), np.nan, np.float32), 4: np.full((200, 4), np.nan, np.float32)},
      {},
      {3: 5, 4: 7},
    )
    for t, v in ids.items():
      d = dims[t]
      out[t] = bufs[d][off[d] : off[d] + v.shape[0]]
      off[d] += v.shape[0] + 2
    got = into.lookup_many(ids, create, step if create else None, out=out)
    for t in dims:
      assert got[t] is out[t] or np.shares_memory(got[t], out[t])
      np.testing.assert_array_equal(out[t], want[t])
    written = sum(v.shape[0] for t, v in ids.items() if dims[t] == 4)
    assert np.isnan(bufs[4]).sum() == (200 - written) * 4
    if create:
      grads = {t: (v, rng.normal(size=(v.shape[0], dims[t])).astype(np.float32)) for t, v in ids.items()}
      fresh.apply_many(grads, step)
      into.apply_many(grads, step)
  for t in dims:
    a, b = fresh.snapshot()[t], into.snapshot()[t]
    order_a, order_b = np.argsort(a["ids"]), np.argsort(b["ids"])
    for k in a:
      np.testing.assert_array_equal(a[k][order_a], b[k][order_b])
  fresh.close()
  into.close()


def test_lookup_out_of_the_wrong_shape_is_refused_and_changes_nothing():
  ps = ParameterServer([TableSpec(name="a", dim=4)])
  ids = {"a": np.arange(5, dtype=np.uint64)}
  for bad in ({"a": np.zeros((4, 4), np.float32)}, {"a": np.zeros((5, 4), np.float64)}, {}):
    with pytest.raises(ValueError, match="table 'a': out is"):
      ps.lookup_many(ids, out=bad)
  assert ps.stats()["a"]["rows"] == 0


# -- whole runs: the worker count changes nothing -----------------------------------------------------


def _criteo_lines(rng, n, bad_at=()):
  """Criteo TSV records (label, 13 integers, 26 hex ids from small vocabularies, some missing)."""
  out = []
  for i in range(n):
    dense = ["" if rng.random() < 0.2 else str(int(rng.integers(0, 50))) for _ in range(13)]
    cats = ["" if rng.random() < 0.1 else f"{int(rng.integers(0, 40 + 10 * j)):08x}" for j in range(26)]
    y = int(rng.random() < 0.2 + 0.5 * (cats[0] > "00000014"))
    if i in bad_at:
      dense[2] = "x7"  # not an integer: a bad record in field I3
    out.append("\t".join([str(y), *dense, *cats]) + "\n")
  return out


def _files(tmp_path, bad_at=((), (), ())):
  d = tmp_path / "data"
  d.mkdir(exist_ok=True)
  rng = np.random.default_rng(0)
  for i, (n, bad) in enumerate(zip((700, 450, 380), bad_at)):
    (d / f"day_{i}").write_text("".join(_criteo_lines(rng, n, bad)))
  (d / "eval").write_text("".join(_criteo_lines(rng, 300)))
  return d


def _config(tiny_config, data_dir, workers, steps=28):
  c = tiny_config
  c.data.name = "criteo"
  c.data.train_files = (str(data_dir / "day_*"),)
  c.data.eval_files = (str(data_dir / "eval"),)
  c.data.chunk_records = 64
  c.data.shuffle_window = 3  # windows of 192 records: batches span windows, and files
  c.data.on_bad_record = "skip"
  c.batch_size = 64  # an epoch of 1530 good records is about 24 steps: the run crosses an epoch
  c.num_steps = steps
  c.eval_batch_size = 128
  c.eval_samples = 0
  c.log_every = 4
  c.checkpoint_every = 10
  c.host_workers = workers
  return c


def _assert_same(a, b, resumed=False):
  (sa, la, pa, ra), (sb, lb, pb, rb) = a, b
  if resumed:
    # A resumed run lists the bad records it met itself (the count is restored), and its first
    # logged loss averages only the steps since the resume (at 10): compare the later ones.
    sa, sb = ({k: v for k, v in x.items() if k != "bad_record_examples"} for x in (sa, sb))
    la, lb = ([x for x in losses if x[0] > 12] for losses in (la, lb))
  assert sa == sb
  assert la == lb
  assert pa.keys() == pb.keys()
  for k in pa:
    np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
  assert ra.keys() == rb.keys()
  for t in ra:
    for k in ra[t]:
      np.testing.assert_array_equal(ra[t][k], rb[t][k], err_msg=f"{t}/{k}")


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
  """The reference: the run with one host worker, with two bad records skipped on the way."""
  from configs import tiny

  tmp = tmp_path_factory.mktemp("feed")
  data = _files(tmp, bad_at=((), (57,), (3,)))
  return data, outcome(_config(tiny.get_config(), data, 1), str(tmp / "one"))


@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.slow), 2])  # 4: in the resume test below
def test_a_run_is_bit_identical_for_any_worker_count(one_worker, tiny_config, tmp_path, workers):
  data, want = one_worker
  assert want[0]["bad_records_skipped"] >= 2 and len(want[1]) == 7  # both bad records met and skipped
  _assert_same(outcome(_config(tiny_config, data, workers), str(tmp_path)), want)


@pytest.mark.slow  # about 20 s; the resume tests above cover one worker count
def test_resume_with_another_worker_count_continues_at_the_same_record(one_worker, tiny_config, tmp_path):
  """Checkpointed at step 10 (mid-epoch, mid-window) by a run with 2 workers that went on to step
  14, so its workers had read past step 10's batch when it saved; resumed from that checkpoint with
  1 and with 4 workers, both equal the uninterrupted run."""
  data, want = one_worker
  stopped = _config(tiny_config, data, 2, steps=14)
  from recsys_jax import train

  train.train_and_evaluate(stopped, str(tmp_path / "stopped"))
  shutil.rmtree(str(tmp_path / "stopped" / "checkpoints" / "14"))  # as if it had stopped after the save at 10
  for workers in (1, 4):
    workdir = str(tmp_path / f"resumed_{workers}")
    shutil.copytree(str(tmp_path / "stopped"), workdir)
    c = _config(stopped.copy_and_resolve_references(), data, workers, steps=28)
    _assert_same(outcome(c, workdir), want, resumed=True)


def test_resume_with_more_workers_continues_at_the_same_record(one_worker, tiny_config, tmp_path):
  """The default suite's form of the test above: one resume (checkpoint at 10 of a 2-worker run
  that read on to step 12, resumed with 4 workers) against the uninterrupted 1-worker run."""
  data, want = one_worker
  stopped = _config(tiny_config, data, 2, steps=12)
  from recsys_jax import train

  train.train_and_evaluate(stopped, str(tmp_path))
  shutil.rmtree(str(tmp_path / "checkpoints" / "12"))  # as if it had stopped after the save at 10
  c = _config(stopped.copy_and_resolve_references(), data, 4, steps=28)
  _assert_same(outcome(c, str(tmp_path)), want, resumed=True)


def test_a_bad_record_read_by_a_worker_stops_the_run_naming_file_and_line(tiny_config, tmp_path):
  """Under on_bad_record='error', a bad record parsed ahead on a worker thread stops the
  training loop with the file and line, in order, and the workers are gone afterwards."""
  data = _files(tmp_path, bad_at=((), (), (100,)))
  c = _config(tiny_config, data, 3)
  c.data.on_bad_record = "error"
  c.data.shuffle = False  # day_2's line 101 comes after 18 good batches
  from recsys_jax import train
  from recsys_jax.data.base import BadRecordError

  t0 = time.monotonic()
  with pytest.raises(BadRecordError, match=r"day_2:101: field 'I3'"):
    train.train_and_evaluate(c, str(tmp_path / "run"))
  assert time.monotonic() - t0 < 120
  _wait_no_feed_threads()


def _feed_threads():
  return [t.name for t in threading.enumerate() if t.name.startswith("host-worker") and t.is_alive()]


# -- the feed itself -----------------------------------------------------------------------------------


def _jittery(x):
  time.sleep(float(np.random.default_rng(x).random()) * 0.003)
  if x == 13:
    raise KeyError("item 13")
  return x * x


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_feed_keeps_order_and_reraises_in_order(workers):
  from recsys_jax.training.feed import Feed

  feed = Feed(workers, name="host-worker-t").start(iter(range(30)), _jittery)
  got = []
  with pytest.raises(KeyError, match="item 13"):
    for x in feed:
      got.append(x)
  assert got == [x * x for x in range(13)]
  feed.close()
  ok = Feed(workers, name="host-worker-t").start(iter(range(12)), lambda x: -x)
  assert list(ok) == [-x for x in range(12)] and list(ok) == []
  ok.close()
  _wait_no_feed_threads()


def test_closing_a_feed_wakes_its_consumer_and_ends_its_threads():
  from recsys_jax.training.feed import Feed, FeedClosed

  def endless():
    while True:
      yield 0

  feed = Feed(2, name="host-worker-t").start(endless(), lambda x: time.sleep(0.01))
  next(feed)
  errors = []

  def consume():
    try:
      while True:
        next(feed)
    except FeedClosed as e:
      errors.append(e)

  t = threading.Thread(target=consume)
  t.start()
  time.sleep(0.2)
  feed.close()
  t.join(timeout=10)
  assert not t.is_alive() and len(errors) == 1
  _wait_no_feed_threads()


def _wait_no_feed_threads():
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline and _feed_threads():
    time.sleep(0.05)
  assert not _feed_threads()
