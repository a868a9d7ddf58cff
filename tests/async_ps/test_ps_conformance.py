"""One suite, every parameter server: the in-process PS (3 shards), the in-process PS with a disk
tier small enough that rows spill, ``RemotePS`` over 2 real server processes, and (read-only)
the model server's ``SnapshotRows``; each is held to ``async_ps.protocol`` and compared, bit for
bit, with a 1-shard in-process PS (the reference) run through the same calls, and its row
optimizers with a float64 numpy reference. The read-ahead tests add ``RemotePS`` over 2 servers
whose tables spill to a disk tier."""

import dataclasses
import os

import numpy as np
import pytest

from recsys_jax.async_ps.optim import optimizers
from recsys_jax.async_ps.protocol import RowReader, RowStore
from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec
from recsys_jax.serving.rows.snapshot_rows import SnapshotRows, table_info
from tests.helpers.servers import ServerProcesses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = 11
SPECS = [
  TableSpec(name="sgd", dim=4, optimizer="sgd", optimizer_kwargs=(("learning_rate", 0.3),), initializer="normal"),
  TableSpec(
    name="item/adagrad",  # a '/' survives the wire's '<kind>/<table>' names and the snapshot's paths
    dim=8,
    optimizer="adagrad",
    optimizer_kwargs=(("learning_rate", 0.05), ("initial_accumulator_value", 0.1)),
  ),
  TableSpec(name="rowwise", dim=3, optimizer="rowwise_adagrad", optimizer_kwargs=(("learning_rate", 0.2),)),
  TableSpec(name="adam", dim=5, optimizer="adam", optimizer_kwargs=(("learning_rate", 0.01),), init_scale=0.5),
]
TIER_CAPACITY = 6  # rows in RAM per table: every sequence below looks up more, so rows spill
SMALL_SPECS = [dataclasses.replace(s, capacity=TIER_CAPACITY) for s in SPECS]
# Rows a table may hold staged by read_ahead_many (the default, a quarter of TIER_CAPACITY, is
# less than a step's misses, so nothing would be staged); a sequence below stages a few dozen.
READ_AHEAD_ROWS = 1000
KINDS = ["local", "local_one_shard", "tiered", "remote"]
TIERED = ("tiered", "remote_tiered")


def _reference() -> ParameterServer:
  return ParameterServer(SPECS, num_shards=1, seed=SEED, threads=1)


def _ids(rng, n, high=200):
  return np.unique(rng.integers(0, high, n).astype(np.uint64))


def _grads(rng, ids):
  dims = {s.name: s.dim for s in SPECS}
  return {t: (v, rng.normal(size=(v.shape[0], dims[t])).astype(np.float32)) for t, v in ids.items()}


def _train(ps, steps=4, seed=0, first_step=0):
  """Looks up and pushes random ids of every table at each step; returns every id touched."""
  rng = np.random.default_rng(seed)
  touched = {s.name: np.zeros(0, np.uint64) for s in SPECS}
  for step in range(first_step, first_step + steps):
    ids = {s.name: _ids(rng, 20) for s in SPECS}
    ps.lookup_many(ids, create=True, step=step)
    ps.apply_many(_grads(rng, ids), step=step)
    touched = {t: np.union1d(touched[t], ids[t]) for t in touched}
  return touched


def _export(ps, ids):
  return {t: (w.copy(), {k: v.copy() for k, v in s.items()}) for t, (w, s) in ps.export_rows_many(ids).items()}


def _assert_same(got, want):
  """Bit for bit: rows, or exports {table: (weights, slots)}."""
  assert set(got) == set(want)
  for t in want:
    if isinstance(want[t], tuple):
      np.testing.assert_array_equal(got[t][0], want[t][0], err_msg=f"{t} weights")
      assert set(got[t][1]) == set(want[t][1]), t
      for k in want[t][1]:
        np.testing.assert_array_equal(got[t][1][k], want[t][1][k], err_msg=f"{t} slot {k}")
    else:
      np.testing.assert_array_equal(got[t], want[t], err_msg=t)


