"""RemotePS against real PS shard server processes: equivalence with the in-process PS, several
workers, at-most-once pushes, malformed requests, snapshots across server counts, a killed
server, TLS; plus the wire format on its own."""

import json
import os
import shutil
import signal
import struct
import threading
import time

import grpc
import numpy as np
import pytest

from recsys_jax import hashing
from recsys_jax.async_ps import wire
from recsys_jax.async_ps.client.remote import RemotePS, RemotePSError
from recsys_jax.async_ps.server import sum_pushes
from recsys_jax.async_ps.snapshot import directory as snapshot
from recsys_jax.async_ps.snapshot.chain import load_into
from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = 7
SPECS = [
  TableSpec(name="user", dim=8, optimizer="adagrad", optimizer_kwargs=(("learning_rate", 0.1),)),
  TableSpec(
    name="item/genre",  # a '/' in a table name must survive the wire's '<kind>/<table>' names
    dim=3,
    optimizer="adagrad",
    optimizer_kwargs=(("learning_rate", 0.05), ("initial_accumulator_value", 0.1)),
    initializer="normal",
    init_scale=0.2,
  ),
]
DIMS = {s.name: s.dim for s in SPECS}


def _ids(rng, n, high=5000):
  return np.unique(rng.integers(0, high, n).astype(np.uint64))


def _grads(rng, ids):
  return {t: (v, rng.normal(size=(v.shape[0], DIMS[t])).astype(np.float32)) for t, v in ids.items()}


def _assert_rows_equal(a, b, rtol=1e-6, atol=0.0):
  assert set(a) == set(b)
  for t in a:
    np.testing.assert_allclose(a[t], b[t], rtol=rtol, atol=atol, err_msg=t)


def _train(rng, pss, steps, start=0, round_grads=None):
  """Trainer-like steps on several PSs at once (same ids and gradients); returns every id used."""
  seen = {t: [] for t in DIMS}
  for step in range(start, start + steps):
    ids = {t: _ids(rng, 300) for t in DIMS}
    rows = [ps.lookup_many(ids, True, step) for ps in pss]
    for r in rows[1:]:
      _assert_rows_equal(rows[0], r)
    g = _grads(rng, ids)
    if round_grads is not None:
      g = {t: (i, round_grads(x)) for t, (i, x) in g.items()}
    for ps in pss:
      ps.apply_many(g, step)
    for t in DIMS:
      seen[t].append(ids[t])
  return {t: np.unique(np.concatenate(v)) for t, v in seen.items()}


# -- equivalence -----------------------------------------------------------------------------
def test_two_servers_equal_in_process_ps(servers):
  addrs = [a for a, _ in servers.start(2)]
  rng = np.random.default_rng(0)
  local = ParameterServer(SPECS, num_shards=3, seed=SEED)
  with RemotePS(addrs, SPECS, seed=SEED) as remote:
    assert remote.num_shards == 2 and remote.specs == local.specs
    ids = _train(rng, [local, remote], steps=5)
    # Ids split over both servers, and in a shuffled order: rows come back in the caller's order.
    assert set(np.unique(remote.shard_of("user", ids["user"]))) == {0, 1}
    shuffled = {t: rng.permutation(v) for t, v in ids.items()}
    _assert_rows_equal(remote.lookup_many(shuffled, create=False), local.lookup_many(shuffled, create=False))
    out = {t: np.full((v.shape[0], DIMS[t]), np.nan, np.float32) for t, v in shuffled.items()}
    got = remote.lookup_many(shuffled, create=False, out=out)  # into the caller's arrays, once from the wire
    assert all(got[t] is out[t] for t in out)
    _assert_rows_equal(out, local.lookup_many(shuffled, create=False), rtol=0)
    np.testing.assert_array_equal(remote.lookup("user", ids["user"][:5]), local.lookup("user", ids["user"][:5]))
    rs, ls = remote.stats(), local.stats()
    for t in DIMS:
      for k in ("rows", "lookups", "hits", "created", "applied_rows"):
        assert rs[t][k] == ls[t][k], (t, k)
    with pytest.raises(KeyError, match="unknown table"):
      remote.lookup("nope", ids["user"])
    with pytest.raises(ValueError, match="gradient shape"):
      remote.apply("user", ids["user"], np.zeros((len(ids["user"]), 3), np.float32))


