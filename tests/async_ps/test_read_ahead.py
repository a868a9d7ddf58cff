"""Read-ahead of tier misses (``read_ahead_many``) changes where rows lie, never their values:
every lookup reads, and the tables end with, the rows and slots of the same run without it, bit
for bit; the rows it brings are pinned in RAM until their step, within its budget."""

import threading

import numpy as np
import pytest

from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec

DIM = 8


def _ps(tmp_path, name, kvstore="file", capacity=80, shards=2, optimizer="adam", read_ahead_rows=0, **spec):
  specs = [
    TableSpec(name="a", dim=DIM, optimizer=optimizer, capacity=capacity, **spec),
    TableSpec(name="b", dim=DIM, optimizer="adagrad", capacity=capacity, eviction="lfu", **spec),
  ]
  tier = {"driver": "memory"} if kvstore == "memory" else {"driver": "file", "path": str(tmp_path / name)}
  return ParameterServer(specs, num_shards=shards, seed=4, tier=tier, read_ahead_rows=read_ahead_rows)


def _filled(tmp_path, name, steps, **kw):
  """A one-shard PS whose table "a" looked up ids 10t .. 10t + 9 at each step t < ``steps``."""
  ps = _ps(tmp_path, name, shards=1, **kw)
  for t in range(steps):
    ps.lookup_many({"a": np.arange(10 * t, 10 * t + 10, dtype=np.uint64)}, step=t)
  ps.shards[0]["a"].wait_evicted()
  return ps


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


def _run(ps, steps, ahead, extra=None, wait=True):
  """Lookups and pushes of every step; with ``ahead`` the read-ahead of step t + ahead before
  step t's lookup (and ``extra`` ids read ahead that no lookup asks for), waited for when
  ``wait`` (else the reader thread races the lookups). Returns each step's rows, and checks the
  capacity bound after every step."""
  looked = []
  for t, ids in enumerate(steps):
    if ahead:
      for u in range(t + 1 if t == 0 else t + ahead, min(t + ahead, len(steps) - 1) + 1):
        ps.read_ahead_many(steps[u], step=u)
      if extra is not None:
        ps.read_ahead_many(extra, step=t)
      if wait:
        ps.wait_read_ahead()
    rows = ps.lookup_many(ids, create=True, step=t)
    looked.append(rows)
    ps.apply_many({k: (v, _grads(v, t)) for k, v in ids.items()}, step=t)
    for shard in ps.shards:
      for table in shard.values():
        table.wait_evicted()
        # Within the capacity, or over it only by rows no eviction may take: those of this
        # step (protected) and those pinned for later ones. (Under the lock: a reader thread
        # racing the lookups holds it from its inserts to the end of its eviction.)
        with table.lock:
          n = table.cols.size
          held = np.count_nonzero(table.cols.last_seen[:n] >= t)
        assert n <= max(table.capacity, held), (t, n, held)
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
  sa, sb = a[0].stats(), b[0].stats()
  for t in ("a", "b"):
    for k in ("lookups", "created", "applied_rows", "dropped_grads"):
      assert sa[t][k] == sb[t][k], (t, k)
    assert sa[t]["rows"] + sa[t]["tier_rows"] == sb[t]["rows"] + sb[t]["tier_rows"], t  # no row lost


@pytest.mark.parametrize("kvstore", ["file", "memory"])
@pytest.mark.parametrize("ahead", [1, 3])
def test_a_run_with_read_ahead_reads_the_rows_of_the_run_without_it(tmp_path, kvstore, ahead):
  steps = _steps(40)
  plain = _ps(tmp_path, "plain", kvstore)
  read = _ps(tmp_path, "read", kvstore)
  extra = {"a": np.arange(250, 300, dtype=np.uint64)}  # read ahead, never looked up at that step
  _same((plain, _run(plain, steps, 0)), (read, _run(read, steps, ahead, extra)), steps)
  p, r = plain.stats(), read.stats()
  for t in ("a", "b"):
    assert p[t]["tier_reads"] > 100 and p[t]["read_ahead_rows"] == 0  # the tier is really used
    # The read-ahead really served lookups: the lookups themselves read far fewer rows.
    assert r[t]["read_ahead_rows"] > 0 and r[t]["read_ahead_hits"] > 0, r[t]
    looked_up_reads = r[t]["tier_reads"] - r[t]["read_ahead_rows"]
    # Three steps ahead, the budget (half the capacity) holds about one step's rows.
    assert looked_up_reads < p[t]["tier_reads"] / (2 if ahead == 1 else 1.2), (looked_up_reads, p[t]["tier_reads"])
  plain.close()
  read.close()


