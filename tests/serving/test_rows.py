"""Serving (issue 16): rows read on demand from a PS snapshot chain equal the PS restored whole.

The reference is the trainer's restore: a fresh ``ParameterServer`` loaded by
``snapshot.load(ps, chain)`` (every row in RAM) and read with ``lookup(create=False)``, which
is what evaluation reads.
"""

from __future__ import annotations

import os
import resource
import time

import numpy as np
import pytest

from recsys_jax.async_ps.snapshot import directory as snapshot
from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec
from recsys_jax.serving.rows import snapshot_rows as rows_lib
from recsys_jax.serving.rows.cache import RowCache


def _grads(ps, ids, rng, scale=1.0):
  return {t: (i, (rng.normal(size=(i.shape[0], ps.specs[t].dim)) * scale).astype(np.float32)) for t, i in ids.items()}


def _chain(tmp_path, specs, seed=3):
  """A full snapshot and two incremental ones; the second incremental deletes a few ids."""
  rng = np.random.default_rng(0)
  ps = ParameterServer(specs, seed=seed)
  chain = []
  ids = {s.name: rng.choice(1 << 40, 3000, replace=False).astype(np.uint64) for s in specs}
  ps.lookup_many(ids)
  ps.apply_many(_grads(ps, ids, rng))
  for k in range(3):
    if k:
      some = {t: v[rng.random(v.shape[0]) < 0.3] for t, v in ids.items()}
      new = {t: rng.choice(1 << 40, 500, replace=False).astype(np.uint64) + np.uint64(1 << 41) for t in ids}
      both = {t: np.concatenate([some[t], new[t]]) for t in ids}
      ps.lookup_many(both)
      ps.apply_many(_grads(ps, both, rng))
      ids = {t: np.unique(np.concatenate([ids[t], new[t]])) for t in ids}
    d = str(tmp_path / f"s{k}")
    snapshot.save(ps, d, incremental=k > 0)
    chain.append(d)
  # Delete ids in the last link by hand (eviction without a tier, expiry): write that link again.
  deleted = {t: v[:50] for t, v in ids.items()}
  last = snapshot.read(chain[-1])
  for t in last:
    keep = ~np.isin(last[t]["ids"], deleted[t])
    last[t] = {k: v[keep] for k, v in last[t].items() if k != "deleted"}
    last[t]["deleted"] = deleted[t]
  d = str(tmp_path / "s2b")
  snapshot.write(last, d)
  chain[-1] = d
  return chain, ids, deleted


def _tables(specs):
  return {s.name: rows_lib.table_info(s) for s in specs}


@pytest.mark.parametrize("dtype, admit", [("float32", 1), ("bfloat16", 1), ("float32", 3)])
def test_chain_rows_equal_the_restored_ps_newest_wins(tmp_path, dtype, admit):
  specs = [
    TableSpec(name="a", dim=8, storage_dtype=dtype, admit_after=admit),
    TableSpec(name="b", dim=4, initializer="normal"),
  ]
  chain, ids, deleted = _chain(tmp_path, specs)
  ref = ParameterServer(specs, seed=3)
  snapshot.load(ref, chain)
  rng = np.random.default_rng(5)
  rows = rows_lib.SnapshotRows(chain, _tables(specs), seed=3, cache_bytes=200 * 8 * 4)
  for t, v in ids.items():
    unseen = rng.choice(1 << 40, 100, replace=False).astype(np.uint64) + np.uint64(1 << 50)
    q = np.unique(np.concatenate([v, unseen, deleted[t]]))
    want = ref.lookup_many({t: q}, create=False)[t]
    got = np.empty_like(want)
    rows.lookup_many({t: q}, out={t: got})
    np.testing.assert_array_equal(got, want)
    got2 = np.empty_like(want)
    rows.lookup_many({t: q[::-1]}, out={t: got2})  # again, now partly from the cache, another order
    np.testing.assert_array_equal(got2, want[::-1])
  assert rows.held_rows() <= rows.capacity_rows() <= 200 + 200 * 8 // 4