def test_bfloat16_wire(servers):
  """Gradients travel rounded to bfloat16 and rows come back rounded: the servers' state is
  exactly an in-process PS fed the rounded gradients; rows read within bf16's 2**-8 relative
  rounding of it."""
  addrs = [a for a, _ in servers.start(2)]
  rng = np.random.default_rng(1)
  local = ParameterServer(SPECS, seed=SEED)
  exact = RemotePS(addrs, SPECS, seed=SEED)
  with RemotePS(addrs, SPECS, seed=SEED, wire_dtype="bfloat16") as bf16:
    bf = wire.DTYPES["bfloat16"]
    for step in range(4):
      ids = {t: _ids(rng, 200) for t in DIMS}
      want = local.lookup_many(ids, True, step)
      got = bf16.lookup_many(ids, True, step)
      _assert_rows_equal(got, want, rtol=2**-8, atol=1e-30)
      for t in DIMS:
        np.testing.assert_array_equal(got[t], want[t].astype(bf).astype(np.float32))
      g = {t: (i, x.astype(bf).astype(np.float32)) for t, (i, x) in _grads(rng, ids).items()}
      bf16.apply_many(g, step)
      local.apply_many(g, step)
    every = {t: np.arange(5000, dtype=np.uint64) for t in DIMS}
    _assert_rows_equal(exact.lookup_many(every, create=False), local.lookup_many(every, create=False))
  exact.close()


# -- several workers ---------------------------------------------------------------------------
def test_two_workers_sum_and_staleness(servers):
  addrs = [a for a, _ in servers.start(2)]
  rng = np.random.default_rng(2)
  w0 = RemotePS(addrs, SPECS, seed=SEED, num_workers=2, worker=0, staleness=0)
  w1 = RemotePS(addrs, SPECS, seed=SEED, num_workers=2, worker=1, staleness=0)
  local = ParameterServer(SPECS, seed=SEED)
  try:
    ids0 = {t: _ids(rng, 200, 1000) for t in DIMS}
    ids1 = {t: _ids(rng, 200, 1000) for t in DIMS}  # overlaps ids0
    union = {t: np.union1d(ids0[t], ids1[t]) for t in DIMS}
    _assert_rows_equal(w0.lookup_many(ids0, True, 0), local.lookup_many(ids0, True, 0))
    _assert_rows_equal(w1.lookup_many(ids1, True, 0), local.lookup_many(ids1, True, 0))
    g0, g1 = _grads(rng, ids0), _grads(rng, ids1)
    w0.apply_many(g0, 0)

    result, done = {}, threading.Event()

    def lookup_next_step():
      result["rows"] = w0.lookup_many(union, True, 1)
      done.set()

    waiter = threading.Thread(target=lookup_next_step)
    waiter.start()
    # Staleness 0: step 1 must see both workers' pushes of step 0; worker 1 has not pushed yet.
    assert not done.wait(0.7), "the lookup of step 1 did not wait for worker 1's push of step 0"
    w1.apply_many(g1, 0)
    assert done.wait(10), "the lookup of step 1 did not resume after worker 1's push"
    waiter.join()

    total = sum_pushes({0: g0, 1: g1}, DIMS)
    for t in DIMS:  # one summed apply: the union, each id's gradients added in worker order
      expect = np.zeros((union[t].shape[0], DIMS[t]), np.float32)
      expect[np.searchsorted(union[t], ids0[t])] += g0[t][1]
      expect[np.searchsorted(union[t], ids1[t])] += g1[t][1]
      np.testing.assert_array_equal(total[t][0], union[t])
      np.testing.assert_array_equal(total[t][1], expect)
    local.apply_many(total, 0)
    _assert_rows_equal(result["rows"], local.lookup_many(union, True, 1), rtol=0)
    # Server-side ordering: a worker may not push a step twice, nor a step already applied.
    with pytest.raises(RemotePSError, match="FAILED_PRECONDITION.*already applied"):
      w1.apply_many(g1, 0)
    w0.apply_many(g0, 1)
    with pytest.raises(RemotePSError, match="FAILED_PRECONDITION.*increasing order"):
      w0.apply_many(g0, 1)
  finally:
    w0.close()
    w1.close()


