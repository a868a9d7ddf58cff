"""One deadline per call: a hung PS server (SIGSTOP) fails every client call within ``timeout_s``.

A stopped server still accepts TCP connections (the kernel does) but never answers, so every
call to it can only end by its deadline. Each call of ``RemotePS`` must end within
``timeout_s`` (retries included) naming the server, and a snapshot or restore within its own,
longer bound; the config's bound is ``factory.snapshot_timeout``.
"""

import signal
import time

import grpc
import numpy as np
import pytest

from recsys_jax.async_ps import factory
from recsys_jax.async_ps.client.remote import RemotePS, RemotePSError
from recsys_jax.embeddings.specs import TableSpec
from tests.helpers.servers import ServerProcesses

SPECS = [TableSpec(name="user", dim=4, optimizer="adagrad", optimizer_kwargs=(("learning_rate", 0.1),))]
TIMEOUT = 1.5
MARGIN = 0.75  # thread hand-offs and the gRPC deadline's own slack, on a busy 2-core machine
SNAPSHOT_TIMEOUT = 2 * TIMEOUT


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
  """Two servers, a client of both, and a snapshot of them; then the second server is SIGSTOPped.

  Yields:
    (addresses, the client (timeout_s=TIMEOUT, snapshot_timeout_s=SNAPSHOT_TIMEOUT), the snapshot).
  """
  tmp = tmp_path_factory.mktemp("servers")
  servers, client = ServerProcesses(tmp), None
  try:
    procs = servers.start(2)
    addresses = [a for a, _ in procs]
    # Step 0 and the snapshot with a generous deadline: the servers compile their kernels first.
    with RemotePS(addresses, SPECS, timeout_s=60) as warm:
      warm.lookup_many(_ids(), True, 0)
      warm.apply_many(_grads(), 0)
      warm.save_snapshot(str(tmp / "snapshot"), step=1)
    client = RemotePS(addresses, SPECS, timeout_s=TIMEOUT, snapshot_timeout_s=SNAPSHOT_TIMEOUT)
    procs[1][1].send_signal(signal.SIGSTOP)
    yield addresses, client, str(tmp / "snapshot")
  finally:
    if client is not None:
      client.close()
    for p in servers.procs:
      p.send_signal(signal.SIGCONT)
    servers.close()


def _ids():
  return {"user": np.arange(256, dtype=np.uint64)}


def _grads():
  return {"user": (_ids()["user"], np.ones((256, 4), np.float32))}


def _timed(fn):
  t0 = time.monotonic()
  with pytest.raises(RemotePSError) as err:
    fn()
  return time.monotonic() - t0, err.value


def _check(err, address, method):
  assert err.address == address and err.rpc == method
  assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
  assert f"PS server {address} (shard 1 of 2): {method} failed: DEADLINE_EXCEEDED" in str(err)


CALLS = {
  "Lookup": lambda ps: ps.lookup_many(_ids(), True, 1),  # retried, within the one deadline
  "Push": lambda ps: ps.apply_many(_grads(), 1),
  "Stats": lambda ps: ps.stats(),
  "Health": lambda ps: ps.health(),
}


@pytest.mark.parametrize("method", sorted(CALLS))
def test_a_call_to_a_hung_server_ends_within_timeout_s(stopped, method):
  addresses, client, _ = stopped
  took, err = _timed(lambda: CALLS[method](client))
  print(f"{method} to a stopped server failed after {took:.2f} s (timeout_s {TIMEOUT})")
  assert took < TIMEOUT + MARGIN, f"{method} took {took:.2f} s, timeout_s is {TIMEOUT}"
  _check(err, addresses[1], method)


def test_configure_of_a_hung_server_ends_within_timeout_s(stopped):
  addresses, _, _ = stopped
  took, err = _timed(lambda: RemotePS(addresses, SPECS, timeout_s=TIMEOUT))
  print(f"Configure to a stopped server failed after {took:.2f} s")
  assert took < TIMEOUT + MARGIN
  _check(err, addresses[1], "Configure")


@pytest.mark.parametrize("method", ["Snapshot", "Restore"])
def test_snapshot_and_restore_of_a_hung_server_end_within_their_bound(stopped, tmp_path, method):
  addresses, client, chain = stopped
  if method == "Snapshot":
    took, err = _timed(lambda: client.save_snapshot(str(tmp_path / "again"), step=1))
  else:
    took, err = _timed(lambda: client.load_snapshot([chain], step=1))
  print(f"{method} to a stopped server failed after {took:.2f} s (snapshot_timeout_s {SNAPSHOT_TIMEOUT})")
  assert SNAPSHOT_TIMEOUT - 0.1 < took < SNAPSHOT_TIMEOUT + MARGIN
  _check(err, addresses[1], method)


def test_the_configs_snapshot_bound_follows_timeout_s(monkeypatch):
  from configs import tiny
  from recsys_jax.async_ps.client import remote

  config = tiny.get_config()
  assert config.ps.snapshot_timeout_s == 0.0
  config.ps.timeout_s = 4.0
  assert factory.snapshot_timeout(config.ps) == 40.0 == factory.SNAPSHOT_TIMEOUT_FACTOR * 4.0
  config.ps.snapshot_timeout_s = 900.0
  assert factory.snapshot_timeout(config.ps) == 900.0
  # The trainer's client gets them: a server hung during a checkpoint is found within 40 s, not an hour.
  config.ps.snapshot_timeout_s = 0.0
  config.ps.kind, config.ps.addresses = "remote", "127.0.0.1:1"
  got = {}
  monkeypatch.setattr(remote, "RemotePS", lambda addresses, tables, **kw: got.update(kw))
  factory.build_ps(config, SPECS)
  assert got["timeout_s"] == 4.0 and got["snapshot_timeout_s"] == 40.0
