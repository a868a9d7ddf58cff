"""The sharded PS as a product: shard-count invariance, snapshots (full and incremental, in
memory and on disk), bounds (LRU/LFU, protection, expiry), admission, low-precision storage,
stats and errors. References are independent: plain-Python cache models, float32/float64
closed-form optimizer updates, hand counts and binomial bounds.
"""

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from recsys_jax.async_ps.snapshot import directory as snapshot
from recsys_jax.async_ps.store import initializers
from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec
from recsys_jax.hashing import name_seed

U64_MAX = 2**64 - 1


@pytest.fixture
def make_ps():
  """Builds ParameterServers and closes them (their thread pools) after the test."""
  made = []

  def make(*args, **kwargs):
    ps = ParameterServer(*args, **kwargs)
    made.append(ps)
    return ps

  yield make
  for ps in made:
    ps.close()


def _pool(rng, n, extremes=True):
  """n distinct ids over the whole uint64 range in random order; with ``extremes``, 0 and
  2**64 - 1 among them, else neither (so such pools are disjoint from ones with extremes)."""
  ids = np.zeros(0, np.uint64)
  while ids.shape[0] < n:  # (a collision in 64 bits is very unlikely, but be exact)
    more = rng.integers(1, U64_MAX - 1, size=n - ids.shape[0], dtype=np.uint64, endpoint=True)
    ids = np.unique(np.concatenate([ids, more]))
  if extremes:
    ids[:2] = np.array([0, U64_MAX], np.uint64)
  return rng.permutation(ids)


def _pools(rng, *sizes):
  """Disjoint id pools of these sizes (0 and 2**64 - 1 in the first one or two)."""
  ids = _pool(rng, sum(sizes))
  return np.split(ids, np.cumsum(sizes)[:-1])


def _init(spec, ids, seed):
  ids = np.asarray(ids, np.uint64)
  return initializers.init_rows(ids, spec.dim, name_seed(spec.name, seed), spec.initializer, spec.init_scale)


def _state(ps):
  """A full ``ps.snapshot()`` with each table's rows sorted by id (shard counts order rows differently)."""
  out = {}
  for t, arrays in ps.snapshot().items():
    order = np.argsort(arrays["ids"], kind="stable")
    out[t] = {k: np.asarray(v)[order] for k, v in arrays.items() if k != "deleted"}
  return out


def _sorted_snap(snap):
  out = {}
  for t, arrays in snap.items():
    order = np.argsort(arrays["ids"], kind="stable")
    out[t] = {k: (np.asarray(v)[order] if k != "deleted" else np.sort(v)) for k, v in arrays.items()}
  return out


def _assert_same_state(a, b):
  assert set(a) == set(b)
  for t in a:
    assert set(a[t]) == set(b[t]), t
    for k in a[t]:
      assert np.shape(a[t][k]) == np.shape(b[t][k]), (t, k)
      np.testing.assert_array_equal(a[t][k], b[t][k], err_msg=f"{t}/{k}")


def _ids_set(arr):
  return {int(i) for i in np.asarray(arr, np.uint64)}


# -- 1. shard-count invariance and routing -------------------------------------------------


def _three_tables():
  return [
    TableSpec(name="user", dim=8),
    TableSpec(name="item", dim=5, initializer="normal", init_scale=0.2),
    TableSpec(name="ctx", dim=3, storage_dtype="bfloat16", init_scale=0.5),
  ]


def test_initial_rows_do_not_depend_on_the_shard_count(make_ps):
  rng = np.random.default_rng(100)
  specs = _three_tables()
  ids = _pool(rng, 3000)
  assert {0, U64_MAX} <= _ids_set(ids)
  rows = {}
  for n in (1, 2, 4):
    ps = make_ps(specs, num_shards=n, seed=21)
    # Split into several calls in another order per shard count; rows must still agree.
    perm = rng.permutation(ids.shape[0])
    got = {t.name: np.empty((ids.shape[0], t.dim), np.float32) for t in specs}
    for chunk in np.array_split(perm, 3):
      out = ps.lookup_many({t.name: ids[chunk] for t in specs}, step=1)
      for t in specs:
        assert out[t.name].dtype == np.float32 and out[t.name].shape == (chunk.shape[0], t.dim)
        got[t.name][chunk] = out[t.name]
    assert all(ps.stats()[t.name]["rows"] == ids.shape[0] for t in specs)
    rows[n] = got
    # A read-only lookup on an untouched PS gives the same initial rows without creating any
    # (float32 tables here; low-precision storage: see the test below).
    fresh = make_ps(specs, num_shards=n, seed=21)
    ro = fresh.lookup_many({t.name: ids for t in specs[:2]}, create=False)
    for t in specs[:2]:
      np.testing.assert_array_equal(ro[t.name], got[t.name])
      assert fresh.stats()[t.name]["rows"] == 0
  for t in specs:
    np.testing.assert_array_equal(rows[2][t.name], rows[1][t.name])
    np.testing.assert_array_equal(rows[4][t.name], rows[1][t.name])
    r = rows[1][t.name].astype(np.float64)
    # Real draws: within the initializer's range, spread out, distinct per id and column.
    if t.initializer == "uniform":
      assert r.min() >= -t.init_scale and r.max() <= t.init_scale
      np.testing.assert_allclose(r.std(), t.init_scale / np.sqrt(3), rtol=0.05)
    else:
      np.testing.assert_allclose(r.std(), t.init_scale, rtol=0.05)
    if t.storage_dtype == "float32":
      assert np.unique(r, axis=0).shape[0] == r.shape[0]
  # bfloat16 storage: the initial rows are already rounded to bfloat16.
  ctx = rows[1]["ctx"]
  np.testing.assert_array_equal(ctx, ctx.astype(ml_dtypes.bfloat16).astype(np.float32))
  # Different tables draw different rows for the same id.
  assert not np.isclose(rows[1]["user"][:, :5], rows[1]["item"]).all(axis=1).any()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_read_only_lookup_of_an_unseen_id_matches_its_created_row(dtype, make_ps):
  rng = np.random.default_rng(99)
  spec = TableSpec(name="ctx", dim=3, storage_dtype=dtype, init_scale=0.5)
  ids = _pool(rng, 100)
  ro = make_ps([spec], num_shards=2, seed=21).lookup("ctx", ids, create=False)
  created = make_ps([spec], num_shards=2, seed=21).lookup("ctx", ids, step=1)
  np.testing.assert_array_equal(ro, created)