def test_push_at_most_once(servers):
  ((addr, _),) = servers.start(1)
  rng = np.random.default_rng(3)
  with RemotePS([addr], SPECS, seed=SEED) as ps:
    ids = {t: _ids(rng, 100) for t in DIMS}
    ps.lookup_many(ids, True, 0)
    g = _grads(rng, ids)
    ps.apply_many(g, 0, request_id="push-a")
    after = ps.lookup_many(ids, False)
    ps.apply_many(g, 0, request_id="push-a")  # acknowledged, not applied again
    _assert_rows_equal(ps.lookup_many(ids, False), after, rtol=0)
    assert ps.stats()["user"]["applied_rows"] == ids["user"].shape[0]


# -- malformed requests --------------------------------------------------------------------------
def _raw(header, payload=b""):
  h = json.dumps(header).encode()
  return struct.pack("<4sI", b"RPS1", len(h)) + h + payload


def test_malformed_requests_are_refused_and_the_server_keeps_serving(servers, tmp_path):
  token = "s3cret-token"
  (tmp_path / "token").write_text(token + "\n")
  ((addr, proc),) = servers.start(
    1, f"--token_file={tmp_path / 'token'}", "--max_message_mb=1", "--shard_index=0", "--num_shards=1"
  )
  md = (("authorization", f"Bearer {token}"),)
  channel = grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", -1)])
  calls = {m: channel.unary_unary(wire.path(m)) for m in wire.METHODS}

  def status(method, request, metadata=md):
    try:
      calls[method](request, timeout=10, metadata=metadata)
    except grpc.RpcError as e:
      return e.code(), e.details()
    return grpc.StatusCode.OK, ""

  ids = np.arange(10, dtype=np.uint64)
  assert status("Lookup", wire.encode({}, {"ids/user": ids}))[0] == grpc.StatusCode.FAILED_PRECONDITION
  assert status("Health", wire.encode())[0] == grpc.StatusCode.OK  # allowed before Configure
  with pytest.raises(RemotePSError, match="UNAUTHENTICATED"):
    RemotePS([addr], SPECS, seed=SEED, timeout_s=3)
  ps = RemotePS([addr], SPECS, seed=SEED, token=token, timeout_s=5)
  local = ParameterServer(SPECS, seed=SEED)
  ps.lookup_many({"user": ids}, True, 0)
  local.lookup_many({"user": ids}, True, 0)
  g = np.ones((10, 8), np.float32)
  nan = g.copy()
  nan[3, 2] = np.nan

  def push(arrays, **fields):
    return wire.encode({"worker": 0, "step": 5, "request_id": "r", **fields}, arrays)

  def raw_ids(dtype="uint64", shape=(1,), offset=0, payload=8, extra=()):
    entry = {"name": "ids/user", "dtype": dtype, "shape": list(shape), "offset": offset}
    return _raw({"v": 1, "fields": {}, "payload_bytes": payload, "arrays": [entry, *extra]}, bytes(payload))

  good = wire.encode({}, {"ids/user": ids})
  configure = {"seed": SEED, "num_workers": 1, "staleness": 0, "shard_index": 0, "num_shards": 1}
  other_user = [wire.spec_to_json(TableSpec(name="user", dim=9)), wire.spec_to_json(SPECS[1])]
  second = {"name": "ids/item/genre", "dtype": "uint64", "shape": [1], "offset": 8}
  C = grpc.StatusCode
  INV, PRE, AUTH = C.INVALID_ARGUMENT, C.FAILED_PRECONDITION, C.UNAUTHENTICATED
  # fmt: off
  cases = [
    ("garbage bytes", "Lookup", b"\x00garbage that is no message at all", INV, "magic"),
    ("empty message", "Lookup", b"", INV, "shorter"),
    ("truncated payload", "Push", push({"ids/user": ids, "grads/user": g})[:-16], INV, "payload bytes"),
    ("header longer than sent", "Lookup", struct.pack("<4sI", b"RPS1", 5000) + b"{}", INV, "header claims"),
    ("header not JSON", "Lookup", _raw({})[:8] + b"{not json", INV, "JSON"),
    ("array overruns", "Lookup", raw_ids(shape=(4,)), INV, "overrun"),
    ("arrays overlap", "Lookup", raw_ids(shape=(2,), payload=16, extra=[second]), INV, "overlap"),
    ("dtype not allowed", "Lookup", raw_ids(dtype="object"), INV, "not allowed"),
    ("unknown table", "Lookup", wire.encode({}, {"ids/nope": ids}), INV, "unknown table 'nope'"),
    ("float ids", "Lookup", wire.encode({}, {"ids/user": ids.astype(np.float32)}), INV, "uint64"),
    ("2-D ids", "Lookup", wire.encode({}, {"ids/user": ids.reshape(2, 5)}), INV, "1-D uint64"),
    ("repeated ids", "Lookup", wire.encode({}, {"ids/user": np.zeros(3, np.uint64)}), INV, "not distinct"),
    ("bad wire dtype", "Lookup", wire.encode({"wire_dtype": "int8"}, {"ids/user": ids}), INV, "wire_dtype"),
    ("wrong dim", "Push", push({"ids/user": ids, "grads/user": np.ones((10, 7), np.float32)}), INV, "dim=8"),
    ("mismatched n", "Push", push({"ids/user": ids, "grads/user": g[:9]}), INV, "n=10"),
    ("non-finite grads", "Push", push({"ids/user": ids, "grads/user": nan}), INV, "not finite"),
    ("grads without ids", "Push", push({"grads/user": g}), INV, "needs both"),
    ("missing field", "Push", wire.encode({"step": 5, "request_id": "e"}, {}), INV, "'worker'"),
    ("bad worker", "Push", push({}, worker=3), INV, "worker 3"),
    ("negative step", "Push", push({}, step=-1), INV, "step -1 is negative"),
    ("negative step", "Lookup", wire.encode({"step": -5}, {"ids/user": ids}), INV, "step -5 is negative"),
    ("negative step", "Snapshot", wire.encode({"directory": str(tmp_path / "n"), "step": -5}), INV, "negative"),
    ("a step", "Push", push({}, step=0, request_id="a0"), C.OK, None),
    ("step already applied", "Push", push({}, step=0, request_id="a1"), PRE, "already applied"),
    ("configure mismatch", "Configure", wire.encode({"tables": other_user, **configure}), PRE,
     "table 'user': field dim is 8"),
    ("wrong place", "Configure", wire.encode({"tables": [], **configure, "shard_index": 1, "num_shards": 2}), INV,
     "'tables' is empty"),
    ("wrong place", "Configure", wire.encode({"tables": [wire.spec_to_json(t) for t in SPECS], **configure,
     "shard_index": 1, "num_shards": 2}), PRE, "started as shard 0 of 1"),
    ("reserved meta", "Snapshot", wire.encode({"directory": str(tmp_path / "s"), "meta": {"format": 1}}), INV,
     "meta may not set ['format']"),
    ("oversized", "Lookup", wire.encode({}, {"ids/user": np.arange(300_000, dtype=np.uint64)}),
     C.RESOURCE_EXHAUSTED, None),
    ("no token", "Lookup", good, AUTH, "token"),
    ("wrong token", "Lookup", good, AUTH, "token"),
  ]
  # fmt: on
  for name, method, request, code, text in cases:
    metadata = {"no token": None, "wrong token": (("authorization", "Bearer wrong"),)}.get(name, md)
    got, details = status(method, request, metadata)
    assert got == code, f"{name}: got {got} ({details}), expected {code}"
    if text is not None:
      assert text in details, f"{name}: {details!r} does not mention {text!r}"
  with pytest.raises(RemotePSError, match="FAILED_PRECONDITION.*dim"):
    RemotePS([addr], [TableSpec(name="user", dim=4), SPECS[1]], seed=SEED, token=token)

  # Nothing above changed anything: the server answers a correct lookup with the right rows.
  assert proc.poll() is None
  _assert_rows_equal(ps.lookup_many({"user": ids}, True, 0), local.lookup_many({"user": ids}, True, 0), rtol=0)
  assert ps.stats()["user"]["applied_rows"] == 0
  assert ps.health()[0]["ok"]
  ps.close()
  channel.close()