# -- the implementations ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def remote_env(tmp_path_factory):
  """Two servers for the module, and an empty full snapshot that resets them between tests."""
  root = tmp_path_factory.mktemp("conformance")
  servers = ServerProcesses(root)
  addresses = [a for a, _ in servers.start(2, f"--snapshot_root={root}")]
  empty = str(root / "empty")
  blank = _reference()
  blank.save_snapshot(empty)
  blank.close()
  yield addresses, empty, root
  servers.close()


@pytest.fixture(scope="module")
def remote_tier_env(tmp_path_factory):
  """Two servers whose bounded tables spill to a disk tier (under their --snapshot_root), and an
  empty full snapshot that resets them, tier included, between tests."""
  root = tmp_path_factory.mktemp("conformance_tier")
  servers = ServerProcesses(root)
  addresses = [a for a, _ in servers.start(2, f"--snapshot_root={root}", f"--read_ahead_rows={READ_AHEAD_ROWS}")]
  empty = str(root / "empty")
  blank = ParameterServer(SMALL_SPECS, seed=SEED)
  blank.save_snapshot(empty)
  blank.close()
  yield addresses, empty, root
  servers.close()


def _new_store(kind, request, tier_path):
  """A fresh store of ``kind`` (a remote one: the servers restored to empty first, so only the
  newest remote store of a test holds its state)."""
  if kind == "local":
    return ParameterServer(SPECS, num_shards=3, seed=SEED, threads=2, min_rows=1)
  if kind == "local_one_shard":  # plain tables worked several at a time, resolved ahead (Table.plain)
    return ParameterServer(SPECS, seed=SEED, threads=2, min_rows=1)
  if kind == "tiered":
    tier = {"driver": "file", "path": str(tier_path)}
    return ParameterServer(SMALL_SPECS, seed=SEED, tier=tier, protect_steps=1, read_ahead_rows=READ_AHEAD_ROWS)
  from recsys_jax.async_ps.client.remote import RemotePS  # grpc only here

  if kind == "remote_tiered":
    addresses, empty, root = request.getfixturevalue("remote_tier_env")
    ps = RemotePS(addresses, SMALL_SPECS, seed=SEED, tier={"driver": "file", "path": str(root / "tier")})
  else:
    addresses, empty, _ = request.getfixturevalue("remote_env")
    ps = RemotePS(addresses, SPECS, seed=SEED)
  ps.load_snapshot([empty])
  return ps


@pytest.fixture(params=KINDS)
def make(request, tmp_path):
  """A factory of fresh stores of one kind."""
  yield from _factory(request, tmp_path)


@pytest.fixture(params=KINDS + ["remote_tiered"])
def make_any(request, tmp_path):
  """``make``, and RemotePS over servers with a disk tier as well."""
  yield from _factory(request, tmp_path)


def _factory(request, tmp_path):
  made = []

  def _make():
    made.append(_new_store(request.param, request, tmp_path / f"tier{len(made)}"))
    return made[-1]

  _make.kind = request.param
  yield _make
  for ps in made:
    ps.close()


@pytest.fixture
def snapdir(request, tmp_path):
  """A directory for snapshots the servers may write (under their --snapshot_root)."""
  if "remote" in request.node.callspec.params.get("make", ""):
    d = request.getfixturevalue("remote_env")[2] / request.node.name.replace("/", "_")
    d.mkdir()
    return d
  return tmp_path


# -- the interface ----------------------------------------------------------------------------
def test_implements_the_protocol(make):
  ps = make()
  assert isinstance(ps, RowStore) and isinstance(ps, RowReader)
  assert set(ps.specs) == {s.name for s in SPECS} and ps.num_shards >= 1


