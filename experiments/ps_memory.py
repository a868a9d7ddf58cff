"""A PS server's memory per request and its first-request latency, measured on a real server process.

    python experiments/ps_memory.py [--sizes_mb=15,60,240] [--narrow_mb=60] [--dim=64] [--concurrent=4] \\
      [--concurrent_mb=60] [--concurrent_push] [--max_request_mb=0] [--server_flags='--max_inflight_mb=512'] [--latency]

Starts ``python -m recsys_jax.async_ps.server`` and calls it through ``RemotePS``: per size (MiB of
rows; ``--narrow_mb``: of ids, dim 2) a ``create`` (new ids), a ``lookup`` (the same again) and a
``push``, each with the server's peak RSS reset first (``/proc/PID/clear_refs``): ``peak_mb`` (VmHWM
after - VmRSS before), ``table_mb`` (the tables' growth) and ``x_payload`` = (peak - table) / the
bytes of the request and its answer. ``--concurrent`` clients call at once (their peak together);
``--latency``: seconds to the ready line with a cold and a warm numba cache, and the first calls.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import tempfile
import time
from typing import Any, Dict, List, Optional

import numpy as np
from absl import app, flags
from harness import processes
from harness.ps import proc_bytes

from recsys_jax.async_ps.client.remote import RemotePS, RemotePSError
from recsys_jax.embeddings.specs import TableSpec

_SIZES = flags.DEFINE_list("sizes_mb", ["15", "60", "240"], "Payload sizes (MiB of rows) to measure.")
_NARROW = flags.DEFINE_list("narrow_mb", [], "Sizes (MiB of request ids) for a dim-2 table.")
_DIM = flags.DEFINE_integer("dim", 64, "Row width of the wide table.")
_CONC = flags.DEFINE_integer("concurrent", 0, "Clients looking up at once (0: skip).")
_CONC_MB = flags.DEFINE_integer("concurrent_mb", 60, "MiB of rows each concurrent client looks up or pushes.")
_CONC_PUSH = flags.DEFINE_bool("concurrent_push", False, "The concurrent clients push instead of looking up.")
_MAX_REQ = flags.DEFINE_float("max_request_mb", 0.0, "RemotePS max_request_mb (0: derived from the server).")
_SERVER_FLAGS = flags.DEFINE_string("server_flags", "", "Extra server flags, space-separated.")
_LATENCY = flags.DEFINE_bool("latency", False, "Measure first-request latency with a cold and a warm numba cache.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 300.0, "RemotePS deadline per call.")
_MIB = 1 << 20


def _status(pid: int, key: str) -> float:
  """A memory field of process ``pid``'s /proc status, in MiB."""
  return proc_bytes(key, f"/proc/{pid}/status") / _MIB


