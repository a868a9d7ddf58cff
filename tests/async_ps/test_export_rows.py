"""Rows with their optimizer slots out of the PS and back (issue 15: hot rows on the device).

``export_rows`` / ``import_rows`` of a table, ``export_rows_many`` / ``import_rows_many`` of the
in-process PS over two shards and of RemotePS over two server processes; each compared with a
reference: the rows and slots of a snapshot of the same table (a separate code path), what a
read-only lookup and ``opt.init`` give, ``optimizers.make(...).update`` on the same values, or
an in-process PS fed the same calls.
"""

import threading

import grpc
import ml_dtypes
import numpy as np
import pytest

from recsys_jax.async_ps import wire
from recsys_jax.async_ps.client.remote import RemotePS, RemotePSError
from recsys_jax.async_ps.optim import optimizers
from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.async_ps.store.table import Table
from recsys_jax.embeddings.specs import TableSpec

KWARGS = {
  "sgd": (("learning_rate", 0.1),),
  "adagrad": (("learning_rate", 0.1), ("initial_accumulator_value", 0.1)),
  "rowwise_adagrad": (("learning_rate", 0.1),),
  "adam": (("learning_rate", 0.01),),
  "ftrl": (("learning_rate", 0.1), ("l1", 0.001), ("learning_rate_power", -0.6)),
}
BF16 = ml_dtypes.bfloat16


def _spec(optimizer="adagrad", name="t", dim=5, **kw):
  return TableSpec(
    name=name, dim=dim, optimizer=optimizer, optimizer_kwargs=KWARGS[optimizer], initializer="normal",
    init_scale=0.1, **kw,
  )  # fmt: skip


def _opt(spec):
  return optimizers.make(spec.optimizer, **dict(spec.optimizer_kwargs))


@pytest.fixture
def make_ps():
  made = []

  def make(*args, **kwargs):
    made.append(ParameterServer(*args, **kwargs))
    return made[-1]

  yield make
  for ps in made:
    ps.close()


def _train(ps, rng, steps, high=400, start=0):
  """Trainer-like steps (lookup, then a random gradient) on every table; returns the ids used."""
  seen = {t: [] for t in ps.specs}
  for step in range(start, start + steps):
    ids = {t: np.unique(rng.integers(0, high, 120)).astype(np.uint64) for t in ps.specs}
    ps.lookup_many(ids, True, step)
    ps.apply_many(
      {t: (v, rng.normal(size=(v.shape[0], ps.specs[t].dim)).astype(np.float32)) for t, v in ids.items()}, step
    )
    for t, v in ids.items():
      seen[t].append(v)
  return {t: np.unique(np.concatenate(v)) for t, v in seen.items()}


def _from_snapshot(snap, ids):
  """The weights and slots of ids (all present) in a snapshot of one table, in the order of ids."""
  pos = {int(i): k for k, i in enumerate(snap["ids"])}
  assert len(pos) == snap["ids"].shape[0], "a snapshot holds each id once"
  at = np.array([pos[int(i)] for i in ids], np.int64)
  return snap["weights"][at], {k[len("slot_") :]: v[at] for k, v in snap.items() if k.startswith("slot_")}


def _counters(stats):
  """A table's stats but the times (mean latencies, the time lookups waited on the tier) and the
  hit rate (nan before any lookup)."""
  return {k: v for k, v in stats.items() if k not in ("lookup_ms", "apply_ms", "hit_rate", "tier_wait_s", "evict_s")}


def _equal(a, b, rtol=0.0):
  """(weights, slots) pairs equal, to rtol."""
  np.testing.assert_allclose(a[0], b[0], rtol=rtol, atol=0)
  assert set(a[1]) == set(b[1])
  for k in a[1]:
    np.testing.assert_allclose(a[1][k], b[1][k], rtol=rtol, atol=0, err_msg=k)


