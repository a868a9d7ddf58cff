"""DiskTier against a plain dict reference: round trips, reduced precision, remove, compaction, threads."""

import os
import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import pytest

from recsys_jax.async_ps.store.tier.disk import DiskTier

U64_MAX = np.iinfo(np.uint64).max
DIM = 8
SLOTS = {"acc": 3, "mom": DIM}


# A store of each kind: tensorstore's zarr3 arrays in memory and in files, and plain files.
STORES = ["memory", "file", "file-tensorstore"]


def _spec(driver, tmp_path):
  return {"driver": "memory"} if driver == "memory" else {"driver": "file", "path": str(tmp_path / "tier")}


def _tier(driver, tmp_path, **kw):
  backend = "tensorstore" if driver == "file-tensorstore" else "auto"
  return DiskTier(_spec(driver, tmp_path), DIM, SLOTS, backend=backend, **kw)


def _rows(rng, n):
  w = rng.standard_normal((n, DIM), dtype=np.float32)
  s = {k: rng.standard_normal((n, width), dtype=np.float32) for k, width in SLOTS.items()}
  return w, s


def _pool(rng, n):
  ids = np.unique(rng.integers(0, U64_MAX, size=n, dtype=np.uint64, endpoint=True))
  return np.concatenate([ids, np.array([0, 1, 2**63, U64_MAX], np.uint64)])


class _Reference:
  """dict id -> (weights, slots) with the garbage the tier should count."""

  def __init__(self):
    self.rows = {}
    self.garbage = 0

  def write(self, ids, w, s):
    # A repeat inside one batch is dropped before writing (last wins): not garbage.
    self.garbage += sum(k in self.rows for k in set(ids.tolist()))
    for i, k in enumerate(ids.tolist()):
      self.rows[k] = (w[i], {name: v[i] for name, v in s.items()})

  def remove(self, ids):
    for k in set(ids.tolist()):
      if self.rows.pop(k, None) is not None:
        self.garbage += 1

  def check(self, tier, ids):
    found, w, s = tier.read(ids)
    assert found.dtype == np.bool_ and found.shape == ids.shape
    assert w.dtype == np.float32 and w.shape == (ids.shape[0], DIM)
    expect_found = np.array([k in self.rows for k in ids.tolist()], bool)
    np.testing.assert_array_equal(found, expect_found)
    exp_w = np.zeros_like(w)
    exp_s = {name: np.zeros((ids.shape[0], width), np.float32) for name, width in SLOTS.items()}
    for i, k in enumerate(ids.tolist()):
      if k in self.rows:
        exp_w[i] = self.rows[k][0]
        for name in SLOTS:
          exp_s[name][i] = self.rows[k][1][name]
    np.testing.assert_array_equal(w, exp_w)
    assert set(s) == set(SLOTS)
    for name in SLOTS:
      assert s[name].dtype == np.float32
      np.testing.assert_array_equal(s[name], exp_s[name])


@pytest.mark.parametrize("read_method", ["index", "chunks"])
@pytest.mark.parametrize("driver", STORES)
def test_random_round_trip_matches_dict(driver, read_method, tmp_path):
  rng = np.random.default_rng(0)
  pool = _pool(rng, 1500)
  never = _pool(np.random.default_rng(99), 300)
  never = never[~np.isin(never, pool)]
  # Small chunks and capacity: batches straddle chunks, capacity grows, reads hit the RAM
  # tail, uncommitted writes and the store.
  tier = _tier(driver, tmp_path, chunk_rows=32, initial_rows=64, min_compact_rows=10**9, read_method=read_method)
  ref = _Reference()
  for step in range(12):
    n = int(rng.integers(1, 400))
    ids = rng.choice(pool, size=n)  # repeats within the batch and across batches
    w, s = _rows(rng, n)
    tier.write(ids, w, s)
    ref.write(ids, w, s)
    if step % 4 == 3:
      tier.flush()
    q = np.concatenate([rng.choice(pool, size=200), rng.choice(never, size=50)])
    rng.shuffle(q)
    ref.check(tier, q)
  tier.flush()
  ref.check(tier, pool)
  ref.check(tier, never)
  st = tier.stats()
  assert len(tier) == len(ref.rows) == st["live_rows"]
  assert st["garbage_rows"] == ref.garbage
  assert st["bytes_read"] > 0 and st["pending_rows"] == 0
  assert st["bytes_written"] >= st["disk_rows"] * (DIM + sum(SLOTS.values())) * 4
  for name in ("weights", "slot_acc", "slot_mom"):
    if driver == "file-tensorstore":
      assert os.path.exists(tmp_path / "tier" / name / "zarr.json")
  if driver == "file":  # one file of records: the weights and every slot of a row together
    assert os.path.getsize(tmp_path / "tier" / "tier.rows") == st["disk_rows"] * (DIM + sum(SLOTS.values())) * 4
  tier.close()