# -- snapshots ----------------------------------------------------------------------------------
def test_snapshot_on_two_servers_restores_onto_one_and_three(servers, tmp_path):
  started = servers.start(6)
  two, one, three = [a for a, _ in started[:2]], [started[2][0]], [a for a, _ in started[3:]]
  rng = np.random.default_rng(4)
  with RemotePS(two, SPECS, seed=SEED) as src:
    _train(rng, [src], steps=3)
    full, inc = str(tmp_path / "snap-3"), str(tmp_path / "snap-5")
    rows = src.save_snapshot(full, meta={"note": "full"}, step=3)
    _train(rng, [src], steps=2, start=3)
    src.save_snapshot(inc, incremental=True, step=5)
    with pytest.raises(FileExistsError):
      src.save_snapshot(full, step=5)
    manifest = json.load(open(os.path.join(full, "remote.json")))
    assert manifest["num_servers"] == 2 and manifest["parts"] == ["server-0", "server-1"]
    assert manifest["step"] == 3 and manifest["incremental"] is False and manifest["rows"] == rows
    every = {t: np.arange(5000, dtype=np.uint64) for t in DIMS}
    want = src.lookup_many(every, create=False)

    chain = [full, inc]
    local = ParameterServer(SPECS, num_shards=2, seed=SEED)
    load_into(local, chain)
    _assert_rows_equal(local.lookup_many(every, create=False), want, rtol=0)
    for addrs in (one, three):
      with RemotePS(addrs, SPECS, seed=SEED) as dst:
        dst.load_snapshot(chain, step=5)
        _assert_rows_equal(dst.lookup_many(every, create=False), want, rtol=0)
        assert sum(s["server"]["applied_step"] for s in dst.server_stats()) == 4 * len(addrs)
        if len(addrs) == 3:  # optimizer slots came along: one more step stays equal
          _train(rng, [src, dst, local], steps=1, start=5)
          _assert_rows_equal(dst.lookup_many(every, create=False), src.lookup_many(every, create=False), rtol=0)
    # An in-process snapshot restores onto servers too.
    snapshot.save(local, str(tmp_path / "local"))
    with RemotePS(one, SPECS, seed=SEED) as dst:
      dst.load_snapshot([str(tmp_path / "local")])
      _assert_rows_equal(dst.lookup_many(every, create=False), local.lookup_many(every, create=False), rtol=0)
      with pytest.raises(RemotePSError, match="FAILED_PRECONDITION.*must be full"):
        dst.load_snapshot([inc])  # refused before anything changed
      _assert_rows_equal(dst.lookup_many(every, create=False), local.lookup_many(every, create=False), rtol=0)
      # A part damaged on disk fails midway: the server refuses to serve partial tables until
      # a restore succeeds.
      damaged = str(tmp_path / "damaged")
      shutil.copytree(full, damaged)
      shutil.rmtree(os.path.join(damaged, "server-1", "user", "0", "weights", "c"))
      with pytest.raises(RemotePSError, match="checksum"):
        dst.load_snapshot([damaged])
      with pytest.raises(RemotePSError, match="FAILED_PRECONDITION.*Restore again"):
        dst.lookup_many(every, create=False)
      dst.load_snapshot(chain, step=5)
      _assert_rows_equal(dst.lookup_many(every, create=False), want, rtol=0)