def test_new_rows_are_the_same_everywhere(make):
  """New ids read (create=False, nothing stored) and then created give the reference's rows bit
  for bit: a function of (table, id, seed) alone, whatever the shards, servers or tier."""
  ps, ref = make(), _reference()
  ids = {s.name: np.array([0, 1, 7, 2**40 + 3, 2**64 - 1], np.uint64) for s in SPECS}
  want = ref.lookup_many(ids, create=False)
  _assert_same(ps.lookup_many(ids, create=False), want)
  assert all(v["rows"] + v["tier_rows"] == 0 for v in ps.stats().values())  # a read creates nothing
  _assert_same(ps.lookup_many(ids, create=True, step=0), want)
  out = {s.name: np.full((5, s.dim), np.nan, np.float32) for s in SPECS}
  got = ps.lookup_many(ids, create=False, out=out)
  assert all(got[t] is out[t] for t in out)  # written into the caller's arrays
  _assert_same(got, want)
  _assert_same({"sgd": ps.lookup("sgd", ids["sgd"])}, {"sgd": want["sgd"]})


def _float64_update(name, kwargs, w, slots, g):
  """One row-optimizer step in float64 (the documented formulas, not the package's code)."""
  kw = dict(kwargs)
  lr, eps = kw["learning_rate"], kw.get("eps", 1e-8)
  if name == "sgd":
    return w - lr * g, slots
  if name == "adagrad":
    acc = slots["acc"] + g * g
    return w - lr * g / (np.sqrt(acc) + eps), {"acc": acc}
  if name == "rowwise_adagrad":
    acc = slots["acc"] + np.mean(g * g, axis=1, keepdims=True)
    return w - lr * g / (np.sqrt(acc) + eps), {"acc": acc}
  assert name == "adam"
  b1, b2 = kw.get("b1", 0.9), kw.get("b2", 0.999)
  t = slots["t"] + 1
  m = b1 * slots["m"] + (1 - b1) * g
  v = b2 * slots["v"] + (1 - b2) * g * g
  return w - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps), {"m": m, "v": v, "t": t}


