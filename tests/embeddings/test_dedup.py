"""dedup against brute force: ids recovered through inverse, per-table uniqueness, weights, buckets."""

import numpy as np
import pytest

from recsys_jax.embeddings import dedup as dd
from recsys_jax.embeddings.specs import FeatureSpec, TableSpec

U64_MAX = np.iinfo(np.uint64).max

TABLES = {
  t.name: t
  for t in [
    TableSpec(name="user", dim=8),
    TableSpec(name="item", dim=8),
    TableSpec(name="tag", dim=4),
  ]
}
FEATURES = [
  FeatureSpec(name="user_id", table="user"),
  FeatureSpec(name="item_id", table="item"),  # one-hot
  FeatureSpec(name="tags", table="tag", max_len=5),  # multi-hot, sum, arbitrary weights
  FeatureSpec(name="item_hist", table="item", max_len=6, combiner="mean"),  # multi-hot mean, shares 'item'
  FeatureSpec(name="tag_mean", table="tag", max_len=3, combiner="mean"),
  FeatureSpec(name="tag_sqrtn", table="tag", max_len=4, combiner="sqrtn"),
]


def _batch(rng, B):
  """Ids drawn from one shared small pool (repeats within and across tables), full uint64 range."""
  pool = rng.integers(0, U64_MAX, size=40, dtype=np.uint64, endpoint=True)
  pool[:3] = np.array([0, 2**63, 2**64 - 1], np.uint64)

  def ids(shape):
    return rng.choice(pool, size=shape)

  def prefix_mask(L):
    n = rng.integers(0, L + 1, size=B)  # includes empty bags
    return (np.arange(L)[None, :] < n[:, None]).astype(np.float32)

  sparse = {
    "user_id": ids((B,)),  # 1-d: one id per example
    "item_id": ids((B, 1)),
    "tags": ids((B, 5)),
    "item_hist": ids((B, 4)),  # shorter than max_len 6: padded by dedup
    "tag_mean": ids((B, 3)),
    "tag_sqrtn": ids((B, 4)),
  }
  tag_w = rng.choice(np.array([0.0, 0.5, 1.0, 2.0, 3.0], np.float32), size=(B, 5))
  hist_w = prefix_mask(4)
  mean_w = rng.choice(np.array([0.0, 1.0, 2.0], np.float32), size=(B, 3))
  mean_w[0] = 0.0  # an empty bag in each 'mean' feature
  hist_w[1] = 0.0
  # Padding positions carry a junk id: it must not be deduplicated.
  sparse["item_hist"] = np.where(hist_w > 0, sparse["item_hist"], np.uint64(12345))
  sqrtn_w = rng.choice(np.array([0.0, 0.5, 1.0, 3.0], np.float32), size=(B, 4))
  sqrtn_w[2] = 0.0
  weights = {"tags": tag_w, "item_hist": hist_w, "tag_mean": mean_w, "tag_sqrtn": sqrtn_w}
  return sparse, weights


