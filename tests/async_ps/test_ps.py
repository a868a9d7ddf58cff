"""ParameterServer against a float64 numpy reference PS, plus determinism, snapshots and errors."""

import numpy as np
import pytest

from recsys_jax.async_ps.store import initializers
from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec
from recsys_jax.hashing import name_seed, splitmix64, uniform01

U64_MAX = np.iinfo(np.uint64).max


def _init(name, ids, dim, seed, kind="uniform", scale=0.05):
  return initializers.init_rows(np.asarray(ids, np.uint64), dim, name_seed(name, seed), kind, scale)


class RefPS:
  """dict id -> float64 row (and Adagrad accumulator), written independently of the PS."""

  def __init__(self, specs, seed):
    self.specs = {s.name: s for s in specs}
    self.seed = seed
    self.rows = {s.name: {} for s in specs}
    self.acc = {s.name: {} for s in specs}

  def lookup(self, table, ids):
    s = self.specs[table]
    kw = dict(s.optimizer_kwargs)
    out = []
    for i in ids:
      i = int(i)
      if i not in self.rows[table]:
        init = _init(table, [i], s.dim, self.seed, s.initializer, s.init_scale)[0]
        self.rows[table][i] = init.astype(np.float64)
        self.acc[table][i] = np.full(s.dim, kw.get("initial_accumulator_value", 0.0), np.float64)
      out.append(self.rows[table][i].copy())
    return np.array(out).reshape(len(out), s.dim)

  def apply(self, table, ids, grads):
    s = self.specs[table]
    kw = dict(s.optimizer_kwargs)
    lr = kw["learning_rate"]
    for i, g in zip(ids, np.asarray(grads, np.float64)):
      i = int(i)
      if s.optimizer == "sgd":
        self.rows[table][i] = self.rows[table][i] - lr * g
      else:
        self.acc[table][i] = self.acc[table][i] + g * g
        eps = kw.get("eps", 1e-8)
        self.rows[table][i] = self.rows[table][i] - lr * g / (np.sqrt(self.acc[table][i]) + eps)


def _specs(optimizer):
  if optimizer == "sgd":
    return [
      TableSpec(name="user", dim=8, optimizer="sgd", optimizer_kwargs=(("learning_rate", 0.3),)),
      TableSpec(name="item", dim=3, optimizer="sgd", optimizer_kwargs=(("learning_rate", 0.05),), initializer="normal"),
    ]
  return [
    TableSpec(name="user", dim=8, optimizer="adagrad", optimizer_kwargs=(("learning_rate", 0.1),)),
    TableSpec(
      name="item",
      dim=3,
      optimizer="adagrad",
      optimizer_kwargs=(("learning_rate", 0.05), ("initial_accumulator_value", 0.1), ("eps", 1e-6)),
      initializer="normal",
      init_scale=0.2,
    ),
  ]


def _id_pool(rng, n):
  """Distinct ids over the whole uint64 range, with 0, 2**63 and 2**64 - 1 among them."""
  pool = rng.integers(0, U64_MAX, size=n, dtype=np.uint64, endpoint=True)
  pool[:3] = np.array([0, 2**63, 2**64 - 1], np.uint64)
  return np.unique(pool)