def test_duplicate_ids_in_one_batch_last_wins():
  tier = DiskTier({"driver": "memory"}, DIM, SLOTS, chunk_rows=4)
  ids = np.array([5, 7, 5, 5], np.uint64)
  w, s = _rows(np.random.default_rng(1), 4)
  tier.write(ids, w, s)
  found, got, slots = tier.read(np.array([5, 7], np.uint64))
  assert found.all() and len(tier) == 2
  np.testing.assert_array_equal(got, w[[3, 1]])
  np.testing.assert_array_equal(slots["acc"], s["acc"][[3, 1]])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", np.float16])
def test_reduced_precision_matches_numpy_cast(dtype):
  rng = np.random.default_rng(2)
  ids = _pool(rng, 500)
  w = (rng.standard_normal((ids.shape[0], DIM)) * 30).astype(np.float32)
  w[0, :3] = [1e-8, 7e4, -65519.0]  # fp16 underflow and overflow behave as numpy's cast
  _, s = _rows(rng, ids.shape[0])
  tier = DiskTier({"driver": "memory"}, DIM, SLOTS, dtype=dtype, chunk_rows=64)
  with np.errstate(over="ignore"):
    tier.write(ids[:300], w[:300], {k: v[:300] for k, v in s.items()})
    tier.flush()
    tier.write(ids[300:], w[300:], {k: v[300:] for k, v in s.items()})
  found, got, slots = tier.read(ids[::-1])
  assert found.all()
  cast = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
  with np.errstate(over="ignore"):
    expect = w[::-1].astype(cast).astype(np.float32)
  np.testing.assert_array_equal(got, expect)
  for name in SLOTS:  # slots stay float32 whatever the weights' dtype
    np.testing.assert_array_equal(slots[name], s[name][::-1])
  st = tier.stats()
  # Whole chunks, plus the partial chunk flushed after 300 rows (its rows are written twice);
  # the last partial chunk is not flushed.
  assert st["bytes_written"] == (st["disk_rows"] // 64 * 64 + 300 % 64) * (DIM * 2 + sum(SLOTS.values()) * 4)


def test_remove_forgets_ids_and_counts_garbage():
  rng = np.random.default_rng(3)
  ids = _pool(rng, 600)
  w, s = _rows(rng, ids.shape[0])
  tier = DiskTier({"driver": "memory"}, DIM, SLOTS, chunk_rows=50, min_compact_rows=10**9)
  ref = _Reference()
  tier.write(ids, w, s)
  ref.write(ids, w, s)
  tier.flush()
  gone = rng.choice(ids, size=200, replace=False)
  unknown = np.array([12345, 67890], np.uint64)
  unknown = unknown[~np.isin(unknown, ids)]
  n_removed = tier.remove(np.concatenate([gone, gone[:10], unknown]))
  ref.remove(gone)
  assert n_removed == 200 and len(tier) == ids.shape[0] - 200
  assert tier.stats()["garbage_rows"] == ref.garbage == 200
  ref.check(tier, ids)
  assert tier.remove(gone) == 0
  # A removed id written again is found again, with its new row.
  w2, s2 = _rows(rng, 20)
  tier.write(gone[:20], w2, s2)
  ref.write(gone[:20], w2, s2)
  ref.check(tier, ids)
  assert len(tier) == len(ref.rows)


def test_remove_rebuilds_the_index_when_dead_entries_dominate():
  rng = np.random.default_rng(4)
  ids = _pool(rng, 20000)
  w, s = _rows(rng, ids.shape[0])
  tier = DiskTier({"driver": "memory"}, DIM, SLOTS, chunk_rows=256, min_compact_rows=10**9)
  tier.write(ids, w, s)
  big = tier.index_nbytes()
  keep = ids[:500]
  tier.remove(ids[500:])
  assert tier.index_nbytes() < big / 4
  found, got, _ = tier.read(ids)
  np.testing.assert_array_equal(found, np.arange(ids.shape[0]) < 500)
  np.testing.assert_array_equal(got[:500], w[:500])
  assert len(tier) == keep.shape[0]


@pytest.mark.parametrize("driver", STORES)
def test_compact_preserves_live_rows_and_drops_garbage(driver, tmp_path):
  rng = np.random.default_rng(5)
  pool = _pool(rng, 800)
  tier = _tier(driver, tmp_path, chunk_rows=16, min_compact_rows=10**9)
  ref = _Reference()
  for _ in range(8):
    ids = rng.choice(pool, size=300, replace=False)
    w, s = _rows(rng, 300)
    tier.write(ids, w, s)
    ref.write(ids, w, s)
  gone = rng.choice(pool, size=100, replace=False)
  tier.remove(gone)
  ref.remove(gone)
  before = tier.stats()
  assert before["garbage_rows"] == ref.garbage > before["live_rows"]
  tier.compact()
  after = tier.stats()
  assert after["garbage_rows"] == 0 and after["compactions"] == 1
  assert after["live_rows"] == after["disk_rows"] == len(ref.rows)
  assert after["capacity_rows"] < before["capacity_rows"]
  ref.check(tier, pool)
  if driver == "file-tensorstore":  # chunks past the live rows are deleted
    chunk_files = sum(len(f) for d, _, f in os.walk(tmp_path / "tier" / "weights") if "zarr.json" not in f)
    assert chunk_files <= -(-len(ref.rows) // 16)
  elif driver == "file":  # the file shrinks to the live rows
    assert os.path.getsize(tmp_path / "tier" / "tier.rows") == after["capacity_rows"] * (DIM + sum(SLOTS.values())) * 4
  # Appending after a compaction keeps working, across the rewritten partial chunk.
  ids = rng.choice(pool, size=50, replace=False)
  w, s = _rows(rng, 50)
  tier.write(ids, w, s)
  ref.write(ids, w, s)
  tier.flush()
  ref.check(tier, pool)


def test_write_compacts_automatically():
  rng = np.random.default_rng(6)
  pool = _pool(rng, 300)
  tier = DiskTier({"driver": "memory"}, DIM, SLOTS, chunk_rows=16, min_compact_rows=100)
  ref = _Reference()
  for _ in range(25):
    ids = rng.choice(pool, size=150, replace=False)
    w, s = _rows(rng, 150)
    tier.write(ids, w, s)
    ref.write(ids, w, s)
    st = tier.stats()
    assert st["garbage_rows"] <= 2 * max(st["live_rows"], 100)
  assert tier.stats()["compactions"] >= 3
  ref.check(tier, pool)


def test_concurrent_reads_see_every_completed_write():
  """A writer rewrites ids with versioned rows; a reader checks each row is a whole, recent version."""
  ids = _pool(np.random.default_rng(7), 400)
  n = ids.shape[0]
  tier = DiskTier({"driver": "memory"}, DIM, SLOTS, chunk_rows=16, min_compact_rows=200)
  done = np.full(n, -1, np.int64)  # latest version whose write() has returned, per id
  errors = []
  reads = [0]  # completed reads; the writer waits on it every other batch so the two interleave
  cond = threading.Condition()
  stop = threading.Event()  # set if the reader fails, so the writer ends at once

  def row(idx, version):
    # Column 0 holds the version; the rest is a function of (id, version).
    w = (idx[:, None] * 31 + version[:, None] * 7 + np.arange(DIM)).astype(np.float32)
    w[:, 0] = version
    return w, {name: w[:, :width] + 0.5 for name, width in SLOTS.items()}

  def writer():
    rng = np.random.default_rng(8)
    try:
      for v in range(60):
        if stop.is_set():
          return
        idx = rng.choice(n, size=80, replace=False)
        w, s = row(idx, np.full(80, v))
        tier.write(ids[idx], w, s)
        done[idx] = v
        if v % 2 == 0:  # odd batches run free, racing the reader
          with cond:
            seen = reads[0]
            cond.wait_for(lambda seen=seen: reads[0] >= seen + 2 or stop.is_set(), timeout=5)
    except Exception as e:  # reported by the main thread
      errors.append(e)

  t = threading.Thread(target=writer, daemon=True)
  t.start()
  rng = np.random.default_rng(9)
  found_while_writing = 0
  try:
    for _ in range(5000):
      alive = t.is_alive()
      idx = rng.choice(n, size=100, replace=False)
      floor = done[idx].copy()
      found, w, s = tier.read(ids[idx])
      version = np.where(found, w[:, 0], -1).astype(np.int64)
      assert (version >= floor).all(), "a read missed a completed write"
      exp_w, exp_s = row(idx[found], version[found])
      np.testing.assert_array_equal(w[found], exp_w)
      for name in SLOTS:
        np.testing.assert_array_equal(s[name][found], exp_s[name])
      found_while_writing += alive and found.any()
      with cond:
        reads[0] += 1
        cond.notify_all()
      if not alive:
        break
  finally:
    stop.set()
    with cond:
      cond.notify_all()
    t.join(timeout=30)
  assert not errors, errors
  assert not t.is_alive()
  assert found_while_writing >= 20
  assert tier.stats()["compactions"] >= 1
  found, w, _ = tier.read(ids)
  np.testing.assert_array_equal(np.where(found, w[:, 0], -1), done)


def test_clear_errors(tmp_path):
  with pytest.raises(ValueError, match="nope"):
    DiskTier({"driver": "nope"}, DIM, SLOTS)
  with pytest.raises(ValueError, match="kvstore spec"):
    DiskTier({"driver": "file", "path": 3}, DIM, SLOTS)
  with pytest.raises(ValueError, match="int8"):
    DiskTier({"driver": "memory"}, DIM, SLOTS, dtype="int8")
  with pytest.raises(ValueError, match="float64"):
    DiskTier({"driver": "memory"}, DIM, SLOTS, dtype=np.float64)
  tier = DiskTier({"driver": "memory"}, DIM, SLOTS)
  ids = np.arange(4, dtype=np.uint64)
  w, s = _rows(np.random.default_rng(10), 4)
  with pytest.raises(ValueError, match=r"\(4, 7\).*\(4, 8\)"):
    tier.write(ids, w[:, :7], s)
  with pytest.raises(ValueError, match=r"'acc'.*\(3, 3\).*\(4, 3\)"):
    tier.write(ids, w, {**s, "acc": s["acc"][:3]})
  with pytest.raises(ValueError, match="slots"):
    tier.write(ids, w, {"acc": s["acc"]})
  with pytest.raises(ValueError, match="1-D"):
    tier.read(ids[None])
  assert len(tier) == 0
  tier.close()
  tier.close()
  with pytest.raises(RuntimeError, match="closed"):
    tier.read(ids)


_FULL_DISK = r"""
import resource, signal, sys
import numpy as np
from recsys_jax.async_ps.store.tier.disk import DiskTier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, 3 << 20))  # files of up to 64k rows fit (2 MiB)
tier = DiskTier({"driver": "file", "path": sys.argv[1]}, 8, {"acc": 8})
rng = np.random.default_rng(0)
written = 0
try:
  for i in range(100):
    ids = np.arange(written, written + 2000, dtype=np.uint64)
    tier.write(ids, rng.standard_normal((2000, 8), dtype=np.float32), {"acc": np.ones((2000, 8), np.float32)})
    written += 2000
except OSError as e:
  found, w, _ = tier.read(np.arange(written, dtype=np.uint64))
  print("ERROR", written, bool(found.all()), e)
"""


def test_a_full_disk_is_an_error_naming_the_file_and_keeps_what_was_written(tmp_path):
  """The plain-file tier writes with pwrite: past the space it gets an OSError naming its file
  (no process killed by a signal), and the rows written before stay readable."""
  out = subprocess.run(
    [sys.executable, "-c", _FULL_DISK, str(tmp_path / "tier")], capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  line = out.stdout.strip().splitlines()[-1]
  assert line.startswith("ERROR") and " True " in line, line
  assert "tier.rows" in line, line
  assert int(line.split()[1]) > 0, line


_FULL_DISK_BEHIND = r"""
import resource, signal, sys
import numpy as np
from recsys_jax.async_ps.store.table import Table
from recsys_jax.async_ps.store.tier.disk import DiskTier
from recsys_jax.embeddings.specs import TableSpec
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # 4,096 rows of 256 bytes
spec = TableSpec(name="t", dim=32, optimizer="adagrad", capacity=1000)
tier = DiskTier({"driver": "file", "path": sys.argv[1]}, 32, {"acc": 32})
table, ref = Table(spec, tier=tier, capacity=1000), Table(spec)  # ref: all in RAM, no file
rng = np.random.default_rng(0)
seen = np.zeros(0, np.uint64)
try:
  for step in range(100):
    ids = np.arange(step * 400, step * 400 + 500, dtype=np.uint64)  # 100 ids of the last step again
    a = table.lookup(ids, step=step)
    b = ref.lookup(ids, step=step)
    assert np.array_equal(a, b), step
    seen = np.union1d(seen, ids)
    g = rng.standard_normal((500, 32)).astype(np.float32)
    table.apply(ids, g)  # waits for the eviction the lookup left running
    ref.apply(ids, g)
except OSError as e:
  print("ERROR", step, e)
w, s = table.export_rows(seen)  # the failed spill's rows stayed in RAM; the spilled ones are read back
rw, rs = ref.export_rows(seen)
print("SAME", bool(np.array_equal(w, rw) and np.array_equal(s["acc"], rs["acc"])), len(seen))
table.close()
"""


def test_a_full_disk_under_a_write_behind_eviction_is_raised_by_the_next_call_and_loses_no_row(tmp_path):
  """The eviction after a lookup runs on another thread: its write failing (a full disk) is raised
  by the table's next call, naming the table and the file, and every row keeps its values
  (against a table holding all in RAM)."""
  out = subprocess.run(
    [sys.executable, "-c", _FULL_DISK_BEHIND, str(tmp_path / "tier")], capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.strip().splitlines()
  assert lines[0].startswith("ERROR") and "table 't'" in lines[0] and "tier.rows" in lines[0], lines
  assert int(lines[0].split()[1]) > 5, lines  # several evictions went through before
  assert lines[1].startswith("SAME True"), lines


def test_stats_and_index_size():
  tier = DiskTier({"driver": "memory"}, DIM, SLOTS, chunk_rows=8)
  empty = tier.stats()
  assert set(empty) >= {"live_rows", "garbage_rows", "bytes_written", "bytes_read", "writes", "reads", "index_bytes"}
  assert empty["live_rows"] == empty["garbage_rows"] == empty["bytes_written"] == 0
  small = tier.index_nbytes()
  rng = np.random.default_rng(11)
  ids = _pool(rng, 5000)
  tier.write(ids, *_rows(rng, ids.shape[0]))
  tier.read(ids[:10])
  st = tier.stats()
  assert st["writes"] == 1 and st["reads"] == 1 and st["live_rows"] == ids.shape[0]
  assert tier.index_nbytes() == st["index_bytes"] > small
  assert st["index_bytes"] >= ids.shape[0] * 8 * 3  # keys, slot table and disk rows
  row_bytes = (DIM + sum(SLOTS.values())) * 4
  assert st["bytes_written"] == ids.shape[0] // 8 * 8 * row_bytes  # whole chunks only
  assert st["pending_rows"] >= ids.shape[0] % 8
  tier.flush()
  st = tier.stats()
  assert st["bytes_written"] == ids.shape[0] * row_bytes and st["pending_rows"] == 0


def test_module_does_not_import_jax():
  code = "import sys, recsys_jax.async_ps.store.tier.disk; assert 'jax' not in sys.modules, 'jax imported'"
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


@pytest.mark.parametrize("driver", STORES)
def test_take_reads_then_removes(driver, tmp_path):
  """``take`` = ``read`` + ``remove`` of distinct ids, against the reference: the found rows in
  order (the latest copy of an id rewritten since it was first written), the ids gone
  afterwards, the garbage counted, also across a compaction."""
  rng = np.random.default_rng(11)
  pool = _pool(rng, 600)
  tier = _tier(driver, tmp_path, chunk_rows=16, min_compact_rows=10**9)
  ref = _Reference()
  w, s = _rows(rng, pool.shape[0])
  tier.write(pool, w, s)
  ref.write(pool, w, s)
  rewritten = pool[:50]
  w2, s2 = _rows(rng, 50)
  tier.write(rewritten, w2, s2)
  ref.write(rewritten, w2, s2)
  for round_ in range(3):
    want = np.unique(np.concatenate([rng.choice(pool, 120, replace=False), _pool(np.random.default_rng(round_), 5)]))
    rng.shuffle(want)
    expect = np.array([k in ref.rows for k in want.tolist()])
    found, got_w, got_s = tier.take(want)
    np.testing.assert_array_equal(found, expect)
    exp_w = np.array([ref.rows[k][0] for k in want[found].tolist()]).reshape(-1, DIM)
    np.testing.assert_array_equal(got_w, exp_w)
    for name in SLOTS:
      exp = np.array([ref.rows[k][1][name] for k in want[found].tolist()]).reshape(-1, SLOTS[name])
      np.testing.assert_array_equal(got_s[name], exp)
    ref.remove(want)
    ref.check(tier, pool)
    assert len(tier) == len(ref.rows) and tier.stats()["garbage_rows"] == ref.garbage
    if round_ == 1:
      tier.compact()  # moves every row
      ref.garbage = 0
  tier.close()


@pytest.mark.parametrize("new_rows", [3, 10, 30])
def test_a_tiered_eviction_makes_room_for_four_lookups_and_an_untiered_one_keeps_four_fifths(new_rows, tmp_path):
  """Capacity 100, full of rows last seen at step 1; a lookup at step 5 brings ``new_rows`` new
  ones in. A tiered table evicts down to min(80, 100 - 4 * new_rows) rows (never the ones just
  looked up); a table without a tier, which loses what it evicts, down to 80. The evicted rows
  come back from the tier bit for bit; a 5x rule or a 3x one fails the counts."""
  from recsys_jax.async_ps.store.table import Table
  from recsys_jax.embeddings.specs import TableSpec

  spec = TableSpec(name="t", dim=8, optimizer="adagrad", capacity=100)
  tiered = Table(spec, tier=DiskTier({"driver": "file", "path": str(tmp_path / "t")}, 8, {"acc": 8}), capacity=100)
  plain = Table(spec, capacity=100)
  rng = np.random.default_rng(new_rows)
  old = rng.choice(1 << 40, 100, replace=False).astype(np.uint64)
  new = np.arange(new_rows, dtype=np.uint64) + np.uint64(1 << 41)
  for t in (tiered, plain):
    t.lookup(old, step=1)
    t.apply(old, rng.standard_normal((100, 8)).astype(np.float32))
  before = tiered.export_rows(old)
  for t in (tiered, plain):
    t.lookup(new, step=5)
    t.wait_evicted()
  assert tiered.num_rows == max(new_rows, min(80, 100 - 4 * new_rows)), tiered.num_rows
  assert plain.num_rows == 80
  assert tiered.in_ram(new).all() and len(tiered.tier) == 100 + new_rows - tiered.num_rows
  w, s = tiered.export_rows(old)  # read back from the tier where evicted
  assert np.array_equal(w, before[0]) and np.array_equal(s["acc"], before[1]["acc"])
  tiered.close()