def _random_rows(rng, spec, n):
  """Weights and (non-negative, as accumulators must be) slots of n rows."""
  slots = {
    k: rng.uniform(0.01, 1.0, (n, v.shape[1])).astype(np.float32) for k, v in _opt(spec).init(1, spec.dim).items()
  }
  if "t" in slots:
    slots["t"] = rng.integers(1, 50, (n, 1)).astype(np.float32)  # adam's per-row step count
  return rng.normal(size=(n, spec.dim)).astype(np.float32), slots


# -- the in-process PS ---------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", sorted(KWARGS))
def test_round_trip_and_training_goes_on_from_the_imported_slots(optimizer, make_ps):
  spec = _spec(optimizer)
  rng = np.random.default_rng(0)
  ps = make_ps([spec], num_shards=2, seed=3)
  seen = _train(ps, rng, 4)["t"]
  unseen = np.arange(1000, 1040, dtype=np.uint64)
  ids = rng.permutation(np.concatenate([rng.choice(seen, 150, replace=False), unseen]))
  full = ps.snapshot()["t"]
  ps.snapshot(incremental=True)  # clears the dirty flags: an export must set none
  stats = ps.stats()

  got = ps.export_rows_many({"t": ids})["t"]
  assert got[0].dtype == np.float32 and all(v.dtype == np.float32 for v in got[1].values())
  old = np.isin(ids, seen)
  _equal((got[0][old], {k: v[old] for k, v in got[1].items()}), _from_snapshot(full, ids[old]))
  # An id without a row: what a read-only lookup reads, with the slots a new row starts from.
  fresh = _opt(spec).init(int((~old).sum()), spec.dim)
  _equal((got[0][~old], {k: v[~old] for k, v in got[1].items()}), (ps.lookup("t", ids[~old], create=False), fresh))
  # It changed nothing: no row, counter, slot or dirty flag.
  assert ps.snapshot(incremental=True)["t"]["ids"].shape[0] == 0
  after = ps.snapshot()["t"]
  assert set(after) == set(full)
  for k in full:
    np.testing.assert_array_equal(after[k], full[k], err_msg=k)
  assert _counters(ps.stats()["t"]) == _counters(stats["t"])

  # Into a PS of another seed (its own initial rows differ) and one shard: the same rows back.
  other = make_ps([spec], num_shards=1, seed=99)
  other.import_rows_many({"t": (ids, got[0], got[1])})
  _equal(other.export_rows_many({"t": ids[::-1]})["t"], (got[0][::-1], {k: v[::-1] for k, v in got[1].items()}))
  np.testing.assert_array_equal(other.lookup("t", ids, create=False), got[0])

  # Training goes on from the imported slots: the optimizer's numpy update of the exported values.
  g = rng.normal(size=(ids.shape[0], spec.dim)).astype(np.float32)
  np.testing.assert_array_equal(other.lookup("t", ids, True, 10), got[0])  # a training lookup reads them too
  other.apply("t", ids, g, 10)
  want_w, want_slots = _opt(spec).update(got[0], {k: v.copy() for k, v in got[1].items()}, g)
  _equal(other.export_rows_many({"t": ids})["t"], (want_w, want_slots), rtol=1e-6)
  # ... and equals the PS the rows came from, trained on with the same gradient.
  ps.lookup("t", ids, True, 10)
  ps.apply("t", ids, g, 10)
  _equal(other.export_rows_many({"t": ids})["t"], ps.export_rows_many({"t": ids})["t"], rtol=1e-6)