def _expected_weights(feature, ids2d, w2d, max_len):
  w = np.ones(ids2d.shape, np.float64) if w2d is None else w2d.astype(np.float64)
  if feature.combiner in ("mean", "sqrtn"):
    s = w.sum(axis=1, keepdims=True) if feature.combiner == "mean" else np.sqrt((w * w).sum(axis=1, keepdims=True))
    w = np.where(s > 0, w / np.where(s > 0, s, 1.0), 0.0)
  return np.pad(w, ((0, 0), (0, max_len - w.shape[1])))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_inverse_recovers_ids_and_tables_are_exact_sets(seed):
  rng = np.random.default_rng(seed)
  B = 64
  sparse, weights = _batch(rng, B)
  groups = dd.dedup(sparse, FEATURES, TABLES, weights)
  assert sorted(groups) == [4, 8]
  seen_features = []
  for dim, g in groups.items():
    feats = [f for f in FEATURES if TABLES[f.table].dim == dim]
    assert g.dim == dim
    assert g.features == tuple(f.name for f in feats)
    seen_features += list(g.features)
    max_len = max(f.max_len for f in feats)
    assert g.inverse.dtype == np.int32 and g.inverse.shape == (B, len(feats), max_len)
    # Tables laid end to end, in order of first use.
    assert [t for t, _, _ in g.tables] == list(dict.fromkeys(f.table for f in feats))
    offsets = np.cumsum([0] + [len(u) for _, u, _ in g.tables])
    assert [o for _, _, o in g.tables] == offsets[:-1].tolist()
    assert g.num_rows == offsets[-1]
    assert g.bucket == dd.bucket_size(g.num_rows) >= g.num_rows
    all_ids = np.concatenate([u for _, u, _ in g.tables])
    table_of_row = np.repeat([t for t, _, _ in g.tables], [len(u) for _, u, _ in g.tables])

    exp_w = np.stack(
      [
        _expected_weights(
          f, np.asarray(sparse[f.name]).reshape(B, -1), weights.get(f.name) if weights else None, max_len
        )
        for f in feats
      ],
      axis=1,
    )
    assert g.weights is not None
    assert g.weights.shape == (B, len(feats), max_len)
    np.testing.assert_allclose(g.weights, exp_w, rtol=1e-6, atol=1e-7)

    valid_by_table = {t: set() for t, _, _ in g.tables}
    for fi, f in enumerate(feats):
      ids = np.asarray(sparse[f.name]).reshape(B, -1)
      for b in range(B):
        for pos in range(max_len):
          inv = g.inverse[b, fi, pos]
          if exp_w[b, fi, pos] != 0:
            assert 0 <= inv < g.num_rows
            assert all_ids[inv] == ids[b, pos]
            assert table_of_row[inv] == f.table
            valid_by_table[f.table].add(int(ids[b, pos]))
          else:
            assert inv == 0  # padding points at row 0
      if f.combiner == "mean":
        sums = g.weights[:, fi].sum(axis=1)
        nonempty = exp_w[:, fi].sum(axis=1) > 0
        assert nonempty.any() and (~nonempty).any()
        np.testing.assert_allclose(sums[nonempty], 1.0, rtol=1e-6)
        np.testing.assert_array_equal(sums[~nonempty], 0.0)
    for t, u, _ in g.tables:
      assert u.dtype == np.uint64
      assert len(np.unique(u)) == len(u)
      assert set(u.tolist()) == valid_by_table[t]
    # The junk id behind the item_hist padding is not in the item table.
    if dim == 8:
      item_ids = dict((t, u) for t, u, _ in g.tables)["item"]
      assert 12345 not in set(item_ids.tolist())
      # The same id values appear in several tables: each table keeps its own copy.
      user_ids = dict((t, u) for t, u, _ in g.tables)["user"]
      assert len(set(user_ids.tolist()) & set(item_ids.tolist())) > 0
  assert sorted(seen_features) == sorted(f.name for f in FEATURES)


@pytest.mark.parametrize("seed", [3, 4])
def test_pooling_dedup_output_equals_direct_pooling(seed):
  """End to end: pooling rows[inverse] * weights gives what each feature's bag would pool to."""
  rng = np.random.default_rng(seed)
  B = 32
  sparse, weights = _batch(rng, B)
  emb = {}  # (table, id) -> float64 row

  def row(t, i):
    key = (t, int(i))
    if key not in emb:
      emb[key] = rng.normal(size=TABLES[t].dim)
    return emb[key]

  groups = dd.dedup(sparse, FEATURES, TABLES, weights)
  for dim, g in groups.items():
    rows = np.zeros((g.bucket, dim))
    for t, u, off in g.tables:
      for j, i in enumerate(u):
        rows[off + j] = row(t, i)
    w = g.weights if g.weights is not None else np.ones(g.inverse.shape)
    pooled = np.einsum("bfld,bfl->bfd", rows[g.inverse], w)
    for fi, name in enumerate(g.features):
      f = next(x for x in FEATURES if x.name == name)
      ids = np.asarray(sparse[name]).reshape(B, -1)
      fw = weights.get(name, np.ones(ids.shape, np.float32)).astype(np.float64)
      for b in range(B):
        total = {"mean": fw[b].sum(), "sqrtn": np.sqrt((fw[b] ** 2).sum()), "sum": 1.0}[f.combiner]
        want = np.zeros(dim)
        for pos in range(ids.shape[1]):
          if fw[b, pos] != 0:
            want += fw[b, pos] * row(f.table, ids[b, pos]) / total
        np.testing.assert_allclose(pooled[b, fi], want, rtol=1e-5, atol=1e-6)


