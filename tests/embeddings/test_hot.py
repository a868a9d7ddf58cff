"""The hot set's host bookkeeping: choice by frequency, slot moves, and the split of a step's ids."""

from __future__ import annotations

import numpy as np
import pytest

from recsys_jax.embeddings import dedup as dedup_lib
from recsys_jax.embeddings import hot as hot_lib
from recsys_jax.embeddings.specs import FeatureSpec, TableSpec


def test_capacities_split_the_budget_by_lookups_per_record():
  cap = hot_lib.capacities(1000, {4: 3, 8: 1}, {4: 10, 8: 20})
  assert cap == {4: 750 // 10, 8: 250 // 20}
  assert hot_lib.capacities(1000, {4: 3, 8: 1}, {4: 10, 8: 20}, limit={4: 7}) == {4: 7, 8: 12}
  assert hot_lib.capacities(0, {4: 1}, {4: 10}) == {4: 0}


def test_choose_ranks_ids_across_tables_by_count_and_honours_overrides():
  counts = {
    "a": (np.array([1, 2, 3, 4], np.uint64), np.array([9, 5, 5, 1])),
    "b": (np.array([7, 8], np.uint64), np.array([6, 5])),
    "c": (np.array([10, 11, 12], np.uint64), np.array([100, 90, 80])),
  }
  groups = {4: ("a", "b"), 8: ("c",)}
  got = hot_lib.choose(counts, groups, {4: 4, 8: 2})
  # Width 4: counts 9 (a1), 6 (b7), then three 5s tied: table order (a before b), then id.
  assert got["a"].tolist() == [1, 2, 3] and got["b"].tolist() == [7]
  assert got["c"].tolist() == [10, 11]
  # An override gives "b" its top 2 first; "a" shares what is left; min_count drops id 4 (count 1).
  got = hot_lib.choose(counts, groups, {4: 10, 8: 2}, overrides={"b": 2, "c": 0})
  assert got["b"].tolist() == [7, 8] and got["a"].tolist() == [1, 2, 3] and got["c"].tolist() == []


def _reference_moves(old, new):
  """What a re-choice must move, from sets."""
  return {t: (sorted(old[t] - new[t]), sorted(new[t] - old[t])) for t in old}


def test_plan_and_apply_keep_staying_rows_in_their_slots_and_reuse_freed_ones():
  rng = np.random.default_rng(0)
  hs = hot_lib.HotSet({4: ("a", "b")}, {4: 30})
  current = {"a": set(), "b": set()}
  slot_of = {}
  for _ in range(6):
    chosen = {t: np.unique(rng.integers(0, 40, rng.integers(0, 15)).astype(np.uint64)) for t in ("a", "b")}
    new = {t: set(chosen[t].tolist()) for t in chosen}
    swap = hs.plan(chosen)
    want = _reference_moves(current, new)
    for t in ("a", "b"):
      assert swap.demote[t][0].tolist() == want[t][0]
      assert swap.promote[t][0].tolist() == want[t][1]
      for i, s in zip(*swap.demote[t]):
        assert slot_of.pop((t, int(i))) == s  # a leaving row frees the slot it had
    hs.apply(swap)
    for t in ("a", "b"):
      for i, s in zip(*swap.promote[t]):
        slot_of[(t, int(i))] = int(s)
    # Staying rows keep their slots; no slot is held twice; the set is the chosen one.
    assert len(set(slot_of.values())) == len(slot_of) == hs.size()
    for t in ("a", "b"):
      ids, slots = hs.hot(t)
      assert set(ids.tolist()) == new[t]
      assert {(t, int(i)): int(s) for i, s in zip(ids, slots)} == {k: v for k, v in slot_of.items() if k[0] == t}
    current = new
  with pytest.raises(ValueError, match="31 rows chosen for the width-4 group, which has 30 slots"):
    hs.plan({"a": np.arange(31, dtype=np.uint64)})
  with pytest.raises(ValueError, match=r"unknown table\(s\) \['z'\]"):
    hs.plan({"z": np.arange(1, dtype=np.uint64)})


@pytest.mark.parametrize("weighted,mins", [(False, (64, None)), (True, (64, None)), (True, (256, 512))])
def test_split_points_every_lookup_at_the_same_row_as_before(weighted, mins):
  """Decoding each remapped inverse entry (cold: the cold tables' layout; hot: hot_idx -> slot ->
  id) gives the (table, id) the original entry named, for random batches and hot sets; also when
  the cold rows and the hot slots are padded to larger buckets than they need."""
  min_bucket, min_hot_bucket = mins
  rng = np.random.default_rng(1)
  tables = {"a": TableSpec(name="a", dim=4), "b": TableSpec(name="b", dim=4)}
  features = [FeatureSpec(name="fa", table="a", max_len=3), FeatureSpec(name="fb", table="b", max_len=1)]
  hs = hot_lib.HotSet({4: ("a", "b")}, {4: 50})
  for _ in range(5):
    sparse = {
      "fa": rng.integers(0, 30, (64, 3)).astype(np.uint64),
      "fb": rng.integers(0, 20, (64, 1)).astype(np.uint64),
    }
    weights = None
    if weighted:
      weights = {"fa": (rng.random((64, 3)) < 0.7).astype(np.float32), "fb": np.ones((64, 1), np.float32)}
    g = dedup_lib.dedup(sparse, features, tables, weights)[4]
    chosen = {
      "a": np.unique(rng.integers(0, 30, 12)).astype(np.uint64),
      "b": np.unique(rng.integers(0, 20, 6)).astype(np.uint64),
    }
    hs.apply(hs.plan(chosen))
    s = hs.split(g, min_bucket, min_hot_bucket=min_hot_bucket)
    cold = s.group
    assert cold.bucket == dedup_lib.bucket_size(cold.num_rows, min_bucket)
    by_slot = {int(sl): (t, int(i)) for t in ("a", "b") for i, sl in zip(*hs.hot(t))}

    def decode(layout, index, bucket=None, by_slot=by_slot, hot_idx=s.hot_idx):
      for name, ids, off in layout.tables:
        if off <= index < off + ids.shape[0]:
          return name, int(ids[index - off])
      assert bucket is not None and index >= bucket, index
      return by_slot[int(hot_idx[index - bucket])]

    counted = np.ones(g.inverse.shape, bool) if g.weights is None else g.weights != 0
    for pos in zip(*np.nonzero(counted)):
      assert decode(cold, int(cold.inverse[pos]), cold.bucket) == decode(g, int(g.inverse[pos]))
    # Cold tables hold exactly the ids that are not hot; hot_idx the distinct hot slots, then padding.
    for name, ids, _ in cold.tables:
      assert not np.isin(ids, hs.hot(name)[0]).any()
    real = s.hot_idx[s.hot_idx < 50]
    assert np.unique(real).shape[0] == real.shape[0] and (s.hot_idx[real.shape[0] :] == 50).all()
    n_hot = sum(np.isin(ids, hs.hot(n)[0]).sum() for n, ids, _ in g.tables)
    assert real.shape[0] == n_hot and cold.num_rows + n_hot == g.num_rows
    assert s.hot_idx.shape[0] == dedup_lib.bucket_size(n_hot, min_hot_bucket or min_bucket)
    assert s.lookups == int(counted.sum())
    assert s.hits == int(sum((cold.inverse[p] >= cold.bucket) for p in zip(*np.nonzero(counted))))