def test_routing_splits_ids_evenly_over_all_shards(make_ps):
  rng = np.random.default_rng(101)
  specs = _three_tables()
  ids = _pool(rng, 40_000)
  assert ids.shape[0] == 40_000
  one = make_ps(specs, num_shards=1, seed=3)
  np.testing.assert_array_equal(one.shard_of("user", ids), np.zeros(ids.shape[0], np.int64))
  for n in (2, 4):
    ps = make_ps(specs, num_shards=n, seed=3)
    for t in specs:
      shard = ps.shard_of(t.name, ids)
      assert shard.shape == ids.shape
      assert shard.min() >= 0 and shard.max() < n
      frac = np.bincount(shard, minlength=n) / ids.shape[0]
      assert np.all(np.abs(frac - 1.0 / n) <= 0.05), (t.name, n, frac)
    if n == 4:
      # The tables really hold the ids on the shard that shard_of names.
      ps.lookup_many({"user": ids[:4000], "item": ids[:4000]}, step=1)
      for name in ("user", "item"):
        shard = ps.shard_of(name, ids[:4000])
        for s in range(n):
          held = ps.shards[s][name].snapshot()["ids"]
          assert _ids_set(held) == _ids_set(ids[:4000][shard == s]), (name, s)
          assert 0.20 <= held.shape[0] / 4000 <= 0.30
      # Routing is per (table, id): two tables agree on an id's shard about 1/4 of the time.
      same = (ps.shard_of("user", ids) == ps.shard_of("item", ids)).mean()
      assert abs(same - 0.25) <= 0.05


# -- 2. snapshots restore into any shard count ---------------------------------------------


def _train_specs():
  return [
    TableSpec(
      name="user",
      dim=8,
      optimizer="adagrad",
      optimizer_kwargs=(("learning_rate", 0.1), ("initial_accumulator_value", 0.1)),
    ),
    TableSpec(
      name="item",
      dim=4,
      optimizer="adam",
      optimizer_kwargs=(("learning_rate", 0.01),),
      initializer="normal",
      init_scale=0.1,
    ),
  ]


def _train_step(ps, specs, pools, step, seed, batch=96):
  """A trainer-like step: raw ids with repeats -> distinct ids -> lookup -> random grads -> apply."""
  rng = np.random.default_rng([seed, step])
  ids = {}
  for s in specs:
    raw = rng.choice(pools[s.name], size=batch, replace=True)
    uniq = np.unique(raw)
    assert uniq.shape[0] < batch  # there were repeats
    ids[s.name] = rng.permutation(uniq)
  ps.lookup_many(ids, step=step)
  grads = {}
  for s in specs:
    perm = rng.permutation(ids[s.name].shape[0])
    g = rng.normal(size=(perm.shape[0], s.dim)) * rng.choice([0.1, 1.0, 3.0], size=(perm.shape[0], 1))
    grads[s.name] = (ids[s.name][perm], g.astype(np.float32))
  ps.apply_many(grads, step=step)
  return ids


@pytest.mark.parametrize("via", ["memory", "disk"])
def test_snapshot_restores_into_any_shard_count(via, make_ps, tmp_path):
  rng = np.random.default_rng(102)
  specs = _train_specs()
  pools = {"user": _pool(rng, 300), "item": _pool(rng, 60)}
  ps = make_ps(specs, num_shards=3, seed=7)
  seen = {s.name: set() for s in specs}
  for step in range(1, 7):
    for t, v in _train_step(ps, specs, pools, step, seed=1).items():
      seen[t] |= _ids_set(v)
  live = _state(ps)
  for s in specs:
    assert _ids_set(live[s.name]["ids"]) == seen[s.name]
  # Training happened: rows moved off their initial values and Adam counted several updates.
  assert np.abs(live["user"]["weights"] - _init(specs[0], live["user"]["ids"], 7)).max() > 0.05
  assert live["item"]["slot_t"].max() >= 3
  if via == "memory":
    snap = ps.snapshot()
  else:
    rows = snapshot.save(ps, str(tmp_path / "full"), meta={"step": 6})
    assert rows == {t: len(seen[t]) for t in seen}
    with open(tmp_path / "full" / snapshot.MANIFEST) as f:
      assert json.load(f)["step"] == 6
  # Every id the trainer saw, plus ids never seen (those read their initial value everywhere).
  probe = {t: np.concatenate([np.array(sorted(seen[t]), np.uint64), _pool(rng, 50, False)]) for t in seen}
  expect = ps.lookup_many(probe, create=False)
  restored = {}
  for n in (1, 2, 4):
    new = make_ps(specs, num_shards=n, seed=7)
    # State the restore must drop.
    new.lookup_many({"user": _pool(rng, 40), "item": pools["item"][:5]}, step=1)
    new.apply("item", pools["item"][:5], np.ones((5, 4), np.float32))
    if via == "memory":
      new.restore(snap)
    else:
      snapshot.load(new, [str(tmp_path / "full")])
    got = new.lookup_many(probe, create=False)
    for t in probe:
      np.testing.assert_array_equal(got[t], expect[t], err_msg=f"{t} with {n} shards")
    _assert_same_state(_state(new), live)
    for s in specs:
      assert new.stats()[s.name]["rows"] == len(seen[s.name])
    restored[n] = new
  # Identical further training (with new ids too) keeps them identical, slots included.
  pools = {t: np.concatenate([v, _pool(rng, 30, False)]) for t, v in pools.items()}
  for step in range(7, 11):
    for p in [ps, *restored.values()]:
      _train_step(p, specs, pools, step, seed=2)
  final = _state(ps)
  assert not np.array_equal(final["user"]["ids"], live["user"]["ids"])  # new ids came in
  probe = {t: np.concatenate([final[t]["ids"], _pool(rng, 20, False)]) for t in final}
  expect = ps.lookup_many(probe, create=False)
  for n, new in restored.items():
    _assert_same_state(_state(new), final)
    got = new.lookup_many(probe, create=False)
    for t in probe:
      np.testing.assert_array_equal(got[t], expect[t], err_msg=f"{t} with {n} shards after training")


# -- 3. incremental snapshots --------------------------------------------------------------