def test_row_optimizers_match_a_float64_reference(make):
  """Three pushes to overlapping ids of every table (sgd, adagrad, row-wise adagrad, adam):
  rows and slots as float64 numpy computes them from the initial rows, to float32 accuracy."""
  ps = make()
  rng = np.random.default_rng(1)
  every = {s.name: np.arange(30, dtype=np.uint64) * 7 for s in SPECS}
  w0 = ps.lookup_many(every, create=False)
  ref = {}
  for s in SPECS:
    slots = optimizers.make(s.optimizer, **dict(s.optimizer_kwargs)).init(30, s.dim)
    ref[s.name] = (w0[s.name].astype(np.float64), {k: v.astype(np.float64) for k, v in slots.items()})
  for step in range(3):
    pick = {t: np.sort(rng.choice(30, 20, replace=False)) for t in every}
    ids = {t: every[t][p] for t, p in pick.items()}
    ps.lookup_many(ids, create=True, step=step)  # the tiered store spills the rest
    grads = _grads(rng, ids)
    ps.apply_many(grads, step=step)
    for s in SPECS:
      w, slots = ref[s.name]
      p = pick[s.name]
      nw, ns = _float64_update(
        s.optimizer, s.optimizer_kwargs, w[p], {k: v[p] for k, v in slots.items()}, grads[s.name][1].astype(np.float64)
      )
      w[p] = nw
      for k in slots:
        slots[k][p] = ns[k]
  got = ps.export_rows_many(every)
  for s in SPECS:
    w, slots = got[s.name]
    np.testing.assert_allclose(w, ref[s.name][0], rtol=1e-5, atol=1e-6, err_msg=s.name)
    for k, v in ref[s.name][1].items():
      np.testing.assert_allclose(slots[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{s.name} slot {k}")
  if make.kind == "tiered":
    assert all(v["tier_rows"] > 0 for v in ps.stats().values())  # rows did spill and come back


def test_a_training_sequence_gives_the_reference_rows_and_slots(make):
  """The same lookups and pushes on this store and on the 1-shard in-process reference leave
  every row and slot equal, bit for bit (no implementation rounds, reorders a sum or loses a
  slot on its way), and the same row counts."""
  ps, ref = make(), _reference()
  start = ps.stats()  # a remote store's servers count since they started: compare what this adds
  touched = _train(ps)
  _train(ref)
  _assert_same(_export(ps, touched), _export(ref, touched))
  _assert_same(ps.lookup_many(touched, create=False), ref.lookup_many(touched, create=False))
  got, want = ps.stats(), ref.stats()
  for t in want:
    assert got[t]["rows"] + got[t]["tier_rows"] == want[t]["rows"] == touched[t].shape[0], t
    assert {"rows", "tier_rows", "bytes", "lookups", "hits", "hit_rate", "lookup_ms", "apply_ms"} <= set(got[t])
    counted = {k: got[t][k] - start[t][k] for k in ("lookups", "created", "applied_rows")}
    assert counted == {k: want[t][k] for k in counted}, t
    if make.kind == "tiered":  # rows went to the tier and came back from it
      assert got[t]["spilled"] > 0 and got[t]["tier_reads"] > 0, got[t]
    else:
      assert got[t]["hits"] - start[t]["hits"] == want[t]["hits"], t


def test_snapshot_then_load_into_a_fresh_store_gives_the_same_rows_and_slots(make, snapdir):
  """A full snapshot, more training, an incremental one: the chain loaded into a fresh store of
  the same kind, and into an in-process PS of another shard count, reads back bit for bit."""
  ps = make()
  touched = _train(ps, steps=2)
  full, incr = str(snapdir / "full"), str(snapdir / "incr")
  rows = ps.save_snapshot(full, meta={"note": "conformance"}, step=2)
  assert rows == {t: touched[t].shape[0] for t in touched}
  more = _train(ps, steps=2, seed=5, first_step=2)
  touched = {t: np.union1d(touched[t], more[t]) for t in touched}
  ps.save_snapshot(incr, incremental=True, step=4)
  want = _export(ps, touched)
  with pytest.raises(FileExistsError):
    ps.save_snapshot(full, step=4)
  fresh = make()
  fresh.load_snapshot([full, incr], step=4)
  _assert_same(_export(fresh, touched), want)
  assert {t: v["rows"] + v["tier_rows"] for t, v in fresh.stats().items()} == {
    t: v.shape[0] for t, v in touched.items()
  }
  other = ParameterServer(SPECS, num_shards=2, seed=SEED)
  other.load_snapshot([full, incr])
  _assert_same(_export(other, touched), want)
  other.close()


def test_export_import_round_trip(make):
  """Rows and slots exported from a trained store and imported into a fresh one (with ids it has
  never seen and ids it already holds) export back bit for bit, and read as those rows."""
  ps = make()
  touched = _train(ps, steps=2)
  want = _export(ps, touched)
  fresh = make()
  fresh.lookup_many({t: v[::2] for t, v in touched.items()}, create=True, step=0)  # some exist already
  fresh.import_rows_many({t: (touched[t], w, s) for t, (w, s) in want.items()})
  _assert_same(_export(fresh, touched), want)
  _assert_same(fresh.lookup_many(touched, create=False), {t: w for t, (w, _) in want.items()})
  unseen = {t: np.array([10**9], np.uint64) for t in touched}  # an id without a row: its initial row, fresh slots
  got = fresh.export_rows_many(unseen)
  ref = _reference()
  _assert_same(got, _export(ref, unseen))


def _rows(ps):
  ids = {s.name: np.arange(40, dtype=np.uint64) for s in SPECS}
  return _export(ps, ids)


def test_a_push_with_a_repeated_id_is_refused_and_changes_nothing(make):
  """A repeated id in one push raises ValueError naming the table and the id, in the caller's
  process, and no table of the push (not even another one, on another shard or server) changes."""
  ps = make()
  ps.lookup_many({s.name: np.arange(40, dtype=np.uint64) for s in SPECS}, create=True, step=0)
  before = _rows(ps)
  grads = _grads(np.random.default_rng(3), {s.name: np.arange(0, 40, 3, dtype=np.uint64) for s in SPECS})
  ids, g = grads["adam"]
  grads["adam"] = (np.concatenate([ids, ids[2:3]]), np.concatenate([g, g[:1]]))
  with pytest.raises(ValueError, match=r"adam.*\b6\b"):
    ps.apply_many(grads, step=1)
  _assert_same(_rows(ps), before)


@pytest.mark.parametrize(
  "call, error, words",
  [
    (lambda ps: ps.lookup_many({"ghost": np.arange(3)}, create=True), KeyError, ["ghost"]),
    (lambda ps: ps.apply("ghost", np.arange(3), np.zeros((3, 4), np.float32)), KeyError, ["ghost"]),
    (lambda ps: ps.export_rows_many({"ghost": np.arange(3)}), KeyError, ["ghost"]),
    (lambda ps: ps.apply("sgd", np.arange(3), np.zeros((3, 5), np.float32)), ValueError, ["sgd", "(3, 5)", "(3, 4)"]),
    (lambda ps: ps.lookup_many({"sgd": np.array([1, -2])}, create=True), ValueError, ["sgd"]),
    (lambda ps: ps.lookup_many({"sgd": np.array([1.5])}, create=True), ValueError, ["sgd"]),
    (lambda ps: ps.export_rows_many({"sgd": np.array([4, 4], np.uint64)}), ValueError, ["sgd", "4"]),
    (
      lambda ps: ps.import_rows_many({"adam": (np.arange(2), np.zeros((2, 5), np.float32), {})}),
      ValueError,
      ["adam", "slot"],
    ),
    (
      lambda ps: ps.import_rows_many({"sgd": (np.arange(2), np.zeros((2, 3), np.float32), {})}),
      ValueError,
      ["sgd", "(2, 3)"],
    ),
    (
      lambda ps: ps.lookup_many({"sgd": np.arange(2)}, out={"sgd": np.zeros((2, 3), np.float32)}),
      ValueError,
      ["sgd"],
    ),
  ],
  ids=[
    "lookup-unknown-table",
    "apply-unknown-table",
    "export-unknown-table",
    "apply-wrong-dim",
    "negative-id",
    "float-id",
    "export-repeated-id",
    "import-missing-slot",
    "import-wrong-dim",
    "out-wrong-shape",
  ],
)
def test_bad_input_is_refused_naming_what_is_wrong(make, call, error, words):
  ps = make()
  ps.lookup_many({s.name: np.arange(10, dtype=np.uint64) for s in SPECS}, create=True, step=0)
  before = _rows(ps)
  with pytest.raises(error) as e:
    call(ps)
  text = str(e.value)
  assert all(w in text for w in words), text
  assert "\n" not in text.strip(), text  # one line
  _assert_same(_rows(ps), before)


def test_loading_what_is_no_snapshot_names_the_directory(make, snapdir):
  ps = make()
  missing = str(snapdir / "nothing-here")
  with pytest.raises((ValueError, FileNotFoundError), match="nothing-here"):
    ps.load_snapshot([missing])


# -- read-ahead ---------------------------------------------------------------------------------
AHEAD = 2  # steps ahead the ids of a step are read: each step's lookup and push fall in between
# Counters a read-ahead must leave as they are. (It moves rows into RAM early and pins them, so
# hits, tier reads and evictions change; the rows' values do not.)
_SAME_COUNTERS = ("lookups", "created", "applied_rows", "dropped_grads")


def _sequence(steps=8, seed=0):
  """The ids and gradients of ``steps`` steps (20 of 200 ids per table: rows come back from the tier,
  and some are looked up again, evicted and spilled anew between their read-ahead and their step)."""
  rng = np.random.default_rng(seed)
  ids = [{s.name: _ids(rng, 20) for s in SPECS} for _ in range(steps)]
  return ids, [_grads(rng, i) for i in ids]


def _run(ps, ids, grads, ahead=None):
  """Looks up and pushes every step; ``ahead``: first reads ahead steps ahead, ..., 1, 0 (the first
  step a store hears of is a later one than its first lookup's), then at each step t > 0 the ids of
  step t + ahead, before t's lookup. An in-process store waits for its read-aheads (so they run
  before their lookups); a remote one's run on the servers when they do. Returns the rows each
  lookup read, the ids handed to read-aheads and the counters this run added."""
  start = ps.stats()  # a remote store's servers count since they started
  wait = getattr(ps, "wait_read_ahead", lambda: None)
  looked, staged = [], 0
  if ahead is not None:
    for t in range(ahead, -1, -1):
      staged += ps.read_ahead_many(ids[t], t)
    wait()
  for t in range(len(ids)):
    if ahead is not None and 0 < t < len(ids) - ahead:
      staged += ps.read_ahead_many(ids[t + ahead], t + ahead)
      wait()
    looked.append({k: v.copy() for k, v in ps.lookup_many(ids[t], create=True, step=t).items()})
    ps.apply_many(grads[t], step=t)
  end = ps.stats()
  keys = _SAME_COUNTERS + ("tier_reads", "read_ahead_rows", "read_ahead_hits")
  return looked, staged, {t: {k: end[t][k] - start[t][k] for k in keys} for t in end}


def test_reading_ahead_changes_no_row(make_any):
  """The same steps with and without read_ahead_many (ids read ``AHEAD`` steps before their lookup)
  read the same rows at every lookup and leave the same rows and slots, bit for bit, equal to the
  RAM-only reference's, with as many lookups, rows created and pushed. With a tier every id of a
  read-ahead is handed to the tables (the count returned), and in process, where the test waits
  for them, rows really came to RAM ahead (``read_ahead_rows``) and lookups found them there
  (``read_ahead_hits``); without a tier nothing is read ahead."""
  ids, grads = _sequence()
  touched = {t: np.unique(np.concatenate([i[t] for i in ids])) for t in ids[0]}
  ref = _reference()
  want, _, _ = _run(ref, ids, grads)
  want_rows = _export(ref, touched)
  plain = make_any()
  got, staged, plain_counts = _run(plain, ids, grads)
  assert staged == 0
  for t in range(len(ids)):
    _assert_same(got[t], want[t])
  _assert_same(_export(plain, touched), want_rows)
  ahead = make_any()  # a remote store: the same servers, emptied
  got, staged, counts = _run(ahead, ids, grads, AHEAD)
  for t in range(len(ids)):
    _assert_same(got[t], want[t])
  _assert_same(_export(ahead, touched), want_rows)
  for t, c in counts.items():
    assert {k: c[k] for k in _SAME_COUNTERS} == {k: plain_counts[t][k] for k in _SAME_COUNTERS}, t
  if make_any.kind in TIERED:
    handed = sum(ids[t][k].shape[0] for t in range(len(ids)) for k in ids[t])
    assert staged == handed, (staged, handed)
    assert all(c["tier_reads"] > 0 for c in counts.values()), counts  # rows did come back from the tier
    if make_any.kind == "tiered":
      for t, c in counts.items():
        assert c["read_ahead_rows"] > 0 and c["read_ahead_hits"] > 0, (t, c)
        assert c["tier_reads"] - c["read_ahead_rows"] < plain_counts[t]["tier_reads"], (t, c, plain_counts[t])
  else:
    assert staged == 0 and all(c["read_ahead_rows"] == c["read_ahead_hits"] == 0 for c in counts.values())


def test_resolving_ahead_of_the_push_before_changes_no_row(make_any):
  """The trainer's order at k = 0 with ``resolve_many``: step t + 1's ids resolved before step t's
  push, then step t's push, then step t + 1's lookup (the same arrays). Every lookup reads the
  reference's rows and the store ends with its rows and slots, bit for bit, with as many lookups,
  rows created and pushed; in process, the plain tables' ids were resolved ahead, a remote store
  resolves nothing (0). Bad input is refused as a lookup refuses it."""
  ids, grads = _sequence()
  touched = {t: np.unique(np.concatenate([i[t] for i in ids])) for t in ids[0]}
  ref = _reference()
  want, _, _ = _run(ref, ids, grads)
  ps = make_any()
  start = ps.stats()
  resolved = ps.resolve_many(ids[0], 0)
  got = []
  for t in range(len(ids)):
    got.append({k: v.copy() for k, v in ps.lookup_many(ids[t], create=True, step=t).items()})
    if t + 1 < len(ids):
      resolved += ps.resolve_many(ids[t + 1], t + 1)  # before step t's push, as a trainer does
    ps.apply_many(grads[t], step=t)
  for t in range(len(ids)):
    _assert_same(got[t], want[t])
  _assert_same(_export(ps, touched), _export(ref, touched))
  end, ref_counts = ps.stats(), ref.stats()
  for t in end:
    assert {k: end[t][k] - start[t][k] for k in _SAME_COUNTERS} == {k: ref_counts[t][k] for k in _SAME_COUNTERS}, t
  plain = [t for t in SPECS if not (t.capacity or t.expire_after or t.admit_after > 1 or t.admit_probability < 1.0)]
  if make_any.kind == "local_one_shard":
    assert resolved == sum(i[t.name].shape[0] for i in ids for t in plain if t.storage_dtype == "float32"), resolved
  else:  # several shards, a tier on every table, or the servers: the lookups do it all
    assert resolved == 0
  with pytest.raises(KeyError, match="ghost"):
    ps.resolve_many({"ghost": np.arange(3)}, 1)
  with pytest.raises(ValueError, match="non-negative"):
    ps.resolve_many({SPECS[0].name: np.array([1, -2])}, 1)


@pytest.mark.parametrize(
  "call, error, words",
  [
    (lambda ps: ps.read_ahead_many({"ghost": np.arange(3)}, 1), KeyError, ["ghost"]),
    (lambda ps: ps.read_ahead_many({"sgd": np.arange(3)}, -1), ValueError, ["step -1", "negative"]),
    (lambda ps: ps.read_ahead_many({"adam": np.array([1, -2])}, 1), ValueError, ["adam", "non-negative"]),
    (lambda ps: ps.read_ahead_many({"adam": np.array([1.5])}, 1), ValueError, ["adam", "float"]),
  ],
  ids=["unknown-table", "negative-step", "negative-id", "float-id"],
)
def test_read_ahead_refuses_bad_input_as_a_lookup_does(make_any, call, error, words):
  """Refused in the caller's process, in one line naming what is wrong, and nothing changes."""
  ps = make_any()
  _train(ps, steps=2)
  before = _rows(ps)
  with pytest.raises(error) as e:
    call(ps)
  text = str(e.value)
  assert all(w in text for w in words), text
  assert "\n" not in text.strip(), text
  _assert_same(_rows(ps), before)


def test_the_servers_refuse_a_bad_read_ahead_and_keep_serving(request):
  """What the client refuses before sending reaches a server only from another client: a server
  refuses it with INVALID_ARGUMENT naming what is wrong (as it refuses such a lookup), changes
  nothing, and serves the next read-ahead and lookup."""
  from recsys_jax.async_ps.client.remote import RemotePSError
  from recsys_jax.async_ps.client.transport import Transport

  ps = _new_store("remote_tiered", request, None)
  try:
    _train(ps, steps=3)
    before = _rows(ps)
    raw = Transport(ps.addresses, timeout_s=10)
    ids = np.arange(5, dtype=np.uint64)
    cases = [
      ({"step": 4}, {"ids/ghost": ids}, "unknown table 'ghost'"),
      ({"step": -1}, {"ids/sgd": ids}, "step -1 is negative"),
      ({"step": 2**62}, {"ids/sgd": ids}, "outside [0, 2**62)"),
      ({}, {"ids/sgd": ids}, "needs the step"),
      ({"step": 4}, {"ids/sgd": ids.astype(np.float32)}, "1-D uint64"),
      ({"step": 4}, {"ids/sgd": np.array([3, 3], np.uint64)}, "not distinct"),
      ({"step": 4}, {"grads/sgd": np.zeros((5, 4), np.float32)}, "unexpected array"),
    ]
    for fields, arrays, words in cases:
      with pytest.raises(RemotePSError, match="ReadAhead failed: INVALID_ARGUMENT") as e:
        raw.call(0, "ReadAhead", fields, arrays)
      assert words in str(e.value), (words, str(e.value))
    raw.close()
    _assert_same(_rows(ps), before)
    assert ps.read_ahead_many({"sgd": ids}, 3) >= 0 and all(h["ok"] for h in ps.health())
  finally:
    ps.close()


# -- read-only: the model server's rows as well -------------------------------------------------
@pytest.fixture(params=KINDS + ["serving"])
def reader(request, tmp_path):
  """A ``RowReader`` holding what ``_train`` left (serving: read from the reference's snapshot)."""
  if request.param == "serving":
    ref = _reference()
    _train(ref)
    ref.save_snapshot(str(tmp_path / "snap"))
    ref.close()
    tables = {s.name: table_info(s) for s in SPECS}
    yield SnapshotRows([str(tmp_path / "snap")], tables, SEED, cache_bytes=2 << 10)
    return
  ps = _new_store(request.param, request, tmp_path / "tier")
  _train(ps)
  yield ps
  ps.close()


def test_reader_implements_the_protocol(reader):
  assert isinstance(reader, RowReader)
  assert isinstance(reader, RowStore) == (not isinstance(reader, SnapshotRows))  # serving only reads


def test_reader_reads_the_reference_rows(reader):
  """Trained ids, and ids never seen (their initial rows), read as the reference reads them, bit
  for bit, twice (the serving reader's second read comes partly from its cache), in any order."""
  ref = _reference()
  touched = _train(ref)
  ids = {t: np.concatenate([v, np.array([10**6, 2**63], np.uint64)]) for t, v in touched.items()}
  want = ref.lookup_many(ids, create=False)
  _assert_same(reader.lookup_many(ids, create=False), want)
  back = {t: v[::-1].copy() for t, v in ids.items()}
  _assert_same(reader.lookup_many(back, create=False), {t: v[::-1] for t, v in want.items()})
  assert {t: v["rows"] + v["tier_rows"] for t, v in reader.stats().items()} == {
    t: v.shape[0] for t, v in touched.items()
  }


def test_reader_refuses_an_unknown_table(reader):
  with pytest.raises(KeyError, match="ghost"):
    reader.lookup_many({"ghost": np.arange(3, dtype=np.uint64)}, create=False)


_PARTIAL_PUSH = {
  "local": "a gradient for an id an unbounded table never looked up raises KeyError from its table "
  "shard after the push's other shards applied their parts (checking first would cost a second id "
  "search on every push)",
  "local_one_shard": "its plain tables are pushed in groups, one per thread: the group of the table "
  "with the unknown id refuses whole, and the other group has applied its part",
  "remote": "the server takes the push, then fails applying the step (FAILED_PRECONDITION, a "
  "RemotePSError, not KeyError), and the other server has applied its part",
}


def test_a_push_to_ids_never_looked_up_is_refused_and_changes_nothing(make, request):
  """Gradients for ids that have no row (never looked up with create): an unbounded table raises
  KeyError naming the table and such an id, and no row of the push changes; a bounded table (the
  tiered store's) drops them and counts them in ``dropped_grads`` (an evicted row's late gradient
  is expected there), applying the rest as the reference does."""
  if make.kind in _PARTIAL_PUSH:
    request.applymarker(pytest.mark.xfail(strict=True, reason=_PARTIAL_PUSH[make.kind]))
  ps, ref = make(), _reference()
  looked = {s.name: np.arange(40, dtype=np.uint64) for s in SPECS}
  ps.lookup_many(looked, create=True, step=0)
  ref.lookup_many(looked, create=True, step=0)
  before = _rows(ps)
  grads = _grads(np.random.default_rng(4), {s.name: np.arange(0, 40, 3, dtype=np.uint64) for s in SPECS})
  ids, g = grads["sgd"]
  bad = dict(grads, sgd=(np.concatenate([ids, [1000]]).astype(np.uint64), np.concatenate([g, g[:1]])))
  if make.kind == "tiered":
    ps.apply_many(bad, step=1)
    ref.apply_many(grads, step=1)
    assert ps.stats()["sgd"]["dropped_grads"] == 1
    _assert_same(_rows(ps), _rows(ref))
    return
  with pytest.raises(KeyError, match=r"sgd.*1000"):
    ps.apply_many(bad, step=1)
  _assert_same(_rows(ps), before)