# -- failures -----------------------------------------------------------------------------------
def test_killed_server_raises_naming_it(servers):
  (a0, _), (a1, p1) = servers.start(2)
  rng = np.random.default_rng(5)
  timeout = 3.0
  # The servers compile their kernels on their first lookup and push, which on a loaded machine
  # takes longer than this test's deadline (retries share it): warm them up first.
  warm_ids = {t: _ids(rng, 50) for t in DIMS}
  with RemotePS([a0, a1], SPECS, seed=SEED, timeout_s=60) as warm:
    warm.lookup_many(warm_ids)
    warm.apply_many(_grads(rng, warm_ids))
  with RemotePS([a0, a1], SPECS, seed=SEED, timeout_s=timeout) as ps:
    ids = {t: _ids(rng, 200) for t in DIMS}
    ps.lookup_many(ids, True, 0)
    ps.apply_many(_grads(rng, ids), 0)
    p1.send_signal(signal.SIGKILL)
    p1.wait()
    t0 = time.monotonic()
    with pytest.raises(RemotePSError) as err:
      ps.lookup_many(ids, True, 1)
    assert time.monotonic() - t0 < timeout + 2
    assert f"PS server {a1} (shard 1 of 2): Lookup failed: UNAVAILABLE" in str(err.value)
    assert err.value.address == a1 and err.value.code == grpc.StatusCode.UNAVAILABLE
    t0 = time.monotonic()
    with pytest.raises(RemotePSError, match=f"{a1}.*Push failed"):
      ps.apply_many(_grads(rng, ids), 1)
    assert time.monotonic() - t0 < timeout + 2


