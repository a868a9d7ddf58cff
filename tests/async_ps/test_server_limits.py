"""One client must not be able to jam a PS server (issue 13, item 3): waits bounded by the server,
cancelled calls freeing their threads, steps far ahead refused without changing anything, ids that
are not unsigned or non-negative integers refused by server and client."""

import os
import select
import subprocess
import sys
import time

import grpc
import ml_dtypes
import numpy as np
import pytest

from recsys_jax.async_ps import wire
from recsys_jax.async_ps.client.remote import RemotePS, RemotePSError
from recsys_jax.async_ps.store.ids import as_ids
from recsys_jax.embeddings.specs import TableSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = [TableSpec(name="user", dim=4), TableSpec(name="item", dim=2)]
C = grpc.StatusCode


class _Raw:
  """Calls without a deadline unless given one, as a client that sets none would."""

  def __init__(self, address):
    self.channel = grpc.insecure_channel(address)
    self.stubs = {m: self.channel.unary_unary(wire.path(m)) for m in wire.METHODS}

  def future(self, method, fields=None, arrays=None, timeout=None):
    return self.stubs[method].future(wire.encode(fields or {}, arrays), timeout=timeout)

  def status(self, method, fields=None, arrays=None, timeout=10):
    try:
      return C.OK, wire.decode(self.stubs[method](wire.encode(fields or {}, arrays), timeout=timeout)).fields
    except grpc.RpcError as e:
      return e.code(), e.details()

  def health(self, timeout=2):
    code, got = self.status("Health", timeout=timeout)
    assert code == C.OK, f"Health: {code}: {got}"
    return got


def _ids(n=5):
  return np.arange(n, dtype=np.uint64)


def _step(ps, step):
  """A trainer's step: lookup, then push."""
  ids = {"user": _ids()}
  ps.lookup_many(ids, True, step)
  ps.apply_many({"user": (ids["user"], np.ones((5, 4), np.float32))}, step)


def _code(future, timeout):
  try:
    future.result(timeout=timeout)
  except grpc.FutureTimeoutError:
    return None
  except grpc.RpcError as e:
    return e.code(), e.details()
  return C.OK, ""


def test_a_wait_ends_within_max_wait_s_whatever_the_deadline(start):
  addr, _ = start(max_wait_s=2)
  raw = _Raw(addr)
  with RemotePS([addr], SPECS, seed=1) as ps:
    _step(ps, 0)
    t0 = time.monotonic()
    # Step 5 waits for the pushes of steps <= 4, which no one sends; no deadline.
    got = _code(raw.future("Lookup", {"step": 5}, {"ids/user": _ids()}), timeout=15)
    took = time.monotonic() - t0
    assert got is not None, "a lookup without a deadline still waited after 15 s"
    code, details = got
    assert code == C.DEADLINE_EXCEEDED, details
    assert 1.9 < took < 4, took
    for text in ("the lookup of step 5", "steps <= 4", "only steps <= 0 are applied", "--max_wait_s=2"):
      assert text in details, details
    _step(ps, 1)  # the server goes on
    assert raw.health()["applied_step"] == 1
  raw.channel.close()


def test_cancelled_waits_free_their_threads(start):
  addr, handlers = start(threads=4)
  raw = _Raw(addr)
  with RemotePS([addr], SPECS, seed=1) as ps:
    _step(ps, 0)
    # More waiting lookups (no deadline) than the server has threads.
    futures = [raw.future("Lookup", {"step": 5}, {"ids/user": _ids()}) for _ in range(6)]
    t0 = time.monotonic()
    while raw.health()["waiting_calls"] < 2 and time.monotonic() - t0 < 5:
      time.sleep(0.05)
    t0 = time.monotonic()
    state = raw.health()  # Health still finds a thread while lookups wait
    health_s = time.monotonic() - t0
    assert state["waiting_calls"] == 2, state
    assert health_s < 1, health_s
    # The lookups beyond threads - 2 are refused at once, and say why.
    t0 = time.monotonic()
    while sum(f.done() for f in futures) < 4 and time.monotonic() - t0 < 5:
      time.sleep(0.02)
    refused = [f for f in futures if f.done()]
    assert len(refused) == 4
    for f in refused:
      code, details = _code(f, 0)
      assert code == C.UNAVAILABLE and "--threads" in details, details
    for f in futures:
      f.cancel()
    t0 = time.monotonic()
    while raw.health()["waiting_calls"] and time.monotonic() - t0 < 5:
      time.sleep(0.02)
    freed_s = time.monotonic() - t0
    assert raw.health()["waiting_calls"] == 0 and freed_s < 1.5, freed_s
    assert raw.health()["refused"].get("Lookup:CANCELLED") == 2
    # Threads are free again: new waits are admitted, and a normal step goes through.
    again = [raw.future("Lookup", {"step": 5}, {"ids/user": _ids()}) for _ in range(2)]
    t0 = time.monotonic()
    while raw.health()["waiting_calls"] < 2 and time.monotonic() - t0 < 5:
      time.sleep(0.02)
    assert raw.health()["waiting_calls"] == 2
    for f in again:
      f.cancel()
    t0 = time.monotonic()
    _step(ps, 1)
    assert time.monotonic() - t0 < 2
    assert handlers.service.state()["applied_step"] == 1
  raw.channel.close()