def test_bfloat16_storage_rounds_the_weights_not_the_slots(make_ps):
  spec = _spec("adam", storage_dtype="bfloat16")
  rng = np.random.default_rng(1)
  ps = make_ps([spec], num_shards=2, seed=3)
  _train(ps, rng, 2, high=100)
  ids = rng.permutation(np.arange(50, 150, dtype=np.uint64))  # half of them have rows
  w, slots = _random_rows(rng, spec, ids.shape[0])
  ps.import_rows_many({"t": (ids, w, slots)})
  rounded = w.astype(BF16).astype(np.float32)
  assert (rounded != w).mean() > 0.9  # the rounding is visible
  _equal(ps.export_rows_many({"t": ids})["t"], (rounded, slots))
  np.testing.assert_array_equal(ps.lookup("t", ids, create=False), rounded)
  g = rng.normal(size=w.shape).astype(np.float32)
  ps.apply("t", ids, g)
  want_w, want_slots = _opt(spec).update(rounded, slots, g)
  _equal(ps.export_rows_many({"t": ids})["t"], (want_w.astype(BF16).astype(np.float32), want_slots), rtol=1e-6)


def test_a_bounded_table_with_a_tier_exports_and_imports_spilled_rows(make_ps, tmp_path):
  spec = _spec("adagrad", capacity=120, eviction="lfu")
  rng = np.random.default_rng(2)
  ps = make_ps([spec], num_shards=2, seed=3, tier={"driver": "file", "path": str(tmp_path / "tier")})
  _train(ps, rng, 8, high=600)
  tables = [ps.shards[s]["t"] for s in range(2)]
  spilled = np.concatenate([t.tier.live_ids() for t in tables])
  in_ram = np.concatenate([t.cols.keys()[: t.num_rows] for t in tables])
  assert spilled.shape[0] > 100 and in_ram.shape[0] > 50
  full = ps.snapshot()["t"]
  stats = ps.stats()["t"]
  ids = rng.permutation(np.concatenate([spilled[:80], in_ram[:40], np.arange(5000, 5010, dtype=np.uint64)]))
  have = ids < 5000
  got = ps.export_rows_many({"t": ids})["t"]
  _equal((got[0][have], {k: v[have] for k, v in got[1].items()}), _from_snapshot(full, ids[have]))
  _equal(
    (got[0][~have], {k: v[~have] for k, v in got[1].items()}),
    (ps.lookup("t", ids[~have], create=False), _opt(spec).init(10, spec.dim)),
  )
  # Spilled rows stay where they are: no read back into RAM, no counter moves.
  np.testing.assert_array_equal(np.sort(np.concatenate([t.tier.live_ids() for t in tables])), np.sort(spilled))
  assert _counters(ps.stats()["t"]) == _counters(stats)

  # Import: every id takes the new values (a snapshot holds each id once); ids in RAM keep their
  # last-seen step and count.
  ram_before = {k: v for k, v in zip(full["ids"].tolist(), zip(full["last_seen"].tolist(), full["freq"].tolist()))}
  w, slots = _random_rows(rng, spec, ids.shape[0])
  ps.snapshot(incremental=True)
  ps.import_rows_many({"t": (ids, w, slots)})
  inc = ps.snapshot(incremental=True)["t"]  # every imported row is dirty: spilled, in RAM, new
  np.testing.assert_array_equal(np.sort(inc["ids"]), np.sort(ids))
  _equal(_from_snapshot(inc, ids), (w, slots))
  _equal(ps.export_rows_many({"t": ids})["t"], (w, slots))
  snap = ps.snapshot()["t"]
  assert np.unique(snap["ids"]).shape[0] == snap["ids"].shape[0]  # each id once, in RAM or the tier
  _equal(_from_snapshot(snap, ids), (w, slots))
  pos = {int(i): k for k, i in enumerate(snap["ids"])}
  for i in in_ram[:40].tolist():
    if not snap["spilled"][pos[i]]:  # rows still in RAM keep their last-seen step and count
      assert (int(snap["last_seen"][pos[i]]), int(snap["freq"][pos[i]])) == ram_before[i]
  assert ps.stats()["t"]["rows"] + ps.stats()["t"]["tier_rows"] == full["ids"].shape[0] + 10
  # With a tier, RAM keeps its bound at once (imported copies may go to the tier first), and
  # nothing imported is lost, through the next training lookup's eviction too.
  assert all(t.num_rows <= spec.capacity // 2 for t in tables)
  ps.lookup("t", np.arange(7000, 7005, dtype=np.uint64), True, 20)
  assert all(t.num_rows <= spec.capacity // 2 for t in tables)
  _equal(ps.export_rows_many({"t": ids})["t"], (w, slots))


def test_import_creates_rows_under_admission_and_marks_them_for_incremental_snapshots(make_ps):
  spec = _spec("rowwise_adagrad", admit_after=3)
  rng = np.random.default_rng(3)
  ps = make_ps([spec], num_shards=2, seed=3)
  ids = np.arange(10, 30, dtype=np.uint64)
  assert not ps.lookup("t", ids, True, 0).any()  # not admitted: zeros, no row
  w0, s0 = ps.export_rows_many({"t": ids})["t"]
  _equal((w0, s0), (np.zeros((20, spec.dim), np.float32), _opt(spec).init(20, spec.dim)))
  ps.snapshot(incremental=True)
  w, slots = _random_rows(rng, spec, 20)
  ps.import_rows_many({"t": (ids[:12], w[:12], {k: v[:12] for k, v in slots.items()})})
  np.testing.assert_array_equal(ps.lookup("t", ids, create=False)[:12], w[:12])
  assert not ps.lookup("t", ids, create=False)[12:].any()
  inc = ps.snapshot(incremental=True)["t"]
  np.testing.assert_array_equal(np.sort(inc["ids"]), ids[:12])
  _equal(_from_snapshot(inc, ids[:12]), (w[:12], {k: v[:12] for k, v in slots.items()}))


def test_bad_rows_are_refused_naming_the_table_and_change_nothing(make_ps):
  specs = [_spec("adam", name="a"), _spec("adagrad", name="b", dim=3)]
  rng = np.random.default_rng(4)
  ps = make_ps(specs, num_shards=2, seed=3)
  _train(ps, rng, 2, high=50)
  before = ps.snapshot()
  ids = np.arange(40, 60, dtype=np.uint64)
  wa, sa = _random_rows(rng, specs[0], 20)
  wb, sb = _random_rows(rng, specs[1], 20)
  good_a = (ids, wa, sa)
  bad = {
    "unknown table": ({"nope": good_a}, KeyError, "unknown table 'nope'"),
    "wrong dim": ({"a": good_a, "b": (ids, wb[:, :2], sb)}, ValueError, r"table 'b': import weights \(20, 2\)"),
    "wrong count": ({"a": good_a, "b": (ids, wb[:19], sb)}, ValueError, r"table 'b': import weights \(19, 3\)"),
    "repeated ids": ({"a": good_a, "b": (np.r_[ids[:19], ids[:1]], wb, sb)}, ValueError, "table 'b': import ids are not distinct"),
    "missing slot": ({"a": good_a, "b": (ids, wb, {})}, ValueError, "table 'b': import lacks optimizer slot 'acc'"),
    "other optimizer's slots": ({"a": good_a, "b": (ids, wb, sa)}, ValueError, r"table 'b': import has optimizer slots \['m', 't', 'v'\]"),
    "slot shape": ({"a": good_a, "b": (ids, wb, {"acc": sb["acc"][:, :1]})}, ValueError, r"table 'b': import optimizer slot 'acc' is \(20, 1\), expected \(20, 3\)"),
    "negative ids": ({"a": good_a, "b": (-np.arange(1, 21), wb, sb)}, ValueError, "table 'b': ids must be non-negative"),
    "2-D ids": ({"a": good_a, "b": (ids.reshape(4, 5), wb, sb)}, ValueError, "table 'b': import ids must be 1-D"),
  }  # fmt: skip
  for name, (rows, error, match) in bad.items():
    with pytest.raises(error, match=match):
      ps.import_rows_many(rows)
    after = ps.snapshot()  # table 'a', good, was checked first and is unchanged too
    for t in before:
      for k in before[t]:
        np.testing.assert_array_equal(after[t][k], before[t][k], err_msg=f"{name}: {t} {k}")
  with pytest.raises(KeyError, match="unknown table 'nope'"):
    ps.export_rows_many({"nope": ids})
  with pytest.raises(ValueError, match=r"table 'a': export ids are not distinct \(e.g. 7\)"):
    ps.export_rows_many({"a": np.array([7, 8, 7], np.uint64)})
  with pytest.raises(ValueError, match="table 'a': ids must be unsigned or non-negative integers"):
    ps.export_rows_many({"a": ids.astype(np.float64)})
  # A table on its own says the same.
  table = Table(specs[1], seed=3)
  with pytest.raises(ValueError, match=r"table 'b': import weights \(20, 2\)"):
    table.import_rows(ids, wb[:, :2], sb)
  with pytest.raises(ValueError, match="table 'b': export ids are not distinct"):
    table.export_rows(np.zeros(2, np.uint64))
  assert table.num_rows == 0


# -- RemotePS over server processes ----------------------------------------------------------------
REMOTE_SPECS = [_spec("adam", name="user", dim=6), _spec("ftrl", name="item/genre", dim=3)]
SEED = 5


def _round(g):
  return g.astype(BF16).astype(np.float32)


def _count_calls(remote):
  counts = {}
  inner = remote._servers.call

  def call(i, method, *args, **kw):
    counts[method] = counts.get(method, 0) + 1
    return inner(i, method, *args, **kw)

  remote._servers.call = call
  return counts


def _all_equal(a, b, rtol=0.0):
  assert set(a) == set(b)
  for t in a:
    _equal(a[t], b[t], rtol)


def test_remote_rows_equal_the_in_process_ps(servers, make_ps):
  """Two server processes with a 1 MiB limit, a bfloat16-wire client with 64 KiB chunks: exports
  equal an in-process PS's to the bit (rows and slots travel as float32), imports too, and training
  goes on alike."""
  addrs = [a for a, _ in servers.start(2, "--max_message_mb=1")]
  rng = np.random.default_rng(6)
  local = make_ps(REMOTE_SPECS, num_shards=2, seed=SEED)
  with RemotePS(addrs, REMOTE_SPECS, seed=SEED, wire_dtype="bfloat16", max_request_mb=1 / 16, timeout_s=60) as remote:
    counts = _count_calls(remote)
    dims = {s.name: s.dim for s in REMOTE_SPECS}
    for step in range(3):  # gradients exactly representable in bfloat16: both PSs get the same ones
      ids = {t: np.unique(rng.integers(0, 3000, 1500)).astype(np.uint64) for t in dims}
      for ps in (local, remote):
        ps.lookup_many(ids, True, step)
      g = {t: (v, _round(rng.normal(size=(v.shape[0], dims[t])).astype(np.float32))) for t, v in ids.items()}
      local.apply_many(g, step)
      remote.apply_many(g, step)
    ids = {t: rng.permutation(np.arange(0, 4000, dtype=np.uint64)) for t in dims}  # a quarter never seen
    got = remote.export_rows_many(ids, step=3)
    _all_equal(got, local.export_rows_many(ids))
    assert set(np.unique(remote.shard_of("user", ids["user"]))) == {0, 1}
    # About 2000 ids of each table per server, 76 + 36 bytes of rows and slots each (adam of 6: 6 + 6 + 6 + 1
    # floats; ftrl of 3: 3 + 3 + 3): about 220 KiB per server, in 64 KiB chunks.
    assert counts["ExportRows"] >= 2 * 3, counts
    # The slots round trip to the bit; new values set on both PSs read back alike.
    new = {}
    for t, spec in zip(dims, REMOTE_SPECS):
      sel = ids[t][:2500]
      new[t] = (sel, *_random_rows(rng, spec, sel.shape[0]))
    remote.import_rows_many(new)
    local.import_rows_many(new)
    assert counts["ImportRows"] >= 2 * 3, counts
    _all_equal(remote.export_rows_many(ids), local.export_rows_many(ids))
    for t, (i, w, s) in new.items():
      _equal(remote.export_rows_many({t: i})[t], (w, s))
      np.testing.assert_array_equal(remote.lookup(t, i, create=False), _round(w))  # rows come as bfloat16
    rs, ls = remote.stats(), local.stats()
    assert all(rs[t]["rows"] == ls[t]["rows"] for t in dims)
    g = {t: (v[:2000], _round(rng.normal(size=(2000, dims[t])).astype(np.float32))) for t, v in ids.items()}
    for ps in (local, remote):
      ps.lookup_many({t: v for t, (v, _) in g.items()}, True, 3)
      ps.apply_many(g, 3)
    _all_equal(remote.export_rows_many(ids), local.export_rows_many(ids), rtol=1e-6)

    # The client refuses what it cannot send, before sending anything.
    n = sum(counts.values())
    with pytest.raises(KeyError, match="unknown table 'nope'"):
      remote.export_rows_many({"nope": ids["user"]})
    with pytest.raises(KeyError, match="unknown table 'nope'"):
      remote.import_rows_many({"nope": new["user"]})
    with pytest.raises(ValueError, match="table 'user': export ids are not distinct"):
      remote.export_rows_many({"user": np.zeros(3, np.uint64)})
    i, w, s = new["item/genre"]
    with pytest.raises(ValueError, match=r"table 'item/genre': import lacks optimizer slot 'linear'"):
      remote.import_rows_many({"user": new["user"], "item/genre": (i, w, {"accum": s["accum"]})})
    assert sum(counts.values()) == n


def _raw_status(channel, method, request, metadata):
  try:
    channel.unary_unary(wire.path(method))(request, timeout=20, metadata=metadata)
  except grpc.RpcError as e:
    return e.code(), e.details()
  return grpc.StatusCode.OK, ""


def test_bad_row_requests_are_refused_and_the_server_keeps_serving(servers, make_ps, tmp_path):
  (tmp_path / "token").write_text("tok\n")
  ((addr, proc),) = servers.start(1, f"--token_file={tmp_path / 'token'}", "--max_message_mb=1")
  md = (("authorization", "Bearer tok"),)
  spec = REMOTE_SPECS[0]  # adam: slots m, t, v
  remote = RemotePS([addr], REMOTE_SPECS, seed=SEED, token="tok", timeout_s=30)
  local = make_ps(REMOTE_SPECS, seed=SEED)
  ids = np.arange(20, dtype=np.uint64)
  for ps in (remote, local):
    ps.lookup_many({"user": ids}, True, 0)
  w, slots = _random_rows(np.random.default_rng(7), spec, 20)

  def imp(**over):
    arrays = {"ids/user": ids, "weights/user": w, **{f"slot_{k}/user": v for k, v in slots.items()}}
    arrays.update(over)
    return wire.encode({}, {k: v for k, v in arrays.items() if v is not None})

  nan = w.copy()
  nan[4, 1] = np.inf
  INV = grpc.StatusCode.INVALID_ARGUMENT
  # fmt: off
  cases = [
    ("unknown table", "ExportRows", wire.encode({}, {"ids/nope": ids}), INV, "unknown table 'nope'"),
    ("repeated ids", "ExportRows", wire.encode({}, {"ids/user": np.zeros(2, np.uint64)}), INV, "not distinct"),
    ("float ids", "ExportRows", wire.encode({}, {"ids/user": ids.astype(np.float32)}), INV, "1-D uint64"),
    ("bad step", "ExportRows", wire.encode({"step": "x"}, {"ids/user": ids}), INV, "'step'"),
    ("answer over the limit", "ExportRows", wire.encode({}, {"ids/user": np.arange(40_000, dtype=np.uint64)}),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "export fewer rows"),
    ("unknown table", "ImportRows", imp(**{"ids/nope": ids}), INV, "unknown table 'nope'"),
    ("missing slot", "ImportRows", imp(**{"slot_v/user": None}), INV, "needs exactly"),
    ("another optimizer's slot", "ImportRows", imp(**{"slot_accum/user": w}), INV, "needs exactly"),
    ("no such slot anywhere", "ImportRows", imp(**{"slot_zz/user": w}), INV, "unexpected array 'slot_zz/user'"),
    ("wrong dim", "ImportRows", imp(**{"weights/user": w[:, :5]}), INV, "import weights (20, 5)"),
    ("wrong slot width", "ImportRows", imp(**{"slot_t/user": slots["m"]}), INV, "optimizer slot 't' is (20, 6)"),
    ("wrong count", "ImportRows", imp(**{"slot_m/user": slots["m"][:19]}), INV, "slot_m of shape [19, 6]"),
    ("bfloat16 rows", "ImportRows", imp(**{"weights/user": w.astype(BF16)}), INV, "must be float32"),
    ("non-finite", "ImportRows", imp(**{"weights/user": nan}), INV, "weights are not finite (e.g. row 4, column 1)"),
    ("repeated ids", "ImportRows", imp(**{"ids/user": np.r_[ids[:19], ids[:1]]}), INV, "not distinct"),
    ("no ids", "ImportRows", imp(**{"ids/user": None}), INV, "needs exactly"),
    ("no token", "ImportRows", imp(), grpc.StatusCode.UNAUTHENTICATED, "token"),
    ("no token", "ExportRows", wire.encode({}, {"ids/user": ids}), grpc.StatusCode.UNAUTHENTICATED, "token"),
  ]
  # fmt: on
  channel = grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", -1)])
  for name, method, request, code, text in cases:
    got, details = _raw_status(channel, method, request, None if name == "no token" else md)
    assert got == code, f"{name}: got {got} ({details}), expected {code}"
    assert text in details, f"{name}: {details!r} does not mention {text!r}"
  channel.close()
  # Nothing above changed anything, and the server goes on serving.
  assert proc.poll() is None and remote.health()[0]["ok"]
  _all_equal(remote.export_rows_many({"user": ids}), local.export_rows_many({"user": ids}))
  remote.import_rows_many({"user": (ids, w, slots)})
  _equal(remote.export_rows_many({"user": ids})["user"], (w, slots))
  remote.close()


def test_an_export_at_a_step_waits_for_every_workers_pushes_before_it(start):
  """Two workers, staleness 0: an export at step 1 returns once both pushes of step 0 are applied,
  and reads rows that hold both."""
  addr, _ = start()
  spec = REMOTE_SPECS[0]
  w0, w1 = (RemotePS([addr], [spec], seed=SEED, num_workers=2, worker=k, timeout_s=30) for k in range(2))
  local = ParameterServer([spec], seed=SEED)
  rng = np.random.default_rng(8)
  ids = np.arange(30, dtype=np.uint64)
  g0, g1 = (rng.normal(size=(30, spec.dim)).astype(np.float32) for _ in range(2))
  try:
    for ps in (w0, w1, local):
      ps.lookup("user", ids, True, 0)
    w0.apply("user", ids, g0, 0)
    result = {}
    thread = threading.Thread(target=lambda: result.update(w0.export_rows_many({"user": ids}, step=1)))
    thread.start()
    thread.join(1.0)
    assert thread.is_alive(), "the export did not wait for worker 1's push of step 0"
    w1.apply("user", ids, g1, 0)
    thread.join(30)
    assert not thread.is_alive()
    local.apply("user", ids, g0 + g1, 0)  # a step's pushes are summed over the workers
    _equal(result["user"], local.export_rows_many({"user": ids})["user"], rtol=1e-6)
    with pytest.raises(RemotePSError, match="OUT_OF_RANGE"):
      w0.export_rows_many({"user": ids}, step=10**6)
  finally:
    w0.close()
    w1.close()
    local.close()