def test_a_reader_thread_racing_the_lookups_changes_no_row(tmp_path):
  """Not waited for, the read-aheads run whenever the reader thread gets to them: before their
  lookup, during the lookups of other tables, or after (late, they do nothing)."""
  steps = _steps(60, seed=1)
  plain, read = _ps(tmp_path, "plain"), _ps(tmp_path, "read")
  _same((plain, _run(plain, steps, 0)), (read, _run(read, steps, 2, wait=False)), steps)
  plain.close()
  read.close()


def test_pinned_rows_are_not_evicted_before_their_step(tmp_path):
  """Rows read ahead for step 5, and a row already in RAM that step 5 asks for, stay in RAM
  through lookups that would otherwise evict them (LRU), so step 5 reads nothing from the tier;
  a lookup of a pinned row before its step keeps the pin."""
  ps = _filled(tmp_path, "pin", 3, capacity=20, read_ahead_rows=20)  # ids 0..29 passed; 0..9 spilled
  table = ps.shards[0]["a"]
  want = np.array([0, 1, 2, 3, 4, 25], np.uint64)  # five in the tier, one in RAM
  assert (table.tier.locate(want[:5]) >= 0).all() and table.in_ram(want[5:]).all()
  assert ps.read_ahead_many({"a": want}, step=5) == 6
  ps.wait_read_ahead()
  assert table.in_ram(want).all()
  assert ps.stats()["a"]["read_ahead_pinned"] == 6
  ps.lookup_many({"a": want[:1]}, step=3)  # looked up early: still pinned for step 5
  for t in (3, 4):  # 20 new ids each: LRU would take every older row
    ps.lookup_many({"a": np.arange(100 + 20 * t, 120 + 20 * t, dtype=np.uint64)}, step=t)
    table.wait_evicted()
    assert table.in_ram(want).all(), t
  before = ps.stats()["a"]
  rows = ps.lookup_many({"a": want}, step=5)["a"]
  after = ps.stats()["a"]
  assert after["tier_reads"] == before["tier_reads"] and after["hits"] - before["hits"] == 6
  assert after["read_ahead_hits"] - before["read_ahead_hits"] == 6
  assert before["read_ahead_rows"] == 5
  plain = _filled(tmp_path, "pin_plain", 3, capacity=20)
  np.testing.assert_array_equal(rows, plain.lookup_many({"a": want}, step=3)["a"])
  ps.close()
  plain.close()


def test_read_ahead_pins_at_most_its_budget(tmp_path):
  ps = _filled(tmp_path, "budget", 5, capacity=10, read_ahead_rows=15)
  assert ps.read_ahead_many({"a": np.arange(0, 10, dtype=np.uint64)}, step=6) == 10
  ps.wait_read_ahead()
  assert ps.read_ahead_many({"a": np.arange(10, 20, dtype=np.uint64)}, step=7) == 10  # 5 fit
  ps.wait_read_ahead()
  st = ps.stats()["a"]
  assert st["read_ahead_pinned"] == 15 and st["read_ahead_skipped"] == 5 and st["read_ahead_rows"] == 15, st
  # The capacity counts them: the evictions after the read-aheads took the unpinned rows
  # (step 4's are protected at step 4), so RAM holds step 4's rows and the pinned ones.
  assert st["rows"] == 25, st
  assert ps.shards[0]["a"].in_ram(np.arange(10, 15, dtype=np.uint64)).all()  # the first that fit
  assert not ps.shards[0]["a"].in_ram(np.arange(15, 20, dtype=np.uint64)).any()
  ps.close()


def test_rows_already_in_ram_are_pinned_after_the_tiers_within_the_budget(tmp_path):
  ps = _filled(tmp_path, "order", 3, capacity=10, read_ahead_rows=6)
  table = ps.shards[0]["a"]
  ids = np.array([20, 21, 22, 23, 0, 1, 2, 3], np.uint64)  # four in RAM, four in the tier
  ps.read_ahead_many({"a": ids}, step=5)
  ps.wait_read_ahead()
  st = ps.stats()["a"]
  assert st["read_ahead_rows"] == 4 and st["read_ahead_pinned"] == 6 and st["read_ahead_skipped"] == 2, st
  with table.lock:
    seen = table.cols.last_seen[table.cols.ids.find(ids)]
  np.testing.assert_array_equal(seen, [5, 5, 2, 2, 5, 5, 5, 5])
  ps.close()