def test_steps_far_ahead_are_refused_and_change_nothing(start):
  addr, handlers = start(step_window=10)
  raw = _Raw(addr)
  with RemotePS([addr], SPECS, seed=1, staleness=2) as ps:
    _step(ps, 0)
    _step(ps, 1)
    before = ps.stats()["user"]["applied_rows"]
    with pytest.raises(RemotePSError, match=r"OUT_OF_RANGE.*step 1000000 is 999999 steps ahead.*up to 13"):
      ps.apply_many({}, 10**6)  # an empty push of a far step
    with pytest.raises(RemotePSError, match=r"OUT_OF_RANGE.*step 14 "):
      ps.lookup_many({"user": _ids()}, True, 14)
    code, details = raw.status("Snapshot", {"directory": "/nonexistent/s", "step": 10**6})
    assert code == C.OUT_OF_RANGE and "the snapshot at step 1000000" in details, details
    code, details = raw.status("Lookup", {"step": 2**70}, {"ids/user": _ids()})
    assert code == C.INVALID_ARGUMENT and "outside" in details, details
    state = handlers.service.state()
    assert state["applied_step"] == 1 and state["pending_steps"] == [], state
    # Later pushes apply; a late or repeated step is refused as before.
    _step(ps, 2)
    _step(ps, 3)
    with pytest.raises(RemotePSError, match="FAILED_PRECONDITION.*already applied"):
      ps.apply_many({}, 2)
    assert ps.stats()["user"]["applied_rows"] == before + 10
    assert raw.health()["applied_step"] == 3
  raw.channel.close()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_server_refuses_ids_that_are_not_uint64(start, dtype):
  addr, handlers = start()
  raw = _Raw(addr)
  with RemotePS([addr], SPECS, seed=1):
    ids = _ids().astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    code, details = raw.status("Lookup", {}, {"ids/item": ids})
    assert code == C.INVALID_ARGUMENT and "table 'item': ids must be 1-D uint64" in details, details
    push = {"worker": 0, "step": 0, "request_id": "r"}
    code, details = raw.status("Push", push, {"ids/item": ids, "grads/item": np.ones((5, 2), np.float32)})
    assert code == C.INVALID_ARGUMENT and "table 'item'" in details, details
    assert handlers.ps.stats()["item"]["rows"] == 0
  raw.channel.close()


def test_remote_ps_refuses_ids_that_are_not_non_negative_integers(start):
  addr, handlers = start()
  g = np.ones((2, 2), np.float32)
  bad = [[-1, 2], np.array([3, -4]), np.array([1.0, 2.0]), [1.5, 2], np.array([True, False]), ["1", "2"]]
  with RemotePS([addr], SPECS, seed=1) as ps:
    for ids in bad:
      with pytest.raises(ValueError, match="table 'item': ids must be"):
        ps.lookup_many({"item": ids}, True, 0)
      with pytest.raises(ValueError, match="table 'item': ids must be"):
        ps.apply_many({"item": (ids, g)}, 0)
    stats = handlers.ps.stats()["item"]
    assert stats["rows"] == 0 and stats["applied_rows"] == 0  # nothing was sent
    # Non-negative integers of any integer type are ids.
    rows = ps.lookup_many({"item": [1, 2]}, True, 0)["item"]
    np.testing.assert_array_equal(rows, ps.lookup_many({"item": np.array([1, 2], np.int32)}, False)["item"])
    ps.apply_many({"item": (np.array([1, 2], np.int64), g)}, 0)
    assert handlers.ps.stats()["item"]["applied_rows"] == 2


def test_as_ids():
  assert as_ids([], "t").dtype == np.uint64
  x = np.array([1, 2**64 - 1], np.uint64)
  assert as_ids(x, "t") is x
  np.testing.assert_array_equal(as_ids([0, 7], "t"), np.array([0, 7], np.uint64))
  with pytest.raises(ValueError, match="table 't': ids must be non-negative, got -3"):
    as_ids(np.array([[1], [-3]]), "t")
  for bad in ([0.0], np.zeros(2, np.float16), [True], [2**64]):
    with pytest.raises(ValueError, match="unsigned or non-negative integers"):
      as_ids(bad, "t")


def test_server_flags():
  proc = subprocess.Popen(
    [sys.executable, "-m", "recsys_jax.async_ps.server", "--port=0", "--max_wait_s=1", "--step_window=5"],
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
    cwd=ROOT,
  )
  try:
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    assert line.startswith("ready "), line
    addr = line.split()[1]
    with RemotePS([addr], SPECS, seed=1, timeout_s=10, lookup_retries=0) as ps:
      _step(ps, 0)
      with pytest.raises(RemotePSError, match="OUT_OF_RANGE.*--step_window 5"):
        ps.lookup_many({"user": _ids()}, True, 6)
      t0 = time.monotonic()
      with pytest.raises(RemotePSError, match="DEADLINE_EXCEEDED.*--max_wait_s=1"):
        ps.lookup_many({"user": _ids()}, True, 5)
      assert time.monotonic() - t0 < 3
  finally:
    proc.terminate()
    proc.wait(timeout=10)
    proc.stdout.close()
