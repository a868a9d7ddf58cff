"""The PS working several tables (and shards) of one call at once: results bit-identical to one
thread and to plain per-table loops, refused requests change nothing, failures surface.

References: ``Table`` objects driven one at a time in a loop written here (no pool, no PS),
and the same PS with one thread; comparisons are array-equal (rows, optimizer slots, created
row order in snapshots, counters).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.async_ps.store.table import Table
from recsys_jax.async_ps.store.workers import Workers, default_threads
from recsys_jax.embeddings.specs import TableSpec

SEED = 11
SPECS = [
  TableSpec(name="a", dim=8, optimizer="adagrad"),
  TableSpec(name="b", dim=4, optimizer="sgd"),
  TableSpec(name="c", dim=16, optimizer="adam"),
  TableSpec(name="d", dim=8, optimizer="ftrl", optimizer_kwargs=(("learning_rate", 0.1), ("l1", 0.01))),
  TableSpec(name="e", dim=8, optimizer="rowwise_adagrad", storage_dtype="bfloat16"),
  TableSpec(name="f", dim=4, optimizer="adagrad", capacity=300, eviction="lfu"),  # evicts: order matters
  TableSpec(name="g", dim=4, optimizer="sgd", admit_after=2),  # admission by a sketch
  TableSpec(name="h", dim=2, optimizer="adagrad", capacity=200, expire_after=5),
]
UNBOUNDED = "abcde"


def _workload(steps: int = 25, seed: int = 0):
  """Per step: {table: distinct ids} (new and old ids, sizes from 1 to ~400) and gradients."""
  rng = np.random.default_rng(seed)
  out = []
  for s in range(steps):
    ids, grads = {}, {}
    for spec in SPECS:
      if rng.random() < 0.15:
        continue  # a table absent from this step
      n = int(rng.integers(1, 400))
      v = np.unique(rng.integers(0, 600 + 40 * s, size=n).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
      ids[spec.name] = rng.permutation(v)
      grads[spec.name] = rng.standard_normal((v.shape[0], spec.dim)).astype(np.float32)
    out.append((ids, grads))
  return out


def _drive(lookup_many, apply_many, snapshot, steps):
  """Runs the workload; returns every lookup's rows and a snapshot (incremental every 7 steps)."""
  rows, snaps = [], []
  for s, (ids, grads) in enumerate(steps):
    got = lookup_many(ids, s + 1)
    rows.append({t: got[t].copy() for t in ids})
    apply_many({t: (ids[t], grads[t]) for t in ids}, s + 1)
    if s % 7 == 6:
      snaps.append(snapshot(True))
  snaps.append(snapshot(False))
  return rows, snaps


def _run_ps(threads, num_shards=1, min_rows=0, steps=None):
  ps = ParameterServer(SPECS, num_shards=num_shards, seed=SEED, threads=threads, min_rows=min_rows)
  try:
    rows, snaps = _drive(
      lambda ids, s: ps.lookup_many(ids, True, s), lambda g, s: ps.apply_many(g, s), ps.snapshot, steps
    )
    counters = {t: {k: v for k, v in st.items() if not k.endswith("_ms")} for t, st in ps.stats().items()}
    return rows, snaps, counters
  finally:
    ps.close()


def _run_tables(steps):
  """The reference: one ``Table`` per spec, each call in turn on this thread (what a 1-shard PS holds)."""
  tables = {s.name: Table(s, SEED, capacity=s.capacity) for s in SPECS}

  def lookup_many(ids, step):
    return {t: tables[t].lookup(v, True, step) for t, v in ids.items()}

  def apply_many(grads, step):
    for t, (i, g) in grads.items():
      tables[t].apply(i, g, step)

  return _drive(lookup_many, apply_many, lambda inc: {t: tab.snapshot(inc) for t, tab in tables.items()}, steps)


def _assert_same(x, y):
  """Array-equal, down to the dtype; dicts and lists recursively."""
  if isinstance(x, dict):
    assert sorted(x) == sorted(y)
    for k in x:
      _assert_same(x[k], y[k])
  elif isinstance(x, (list, tuple)):
    assert len(x) == len(y)
    for a, b in zip(x, y):
      _assert_same(a, b)
  elif isinstance(x, np.ndarray):
    assert x.dtype == y.dtype and np.array_equal(x, y)
  else:
    assert x == y or (x != x and y != y)  # nan == nan for an unused hit rate


def test_every_thread_count_gives_bit_identical_rows_state_and_snapshots():
  steps = _workload()
  ref_rows, ref_snaps = _run_tables(steps)
  assert any(s["f"]["deleted"].shape[0] for s in ref_snaps[:-1])  # the workload does evict
  one = _run_ps(1, steps=steps)
  _assert_same(one[0], ref_rows)
  _assert_same(one[1], ref_snaps)
  for threads in (2, 4):
    got = _run_ps(threads, steps=steps)
    _assert_same(got[0], ref_rows)
    _assert_same(got[1], ref_snaps)
    _assert_same(got[2], one[2])


@pytest.mark.parametrize("threads", [2, 4])
def test_several_shards_with_several_threads_match_one_thread(threads):
  steps = _workload(steps=18, seed=1)
  one = _run_ps(1, num_shards=3, steps=steps)
  got = _run_ps(threads, num_shards=3, steps=steps)
  for a, b in zip(one[:2], got[:2]):
    _assert_same(a, b)
  _assert_same(one[2], got[2])


