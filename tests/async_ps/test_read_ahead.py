"""Read-ahead of tier misses (``read_ahead_many``) changes timing only: rows, slots, counters and
placement equal the same run without it, bit for bit, also when a staged copy went stale."""

import numpy as np
import pytest

from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec

DIM = 8
TIMES = ("tier_wait_s", "evict_s", "lookup_ms", "apply_ms", "hit_rate")
# What read-ahead changes: its own counters, and the bytes (staged rows are held in RAM).
AHEAD = ("read_ahead_rows", "read_ahead_used", "read_ahead_skipped", "reads_in_flight", "read_ahead_held", "bytes")


def _ps(tmp_path, name, kvstore, capacity=40, shards=2, optimizer="adam", read_ahead_rows=0):
  specs = [
    TableSpec(name="a", dim=DIM, optimizer=optimizer, capacity=capacity),
    TableSpec(name="b", dim=DIM, optimizer="adagrad", capacity=capacity, eviction="lfu"),
  ]
  tier = {"driver": "memory"} if kvstore == "memory" else {"driver": "file", "path": str(tmp_path / name)}
  return ParameterServer(specs, num_shards=shards, seed=4, tier=tier, read_ahead_rows=read_ahead_rows)


def _steps(n, vocab=300, per_step=30, seed=0):
  """Per step, per table: distinct ids of a skewed draw (a few hot ids, a long tail)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    out.append({t: np.unique((vocab * rng.random(per_step) ** 3).astype(np.uint64)) for t in ("a", "b")})
  return out


def _grads(ids, step):
  rng = np.random.default_rng(step)
  return rng.standard_normal((ids.shape[0], DIM)).astype(np.float32)


def _counters(ps):
  return {t: {k: v for k, v in s.items() if k not in TIMES + AHEAD} for t, s in ps.stats().items()}


def _run(ps, steps, ahead, extra=None):
  """Lookups and pushes of every step; with ``ahead`` the read-ahead of step t + ahead before
  step t's lookup (and ``extra`` ids read ahead that no lookup asks for). Returns each step's rows."""
  looked = []
  for t, ids in enumerate(steps):
    if ahead:
      for u in range(t + 1 if t == 0 else t + ahead, min(t + ahead, len(steps) - 1) + 1):
        ps.read_ahead_many(steps[u], step=u)
      if extra is not None:
        ps.read_ahead_many(extra, step=t)
    rows = ps.lookup_many(ids, create=True, step=t)
    looked.append(rows)
    ps.apply_many({k: (v, _grads(v, t)) for k, v in ids.items()}, step=t)
  return looked


def _same(a, b, steps):
  for ra, rb in zip(a[1], b[1]):
    for t in ra:
      np.testing.assert_array_equal(ra[t], rb[t])
  every = {t: np.unique(np.concatenate([s[t] for s in steps])) for t in ("a", "b")}
  ea, eb = a[0].export_rows_many(every), b[0].export_rows_many(every)
  for t in every:
    np.testing.assert_array_equal(ea[t][0], eb[t][0])
    for k in ea[t][1]:
      np.testing.assert_array_equal(ea[t][1][k], eb[t][1][k])
  assert _counters(a[0]) == _counters(b[0])
  for t in ("a", "b"):
    for i in range(a[0].num_shards):
      ta, tb = a[0].shards[i][t], b[0].shards[i][t]
      np.testing.assert_array_equal(np.sort(ta.tier.live_ids()), np.sort(tb.tier.live_ids()))


@pytest.mark.parametrize("kvstore", ["file", "memory"])
@pytest.mark.parametrize("ahead", [1, 3])
def test_a_run_with_read_ahead_is_the_run_without_it(tmp_path, kvstore, ahead):
  steps = _steps(40)
  plain = _ps(tmp_path, "plain", kvstore)
  read = _ps(tmp_path, "read", kvstore)
  extra = {"a": np.arange(250, 300, dtype=np.uint64)}  # read ahead, never looked up at that step
  _same((plain, _run(plain, steps, 0)), (read, _run(read, steps, ahead, extra)), steps)
  st = {t: read.stats()[t] for t in ("a", "b")}
  assert plain.stats()["a"]["tier_reads"] > 100  # the tier is really used
  for t in st:  # and the staged rows really served lookups
    assert st[t]["read_ahead_rows"] > 0 and st[t]["read_ahead_used"] > 0, st[t]
  plain.close()
  read.close()


def test_a_staged_copy_that_went_stale_is_not_used(tmp_path):
  """Row x is read ahead for step 3, then comes to RAM at step 1, is pushed (its values change)
  and is evicted back to the tier before step 3: step 3 must see the new values."""
  x = np.array([7], np.uint64)
  others = [np.arange(100 + 20 * i, 120 + 20 * i, dtype=np.uint64) for i in range(3)]

  def run(ahead):
    ps = _ps(tmp_path, f"stale{ahead}", "file", capacity=10, shards=1)
    ps.lookup_many({"a": x}, step=0)
    ps.apply_many({"a": (x, np.ones((1, DIM), np.float32))}, step=0)
    ps.lookup_many({"a": others[0]}, step=1)  # evicts x to the tier
    ps.shards[0]["a"].wait_evicted()  # the eviction runs after the lookup returns (write-behind)
    assert ps.shards[0]["a"].tier.locate(x)[0][0] >= 0
    if ahead:
      ps.read_ahead_many({"a": x}, step=4)
    ps.lookup_many({"a": x}, step=2)  # back to RAM...
    ps.apply_many({"a": (x, np.full((1, DIM), 3.0, np.float32))}, step=2)  # ...changed...
    ps.lookup_many({"a": others[1]}, step=3)  # ...and evicted again, with its new values
    rows = ps.lookup_many({"a": x}, step=4)["a"]
    st = ps.stats()["a"]
    ps.close()
    return rows, st

  plain, _ = run(False)
  rows, st = run(True)
  np.testing.assert_array_equal(rows, plain)
  # The copy served step 2 (x was still where it was read from), not step 4.
  assert st["read_ahead_rows"] == 1 and st["read_ahead_used"] == 1 and st["tier_reads"] == 2, st


def test_a_copy_read_before_a_compaction_is_not_used(tmp_path):
  ps = _ps(tmp_path, "compact", "file", capacity=10, shards=1)
  ids = np.arange(60, dtype=np.uint64)
  for t, i in enumerate(range(0, 60, 10)):
    ps.lookup_many({"a": ids[i : i + 10]}, step=t)
  table = ps.shards[0]["a"]
  ps.read_ahead_many({"a": ids[:10]}, step=10)
  before = table.tier.locate(ids[:10])
  table.tier.compact()
  assert table.tier.locate(ids[:10])[1] != before[1]  # the epoch moved on
  expect = ps.export_rows_many({"a": ids[:10]})["a"][0]
  np.testing.assert_array_equal(ps.lookup_many({"a": ids[:10]}, step=10)["a"], expect)
  assert ps.stats()["a"]["read_ahead_used"] == 0
  ps.close()


def test_read_ahead_holds_at_most_its_budget(tmp_path):
  ps = _ps(tmp_path, "budget", "file", capacity=10, shards=1, read_ahead_rows=15)
  for t in range(5):
    ps.lookup_many({"a": np.arange(10 * t, 10 * t + 10, dtype=np.uint64)}, step=t)
  assert ps.read_ahead_many({"a": np.arange(0, 10, dtype=np.uint64)}, step=6) == 10
  assert ps.read_ahead_many({"a": np.arange(10, 20, dtype=np.uint64)}, step=7) == 0  # 20 > 15
  st = ps.stats()["a"]
  assert st["read_ahead_held"] == 10 and st["read_ahead_skipped"] == 10, st
  ps.close()


def test_read_ahead_checks_its_request(tmp_path):
  ps = _ps(tmp_path, "bad", "file")
  with pytest.raises(KeyError, match="unknown table"):
    ps.read_ahead_many({"nope": np.arange(3, dtype=np.uint64)}, step=1)
  with pytest.raises(ValueError, match="negative"):
    ps.read_ahead_many({"a": np.arange(3, dtype=np.uint64)}, step=-1)
  ps.close()


def test_a_copy_from_before_a_compaction_is_not_used_at_the_same_row(tmp_path):
  """After a compaction the tier appends from a lower row again, so an id can come back to the
  very row a staged copy was read from, with other values: only the epoch tells them apart."""
  ps = _ps(tmp_path, "epoch", "file", capacity=10, shards=1, optimizer="sgd")
  table = ps.shards[0]["a"]
  tier = table.tier

  def w(n, v):
    return np.full((n, DIM), v, np.float32), {k: np.zeros((n, c), np.float32) for k, c in tier.slot_shapes.items()}

  tier.write(np.arange(60, dtype=np.uint64), *w(60, 1.0))
  x = np.array([50], np.uint64)
  assert tier.locate(x)[0][0] == 50
  assert table.read_ahead(x, step=5) == 1  # reads row 50 (value 1) at epoch 0
  tier.remove(np.arange(30, dtype=np.uint64))
  tier.compact()  # ids 30..59 now at rows 0..29; the next append goes to row 30
  tier.remove(x)
  tier.write(np.arange(1000, 1020, dtype=np.uint64), *w(20, 2.0))  # rows 30..49
  tier.write(x, *w(1, 9.0))  # row 50 again, other values
  assert tier.locate(x)[0][0] == 50
  np.testing.assert_array_equal(table.lookup(x, step=5), np.full((1, DIM), 9.0, np.float32))
  assert table.counters["read_ahead_used"] == 0
  ps.close()


def test_a_failed_read_ahead_costs_no_row(tmp_path, monkeypatch):
  """A read-ahead whose reads fail is dropped and the lookup reads the rows itself."""
  from recsys_jax.async_ps.store import tier as tier_lib

  steps = _steps(12)
  plain, read = _ps(tmp_path, "plain", "file"), _ps(tmp_path, "read", "file")

  def fail(self):
    raise OSError("disk gone")

  monkeypatch.setattr(tier_lib.PendingRead, "result", fail)
  _same((plain, _run(plain, steps, 0)), (read, _run(read, steps, 2)), steps)
  st = read.stats()["a"]
  assert st["read_ahead_rows"] > 0 and st["read_ahead_used"] == 0, st
  plain.close()
  read.close()
