"""Compiles a PS server's numba kernels before it says it is ready: ``warm_up``.

numba compiles a kernel on its first call for the argument types of that call (or loads it
from its on-disk cache, which takes far less). Without this the first lookup and push of a
fresh server compile the id map's probing and the row optimizer's update inside the client's
deadline: seconds with a cold cache. The tables are only known at ``Configure``, so every row
optimizer is warmed, and a bounded table's eviction. The calls go through a throwaway ``ShardServer``'s own handlers with
decoded messages, so the arrays have the types real calls have.

Servers started together (a launcher starts several) would each compile the same kernels at
once, on the same cores; a file lock per numba cache lets one compile while the others wait
and then load what it cached.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from typing import Iterator

import numpy as np

from recsys_jax.async_ps import wire
from recsys_jax.async_ps.optim import optimizers
from recsys_jax.embeddings.specs import TableSpec


class _Context:
  """What the handlers ask of a gRPC context: no deadline, always active."""

  def time_remaining(self):
    return None

  def is_active(self) -> bool:
    return True

  def add_callback(self, callback) -> bool:
    del callback
    return True


def _call(handler, fields, arrays=None) -> wire.Message:
  return wire.decode(handler(wire.decode(wire.encode(fields, arrays)), _Context()))


@contextlib.contextmanager
def _one_at_a_time() -> Iterator[None]:
  """Holds a lock shared by the processes that use the same numba cache (none where flock is missing)."""
  try:
    import fcntl
  except ImportError:  # not POSIX: each process compiles for itself
    yield
    return
  cache = os.environ.get("NUMBA_CACHE_DIR") or os.path.dirname(os.path.abspath(__file__))
  name = hashlib.sha256(cache.encode("utf-8")).hexdigest()[:16]
  with open(os.path.join(tempfile.gettempdir(), f"recsys_jax-warmup-{name}.lock"), "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def warm_up(local_shards: int = 1) -> float:
  """Looks up and pushes to a table of every row optimizer in a throwaway server.

  Args:
    local_shards: shards of the in-process PS (as the real server's).

  Returns:
    The seconds it took.
  """
  from recsys_jax.async_ps.server.rpc import ShardServer  # rpc imports the service, which needs no warm-up

  t0 = time.perf_counter()
  with _one_at_a_time():
    _run(ShardServer(local_shards=local_shards), local_shards)
  return time.perf_counter() - t0


def _run(server, local_shards: int) -> None:
  dim = 4
  specs = [TableSpec(name=name, dim=dim, optimizer=name) for name in optimizers.NAMES]
  # A bounded table evicts from the second step on: the id map's deletion kernels.
  specs.append(TableSpec(name="bounded", dim=dim, capacity=64))
  cfg = {"seed": 0, "num_workers": 1, "staleness": 0, "shard_index": 0, "num_shards": 1}
  _call(server._rpc_configure, {**cfg, "tables": [wire.spec_to_json(s) for s in specs]})
  for step in range(3):
    ids = np.arange(step * 64, (step + 1) * 64, dtype=np.uint64)
    arrays = {f"ids/{s.name}": ids for s in specs}
    _call(server._rpc_lookup, {"step": step, "create": True}, arrays)
    grads = {f"grads/{s.name}": np.full((64, dim), 0.01, np.float32) for s in specs}
    _call(server._rpc_push, {"worker": 0, "step": step, "request_id": f"warm-{step}"}, {**arrays, **grads})
  _call(server._rpc_lookup, {"create": False}, {f"ids/{s.name}": np.arange(64, dtype=np.uint64) for s in specs})
  server.service.ps.close()