def test_wrong_address_fails_within_the_deadline():
  import socket

  with socket.socket() as s:  # a port nobody listens on
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  t0 = time.monotonic()
  with pytest.raises(RemotePSError, match=f"127.0.0.1:{port}.*Configure failed"):
    RemotePS([f"127.0.0.1:{port}"], SPECS, timeout_s=1.5)
  assert time.monotonic() - t0 < 4


def test_tls_round_trip(servers, tmp_path, self_signed_cert):
  cert, key = self_signed_cert
  ((addr, _),) = servers.start(1, f"--tls_cert={cert}", f"--tls_key={key}")
  ids = {"user": np.arange(50, dtype=np.uint64)}
  with RemotePS([addr], SPECS, seed=SEED, tls_ca=str(cert)) as ps:
    _assert_rows_equal(ps.lookup_many(ids, True, 0), ParameterServer(SPECS, seed=SEED).lookup_many(ids), rtol=0)
  with pytest.raises(RemotePSError, match="Configure failed"):
    RemotePS([addr], SPECS, seed=SEED, timeout_s=1.0)  # plaintext to a TLS server


# -- the wire format on its own -----------------------------------------------------------------
def test_wire_round_trip_and_checks():
  rows = np.linspace(-3, 3, 12, dtype=np.float32).reshape(4, 3)
  msg = wire.encode(
    {"step": 3, "x": [1, "a"]},
    {"ids/a/b": np.array([0, 2**64 - 1], np.uint64), "rows/a/b": wire.to_wire(rows, "bfloat16"), "e/t": rows[:0]},
  )
  got = wire.decode(msg)
  assert got.fields == {"step": 3, "x": [1, "a"]}
  np.testing.assert_array_equal(got.arrays["ids/a/b"], [0, 2**64 - 1])
  assert got.arrays["rows/a/b"].dtype == wire.DTYPES["bfloat16"] and got.arrays["e/t"].shape == (0, 3)
  np.testing.assert_allclose(wire.from_wire(got.arrays["rows/a/b"]), rows, rtol=2**-8)
  assert wire.split_name("rows/a/b") == ("rows", "a/b")
  for bad, text in [
    (msg[:-1], "payload bytes"),
    (b"RPS1" + struct.pack("<I", 2**30), "exceeds"),
    (_raw([1, 2]), "JSON object"),
    (_raw({"v": 2, "fields": {}, "arrays": [], "payload_bytes": 0}), "version"),
    (
      _raw(
        {
          "v": 1,
          "fields": {},
          "payload_bytes": 8,
          "arrays": [{"name": "x/t", "dtype": "uint64", "shape": [-1], "offset": 0}],
        },
        bytes(8),
      ),
      "negative",
    ),
    (
      _raw(
        {
          "v": 1,
          "fields": {},
          "payload_bytes": 8,
          "arrays": [{"name": "x/t", "dtype": "uint64", "shape": [1], "offset": 4}],
        },
        bytes(8),
      ),
      "multiple of 8",
    ),
    (_raw({"v": 1, "fields": {}, "payload_bytes": 0, "arrays": [{"name": "x/t"}]}), "exactly"),
  ]:
    with pytest.raises(wire.WireError, match=text):
      wire.decode(bad)
  with pytest.raises(wire.WireError, match="cannot be sent"):
    wire.encode({}, {"x/t": np.zeros(2, np.int64)})
  for s in SPECS:
    assert wire.spec_from_json(json.loads(json.dumps(wire.spec_to_json(s)))) == s
  with pytest.raises(wire.WireError, match="unknown fields"):
    wire.spec_from_json({"name": "t", "dim": 2, "colour": 1})
  # Routing: stable, balanced, and independent of the in-process PS's shard hash.
  ids = np.arange(30000, dtype=np.uint64)
  counts = np.bincount(hashing.server_of("user", ids, SEED, 3), minlength=3)
  assert counts.min() > 9000
  local = ParameterServer(SPECS, num_shards=2, seed=SEED).shard_of("user", ids)
  inside = local[hashing.server_of("user", ids, SEED, 2) == 0]
  assert 0.45 < inside.mean() < 0.55  # a server's ids still spread over its local shards


