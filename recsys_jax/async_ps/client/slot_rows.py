"""Rows with their optimizer slots, out of PS shard servers and back (``RemotePS.export_rows_many`` /
``import_rows_many``).

The same two calls as ``ParameterServer.export_rows_many`` / ``import_rows_many``, over the
servers' ``ExportRows`` / ``ImportRows`` RPCs: ids routed to their servers as a lookup's are, all
servers in parallel, each server's part in chunks under its message limit within one deadline, the
answers put back in the caller's order. Rows and slots travel as float32 whatever ``wire_dtype``
is: optimizer state is never rounded for the wire.

Both are retried on UNAVAILABLE / DEADLINE_EXCEEDED as lookups are: an export only reads, and
an import sets values, so doing it twice leaves what doing it once does. An import is checked
whole before anything is sent; a server failing midway may leave some chunks imported and
others not (the error says which server), and importing the same rows again completes it.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from recsys_jax.async_ps import wire
from recsys_jax.async_ps.client.shards import Shards
from recsys_jax.async_ps.store.ids import distinct_ids
from recsys_jax.async_ps.store.rows import check_rows

_F32 = wire.DTYPES["float32"]


def _chunks(shards: Shards, s: int, part: Mapping[str, np.ndarray], fields, request: bool, what: str):
  """The chunks of server s's part of an export (``request`` False: rows in the answer) or an import."""
  kinds = {t: wire.row_arrays(shards.specs[t]) for t in part}
  every = sorted({k for v in kinds.values() for k in v})  # the header's names: a bound for every table
  row = {t: sum(k.values()) * _F32.itemsize for t, k in kinds.items()}
  names: Tuple[List[str], List[str]]
  if request:  # an import: ids and rows in the request, nothing in the answer
    sizes, names = ({t: 8 + row[t] for t in part}, {t: 0 for t in part}), (["ids", *every], [])
  else:  # an export: ids in the request, rows in the answer
    sizes, names = ({t: 8 for t in part}, row), (["ids"], every)
  return shards.chunks(s, part, fields, names, sizes, what)


def export_rows(
  shards: Shards, ids: Mapping[str, np.ndarray], step: Optional[int], *, timeout_s: float, retries: int
) -> Dict[str, Tuple[np.ndarray, Dict[str, np.ndarray]]]:
  """Rows of distinct ids with their optimizer slots; changes nothing (see ``RemotePS.export_rows_many``).

  ``timeout_s``: the deadline of the whole call, its chunks and retries; ``retries``: of each chunk.
  """
  for t in ids:
    shards.check(t)
  arrays = {t: distinct_ids(v, t, "export ids") for t, v in ids.items()}
  routes = shards.route(arrays)
  fields = {"step": None if step is None else int(step)}
  deadline = time.monotonic() + timeout_s  # one for all the chunks and retries
  out = {}
  for t, v in arrays.items():
    kinds = wire.row_arrays(shards.specs[t])
    out[t] = {k: np.empty((v.shape[0], w), np.float32) for k, w in kinds.items()}

  def send(s, part, chunks):
    for c in chunks:
      message = {f"ids/{t}": part[t][a:b] for t, (a, b) in c.items()}
      got = shards.servers.call(s, "ExportRows", fields, message, retries=retries, deadline=deadline)
      for t, (a, b) in c.items():
        at = routes[t][s][a:b]
        for k, into in out[t].items():
          into[at] = _answered(shards, got, s, f"{k}/{t}", (b - a, into.shape[1]))

  work = {}
  for s in range(shards.num_shards):
    part = {t: arrays[t][routes[t][s]] for t in arrays if routes[t][s].shape[0]}
    if part:
      chunks = _chunks(shards, s, part, fields, False, "export_rows")
      work[s] = functools.partial(send, s, part, chunks)
  if work:
    shards.servers.fan("control", work)
  return {t: (v.pop("weights"), {k[len("slot_") :]: a for k, a in v.items()}) for t, v in out.items()}


def _answered(shards: Shards, reply: wire.Message, s: int, name: str, shape: Tuple[int, int]) -> np.ndarray:
  """Array ``name`` of server s's ExportRows answer, checked to be float32 of ``shape``."""
  got = reply.arrays.get(name)
  if got is None or got.shape != shape or got.dtype != _F32:
    have = None if got is None else (got.dtype.name, list(got.shape))
    raise shards.error(s, "ExportRows", f"ExportRows answered {name} as {have}, expected float32 {list(shape)}")
  return got


def import_rows(
  shards: Shards, rows: Mapping[str, Tuple[Any, Any, Mapping[str, Any]]], *, timeout_s: float, retries: int
) -> None:
  """Sets rows and their optimizer slots, creating rows that do not exist (see ``RemotePS.import_rows_many``);
  ``timeout_s`` and ``retries`` as ``export_rows``'s."""
  for t in rows:
    shards.check(t)
  checked = {t: check_rows(shards.specs[t], i, w, s, "import") for t, (i, w, s) in rows.items()}
  routes = shards.route({t: c[0] for t, c in checked.items()})
  deadline = time.monotonic() + timeout_s  # one for all the chunks and retries

  def send(s, sel, chunks):
    for c in chunks:
      message = {}
      for t, (a, b) in c.items():
        at = sel[t][a:b]
        ids, weights, slots = checked[t]
        message[f"ids/{t}"], message[f"weights/{t}"] = ids[at], weights[at]
        message.update({f"slot_{k}/{t}": v[at] for k, v in slots.items()})
      shards.servers.call(s, "ImportRows", {}, message, retries=retries, deadline=deadline)

  work = {}
  for s in range(shards.num_shards):
    sel = {t: routes[t][s] for t in checked if routes[t][s].shape[0]}
    if sel:
      chunks = _chunks(shards, s, {t: checked[t][0][v] for t, v in sel.items()}, {}, True, "import_rows")
      work[s] = functools.partial(send, s, sel, chunks)
  if work:
    shards.servers.fan("control", work)