def test_all_one_hot_sum_group_has_no_weights():
  rng = np.random.default_rng(5)
  B = 50
  tables = {"a": TableSpec(name="a", dim=4), "b": TableSpec(name="b", dim=4)}
  feats = [FeatureSpec(name="fa", table="a"), FeatureSpec(name="fb", table="b"), FeatureSpec(name="fb2", table="b")]
  sparse = {n: rng.integers(0, 10, size=(B, 1)).astype(np.uint64) for n in ("fa", "fb", "fb2")}
  (g,) = dd.dedup(sparse, feats, tables).values()
  assert g.weights is None
  all_ids = np.concatenate([u for _, u, _ in g.tables])
  for fi, n in enumerate(("fa", "fb", "fb2")):
    np.testing.assert_array_equal(all_ids[g.inverse[:, fi, 0]], sparse[n][:, 0])
  b_ids = dict((t, u) for t, u, _ in g.tables)["b"]
  np.testing.assert_array_equal(b_ids, np.unique(np.concatenate([sparse["fb"], sparse["fb2"]])))


def test_dedup_rejects_bad_shapes():
  tables = {"a": TableSpec(name="a", dim=4)}
  feats = [FeatureSpec(name="f", table="a", max_len=2), FeatureSpec(name="g", table="a")]
  ok = {"f": np.zeros((3, 2), np.uint64), "g": np.zeros((3, 1), np.uint64)}
  dd.dedup(ok, feats, tables)
  with pytest.raises(ValueError):
    dd.dedup({**ok, "f": np.zeros((3, 3), np.uint64)}, feats, tables)
  with pytest.raises(ValueError):
    dd.dedup({**ok, "g": np.zeros((4, 1), np.uint64)}, feats, tables)
  with pytest.raises(KeyError):
    dd.dedup({"f": ok["f"]}, feats, tables)


def _grid_brute_force(n, min_bucket):
  grid = sorted(m << e for m in (4, 5, 6, 7) for e in range(0, 62))
  target = max(n, min_bucket)
  return next(v for v in grid if v >= target)


def test_bucket_size_is_smallest_grid_value():
  grid = {m << e for m in (4, 5, 6, 7) for e in range(0, 62)}
  ns = list(range(0, 5000)) + [2**k + d for k in range(12, 50) for d in (-1, 0, 1)]
  ns += np.random.default_rng(0).integers(5000, 10**12, size=2000).tolist()
  for n in ns:
    b = dd.bucket_size(n)
    assert b >= n
    assert b in grid, (n, b)
    assert b == _grid_brute_force(n, dd.MIN_BUCKET), n
    if n > 64:
      assert (b - n) / n < 0.25, (n, b)
  # Another minimum.
  assert dd.bucket_size(3, min_bucket=16) == 16
  assert dd.bucket_size(17, min_bucket=16) == 20
  assert dd.bucket_size(0, min_bucket=4) == 4