def test_bounded_tables_resume_exactly_on_servers(servers, tmp_path):
  """Admission sketch, table step and expiry cadence survive a snapshot onto fresh servers,
  as many as before and one (in-process too): a resumed PS then answers as the one that went on."""
  specs = [
    TableSpec(name=t, dim=d, optimizer="sgd", optimizer_kwargs=(("learning_rate", 0.1),), admit_after=3, expire_after=3)
    for t, d in DIMS.items()
  ]
  started = servers.start(5)
  src_addrs, same, one = [a for a, _ in started[:2]], [a for a, _ in started[2:4]], [started[4][0]]

  def train(pss, steps, start, seed):
    rng = np.random.default_rng(seed)
    for step in range(start, start + steps):
      ids = {t: _ids(rng, 150, high=400) for t in DIMS}
      rows = [ps.lookup_many(ids, True, step) for ps in pss]
      for r in rows[1:]:
        _assert_rows_equal(rows[0], r, rtol=0)
      g = _grads(rng, ids)
      for ps in pss:
        ps.apply_many(g, step)

  every = {t: np.arange(400, dtype=np.uint64) for t in DIMS}
  with (
    RemotePS(src_addrs, specs, seed=SEED) as src,
    RemotePS(same, specs, seed=SEED) as two,
    RemotePS(one, specs, seed=SEED) as single,
  ):
    train([src], 6, 0, seed=1)
    snap = str(tmp_path / "snap")
    src.save_snapshot(snap, step=6)
    two.load_snapshot([snap], step=6)
    single.load_snapshot([snap], step=6)
    local = ParameterServer(specs, num_shards=2, seed=SEED)
    load_into(local, [snap])
    train([src, two, single, local], 6, 6, seed=2)  # every lookup equal: ids admitted and expired alike
    want = src.lookup_many(every, create=False)
    for ps in (two, single, local):
      _assert_rows_equal(ps.lookup_many(every, create=False), want, rtol=0)
    local.close()