def test_the_default_threshold_keeps_small_calls_on_the_caller_and_still_matches():
  steps = _workload(steps=10, seed=2)
  _assert_same(_run_ps(4, min_rows=10**9, steps=steps)[:2], _run_ps(4, min_rows=0, steps=steps)[:2])
  seen = set()
  w = Workers(4, min_rows=100)
  try:
    w.run([(10, lambda: seen.add(threading.current_thread().name))] * 5)  # 50 rows: no pool thread
    assert seen == {threading.current_thread().name}
    together = threading.Barrier(4, timeout=60)  # passes only when four threads run tasks at once
    w.run([(100, lambda: (together.wait(), seen.add(threading.current_thread().name)))] * 4)
    assert len(seen) == 4  # the caller and three pool threads
  finally:
    w.close()


def test_a_refused_request_changes_no_table():
  ps = ParameterServer(SPECS, seed=SEED, threads=4, min_rows=0)
  try:
    ids = {s.name: np.arange(50, dtype=np.uint64) for s in SPECS}
    ps.lookup_many(ids, True, 1)
    before = ps.snapshot()
    good = {s.name: (ids[s.name], np.ones((50, s.dim), np.float32)) for s in SPECS}
    bad_shape = dict(good, h=(ids["h"], np.ones((50, 3), np.float32)))
    with pytest.raises(ValueError, match="table 'h': gradient shape"):
      ps.apply_many(bad_shape, 2)
    repeated = dict(good, h=(np.zeros(50, np.uint64), good["h"][1]))
    with pytest.raises(ValueError, match="'h'"):
      ps.apply_many(repeated, 2)
    out = {s.name: np.zeros((50, s.dim), np.float32) for s in SPECS}
    out["h"] = np.zeros((50, 3), np.float32)
    with pytest.raises(ValueError, match="'h'"):
      ps.lookup_many({t: v + np.uint64(1000) for t, v in ids.items()}, True, 2, out=out)  # would create rows
    _assert_same(ps.snapshot(), before)
  finally:
    ps.close()


def test_a_failing_table_is_raised_after_every_other_table_is_done():
  ps = ParameterServer(SPECS, seed=SEED, threads=4, min_rows=0)
  ref = {s.name: Table(s, SEED, capacity=s.capacity) for s in SPECS}
  try:
    ids = {s.name: np.arange(1, 300, dtype=np.uint64) for s in SPECS}
    ps.lookup_many(ids, True, 1)
    grads = {s.name: (ids[s.name], np.full((299, s.dim), 0.5, np.float32)) for s in SPECS}
    grads["a"] = (np.arange(1000, 1010, dtype=np.uint64), np.ones((10, 8), np.float32))  # never looked up
    with pytest.raises(KeyError, match="table 'a': gradient for ids never looked up"):
      ps.apply_many(grads, 2)
    for s in SPECS:  # every other table got its gradient, exactly once
      ref[s.name].lookup(ids[s.name], True, 1)
      if s.name != "a":
        ref[s.name].apply(*grads[s.name], 2)
    _assert_same(ps.snapshot(), {t: tab.snapshot() for t, tab in ref.items()})
  finally:
    ps.close()


def test_workers_run_every_task_then_raise_the_first_failure_in_task_order():
  w = Workers(3, min_rows=0)
  done = []

  def slow(i):
    time.sleep(0.1)
    done.append(i)
    return i

  def fail(msg):
    raise RuntimeError(msg)

  try:
    with pytest.raises(RuntimeError, match="first"):
      w.run([(5, lambda: fail("first")), (9, lambda: slow(1)), (1, lambda: fail("second")), (7, lambda: slow(3))])
    assert sorted(done) == [1, 3]  # the others finished before the error came back
    assert w.run([(3, lambda: 1), (20, lambda: 2), (1, lambda: 3)]) == [1, 2, 3]
  finally:
    w.close()


def test_every_task_runs_once_and_results_keep_task_order():
  w = Workers(3, min_rows=0)
  lock = threading.Lock()
  try:
    rng = np.random.default_rng(0)
    for _ in range(30):
      weights = [int(x) for x in rng.integers(1, 1000, size=int(rng.integers(1, 30)))]
      calls = [0] * len(weights)

      def task(i, calls=calls):
        with lock:
          calls[i] += 1
        time.sleep(0.001 * (i % 3))  # uneven, so the threads interleave
        return i * 10

      assert w.run([(wt, lambda i=i: task(i)) for i, wt in enumerate(weights)]) == [10 * i for i in range(len(weights))]
      assert calls == [1] * len(weights)
  finally:
    w.close()


def test_thread_counts_are_checked_and_the_config_reaches_the_ps(tiny_config):
  from recsys_jax.async_ps.factory import build_ps
  from recsys_jax.training.validation import validate_config

  for bad in (0, -2, 1.5, True):
    with pytest.raises(ValueError, match="threads"):
      Workers(bad)
  assert ParameterServer(SPECS[:1]).threads == default_threads()
  tiny_config.ps.threads = 0
  with pytest.raises(ValueError, match=r"config.ps.threads = 0: must be >= 1, or -1 for the core count"):
    validate_config(tiny_config)
  tiny_config.ps.threads = 3
  ps = build_ps(tiny_config, SPECS[:2])
  assert ps.threads == 3
  ps.close()
  tiny_config.ps.threads = -1
  ps = build_ps(tiny_config, SPECS[:2])
  assert ps.threads == default_threads()
  ps.close()