def _reset_peak(pid: int) -> None:
  with open(f"/proc/{pid}/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS


def _start(extra: List[str], env: Optional[Dict[str, str]] = None):
  """A PS server: the process, its address and the seconds to its ready line."""
  t0 = time.monotonic()
  proc, line = processes.start("recsys_jax.async_ps.server", ["--port=0", *extra], env=env)
  return proc, line.split()[1], time.monotonic() - t0


def _client(addr: str, specs) -> RemotePS:
  return RemotePS([addr], specs, seed=1, timeout_s=_TIMEOUT.value, lookup_retries=0, max_request_mb=_MAX_REQ.value)


def _table_mb(ps: Optional[RemotePS]) -> float:
  return 0.0 if ps is None else sum(t["bytes"] for t in ps.stats().values()) / _MIB


def _measure(pid: int, payload_mb: float, fn, ps: Optional[RemotePS] = None) -> Dict[str, float]:
  time.sleep(0.2)
  table = _table_mb(ps)
  _reset_peak(pid)
  before = _status(pid, "VmRSS")
  t0 = time.perf_counter()
  try:
    fn()
  except RemotePSError as e:
    return {"payload_mb": round(payload_mb, 1), "error": str(e)[:300]}
  took = time.perf_counter() - t0
  peak = _status(pid, "VmHWM") - before
  grown = _table_mb(ps) - table
  return {
    "payload_mb": round(payload_mb, 1),
    "peak_mb": round(peak, 1),
    "table_mb": round(grown, 1),
    "x_payload": round((peak - grown) / payload_mb, 2),
    "s": round(took, 3),
  }


def _sizes(ps: RemotePS, pid: int, table: str, dim: int, sizes: List[float], per_id: int, base: int) -> List[Any]:
  out = []
  rng = np.random.default_rng(0)
  for mb in sizes:
    n = int(mb * _MIB) // per_id
    ids = np.arange(base, base + n, dtype=np.uint64)
    base += n
    row_mb = n * dim * 4 / _MIB
    grads = rng.standard_normal((n, dim), dtype=np.float32)
    res = {"size_mb": mb, "ids": n}
    payload = row_mb + n * 8 / _MIB  # ids and rows, or ids and gradients
    res["create"] = _measure(pid, payload, functools.partial(ps.lookup, table, ids, True), ps)
    res["lookup"] = _measure(pid, payload, functools.partial(ps.lookup, table, ids, True), ps)
    res["push"] = _measure(pid, payload, functools.partial(ps.apply, table, ids, grads), ps)
    print(table, json.dumps(res), flush=True)
    out.append(res)
  return out


def _concurrent_client(addr: str, dim: int, n: int, index: int, push: bool, ready, go, results) -> None:
  """One client process: makes its rows, then on ``go`` looks them up (or pushes to them) once."""
  specs = [TableSpec(name="wide", dim=dim, optimizer="adagrad"), TableSpec(name="narrow", dim=2)]
  ids = np.arange(10**9 + index * n, 10**9 + (index + 1) * n, dtype=np.uint64)
  grads = np.ones((n, dim), np.float32) if push else None
  with RemotePS([addr], specs, seed=1, timeout_s=600, lookup_retries=0) as ps:
    ps.lookup("wide", ids, True)  # rows exist before the measured call
    ready.release()
    go.wait()
    try:
      ps.apply("wide", ids, grads) if push else ps.lookup("wide", ids, True)
      results.put("")
    except Exception as e:  # noqa: BLE001 - reported
      results.put(f"{type(e).__name__}: {e}"[:300])


def _concurrent(addr: str, pid: int, k: int, mb: int, dim: int) -> Dict[str, Any]:
  """``k`` client processes (threads of one would take turns at the GIL) call at once."""
  ctx = multiprocessing.get_context("spawn")
  ready, go, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
  n = mb * _MIB // (4 * dim)
  procs = [
    ctx.Process(target=_concurrent_client, args=(addr, dim, n, i, _CONC_PUSH.value, ready, go, results))
    for i in range(k)
  ]
  for p in procs:
    p.start()
  for _ in procs:
    ready.acquire()
  errors = []

  def run():
    go.set()
    errors.extend(e for e in (results.get() for _ in procs) if e)

  res = _measure(pid, k * mb, run)
  for p in procs:
    p.join()
  res.update(clients=k, each_mb=mb, push=_CONC_PUSH.value, errors=errors)
  print("concurrent", json.dumps(res), flush=True)
  return res


def _latency(extra: List[str]) -> Dict[str, Any]:
  specs = [TableSpec(name="t", dim=64, optimizer="adagrad")]
  out = {}
  with tempfile.TemporaryDirectory() as cache:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache}
    for label in ("cold", "warm"):
      proc, addr, ready_s = _start(extra, env)
      try:
        with _client(addr, specs) as ps:
          r = {"ready_s": round(ready_s, 2)}
          for i, what in enumerate(("first", "second")):
            ids = np.arange(i * 1000, (i + 1) * 1000, dtype=np.uint64)
            t0 = time.perf_counter()
            ps.lookup("t", ids, True)
            r[f"{what}_lookup_s"] = round(time.perf_counter() - t0, 3)
            t0 = time.perf_counter()
            ps.apply("t", ids, np.ones((1000, 64), np.float32))
            r[f"{what}_push_s"] = round(time.perf_counter() - t0, 3)
      finally:
        processes.stop(proc)
      out[label] = r
      print("latency", label, json.dumps(r), flush=True)
  return out


def main(argv):
  del argv
  extra = _SERVER_FLAGS.value.split()
  result: Dict[str, Any] = {"server_flags": extra, "max_request_mb": _MAX_REQ.value}
  if _LATENCY.value:
    result["latency"] = _latency(extra)
  sizes = [float(s) for s in _SIZES.value]
  narrow = [float(s) for s in _NARROW.value]
  if sizes or narrow or _CONC.value:
    specs = [TableSpec(name="wide", dim=_DIM.value, optimizer="adagrad"), TableSpec(name="narrow", dim=2)]
    proc, addr, _ = _start(extra)
    try:
      with _client(addr, specs) as ps:
        ps.lookup("wide", np.arange(10, dtype=np.uint64), True)  # compiled, grpc warmed
        ps.apply("wide", np.arange(10, dtype=np.uint64), np.ones((10, _DIM.value), np.float32))
        result["server_idle_mb"] = round(_status(proc.pid, "VmRSS"), 1)
        result["wide"] = _sizes(ps, proc.pid, "wide", _DIM.value, sizes, 4 * _DIM.value, 10**6)
        result["narrow"] = _sizes(ps, proc.pid, "narrow", 2, narrow, 8, 10**12)
      if _CONC.value:
        result["concurrent"] = _concurrent(addr, proc.pid, _CONC.value, _CONC_MB.value, _DIM.value)
    finally:
      processes.stop(proc)
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)