def test_a_disk_tier_on_the_servers_resumes_as_no_stop(servers, tmp_path):
  """``config.ps.tier`` with PS servers: each server spills what its capacity evicts to its own
  tier (not dropped), its snapshots say which rows are there, and a stop at step 4 resumed on
  fresh servers ends at step 8 with every row where the run that never stopped has it: same
  ids, weights, slots, last-seen step, use count and place (RAM or tier), read back as
  ``test_composition`` does (a chain into an in-process PS with a tier). Found by
  test_composition: the servers had no tier, and the read-back put the rows past its capacity
  into its tier in the order of the chain, so -1 against a step for ~10% of the rows."""
  from configs import tiny
  from recsys_jax.async_ps import factory

  specs = [
    TableSpec(name=t, dim=d, optimizer="adagrad", optimizer_kwargs=(("learning_rate", 0.1),), capacity=40, eviction=e)
    for (t, d), e in zip(DIMS.items(), ("lru", "lfu"))
  ]
  c = tiny.get_config()
  c.seed, c.staleness, c.ps.kind, c.ps.tier = SEED, 0, "remote", "memory"
  addrs = [a for a, _ in servers.start(4)]

  def remote(addresses):
    c.ps.addresses = ",".join(addresses)
    return factory.build_ps(c, specs, str(tmp_path))

  def train(ps, start, stop):
    for step in range(start, stop):
      rng = np.random.default_rng(step)
      # Fewer ids after the stop: the resumed chain's last (incremental) snapshot holds a part
      # of the rows, so a chain read back in its order puts others where the full one does.
      ids = {t: _ids(rng, 60 if step < 4 else 12, high=300) for t in DIMS}
      ps.lookup_many(ids, True, step)
      ps.apply_many(_grads(rng, ids), step)

  snaps = {n: str(tmp_path / n) for n in ("2", "4", "8", "8-resumed")}
  with remote(addrs[:2]) as ps:
    train(ps, 0, 2)
    ps.save_snapshot(snaps["2"], step=2)
    train(ps, 2, 4)
    ps.save_snapshot(snaps["4"], incremental=True, step=4)
    train(ps, 4, 8)
    ps.save_snapshot(snaps["8"], step=8)
  with remote(addrs[2:]) as ps:
    ps.load_snapshot([snaps["2"], snaps["4"]], step=4)
    train(ps, 4, 8)
    ps.save_snapshot(snaps["8-resumed"], incremental=True, step=8)
  for t in DIMS:  # the servers spilled (their parts say where each row is)
    parts = [snapshot.read(os.path.join(snaps["8"], f"server-{i}"))[t] for i in range(2)]
    assert all("spilled" in p for p in parts) and sum(int(p["spilled"].sum()) for p in parts) > 0, t

  def read_back(chain):
    local = ParameterServer(specs, seed=SEED, tier={"driver": "memory"})
    load_into(local, chain)
    out = {}
    for t, part in local.snapshot().items():
      order = np.argsort(part["ids"])
      out[t] = {k: v[order] for k, v in part.items()}
    local.close()
    return out

  want, got = read_back([snaps["8"]]), read_back([snaps["2"], snaps["4"], snaps["8-resumed"]])
  for t in DIMS:
    assert sorted(want[t]) == sorted(got[t]) and "spilled" in want[t], t
    for k in want[t]:
      np.testing.assert_array_equal(got[t][k], want[t][k], err_msg=f"{t}/{k}")


def test_the_tier_a_client_asks_for_is_checked_and_each_server_has_its_own(start, tmp_path):
  """Configure's tier: a spec without a driver is refused, a file path outside --snapshot_root
  too (the client names where the server writes, as for snapshots), another tier than the
  first Configure's too; a file tier is the server's own ``server-<i>/`` under the path."""
  specs = [TableSpec(name="user", dim=4, capacity=8)]
  root = tmp_path / "root"
  addrs = [start(snapshot_root=str(root))[0] for _ in range(2)]
  with pytest.raises(RemotePSError, match="INVALID_ARGUMENT.*'tier' must be a tensorstore kvstore spec"):
    RemotePS(addrs, specs, tier={"path": "x"})
  with pytest.raises(RemotePSError, match="PERMISSION_DENIED.*the tier path.*outside --snapshot_root"):
    RemotePS(addrs, specs, tier={"driver": "file", "path": str(tmp_path / "elsewhere")})
  tier = {"driver": "file", "path": str(root / "tier")}
  with RemotePS(addrs, specs, tier=tier) as ps:
    for step in range(3):  # rows of the step before are not protected from eviction any more
      ps.lookup_many({"user": np.arange(40 * step, 40 * step + 40, dtype=np.uint64)}, True, step)
      ps.apply_many({}, step)
    stats = ps.stats()["user"]
    assert stats["rows"] == 40 and stats["tier_rows"] == 80, stats  # in RAM: the last step's, protected
  assert sorted(os.listdir(root / "tier")) == ["server-0", "server-1"]
  with pytest.raises(RemotePSError, match="FAILED_PRECONDITION.*tier is .* on this server, None in the request"):
    RemotePS(addrs, specs)