def _train_step(rng, ps, refs, specs, pools, batch):
  """One trainer-like step: raw ids with repeats -> unique ids -> lookup -> summed grads -> apply."""
  for s in specs:
    raw = rng.choice(pools[s.name], size=batch, replace=True)
    uniq, inv = np.unique(raw, return_inverse=True)
    assert len(uniq) < len(raw)  # there are repeats to sum over
    rows = ps.lookup(s.name, uniq)
    assert rows.dtype == np.float32 and rows.shape == (len(uniq), s.dim)
    for ref in refs:
      np.testing.assert_allclose(rows, ref.lookup(s.name, uniq), rtol=1e-5, atol=1e-7)
    occ = rng.normal(size=(batch, s.dim)) * rng.choice([0.0, 0.1, 1.0, 3.0], size=(batch, 1))
    summed = np.zeros((len(uniq), s.dim))
    np.add.at(summed, inv, occ)
    summed32 = summed.astype(np.float32)
    # Apply in a different order than the lookup: rows must be matched by id, not by position.
    perm = rng.permutation(len(uniq))
    ps.apply(s.name, uniq[perm], summed32[perm])
    for ref in refs:
      ref.apply(s.name, uniq[perm], summed32[perm].astype(np.float64))


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_matches_float64_reference_over_steps(optimizer):
  rng = np.random.default_rng(0 if optimizer == "adagrad" else 1)
  specs = _specs(optimizer)
  seed = 3
  ps = ParameterServer(specs, seed=seed)
  ref = RefPS(specs, seed)
  pools = {"user": _id_pool(rng, 300), "item": _id_pool(rng, 40)}
  for _ in range(10):
    _train_step(rng, ps, [ref], specs, pools, batch=128)
  for s in specs:
    ids = np.array(sorted(ref.rows[s.name]), np.uint64)
    np.testing.assert_allclose(ps.lookup(s.name, ids), ref.lookup(s.name, ids), rtol=1e-5, atol=1e-6)
    st = ps.stats()[s.name]
    assert st["rows"] == len(ref.rows[s.name])
  # Training really moved the rows away from their initial values.
  ids = np.array(sorted(ref.rows["user"]), np.uint64)
  assert np.abs(ps.lookup("user", ids) - _init("user", ids, 8, seed)).max() > 0.05
  if optimizer == "adagrad":
    snap = ps.snapshot()
    for s in specs:
      ids = snap[s.name]["ids"]
      expect = np.array([ref.acc[s.name][int(i)] for i in ids])
      np.testing.assert_allclose(snap[s.name]["slot_acc"], expect, rtol=1e-5, atol=1e-7)


def test_initial_rows_depend_only_on_table_id_and_seed():
  rng = np.random.default_rng(5)
  ids = _id_pool(rng, 500)
  specs = [TableSpec(name="a", dim=6), TableSpec(name="b", dim=6)]
  ps1 = ParameterServer(specs, seed=11)
  ps2 = ParameterServer(specs, seed=11)
  rows1 = ps1.lookup("a", ids)
  # ps2 sees other ids first and then ours in another order, split into several calls.
  ps2.lookup("a", _id_pool(np.random.default_rng(6), 300))
  perm = rng.permutation(len(ids))
  for chunk in np.array_split(perm, 7):
    np.testing.assert_array_equal(ps2.lookup("a", ids[chunk]), rows1[chunk])
  np.testing.assert_array_equal(ps2.lookup("a", ids), rows1)
  np.testing.assert_array_equal(rows1, _init("a", ids, 6, 11))
  # Initial values are spread over [-scale, scale) and not trivially constant.
  assert rows1.min() >= -0.05 and rows1.max() < 0.05 and rows1.std() > 0.02
  # Another table, or another seed, gives other values for the same ids.
  rows_b = ps1.lookup("b", ids)
  assert not np.isclose(rows_b, rows1).all(axis=1).any()
  rows_seed = ParameterServer(specs, seed=12).lookup("a", ids)
  assert not np.isclose(rows_seed, rows1).all(axis=1).any()
  # Rows of one id differ across columns too (each column has its own draw).
  assert (np.abs(np.diff(rows1, axis=1)) > 0).any(axis=1).all()


def test_initializer_kinds_have_the_documented_distribution():
  ids = np.arange(40_000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
  seed = name_seed("t", 0)
  u = initializers.init_rows(ids, 4, seed, "uniform", 0.3).astype(np.float64)
  assert u.min() >= -0.3 and u.max() < 0.3
  np.testing.assert_allclose(u.mean(), 0.0, atol=0.005)
  np.testing.assert_allclose(u.std(), 0.3 / np.sqrt(3), rtol=0.02)
  n = initializers.init_rows(ids, 4, seed, "normal", 0.2).astype(np.float64)
  np.testing.assert_allclose(n.mean(), 0.0, atol=0.003)
  np.testing.assert_allclose(n.std(), 0.2, rtol=0.02)
  # Fraction beyond 2 sigma of a normal is 4.55 %.
  np.testing.assert_allclose((np.abs(n) > 0.4).mean(), 0.0455, atol=0.004)
  np.testing.assert_array_equal(initializers.init_rows(ids, 4, seed, "zeros", 0.2), np.zeros((len(ids), 4)))
  with pytest.raises(ValueError):
    initializers.init_rows(ids, 4, seed, "bogus", 0.2)


@pytest.mark.parametrize("kind", ["uniform", "normal", "zeros"])
def test_init_rows_with_a_seed_per_id_makes_each_tables_own_rows(kind):
  """Rows of several tables in one call (a seed per id) equal each table's own call, across blocks."""
  rng = np.random.default_rng(3)
  names = ["a", "b", "cat_07"]
  ids = [rng.integers(0, 2**63, n, dtype=np.uint64) for n in (5, 1, 70_000)]  # the last spans two blocks
  want = np.concatenate([initializers.init_rows(i, 8, name_seed(t, 4), kind, 0.1) for t, i in zip(names, ids)])
  seeds = np.concatenate([np.full(i.shape[0], name_seed(t, 4), np.uint64) for t, i in zip(names, ids)])
  got = initializers.init_rows(np.concatenate(ids), 8, seeds, kind, 0.1)
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="2 seeds for 3 ids"):
    initializers.init_rows(ids[0][:3], 8, seeds[:2], kind, 0.1)