def test_reading_the_older_snapshot_first_would_differ(tmp_path):
  """The chain's order matters for this data: ids of the full snapshot updated by the incrementals
  (about half of them) read their newest value, not the full snapshot's."""
  specs = [TableSpec(name="a", dim=8)]
  chain, _, deleted = _chain(tmp_path, specs)
  q = snapshot.read(chain[0])["a"]["ids"]
  q = np.sort(q[~np.isin(q, deleted["a"])])
  new = np.empty((q.shape[0], 8), np.float32)
  rows_lib.SnapshotRows(chain, _tables(specs), 3, 1 << 20).lookup_many({"a": q}, out={"a": new})
  old = np.empty_like(new)
  rows_lib.SnapshotRows(chain[:1], _tables(specs), 3, 1 << 20).lookup_many({"a": q}, out={"a": old})
  assert 0.3 < (new != old).any(axis=1).mean() < 0.7


def test_a_damaged_snapshot_is_refused_naming_the_array(tmp_path):
  specs = [TableSpec(name="a", dim=8)]
  chain, _, _ = _chain(tmp_path, specs)
  chunk_dir = os.path.join(chain[0], "a", "0", "weights", "c")
  path = os.path.join(chunk_dir, *sorted(os.listdir(chunk_dir))[:1])
  while os.path.isdir(path):
    path = os.path.join(path, sorted(os.listdir(path))[0])
  data = bytearray(open(path, "rb").read())
  data[len(data) // 2] ^= 0x10
  open(path, "wb").write(bytes(data))
  with pytest.raises(ValueError, match="a/0/weights fails its checksum"):
    rows_lib.SnapshotRows(chain, _tables(specs), 3, 1 << 20)


def test_row_cache_never_holds_more_than_its_bound():
  c = RowCache(10, 2)
  rng = np.random.default_rng(0)
  for _ in range(50):
    ids = np.unique(rng.integers(0, 40, 7).astype(np.uint64))
    out = np.zeros((ids.shape[0], 2), np.float32)
    found = c.get(ids, out)
    np.testing.assert_array_equal(out[found], np.stack([ids[found], ids[found]], 1).astype(np.float32))
    miss = ids[~found]
    c.put(miss, np.stack([miss, miss], 1).astype(np.float32))
    assert c.held() <= 10
    assert len(set(c.key[c.used].tolist())) == c.held()


def _rss_mib():
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_table_larger_than_the_cache_is_served_within_bounded_rss(tmp_path):
  """1M rows of width 64 (256 MiB on disk) behind a 16 MiB cache: RSS grows by the index
  (16 MiB, with ~3x that in temporaries while it is sorted), the cache and one part's read
  buffers, not by the table (rows held in RAM would add 256 MiB)."""
  n, dim = 1 << 20, 64
  d = str(tmp_path / "full")
  w = snapshot._Writer(d)
  rng = np.random.default_rng(0)
  ids_all = rng.choice(1 << 62, n, replace=False).astype(np.uint64)
  for a in range(0, n, 1 << 14):
    ids = ids_all[a : a + (1 << 14)]
    w.add(
      "t",
      {"ids": ids, "weights": (ids[:, None] % np.uint64(1000)).astype(np.float32) + np.arange(dim, dtype=np.float32)},
    )
  w.finish(False, None)
  del ids_all
  spec = TableSpec(name="t", dim=dim)
  before = _rss_mib()
  rows = rows_lib.SnapshotRows([d], _tables([spec]), 0, cache_bytes=16 << 20, verify=True)
  peak = _rss_mib()
  load_peak = _rss_mib()
  probe = rows.tables["t"].ids
  spent = 0.0
  for _ in range(40):
    q = np.unique(probe[rng.integers(0, n, 4096)])
    out = np.empty((q.shape[0], dim), np.float32)
    t0 = time.perf_counter()
    rows.lookup_many({"t": q}, out={"t": out})
    spent += time.perf_counter() - t0
    np.testing.assert_array_equal(
      out, (q[:, None] % np.uint64(1000)).astype(np.float32) + np.arange(dim, dtype=np.float32)
    )
    peak = max(peak, _rss_mib())
    assert rows.held_bytes() <= 16 << 20
  grown = peak - before
  print(
    f"RSS before {before:.0f} MiB, after load {load_peak:.0f}, peak {peak:.0f}, grown {grown:.0f} MiB; table 256 MiB, "
    f"cache 16, index {rows.index_bytes() / 2**20:.0f}; lookups of 4096 random ids: {spent / 40 * 1e3:.1f} ms each"
  )
  assert grown < 16 + 16 + 64, grown  # index + cache + read buffers and allocator slack; the table is 256