def test_incremental_snapshot_holds_exactly_the_changed_rows(make_ps, tmp_path):
  rng = np.random.default_rng(103)
  specs = [*_train_specs(), TableSpec(name="ctx", dim=2)]
  ps = make_ps(specs, num_shards=2, seed=5)
  old = {"user": _pool(rng, 200), "item": _pool(rng, 40)}
  for step in range(1, 5):
    _train_step(ps, specs[:2], old, step, seed=3, batch=128)
  ps.lookup("ctx", _pool(rng, 30), step=4)
  full_dir, inc_dir = str(tmp_path / "full"), str(tmp_path / "inc")
  snapshot.save(ps, full_dir)
  present = {t: _ids_set(a["ids"]) for t, a in snapshot.read(full_dir).items()}
  assert len(present["user"]) > 100 and len(present["ctx"]) == 30
  # During the next 10 steps the trainer draws from part of the old ids plus new ones; others
  # are only read (create=False) or looked up without ever getting a gradient.
  split = {t: sorted(v) for t, v in present.items()}
  active = {t: np.array(split[t][: len(split[t]) // 2], np.uint64) for t in ("user", "item")}
  hit_only = {t: np.array(split[t][len(split[t]) // 2 :][:8], np.uint64) for t in ("user", "item")}
  read_only = {t: np.array(split[t][len(split[t]) // 2 :][8:16], np.uint64) for t in ("user", "item")}
  new_ids = {"user": _pool(rng, 60, False), "item": _pool(rng, 10, False)}
  changed = {t: set() for t in ("user", "item")}
  prev = {t: np.zeros(0, np.uint64) for t in ("user", "item")}
  for step in range(5, 15):
    lookups, grads = {}, {}
    for t, s in (("user", specs[0]), ("item", specs[1])):
      pool = np.concatenate([active[t], new_ids[t]])
      ids = np.unique(rng.choice(pool, size=24, replace=True))
      lookups[t] = rng.permutation(ids)
      # Rows created now (not present before) are changed rows, looked up again or not.
      changed[t] |= _ids_set(ids) - present[t]
      present[t] |= _ids_set(ids)
      # Gradients for ~70% of this step's ids and some of the previous step's (staleness).
      cur = ids[rng.random(ids.shape[0]) < 0.7]
      stale = prev[t][rng.random(prev[t].shape[0]) < 0.3]
      gids = np.union1d(cur, stale).astype(np.uint64)
      grads[t] = (gids, rng.normal(size=(gids.shape[0], s.dim)).astype(np.float32))
      changed[t] |= _ids_set(gids)
      prev[t] = ids
    if step == 9:
      lookups = {t: np.concatenate([v, hit_only[t]]) for t, v in lookups.items()}
    ps.lookup_many(lookups, step=step)
    ps.apply_many(grads, step=step)
    ps.lookup_many(read_only, create=False)
  rows = snapshot.save(ps, inc_dir, incremental=True)
  inc = snapshot.read(inc_dir)
  assert set(inc) == {"user", "item", "ctx"}
  for t in ("user", "item"):
    got = _ids_set(inc[t]["ids"])
    assert rows[t] == len(got) == inc[t]["ids"].shape[0]
    assert got == changed[t]
    # Rows not touched in those 10 steps are absent: read-only ids, ids only looked up (a hit
    # changes no stored value), and the old ids the trainer did not draw.
    untouched = present[t] - changed[t]
    assert _ids_set(hit_only[t]) <= untouched and _ids_set(read_only[t]) <= untouched
    assert len(untouched) >= 16 and not (got & untouched)
    assert changed[t] - _ids_set(new_ids[t])  # old rows that changed are in it too
    assert inc[t]["deleted"].shape == (0,)
    assert inc[t]["weights"].shape == (len(got), specs[0 if t == "user" else 1].dim)
  assert inc["ctx"]["ids"].shape == (0,) and inc["ctx"]["weights"].shape == (0, 2)
  assert inc["ctx"]["deleted"].shape == (0,)
  live = _state(ps)
  # Full + incremental into fresh PSs with other shard counts equals the live state.
  for n in (1, 3):
    new = make_ps(specs, num_shards=n, seed=5)
    snapshot.load(new, [full_dir])
    with pytest.raises(AssertionError):
      _assert_same_state(_state(new), live)  # the full snapshot alone is behind
    new = make_ps(specs, num_shards=n, seed=5)
    snapshot.load(new, [full_dir, inc_dir])
    _assert_same_state(_state(new), live)
  # Taking the snapshot reset the tracking: nothing changed since.
  again = ps.snapshot(incremental=True)
  assert all(a["ids"].shape == (0,) and a["deleted"].shape == (0,) for a in again.values())


def test_incremental_snapshot_of_a_bounded_table_lists_evicted_ids(make_ps, tmp_path):
  rng = np.random.default_rng(104)
  specs = [
    TableSpec(name="user", dim=4, capacity=240, optimizer_kwargs=(("learning_rate", 0.2),)),
    TableSpec(name="item", dim=3, optimizer="adam", optimizer_kwargs=(("learning_rate", 0.01),)),
  ]
  ps = make_ps(specs, num_shards=2, seed=8)
  pools = {"user": _pool(rng, 700), "item": _pool(rng, 50)}
  for step in range(1, 5):
    _train_step(ps, specs, pools, step, seed=4, batch=80)
  full_dir, inc_dir = str(tmp_path / "full"), str(tmp_path / "inc")
  snapshot.save(ps, full_dir)
  ever = {t: _ids_set(a["ids"]) for t, a in snapshot.read(full_dir).items()}
  full_user = set(ever["user"])
  touched = {t: set() for t in ever}
  ev0 = ps.stats()["user"]["evictions"]
  for step in range(5, 15):
    for t, v in _train_step(ps, specs, pools, step, seed=5, batch=80).items():
      touched[t] |= _ids_set(v)  # every id looked up also gets a gradient
      ever[t] |= _ids_set(v)
  snapshot.save(ps, inc_dir, incremental=True)
  inc = snapshot.read(inc_dir)
  live = _state(ps)
  live_ids = {t: _ids_set(live[t]["ids"]) for t in live}
  st = ps.stats()["user"]
  assert st["rows"] <= 240 and st["evictions"] - ev0 > 0
  # Without a tier and without expiry, an id that had a row since the full snapshot and has
  # none now was evicted; exactly those are `deleted`.
  evicted = ever["user"] - live_ids["user"]
  assert len(evicted) > 50 and evicted & full_user and evicted - full_user
  assert _ids_set(inc["user"]["deleted"]) == evicted
  assert inc["user"]["deleted"].shape[0] == len(evicted)  # distinct
  assert st["evictions"] - ev0 >= len(evicted)
  assert inc["item"]["deleted"].shape == (0,)
  for t in ("user", "item"):
    assert _ids_set(inc[t]["ids"]) == touched[t] & live_ids[t]
  # Restoring full + incremental (into 1 shard holding the whole capacity, and into 2) equals
  # the live state.
  for n in (1, 2):
    new = make_ps(specs, num_shards=n, seed=8)
    snapshot.load(new, [full_dir, inc_dir])
    _assert_same_state(_state(new), live)
    assert new.stats()["user"]["rows"] == len(live_ids["user"])


# -- 4. bounds -----------------------------------------------------------------------------


class RefCache:
  """Which ids a bounded single-shard table holds, written from its documented rules.

  On a lookup at ``step``: seen ids get last_seen = step (and one more hit), unseen ids a row
  with 0 hits; rows not seen for more than ``expire_after`` steps are dropped; then, over
  capacity, the unprotected rows (last seen >= ``protect_steps`` steps ago) with the lowest
  (last_seen) for LRU or (hits, last_seen) for LFU are evicted until floor(0.8 * capacity)
  rows are left or no unprotected row remains.
  """

  def __init__(self, capacity=0, eviction="lru", protect_steps=1, expire_after=0):
    assert expire_after < 16  # expiry is checked every max(1, T // 8) steps: exact for T < 16
    self.capacity, self.eviction, self.protect, self.expire = capacity, eviction, protect_steps, expire_after
    self.rows = {}  # id -> [last_seen, hits]
    self.evictions = self.expirations = self.misses = self.hits = 0
    self.gone = []

  def lookup(self, ids, step):
    self.gone = []
    for i in map(int, ids):
      if i in self.rows:
        self.rows[i] = [step, self.rows[i][1] + 1]
        self.hits += 1
      else:
        self.rows[i] = [step, 0]
        self.misses += 1
    if self.expire:
      old = [i for i, (ls, _) in self.rows.items() if step - ls > self.expire]
      for i in old:
        del self.rows[i]
      self.expirations += len(old)
      self.gone += old
    if self.capacity and len(self.rows) > self.capacity:
      target = self.capacity * 4 // 5
      cand = [i for i, (ls, _) in self.rows.items() if step - ls >= self.protect]
      key = (lambda i: tuple(self.rows[i][::-1])) if self.eviction == "lfu" else (lambda i: self.rows[i][0])
      cand.sort(key=key)
      k = min(len(self.rows) - target, len(cand))
      if 0 < k < len(cand):
        assert key(cand[k - 1]) != key(cand[k]), "test design: a tie at the eviction boundary"
      for i in cand[:k]:
        del self.rows[i]
      self.evictions += max(k, 0)
      self.gone += cand[:k]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_follows_the_reference_model_and_evicted_rows_restart(policy, make_ps):
  rng = np.random.default_rng(105 if policy == "lru" else 106)
  cap = 23  # floor(0.8 * 23) = 18
  spec = TableSpec(
    name="t", dim=4, capacity=cap, eviction=policy, optimizer="sgd", optimizer_kwargs=(("learning_rate", 0.5),)
  )
  ps = make_ps([spec], num_shards=1, seed=6)
  model = RefCache(cap, policy)
  universe = _pool(rng, 60)
  prob = 1.0 / np.arange(1, 61) ** 0.8  # skewed, so frequencies differ
  prob /= prob.sum()
  values = {}  # id -> expected float32 row
  dropped = applied = 0
  saw_eviction = saw_return = False
  for step in range(1, 401):
    i = int(rng.choice(universe, p=prob))
    returning = i not in model.rows and i in values
    model.lookup([i], step)
    if i not in values or returning:
      values[i] = _init(spec, [i], 6)[0]  # a new or evicted id starts from its initial row
      saw_return |= returning
    row = ps.lookup("t", np.array([i], np.uint64), step=step)
    np.testing.assert_array_equal(row[0], values[i])
    for j in model.gone:
      values[j] = None  # its trained value is lost
    saw_eviction |= bool(model.gone)
    # Gradients for this id and one other id of the universe (dropped if it has no row).
    j = int(rng.choice(universe))
    gids = [i] if j == i else [i, j]
    g = rng.normal(size=(len(gids), 4)).astype(np.float32)
    ps.apply("t", np.array(gids, np.uint64), g)
    for k, gid in enumerate(gids):
      if gid in model.rows:
        values[gid] = values[gid] - np.float32(0.5) * g[k]
        applied += 1
      else:
        dropped += 1
    snap = ps.snapshot()["t"]
    assert _ids_set(snap["ids"]) == set(model.rows), step
    if model.gone:
      assert len(model.rows) == cap * 4 // 5
  assert saw_eviction and saw_return
  present = np.array(sorted(model.rows), np.uint64)
  np.testing.assert_array_equal(ps.lookup("t", present, create=False), np.stack([values[int(i)] for i in present]))
  absent = np.array(sorted(set(map(int, universe)) - set(model.rows)), np.uint64)
  np.testing.assert_array_equal(ps.lookup("t", absent, create=False), _init(spec, absent, 6))
  st = ps.stats()["t"]
  assert st["evictions"] == model.evictions > 20
  assert st["rows"] == len(model.rows)
  assert (st["hits"], st["misses"], st["created"]) == (model.hits, model.misses, model.misses)
  assert (st["dropped_grads"], st["applied_rows"]) == (dropped, applied)
  assert dropped > 0


def test_lru_evicts_exactly_the_least_recently_used(make_ps):
  spec = TableSpec(
    name="t",
    dim=4,
    capacity=10,
    optimizer_kwargs=(("learning_rate", 0.1), ("initial_accumulator_value", 0.5)),
  )
  ps = make_ps([spec], num_shards=1, seed=2)
  rng = np.random.default_rng(107)
  x = _pool(rng, 11)
  g = np.ones((1, 4), np.float32)
  for step in range(1, 11):  # x0..x9, one per step, each trained
    ps.lookup("t", x[step - 1 : step], step=step)
    ps.apply("t", x[step - 1 : step], g)
  for step, k in ((11, 0), (12, 4), (13, 7)):  # touched again: now the most recent
    ps.lookup("t", x[k : k + 1], step=step)
  assert ps.stats()["t"]["rows"] == 10 and ps.stats()["t"]["evictions"] == 0
  ps.lookup("t", x[10:11], step=14)  # 11 rows > 10: down to floor(0.8 * 10) = 8
  held = _ids_set(ps.snapshot()["t"]["ids"])
  assert held == _ids_set(x[[0, 4, 5, 6, 7, 8, 9, 10]])
  assert ps.stats()["t"]["rows"] == 8 and ps.stats()["t"]["evictions"] == 3
  # The survivors kept their trained values; the evicted ones read their initial value again.
  trained = ps.lookup("t", x[[0, 4, 9]], create=False)
  assert np.abs(trained - _init(spec, x[[0, 4, 9]], 2)).min() > 0.05
  np.testing.assert_array_equal(ps.lookup("t", x[[1, 2, 3]], create=False), _init(spec, x[[1, 2, 3]], 2))
  # A gradient for an evicted id is dropped, and creates no row.
  ps.apply("t", x[3:4], g)
  assert ps.stats()["t"]["dropped_grads"] == 1 and ps.stats()["t"]["rows"] == 8
  # Looked up again for training, an evicted id restarts: initial row, fresh optimizer slot.
  np.testing.assert_array_equal(ps.lookup("t", x[1:2], step=15), _init(spec, x[1:2], 2))
  snap = ps.snapshot()["t"]
  pos = {int(i): k for k, i in enumerate(snap["ids"])}
  np.testing.assert_array_equal(snap["slot_acc"][pos[int(x[1])]], np.full(4, 0.5, np.float32))
  assert snap["slot_acc"][pos[int(x[0])]][0] == np.float32(1.5)  # trained once: 0.5 + 1
  assert ps.stats()["t"]["rows"] == 9 and ps.stats()["t"]["evictions"] == 3


def test_lfu_keeps_frequently_used_ids_that_lru_evicts(make_ps):
  rng = np.random.default_rng(108)
  hot, cold = _pools(rng, 5, 10)
  # Hot ids looked up 4 times each, early; then cold ids once each, later.
  seq = [hot[k % 5] for k in range(20)] + list(cold)
  kept = {}
  for policy in ("lru", "lfu"):
    ps = make_ps([TableSpec(name="t", dim=2, capacity=10, eviction=policy)], num_shards=1, seed=0)
    model = RefCache(10, policy)
    for step, i in enumerate(seq, start=1):
      ps.lookup("t", np.array([i], np.uint64), step=step)
      model.lookup([i], step)
    kept[policy] = _ids_set(ps.snapshot()["t"]["ids"])
    assert kept[policy] == set(model.rows)
    assert ps.stats()["t"]["evictions"] == model.evictions == 6
  assert _ids_set(hot) <= kept["lfu"]  # the frequent ids survive under LFU
  assert not (_ids_set(hot) & kept["lru"])  # and are the least recent ones under LRU
  assert kept["lfu"] == _ids_set(hot) | _ids_set(cold[6:])


def test_protected_rows_are_never_evicted(make_ps):
  rng = np.random.default_rng(109)
  spec = TableSpec(name="t", dim=2, capacity=10)
  ids = _pool(rng, 60)
  batches = [ids[6 * k : 6 * (k + 1)] for k in range(10)]
  # At step 5 two ids of step 2 are looked up again: their protection starts over.
  batches[4] = np.concatenate([batches[4], batches[1][:2]])
  ps = make_ps([spec], num_shards=1, seed=1, protect_steps=3)
  model = RefCache(10, "lru", protect_steps=3)
  overflowed = False
  for step, b in enumerate(batches, start=1):
    ps.lookup("t", b, step=step)
    model.lookup(b, step)
    held = _ids_set(ps.snapshot()["t"]["ids"])
    assert held == set(model.rows), step
    recent = set().union(*[_ids_set(x) for x in batches[max(0, step - 3) : step]])
    assert recent <= held  # everything looked up in the last 3 steps is still there
    overflowed |= len(held) > 10
    if step == 6:  # the two ids of step 2 looked up again at step 5 outlived the other four
      assert _ids_set(batches[1][:2]) <= held and not (_ids_set(batches[1][2:]) & held)
  assert overflowed
  assert ps.stats()["t"]["evictions"] == model.evictions == 60 - 18
  # Without protection beyond the current step, the table is brought down to 8 rows.
  ps1 = make_ps([spec], num_shards=1, seed=1, protect_steps=1)
  for step, b in enumerate(batches, start=1):
    ps1.lookup("t", b, step=step)
    assert ps1.stats()["t"]["rows"] == (6 * step if step == 1 else 8)
    assert _ids_set(b) <= _ids_set(ps1.snapshot()["t"]["ids"])


def _held_by_value(ps, spec, ids, seed):
  """The ids whose row differs from its initial value (all rows here were trained when created)."""
  rows = ps.lookup(spec.name, ids, create=False)
  return _ids_set(ids[(rows != _init(spec, ids, seed)).any(axis=1)])


def test_expiry_drops_rows_not_seen_for_more_than_t_steps(make_ps):
  rng = np.random.default_rng(110)
  T = 4
  spec = TableSpec(name="t", dim=3, expire_after=T)
  ps = make_ps([spec], num_shards=1, seed=9)
  a, b, c = _pools(rng, 5, 6, 7)  # every step / step 1 only / steps 1 and 3
  every = np.concatenate([a, b, c])
  ps.snapshot()
  expect = {}  # step -> ids held after it
  for step in range(1, 11):
    ids = [a] + ([b] if step == 1 else []) + ([c] if step in (1, 3) else [])
    batch = np.concatenate(ids)
    ps.lookup("t", batch, step=step)
    ps.apply("t", batch, np.ones((batch.shape[0], 3), np.float32))
    # b was last seen at step 1 and c at step 3: present while not seen for <= T steps.
    expect[step] = _ids_set(a) | (_ids_set(b) if step - 1 <= T else set()) | (_ids_set(c) if step - 3 <= T else set())
    assert _held_by_value(ps, spec, every, 9) == expect[step], step
    assert ps.stats()["t"]["rows"] == len(expect[step])
  assert expect[5] == expect[4] and len(expect[6]) == 12 and len(expect[7]) == 12 and expect[8] == _ids_set(a)
  st = ps.stats()["t"]
  assert st["expirations"] == 13 and st["rows"] == 5
  # Expired rows were forgotten: they read their initial value; the others kept training.
  np.testing.assert_array_equal(ps.lookup("t", c, create=False), _init(spec, c, 9))
  assert np.abs(ps.lookup("t", a, create=False) - _init(spec, a, 9)).min() > 0.05
  # The incremental snapshot lists them as deleted.
  inc = ps.snapshot(incremental=True)["t"]
  assert _ids_set(inc["ids"]) == _ids_set(a)
  assert _ids_set(inc["deleted"]) == _ids_set(b) | _ids_set(c) and inc["deleted"].shape == (13,)
  # Gradients for expired ids are dropped.
  ps.apply("t", b, np.ones((6, 3), np.float32))
  assert ps.stats()["t"]["dropped_grads"] == 6


def test_expiry_follows_the_reference_model_on_random_traffic(make_ps):
  rng = np.random.default_rng(111)
  spec = TableSpec(name="t", dim=2, expire_after=6)
  ps = make_ps([spec], num_shards=1, seed=0)
  model = RefCache(expire_after=6)
  universe = _pool(rng, 80)
  ps.snapshot()
  gone, touched = set(), set()
  for step in range(1, 61):
    ids = np.unique(rng.choice(universe, size=int(rng.integers(1, 12))))
    touched |= _ids_set(ids)
    ps.lookup("t", ids, step=step)
    model.lookup(ids, step)
    gone |= set(model.gone)
    assert ps.stats()["t"]["rows"] == len(model.rows), step
    if step % 10 == 0:
      # An incremental snapshot holds the rows created or looked up (their last-seen step
      # changed) since the last one that still exist, and as deleted the ids that expired
      # since and did not come back.
      inc = ps.snapshot(incremental=True)["t"]
      assert _ids_set(inc["ids"]) == touched & set(model.rows), step
      assert _ids_set(inc["deleted"]) == gone - set(model.rows), step
      gone, touched = set(), set()
  assert _ids_set(ps.snapshot()["t"]["ids"]) == set(model.rows)
  assert ps.stats()["t"]["expirations"] == model.expirations > 50


# -- 5. admission --------------------------------------------------------------------------


def test_admit_after_three_lookups(make_ps):
  rng = np.random.default_rng(112)
  spec = TableSpec(
    name="t",
    dim=4,
    admit_after=3,
    optimizer_kwargs=(("learning_rate", 0.1), ("initial_accumulator_value", 0.1)),
  )
  ps = make_ps([spec], num_shards=2, seed=4)
  ids = _pool(rng, 40)
  zeros = np.zeros((40, 4), np.float32)

  def counters():
    st = ps.stats()["t"]
    return {k: st[k] for k in ("rows", "lookups", "hits", "misses", "rejected", "admitted", "dropped_grads")}

  # 1st lookup: rejected, zeros; the gradients are dropped.
  np.testing.assert_array_equal(ps.lookup("t", ids, step=1), zeros)
  g1 = rng.normal(size=(40, 4)).astype(np.float32)
  ps.apply("t", ids, g1)
  assert counters() == dict(rows=0, lookups=40, hits=0, misses=40, rejected=40, admitted=0, dropped_grads=40)
  # Read-only lookups neither count towards admission nor change any counter.
  for _ in range(3):
    np.testing.assert_array_equal(ps.lookup("t", ids, create=False), zeros)
  assert counters()["rejected"] == 40
  # 2nd lookup of the first 30: still rejected.
  np.testing.assert_array_equal(ps.lookup("t", ids[:30], step=2), zeros[:30])
  ps.apply("t", ids[:30], g1[:30])
  assert counters() == dict(rows=0, lookups=70, hits=0, misses=70, rejected=70, admitted=0, dropped_grads=70)
  # 3rd lookup of the first 20 (with 10 never-seen ids): admitted with their initial row.
  fresh = _pool(rng, 10, False)
  out = ps.lookup("t", np.concatenate([ids[:20], fresh]), step=3)
  np.testing.assert_array_equal(out[:20], _init(spec, ids[:20], 4))
  np.testing.assert_array_equal(out[20:], zeros[:10])
  assert counters() == dict(rows=20, lookups=100, hits=0, misses=100, rejected=80, admitted=20, dropped_grads=70)
  # Their first gradient acts on the initial row with a fresh accumulator: the dropped ones
  # left no trace (Adagrad in float32: acc = 0.1 + g^2, w = w0 - 0.1 g / (sqrt(acc) + 1e-8)).
  g3 = rng.normal(size=(30, 4)).astype(np.float32)
  ps.apply("t", np.concatenate([ids[:20], fresh]), g3)
  acc = np.float32(0.1) + g3[:20] * g3[:20]
  want = _init(spec, ids[:20], 4) - np.float32(0.1) * g3[:20] / (np.sqrt(acc) + np.float32(1e-8))
  np.testing.assert_array_equal(ps.lookup("t", ids[:20], create=False), want)
  assert counters()["dropped_grads"] == 80
  # 3rd lookup of ids 20..29 admits them; the first 20 are hits; ids 30..39 (2nd time) are not.
  out = ps.lookup("t", ids, step=4)
  np.testing.assert_array_equal(out[:20], want)
  np.testing.assert_array_equal(out[20:30], _init(spec, ids[20:30], 4))
  np.testing.assert_array_equal(out[30:], zeros[:10])
  assert counters() == dict(rows=30, lookups=140, hits=20, misses=120, rejected=90, admitted=30, dropped_grads=80)
  assert _ids_set(ps.snapshot()["t"]["ids"]) == _ids_set(ids[:30])


def test_admit_probability(make_ps):
  rng = np.random.default_rng(113)
  p, n = 0.25, 20_000
  spec = TableSpec(name="t", dim=2, admit_probability=p)
  ids = _pool(rng, n)
  ps = make_ps([spec], num_shards=1, seed=9)
  out = ps.lookup("t", ids, step=5)
  st = ps.stats()["t"]
  sigma = np.sqrt(p * (1 - p) / n)
  assert abs(st["admitted"] / n - p) <= 5 * sigma
  assert st["rows"] == st["admitted"] and st["rejected"] == n - st["admitted"]
  admitted = _ids_set(ps.snapshot()["t"]["ids"])
  got_row = np.abs(out).sum(axis=1) > 0
  assert _ids_set(ids[got_row]) == admitted
  np.testing.assert_array_equal(out[got_row], _init(spec, ids[got_row], 9))
  # Deterministic given (ids, step, seed): other shard counts, orders and call splits agree.
  for shards in (1, 3):
    other = make_ps([spec], num_shards=shards, seed=9)
    for chunk in np.array_split(rng.permutation(ids), 4):
      other.lookup("t", chunk, step=5)
    assert _ids_set(other.snapshot()["t"]["ids"]) == admitted
  # Another seed decides independently: the overlap is about p * p.
  other = make_ps([spec], num_shards=1, seed=10)
  other.lookup("t", ids, step=5)
  both = len(admitted & _ids_set(other.snapshot()["t"]["ids"])) / n
  assert abs(both - p * p) <= 5 * np.sqrt(p * p * (1 - p * p) / n)
  # Another step is a new chance: after two tries 1 - (1 - p)^2 of the ids have rows.
  ps.lookup("t", ids, step=6)
  q = 1 - (1 - p) ** 2
  frac = ps.stats()["t"]["rows"] / n
  assert abs(frac - q) <= 5 * np.sqrt(q * (1 - q) / n)
  assert admitted <= _ids_set(ps.snapshot()["t"]["ids"])
  assert ps.stats()["t"]["hits"] == len(admitted)


# -- 6. low-precision storage --------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_rows_are_the_rounded_float32_update(dtype, make_ps):
  rng = np.random.default_rng(114)
  np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
  lr, acc0, eps = 0.01, 0.1, 1e-6
  spec = TableSpec(
    name="t",
    dim=16,
    storage_dtype=dtype,
    optimizer_kwargs=(("learning_rate", lr), ("initial_accumulator_value", acc0), ("eps", eps)),
    init_scale=0.3,
  )
  ps = make_ps([spec], num_shards=2, seed=4)
  ids = _pool(rng, 200)
  pos = {int(i): k for k, i in enumerate(ids)}
  ref_w = _init(spec, ids, 4).astype(np_dtype)  # stored rows
  ref_acc = np.full((200, 16), acc0, np.float32)
  out = ps.lookup("t", ids, step=1)
  assert out.dtype == np.float32
  np.testing.assert_array_equal(out, ref_w.astype(np.float32))
  rounding_mattered = 0
  for step in range(2, 8):
    sub = ids[rng.random(200) < 0.6]
    idx = np.array([pos[int(i)] for i in sub])
    g = (rng.normal(size=(sub.shape[0], 16)) * rng.choice([0.01, 1.0, 10.0], size=(sub.shape[0], 1))).astype(np.float32)
    ps.lookup("t", sub, step=step)
    ps.apply("t", sub, g)
    # Reference: dequantise, Adagrad in float32, round to the storage dtype.
    w32 = ref_w[idx].astype(np.float32)
    acc = ref_acc[idx] + g * g
    new32 = w32 - np.float32(lr) * g / (np.sqrt(acc) + np.float32(eps))
    ref_acc[idx] = acc
    ref_w[idx] = new32.astype(np_dtype)
    rounding_mattered += int((ref_w[idx].astype(np.float32) != new32).sum())
    out = ps.lookup("t", ids, create=False)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, ref_w.astype(np.float32), err_msg=f"step {step}")
  assert rounding_mattered > 1000  # the float32 results were not representable as they were
  snap = ps.snapshot()["t"]
  order = np.array([pos[int(i)] for i in snap["ids"]])
  assert snap["weights"].dtype == np.float32 and snap["slot_acc"].dtype == np.float32
  np.testing.assert_array_equal(snap["weights"], ref_w[order].astype(np.float32))
  np.testing.assert_array_equal(snap["slot_acc"], ref_acc[order])


# -- 7. stats ------------------------------------------------------------------------------


def test_stats_match_a_hand_count(make_ps):
  specs = [
    TableSpec(name="a", dim=8),
    TableSpec(name="b", dim=8, storage_dtype="bfloat16"),
    TableSpec(name="c", dim=2),
  ]
  ps = make_ps(specs, num_shards=2, seed=0)
  st = ps.stats()
  for t in ("a", "b", "c"):
    assert st[t]["rows"] == st[t]["lookups"] == st[t]["hits"] == st[t]["misses"] == 0
    assert np.isnan(st[t]["hit_rate"])

  def u(*v):
    return np.array(v, np.uint64)

  sizes = []
  script = [
    (u(1, 2, 3), True),  # 3 misses
    (u(2, 3, 4, 5), True),  # 2 hits, 2 misses
    (u(1, 9, 10), False),  # read-only: not counted
    (u(5, 1), True),  # 2 hits
    (u(6, 7, 8, 2**64 - 1), True),  # 4 misses
  ]
  for step, (ids, create) in enumerate(script, start=1):
    ps.lookup_many({"a": ids, "b": ids}, create=create, step=step)
    st = ps.stats()
    sizes.append((st["a"]["rows"], st["a"]["bytes"], st["b"]["bytes"]))
  ps.apply_many({"a": (u(1, 4), np.ones((2, 8), np.float32))})
  st = ps.stats()
  for t in ("a", "b"):
    assert st[t]["rows"] == 9 and st[t]["created"] == 9
    assert (st[t]["lookups"], st[t]["hits"], st[t]["misses"]) == (13, 4, 9)
    assert st[t]["hit_rate"] == pytest.approx(4 / 13)
    for k in ("lookup_ms", "apply_ms"):
      assert np.isfinite(st[t][k]) and st[t][k] >= 0
  assert st["a"]["applied_rows"] == 2 and st["b"]["applied_rows"] == 0
  assert st["c"]["rows"] == 0 and st["c"]["lookups"] == 0
  # Bytes grow with the rows; a bfloat16 table holds 2 bytes less per row element.
  rows = [r for r, _, _ in sizes]
  assert rows == [3, 5, 5, 5, 9]
  for (r0, a0, _), (r1, a1, _) in zip(sizes, sizes[1:]):
    assert (a1 > a0) if r1 > r0 else (a1 == a0)
    assert a1 - a0 >= (r1 - r0) * 8 * 4 * 2  # at least the float32 row and accumulator
  # On one shard (same id map for both tables) the difference is exactly 2 bytes per element.
  one = make_ps(specs[:2], num_shards=1, seed=0)
  for k, (ids, create) in enumerate(script, start=1):
    one.lookup_many({"a": ids, "b": ids}, create=create, step=k)
    st = one.stats()
    assert st["a"]["bytes"] - st["b"]["bytes"] == st["a"]["rows"] * 8 * 2


# -- 8. errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 3])
def test_wrong_gradient_shape_names_the_table(num_shards, make_ps):
  specs = [TableSpec(name="alpha", dim=4), TableSpec(name="beta", dim=3)]
  ps = make_ps(specs, num_shards=num_shards, seed=0)
  ids = np.arange(12, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
  ps.lookup_many({"alpha": ids, "beta": ids}, step=1)
  before = _state(ps)
  with pytest.raises(ValueError, match="'beta'"):
    ps.apply_many({"beta": (ids, np.ones((12, 4), np.float32))})
  with pytest.raises(ValueError, match="'alpha'"):
    ps.apply("alpha", ids, np.ones((11, 4), np.float32))
  with pytest.raises(ValueError, match="'beta'"):
    ps.apply_many({"beta": (ids, np.ones((12,), np.float32))})
  _assert_same_state(_state(ps), before)


@pytest.mark.parametrize(
  "num_shards",
  [
    pytest.param(
      1,
    ),
    3,
  ],
)
def test_rejected_apply_many_changes_no_table(num_shards, make_ps):
  specs = [TableSpec(name="alpha", dim=4), TableSpec(name="beta", dim=3)]
  ps = make_ps(specs, num_shards=num_shards, seed=0)
  ids = np.arange(12, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
  ps.lookup_many({"alpha": ids, "beta": ids}, step=1)
  before = _state(ps)
  with pytest.raises(ValueError, match="'beta'"):
    ps.apply_many({"alpha": (ids, np.ones((12, 4), np.float32)), "beta": (ids, np.ones((12, 4), np.float32))})
  _assert_same_state(_state(ps), before)


def test_unknown_table_is_a_key_error_naming_it(make_ps):
  ps = make_ps([TableSpec(name="alpha", dim=4)], num_shards=2, seed=0)
  ids = np.array([1, 2, 3], np.uint64)
  g = np.zeros((3, 4), np.float32)
  for call in (
    lambda: ps.lookup("ghost", ids),
    lambda: ps.lookup_many({"alpha": ids, "ghost": ids}),
    lambda: ps.lookup_many({"ghost": ids}, create=False),
    lambda: ps.apply("ghost", ids, g),
    lambda: ps.apply_many({"alpha": (ids, g), "ghost": (ids, g)}),
    lambda: ps.shard_of("ghost", ids),
  ):
    with pytest.raises(KeyError, match="ghost"):
      call()
  # Nothing happened to the known table either.
  st = ps.stats()["alpha"]
  assert st["rows"] == st["lookups"] == st["applied_rows"] == 0


def _dup_snapshot(ps, table, rng):
  """A snapshot of ``ps`` in which one id of ``table`` on its last shard appears twice."""
  snap = {t: {k: v.copy() for k, v in a.items()} for t, a in ps.snapshot().items()}
  last = np.flatnonzero(ps.shard_of(table, snap[table]["ids"]) == ps.num_shards - 1)
  a, b = rng.choice(last, size=2, replace=False)
  snap[table]["ids"][a] = snap[table]["ids"][b]
  return snap


@pytest.mark.parametrize(
  "num_shards",
  [
    1,
    pytest.param(
      3,
    ),
  ],
)
def test_restore_with_repeated_ids_is_refused_and_leaves_the_table_unchanged(num_shards, make_ps):
  rng = np.random.default_rng(115)
  specs = _train_specs()
  ps = make_ps(specs, num_shards=num_shards, seed=1)
  pools = {"user": _pool(rng, 100), "item": _pool(rng, 30)}
  _train_step(ps, specs, pools, 1, seed=6)
  bad = _dup_snapshot(ps, "user", rng)  # "user" is restored first
  _train_step(ps, specs, pools, 2, seed=6)  # so the live state differs from the snapshot
  before = _state(ps)
  with pytest.raises(ValueError, match="'user'.*not distinct"):
    ps.restore(bad)
  after = _state(ps)
  _assert_same_state({"user": after["user"]}, {"user": before["user"]})


def test_refused_restore_leaves_the_other_tables_unchanged(make_ps):
  rng = np.random.default_rng(116)
  specs = _train_specs()
  ps = make_ps(specs, num_shards=1, seed=1)
  pools = {"user": _pool(rng, 100), "item": _pool(rng, 30)}
  _train_step(ps, specs, pools, 1, seed=7)
  bad = _dup_snapshot(ps, "item", rng)  # "item" is restored after "user"
  _train_step(ps, specs, pools, 2, seed=7)
  before = _state(ps)
  with pytest.raises(ValueError, match="'item'"):
    ps.restore(bad)
  _assert_same_state(_state(ps), before)


def _saved(make_ps, tmp_path):
  rng = np.random.default_rng(117)
  specs = _train_specs()
  ps = make_ps(specs, num_shards=2, seed=1)
  _train_step(ps, specs, {"user": _pool(rng, 200), "item": _pool(rng, 40)}, 1, seed=8)
  d = str(tmp_path / "snap")
  snapshot.save(ps, d)
  return d, ps


def _truncate(path):
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[: len(data) // 2])


def _garbage(path):
  with open(path, "w") as f:
    f.write("{ this is not json")


def _overwrite_same_size(path):
  with open(path, "r+b") as f:
    n = len(f.read())
    f.seek(0)
    f.write(b"\xff" * n)


@pytest.mark.parametrize(
  "damage",
  [
    "truncated_chunk",
    "empty_chunk",
    "garbage_metadata",
    "missing_array",
    pytest.param("missing_chunk"),
    pytest.param("overwritten_chunk"),
  ],
)
def test_read_of_a_damaged_snapshot_names_the_array(damage, make_ps, tmp_path):
  d, _ = _saved(make_ps, tmp_path)
  chunk = os.path.join(d, "item", "0", "weights", "c", "0", "0")
  assert os.path.isfile(chunk)
  if damage == "truncated_chunk":
    _truncate(chunk)
  elif damage == "empty_chunk":
    open(chunk, "wb").close()
  elif damage == "garbage_metadata":
    _garbage(os.path.join(d, "item", "0", "weights", "zarr.json"))
  elif damage == "missing_array":
    shutil.rmtree(os.path.join(d, "item", "0", "weights"))
  elif damage == "missing_chunk":
    os.remove(chunk)
  else:
    _overwrite_same_size(chunk)
  with pytest.raises(ValueError, match="item/weights"):
    snapshot.read(d)


def test_read_without_manifest_is_a_value_error(make_ps, tmp_path):
  d, _ = _saved(make_ps, tmp_path)
  os.remove(os.path.join(d, snapshot.MANIFEST))
  with pytest.raises(ValueError, match="manifest"):
    snapshot.read(d)


def test_write_never_overwrites_a_snapshot(make_ps, tmp_path):
  d, ps = _saved(make_ps, tmp_path)
  saved = _sorted_snap(snapshot.read(d))
  _train_step(
    ps,
    _train_specs(),
    {"user": _pool(np.random.default_rng(1), 50), "item": _pool(np.random.default_rng(2), 9)},
    2,
    seed=9,
  )
  with pytest.raises(FileExistsError):
    snapshot.write(ps.snapshot(), d)
  with pytest.raises(FileExistsError):
    snapshot.save(ps, d)
  _assert_same_state(_sorted_snap(snapshot.read(d)), saved)
  assert not os.path.exists(d + ".tmp")


def test_refused_incremental_save_loses_no_changes(make_ps, tmp_path):
  d, ps = _saved(make_ps, tmp_path)
  rng = np.random.default_rng(118)
  specs = _train_specs()
  _train_step(ps, specs, {"user": _pool(rng, 50), "item": _pool(rng, 9)}, 2, seed=10)
  with pytest.raises(FileExistsError):
    snapshot.save(ps, d, incremental=True)
  inc = str(tmp_path / "inc")
  snapshot.save(ps, inc, incremental=True)
  new = make_ps(specs, num_shards=1, seed=1)
  snapshot.load(new, [d, inc])
  _assert_same_state(_state(new), _state(ps))