@pytest.mark.parametrize("dim", [1, 7, 64])
def test_uniform_rows_are_the_numpy_formulas_bits(dim):
  """'uniform' rows come from one compiled pass; they must be, bit for bit, the numpy formula the
  rows of every checkpoint and served model were made with: (2 u - 1) * scale in float64 with
  u = uniform01(splitmix64(splitmix64(id ^ seed) ^ (j + 1) * C)), rounded to float32 (the ids at
  the uint64 edges, one seed for all and one seed per id)."""
  rng = np.random.default_rng(dim)
  ids = rng.integers(0, U64_MAX, 3000, dtype=np.uint64, endpoint=True)
  ids[:3] = np.array([0, 2**63, U64_MAX], np.uint64)
  for seed in (name_seed("t", 1), rng.integers(0, U64_MAX, 3000, dtype=np.uint64, endpoint=True)):
    for scale in (0.05, 0.3, 1e-3):
      base = splitmix64(ids ^ seed)
      cols = np.arange(1, dim + 1, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
      u = uniform01(splitmix64(base[:, None] ^ cols[None, :]))
      want = ((2.0 * u - 1.0) * scale).astype(np.float32)
      np.testing.assert_array_equal(initializers.init_rows(ids, dim, seed, "uniform", scale), want)


def test_lookup_without_create_reads_init_and_does_not_grow():
  rng = np.random.default_rng(8)
  specs = _specs("adagrad")
  ps = ParameterServer(specs, seed=0)
  # On an empty table.
  ids = _id_pool(rng, 20)
  np.testing.assert_array_equal(ps.lookup("user", ids, create=False), _init("user", ids, 8, 0))
  assert ps.stats()["user"]["rows"] == 0
  # After training some ids: known ids read their trained value, unknown ones their init value.
  known = ids[:10]
  ps.lookup("user", known)
  ps.apply("user", known, rng.normal(size=(10, 8)).astype(np.float32))
  trained = ps.lookup("user", known)
  assert np.abs(trained - _init("user", known, 8, 0)).min() > 1e-3
  before = ps.stats()["user"]["rows"]
  mixed = np.concatenate([ids[5:], _id_pool(rng, 15)])
  rng.shuffle(mixed)
  out = ps.lookup("user", mixed, create=False)
  assert ps.stats()["user"]["rows"] == before == 10
  is_known = np.isin(mixed, known)
  assert is_known.any() and (~is_known).any()
  pos = {int(k): i for i, k in enumerate(known)}
  np.testing.assert_array_equal(out[is_known], trained[[pos[int(k)] for k in mixed[is_known]]])
  np.testing.assert_array_equal(out[~is_known], _init("user", mixed[~is_known], 8, 0))
  # The ids read without create still have no row to train.
  with pytest.raises(KeyError):
    ps.apply("user", mixed[~is_known][:2], np.zeros((2, 8), np.float32))
  # The returned rows are copies: writing into them changes nothing.
  out[:] = 123.0
  np.testing.assert_array_equal(ps.lookup("user", known), trained)


def test_snapshot_restore_round_trip_and_continued_training():
  rng = np.random.default_rng(9)
  specs = _specs("adagrad")
  ps1 = ParameterServer(specs, seed=4)
  pools = {"user": _id_pool(rng, 200), "item": _id_pool(rng, 30)}
  for _ in range(5):
    _train_step(rng, ps1, [], specs, pools, batch=64)
  snap = ps1.snapshot()
  ps2 = ParameterServer(specs, seed=4)
  ps2.lookup("user", _id_pool(rng, 50))  # state that the restore must drop
  ps2.restore(snap)
  snap2 = ps2.snapshot()
  assert set(snap2) == set(snap) == {"user", "item"}
  for name in snap:
    assert set(snap2[name]) == set(snap[name]) == {"ids", "weights", "slot_acc"}
    for key in snap[name]:
      np.testing.assert_array_equal(snap2[name][key], snap[name][key])
    ids = snap[name]["ids"]
    np.testing.assert_array_equal(ps2.lookup(name, ids), ps1.lookup(name, ids))
    assert ps2.stats()[name]["rows"] == ps1.stats()[name]["rows"] == len(ids)
  # Training both further (with new ids too) keeps them identical; the slots carried over.
  pools = {k: np.concatenate([v, _id_pool(rng, 20)]) for k, v in pools.items()}
  frozen = {n: {k: v.copy() for k, v in t.items()} for n, t in snap.items()}
  for step in range(5):
    step_rng = np.random.default_rng([10, step])
    _train_step(step_rng, ps1, [], specs, pools, batch=64)
    step_rng = np.random.default_rng([10, step])
    _train_step(step_rng, ps2, [], specs, pools, batch=64)
  s1, s2 = ps1.snapshot(), ps2.snapshot()
  for name in s1:
    for key in s1[name]:
      np.testing.assert_array_equal(s1[name][key], s2[name][key])
  # A snapshot is a copy: later training did not change it.
  for name in snap:
    for key in snap[name]:
      np.testing.assert_array_equal(snap[name][key], frozen[name][key])
  assert not np.array_equal(s1["user"]["weights"][: len(snap["user"]["ids"])], snap["user"]["weights"])


def test_restore_with_fresh_slots_would_differ():
  """Guards the test above: dropping the Adagrad slots changes the next update."""
  specs = _specs("adagrad")
  ps1 = ParameterServer(specs, seed=0)
  ids = np.array([1, 2**64 - 1], np.uint64)
  ps1.lookup("user", ids)
  g = np.ones((2, 8), np.float32)
  ps1.apply("user", ids, g)
  snap = ps1.snapshot()
  np.testing.assert_allclose(snap["user"]["slot_acc"], 1.0)
  snap["user"]["slot_acc"] = np.zeros_like(snap["user"]["slot_acc"])
  ps2 = ParameterServer(specs, seed=0)
  ps2.restore(snap)
  ps1.apply("user", ids, g)
  ps2.apply("user", ids, g)
  assert not np.allclose(ps1.lookup("user", ids), ps2.lookup("user", ids))


def test_restore_missing_table_starts_empty_and_unknown_table_is_rejected():
  specs = _specs("adagrad")
  ps = ParameterServer(specs, seed=0)
  ids = np.array([3, 4, 5], np.uint64)
  ps.lookup("user", ids)
  ps.lookup("item", ids)
  snap = ps.snapshot()
  del snap["item"]
  ps.restore(snap)
  assert ps.stats()["item"]["rows"] == 0
  assert ps.stats()["user"]["rows"] == 3
  with pytest.raises(ValueError):
    ps.restore({**ps.snapshot(), "ghost": snap["user"]})


def test_errors():
  specs = _specs("adagrad")
  ps = ParameterServer(specs, seed=0)
  ids = np.array([7, 8, 2**63 + 9], np.uint64)
  ps.lookup("user", ids)
  before = ps.lookup("user", ids)
  with pytest.raises(KeyError):
    ps.apply("user", np.array([7, 99], np.uint64), np.zeros((2, 8), np.float32))
  # A rejected apply changes nothing, not even for the ids that do exist.
  np.testing.assert_array_equal(ps.lookup("user", ids), before)
  with pytest.raises(ValueError):
    ps.apply("user", ids, np.zeros((3, 7), np.float32))
  with pytest.raises(ValueError):
    ps.apply("user", ids, np.zeros((2, 8), np.float32))
  np.testing.assert_array_equal(ps.lookup("user", ids), before)
  with pytest.raises(KeyError, match="nope"):
    ps.lookup("nope", ids)
  with pytest.raises(KeyError, match="nope"):
    ps.apply("nope", ids, np.zeros((3, 8), np.float32))
  with pytest.raises(ValueError):
    ParameterServer([TableSpec(name="x", dim=2, optimizer="adamw")])


@pytest.mark.parametrize("num_shards", [1, 2])
@pytest.mark.parametrize("bad", [np.array([3, -1], np.int64), np.array([3.0, 1.5]), np.array([True, False])])
def test_ids_that_are_not_non_negative_integers_are_refused(num_shards, bad):
  """numpy would cast -1 to 2**64 - 1 and 1.5 to 1 and the PS would create rows for them."""
  ps = ParameterServer(
    [TableSpec(name="t", dim=4, optimizer="sgd", optimizer_kwargs=(("learning_rate", 0.1),))], num_shards
  )
  with pytest.raises(ValueError, match="table 't'"):
    ps.lookup_many({"t": bad})
  with pytest.raises(ValueError, match="table 't'"):
    ps.apply_many({"t": (bad, np.ones((2, 4), np.float32))})
  assert ps.stats()["t"]["rows"] == 0
  ok = ps.lookup_many({"t": np.array([3, 4], np.int64)})["t"]  # non-negative signed ids are fine
  np.testing.assert_array_equal(ok, ps.lookup_many({"t": np.array([3, 4], np.uint64)})["t"])
  ps.close()


def _snapshot_bytes(ps):
  """Every array of every table (weights in storage precision, slots, counters), as bytes."""
  return {
    (t, k): np.ascontiguousarray(v[np.argsort(arrays["ids"], kind="stable")] if k != "deleted" else v).tobytes()
    for t, arrays in ps.snapshot().items()
    for k, v in arrays.items()
  }


@pytest.mark.parametrize("num_shards", [1, 2])
@pytest.mark.parametrize("storage_dtype", ["float32", "bfloat16"])
def test_repeated_ids_in_an_apply_are_refused_and_change_nothing(num_shards, storage_dtype):
  """A repeated id would be updated twice (float32) or keep only its last update (bfloat16), as the
  server refuses it: one ValueError naming the table and the id, and no table changes, not even
  a table of the same request that had no repeat (every table is checked before any changes)."""
  kw = (("learning_rate", 0.5), ("initial_accumulator_value", 0.1))
  specs = [
    TableSpec(name=n, dim=4, optimizer="adagrad", optimizer_kwargs=kw, storage_dtype=storage_dtype)
    for n in ("item", "user")
  ]
  ps = ParameterServer(specs, num_shards=num_shards, seed=3)
  ids = np.array([5, 11, 2**63 + 7, 40], np.uint64)
  ps.lookup_many({"item": ids, "user": ids}, step=0)
  before = _snapshot_bytes(ps)
  g = np.ones((5, 4), np.float32)
  repeated = np.array([5, 2**63 + 7, 11, 2**63 + 7, 40], np.uint64)
  with pytest.raises(ValueError, match=r"^table 'user': ids are not distinct \(e\.g\. 9223372036854775815\)$"):
    ps.apply_many({"item": (ids, g[:4]), "user": (repeated, g)})
  assert _snapshot_bytes(ps) == before
  # The table itself refuses too (its callers need not be the PS), changing nothing.
  table = ps.shards[ps.shard_of("user", [5])[0]]["user"]
  with pytest.raises(ValueError, match=r"table 'user': ids are not distinct \(e\.g\. 5\)"):
    table.apply(np.array([5, 5], np.uint64), g[:2])
  assert _snapshot_bytes(ps) == before
  assert all(s["applied_rows"] == 0 for shard in ps.shards for s in [shard["user"].counters])
  # The same request without the repeat is applied: the refusal was about the repeat only.
  ps.apply_many({"item": (ids, g[:4]), "user": (ids, g[:4])})
  assert _snapshot_bytes(ps) != before
  ps.close()


@pytest.mark.slow  # about 17 s: a million stats calls racing row creation
def test_stats_while_another_thread_creates_rows():
  """The training loop logs PS stats while the prefetcher's lookups create rows: a stats call
  must never see the id map in the middle of growing (its slots are briefly None). Without the
  table's lock in stats this failed within 1M calls in each of 4 runs."""
  import threading

  from recsys_jax.async_ps.store.table import Table

  table = Table(TableSpec(name="t", dim=4))
  done, errors = threading.Event(), []

  def create():
    try:
      for start in range(0, 3_000_000, 1000):  # 12 doublings of the id map
        table.lookup(np.arange(start, start + 1000, dtype=np.uint64) * 7919 + 1, create=True)
    finally:
      done.set()

  thread = threading.Thread(target=create)
  thread.start()
  while not done.is_set():
    try:
      table.stats()
    except Exception as e:  # noqa: BLE001 - collected, the assertion names it
      errors.append(repr(e))
      break
  thread.join()
  assert not errors
  assert table.stats()["rows"] == 3_000_000


def test_a_negative_step_is_refused_naming_it_and_changes_nothing():
  """Steps count from 0 (a row's last step, expiry and the staleness wait read them): a lookup or
  push of step -5 is a caller's mistake, refused before any table is touched."""
  ps = ParameterServer([TableSpec(name="t", dim=4)], seed=0)
  ids = np.arange(3, dtype=np.uint64)
  with pytest.raises(ValueError, match=r"step -5 is negative"):
    ps.lookup_many({"t": ids}, True, -5)
  with pytest.raises(ValueError, match=r"step -5 is negative"):
    ps.apply_many({"t": (ids, np.ones((3, 4), np.float32))}, -5)
  assert ps.stats()["t"]["rows"] == 0
  ps.lookup_many({"t": ids}, True, 0)  # step 0 is a step
  assert ps.stats()["t"]["rows"] == 3


def test_a_push_with_the_looked_up_ids_uses_the_lookups_rows_and_matches_the_reference():
  """A training lookup's rows are kept for its step's push when the push comes with the very ids
  array looked up (the trainer's way: no second probe of the id map). Against the float64
  reference, with two steps in flight (lookups of t and t + 1 before the push of t), a push with
  the ids in another order (another array: looked up again), a restore between a lookup and its push (the kept
  rows are forgotten: the restored table numbers its rows anew), and a bounded table (nothing
  kept: its rows move)."""
  rng = np.random.default_rng(12)
  specs = _specs("adagrad") + [TableSpec(name="bounded", dim=8, optimizer="adagrad", capacity=10_000)]
  ps, ref = ParameterServer(specs, seed=5), RefPS(specs, 5)
  pools = {"user": _id_pool(rng, 400), "item": _id_pool(rng, 50), "bounded": _id_pool(rng, 300)}

  def look(step):
    out = {}
    for s in specs:
      uniq = np.unique(rng.choice(pools[s.name], size=200))
      got = ps.lookup_many({s.name: uniq}, step=step)[s.name]
      np.testing.assert_allclose(got, ref.lookup(s.name, uniq), rtol=1e-5, atol=1e-6)
      out[s.name] = uniq
    return out

  def push(step, ids, permuted=False):
    for s in specs:
      i = ids[s.name][rng.permutation(ids[s.name].shape[0])] if permuted else ids[s.name]
      g = rng.normal(size=(i.shape[0], s.dim)).astype(np.float32)
      ps.apply_many({s.name: (i, g)}, step=step)
      ref.apply(s.name, i, g.astype(np.float64))

  table = ps.shards[0]["user"]
  pending = look(0)
  for step in range(1, 12):
    nxt = look(step)  # the lookup of step runs before the push of step - 1 (k = 1)
    assert step in table.looked_up and (step - 1 in table.looked_up) == (step != 6)  # 5's went with the restore
    assert not ps.shards[0]["bounded"].looked_up
    if step == 5:
      snap = ps.snapshot()
      ps.restore(snap)
      assert not table.looked_up  # the restored table's rows are numbered anew
    push(step - 1, pending, permuted=step == 8)  # other ids than those looked up: probed again
    assert (step - 1 in table.looked_up) == (step == 8)  # kept until more steps push it out
    pending = nxt
  push(11, pending)
  for s in specs:
    ids = np.array(sorted(ref.rows[s.name]), np.uint64)
    np.testing.assert_allclose(ps.lookup(s.name, ids), ref.lookup(s.name, ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_plain_tables_worked_together_equal_each_table_on_its_own(threads):
  """Plain tables (no bound, no tier, float32) are worked several at a time, their locks taken once
  and only their kernels per table (``Table.lookup_plain``, ``apply_plain``); the result, bit for
  bit, is each table's own ``lookup`` and ``apply``: rows, optimizer slots, the rows an incremental
  snapshot carries, counters, over steps that create rows, with every row optimizer, a clip, a
  bounded table beside them (per table), lookups without create, and in groups on 2 threads. A
  push with ids never looked up is refused and changes no table."""
  from recsys_jax.async_ps.optim import optimizers

  specs = [TableSpec(name=o, dim=8, optimizer=o) for o in optimizers.NAMES]
  specs += [
    TableSpec(name="clipped", dim=8, optimizer="adagrad", optimizer_kwargs=(("learning_rate", 0.5), ("clip", 0.02))),
    TableSpec(name="sgd_b", dim=4, optimizer="sgd", optimizer_kwargs=(("learning_rate", 0.2),)),
    TableSpec(name="bounded", dim=8, capacity=150),
  ]
  together = ParameterServer(specs, seed=2, threads=threads, min_rows=1)
  alone = ParameterServer(specs, seed=2, threads=1)
  assert together.shards[0]["adagrad"].plain and not together.shards[0]["bounded"].plain
  rng = np.random.default_rng(4)
  for step in range(6):
    ids = {s.name: np.unique(rng.integers(0, 400, 120)).astype(np.uint64) for s in specs}
    got = together.lookup_many(ids, create=True, step=step)
    for s in specs:
      want = alone.shards[0][s.name].lookup(ids[s.name], True, step)
      np.testing.assert_array_equal(got[s.name], want, err_msg=f"{s.name} step {step}")
    grads = {s.name: (ids[s.name], rng.normal(size=(ids[s.name].shape[0], s.dim)).astype(np.float32)) for s in specs}
    together.apply_many(grads, step=step)
    for s in specs:
      alone.shards[0][s.name].apply(*grads[s.name], step, distinct=True)
  probe = {s.name: np.arange(0, 500, 7, dtype=np.uint64) for s in specs}  # unseen ids too: their initial rows
  got = together.lookup_many(probe, create=False)
  for s in specs:
    np.testing.assert_array_equal(got[s.name], alone.shards[0][s.name].lookup(probe[s.name], False))
  together.snapshot(incremental=True), alone.snapshot(incremental=True)  # from here, changed rows only
  seen = {s.name: np.array(sorted(together.snapshot()[s.name]["ids"][::5]), np.uint64) for s in specs}
  together.lookup_many(seen, create=True, step=6)
  for s in specs:
    alone.shards[0][s.name].lookup(seen[s.name], True, 6)
  pushed = {s.name: (seen[s.name], np.full((seen[s.name].shape[0], s.dim), 0.01, np.float32)) for s in specs}
  together.apply_many(pushed, step=6)
  for s in specs:
    alone.shards[0][s.name].apply(*pushed[s.name], 6, distinct=True)
  inc_a, inc_b = together.snapshot(incremental=True), alone.snapshot(incremental=True)
  assert np.array_equal(np.sort(inc_a["adagrad"]["ids"]), seen["adagrad"])  # the pushed rows, no others
  for t in inc_a:
    assert inc_a[t].keys() == inc_b[t].keys()
    for k in inc_a[t]:
      np.testing.assert_array_equal(inc_a[t][k], inc_b[t][k], err_msg=f"incremental {t}/{k}")
  a, b = together.snapshot(), alone.snapshot()
  for t in a:
    for k in a[t]:
      np.testing.assert_array_equal(a[t][k], b[t][k], err_msg=f"{t}/{k}")
  for t, st in together.stats().items():
    other = alone.stats()[t]
    assert {k: st[k] for k in ("lookups", "hits", "misses", "created", "applied_rows")} == {
      k: other[k] for k in ("lookups", "hits", "misses", "created", "applied_rows")
    }, t
  before = together.snapshot()
  bad = {s.name: (np.array([1, 10**9], np.uint64), np.ones((2, s.dim), np.float32)) for s in specs[:3]}
  with pytest.raises(KeyError, match="never looked up"):
    together.apply_many(bad, step=7)
  after = together.snapshot()
  for t in before:
    for k in before[t]:
      np.testing.assert_array_equal(before[t][k], after[t][k], err_msg=f"{t}/{k}")