@pytest.mark.parametrize("n", [0, 1, 2, 15, 16, 17, 1000, 70_000])
def test_unique_inverse_equals_numpy_unique(n):
  """The compiled kernel against np.unique: sorted distinct ids and the same inverse, plus the offset."""
  rng = np.random.default_rng(n)
  for pool in (3, max(1, n // 4), n + 1, None):  # few distinct ids, some, all distinct, the full range
    if pool is None:
      ids = rng.integers(0, U64_MAX, size=n, dtype=np.uint64, endpoint=True)
    else:
      values = rng.integers(0, U64_MAX, size=pool, dtype=np.uint64, endpoint=True)
      values[: min(pool, 3)] = np.array([0, 2**63, U64_MAX], np.uint64)[: min(pool, 3)]
      ids = rng.choice(values, size=n)
    want_u, want_inv = np.unique(ids, return_inverse=True)
    got_u, got_inv = dd.unique_inverse(ids, offset=7)
    assert got_u.dtype == np.uint64 and got_inv.dtype == np.int32
    np.testing.assert_array_equal(got_u, want_u)
    np.testing.assert_array_equal(got_inv, want_inv.reshape(-1) + 7)


@pytest.mark.parametrize("L", [1, 3])
def test_own_tables_in_one_call_equal_numpy_unique_batch_after_batch(L):
  """Features that each read a table of their own, no padding (Criteo's shape: the one-call kernel
  that sizes each table's hash table from its last batch), against np.unique per table, over
  batches whose distinct ids jump from a handful to all distinct and back (so a table sized for
  the last batch is too small and must grow), and through ``dedup``: the same groups as the
  per-table path gives when the batch does not take the one-call path."""
  rng = np.random.default_rng(L)
  B, T = 3000, 5
  tables = {f"t{i}": TableSpec(name=f"t{i}", dim=4) for i in range(T)}
  feats = [FeatureSpec(name=f"f{i}", table=f"t{i}", max_len=L) for i in range(T)]
  # The same features in two groups of one row width, one table shared: the per-table path.
  shared = [FeatureSpec(name=f"f{i}", table="t0" if i == 1 else f"t{i}", max_len=L) for i in range(T)]
  for distinct in (4, B * L, 20, B * L, 2):
    sparse = {}
    for i in range(T):
      pool = rng.integers(0, U64_MAX, size=distinct, dtype=np.uint64, endpoint=True)
      sparse[f"f{i}"] = rng.choice(pool, size=(B, L))
    uniqs, inverse = dd.dedup_own_tables(sparse, [f.name for f in feats], key="test-own")
    assert inverse.shape == (B, T, L) and inverse.dtype == np.int32
    offset = 0
    for i in range(T):
      want_u, want_inv = np.unique(sparse[f"f{i}"], return_inverse=True)
      np.testing.assert_array_equal(uniqs[i], want_u)
      np.testing.assert_array_equal(inverse[:, i, :], want_inv.reshape(B, L) + offset)
      offset += want_u.shape[0]
    (g,) = dd.dedup(sparse, feats, tables).values()
    assert [(n, o) for n, _, o in g.tables] == [(f"t{i}", sum(u.shape[0] for u in uniqs[:i])) for i in range(T)]
    np.testing.assert_array_equal(g.inverse, inverse)
    for (_, ids, _), u in zip(g.tables, uniqs):
      np.testing.assert_array_equal(ids, u)
    (h,) = dd.dedup(sparse, shared, {**tables}).values()  # t0 read by f0 and f1: per table
    for b in rng.integers(0, B, 20):
      for i in range(T):
        rows = np.concatenate([ids for _, ids, _ in h.tables])
        np.testing.assert_array_equal(rows[h.inverse[b, i]], sparse[f"f{i}"][b])


@pytest.mark.parametrize("L", [1, 2])
def test_gathered_batches_dedup_as_their_gathered_arrays(L):
  """A batch whose sparse ids are records of shuffle windows (``Gathered``: one window, or two for
  a batch that spans them) dedups to exactly what its ids gathered into arrays dedup to, for the
  one-call path (own tables) and the per-table one (a table read by two features, an alias);
  asking whether a feature is there gathers nothing, and each feature is gathered at most once."""
  from recsys_jax.embeddings.gathered import Gathered

  rng = np.random.default_rng(10 + L)
  T = 4
  tables = {f"t{i}": TableSpec(name=f"t{i}", dim=4) for i in range(T)}
  own = [FeatureSpec(name=f"f{i}", table=f"t{i}", max_len=L) for i in range(T)]
  shared = own[:-1] + [FeatureSpec(name="alias", table="t0", max_len=L)]

  def window(n):
    return {
      f"f{i}": rng.integers(0, 40 * (i + 1), size=(n, L)).astype(np.uint64) * np.uint64(2**61 + 1) for i in range(T)
    }

  w1, w2 = window(500), window(300)
  i1, i2 = rng.permutation(500)[:200], rng.permutation(300)[:120]
  for g in (Gathered([(w1, i1)]), Gathered.concat([Gathered([(w1, i1)]), Gathered([(w2, i2)])])):
    arrays = {f: g[f] for f in g}
    assert arrays["f0"].shape == g.feature_shape("f0") == (g.num_records, L)
    want = np.concatenate([w1["f2"][i1]] + ([w2["f2"][i2]] if len(g.pieces) == 2 else []))
    np.testing.assert_array_equal(arrays["f2"], want)
    fresh = Gathered(g.pieces)
    assert "f1" in fresh and "nope" not in fresh and not fresh._made  # membership gathers nothing
    for feats, sparse in ((own, fresh), (shared, fresh.with_aliases({"alias": "f3"}))):
      got = dd.dedup(sparse, feats, tables)
      ref_sparse = dict(arrays, alias=arrays["f3"])
      want = dd.dedup({f.name: ref_sparse[f.name] for f in feats}, feats, tables)
      for dim in want:
        np.testing.assert_array_equal(got[dim].inverse, want[dim].inverse)
        assert [(n, o) for n, _, o in got[dim].tables] == [(n, o) for n, _, o in want[dim].tables]
        for (_, a, _), (_, b, _) in zip(got[dim].tables, want[dim].tables):
          np.testing.assert_array_equal(a, b)
    assert not fresh._made  # the one-call path read the windows, gathered nothing