def test_the_default_budget_is_half_the_capacity(tmp_path):
  ps = _ps(tmp_path, "default", capacity=40, shards=1)
  assert ps.shards[0]["a"].read_ahead_rows == 20
  ps.close()


def test_a_read_ahead_after_its_lookup_does_nothing(tmp_path):
  ps = _filled(tmp_path, "late", 4, capacity=10)
  ps.read_ahead_many({"a": np.arange(0, 5, dtype=np.uint64)}, step=2)
  ps.wait_read_ahead()
  st = ps.stats()["a"]
  assert st["read_ahead_late"] == 5 and st["read_ahead_rows"] == 0 and st["read_ahead_pinned"] == 0, st
  ps.close()


def test_tables_that_expire_rows_do_not_read_ahead(tmp_path):
  """Expiry forgets rows in RAM, never those in the tier: moving rows would change which expire."""
  ps = _filled(tmp_path, "expire", 3, capacity=10, expire_after=5)
  assert ps.read_ahead_many({"a": np.arange(0, 10, dtype=np.uint64)}, step=4) == 0
  ps.wait_read_ahead()
  assert ps.stats()["a"]["read_ahead_rows"] == 0
  ps.close()


def test_read_ahead_checks_its_request(tmp_path):
  ps = _ps(tmp_path, "bad")
  with pytest.raises(KeyError, match="unknown table"):
    ps.read_ahead_many({"nope": np.arange(3, dtype=np.uint64)}, step=1)
  with pytest.raises(ValueError, match="negative"):
    ps.read_ahead_many({"a": np.arange(3, dtype=np.uint64)}, step=-1)
  ps.close()


def test_a_failed_read_ahead_costs_no_row(tmp_path, monkeypatch):
  """A read-ahead whose tier reads fail leaves the ids in the tier; the lookup reads them itself."""
  from recsys_jax.async_ps.store.tier import disk as tier_lib

  steps = _steps(12)
  plain, read = _ps(tmp_path, "plain"), _ps(tmp_path, "read")
  take = tier_lib.DiskTier.take

  def fail_on_the_reader_thread(self, *a, **k):
    if threading.current_thread().name.startswith("ps-ahead"):
      raise OSError("disk gone")
    return take(self, *a, **k)

  monkeypatch.setattr(tier_lib.DiskTier, "take", fail_on_the_reader_thread)
  _same((plain, _run(plain, steps, 0)), (read, _run(read, steps, 2)), steps)
  st = read.stats()["a"]
  assert st["read_ahead_rows"] == 0 and st["tier_reads"] > 0, st
  plain.close()
  read.close()


def test_a_failed_eviction_on_the_reader_thread_is_raised_by_the_next_call(tmp_path, monkeypatch):
  """The eviction a read-ahead makes room with can fail (a full disk): its rows stay in RAM and
  the table's next call raises the error, as after a lookup's eviction."""
  from recsys_jax.async_ps.store.tier import disk as tier_lib

  ps = _filled(tmp_path, "evict", 3, capacity=10, read_ahead_rows=10)
  ps.lookup_many({"a": np.arange(20, 21, dtype=np.uint64)}, step=3)  # 21..29 no longer protected
  ps.shards[0]["a"].wait_evicted()
  write = tier_lib.DiskTier.write

  def full(self, *a, **k):
    if threading.current_thread().name.startswith("ps-ahead"):
      raise OSError(28, "No space left on device")
    return write(self, *a, **k)

  monkeypatch.setattr(tier_lib.DiskTier, "write", full)
  ps.read_ahead_many({"a": np.arange(0, 10, dtype=np.uint64)}, step=5)
  ps.wait_read_ahead()
  assert ps.shards[0]["a"]._evict_error is not None
  with pytest.raises(OSError, match="eviction after a lookup or a read-ahead failed"):
    ps.lookup_many({"a": np.arange(0, 10, dtype=np.uint64)}, step=4)
  np.testing.assert_array_equal(ps.export_rows_many({"a": np.arange(30, dtype=np.uint64)})["a"][0].shape, (30, DIM))
  ps.close()
