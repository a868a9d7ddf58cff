"""``RemotePS``'s export and import of rows with their optimizer slots (``RemoteRows``, a mixin).

The same two calls as ``ParameterServer.export_rows_many`` / ``import_rows_many``, over the
servers' ``ExportRows`` / ``ImportRows`` RPCs (``rpc_rows``): ids routed to their servers as a
lookup's are, all servers in parallel, each server's part in chunks under its message limit
within one deadline, the answers put back in the caller's order. Rows and slots travel as
float32 whatever ``wire_dtype`` is: optimizer state is never rounded for the wire.

Both are retried on UNAVAILABLE / DEADLINE_EXCEEDED as lookups are: an export only reads, and
an import sets values, so doing it twice leaves what doing it once does. An import is checked
whole before anything is sent; a server failing midway may leave some chunks imported and
others not (the error says which server), and importing the same rows again completes it.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from recsys_jax.async_ps import chunking, wire
from recsys_jax.async_ps.ids import distinct_ids
from recsys_jax.async_ps.table_rows import check_rows
from recsys_jax.async_ps.transport import RemotePSError

_F32 = wire.DTYPES["float32"]


class RemoteRows:
  """``export_rows_many`` and ``import_rows_many`` of a ``RemotePS`` (over its transport and routing)."""

  def _chunks(self, s: int, part: Mapping[str, np.ndarray], fields, request: bool, what: str):
    """The chunks of server s's part of an export (``request`` False: rows in the answer) or an import."""
    kinds = {t: wire.row_arrays(self.specs[t]) for t in part}
    every = sorted({k for v in kinds.values() for k in v})  # the header's names: a bound for every table
    row = {t: sum(k.values()) * _F32.itemsize for t, k in kinds.items()}
    if request:  # an import: ids and rows in the request, nothing in the answer
      sizes, names = ({t: 8 + row[t] for t in part}, {t: 0 for t in part}), (["ids", *every], [])
    else:  # an export: ids in the request, rows in the answer
      sizes, names = ({t: 8 for t in part}, row), (["ids"], every)
    return chunking.split(part, self.message_limits[s], fields, names, sizes, what)

  def export_rows_many(
    self, ids: Mapping[str, np.ndarray], *, step: Optional[int] = None
  ) -> Dict[str, Tuple[np.ndarray, Dict[str, np.ndarray]]]:
    """Rows of distinct ids with their optimizer slots; changes nothing (``Table.export_rows``).

    Args:
      ids: {table: distinct ids (uint64 or non-negative integers)}.
      step: the servers first wait until the pushes of every step before it are applied (as a
        snapshot at that step does), so no gradient still on its way is missing; None: no wait.

    Returns:
      {table: (float32 weights [n, dim], {slot: float32 [n, width]})}, in the order of the ids.

    Raises:
      KeyError: an unknown table.
      ValueError: ids that are not 1-D non-negative integers, or repeat (nothing is sent then).
      RemotePSError: a server failed or refused (after ``lookup_retries`` retries).
    """
    for t in ids:
      self._check(t)
    arrays = {t: distinct_ids(v, t, "export ids") for t, v in ids.items()}
    routes = chunking.route(arrays, self.shard_of, self.num_shards)
    fields = {"step": None if step is None else int(step)}
    deadline = time.monotonic() + self.timeout_s  # one for all the chunks and retries
    out = {}
    for t, v in arrays.items():
      kinds = wire.row_arrays(self.specs[t])
      out[t] = {k: np.empty((v.shape[0], w), np.float32) for k, w in kinds.items()}

    def send(s, part, chunks):
      for c in chunks:
        message = {f"ids/{t}": part[t][a:b] for t, (a, b) in c.items()}
        got = self._servers.call(s, "ExportRows", fields, message, retries=self.lookup_retries, deadline=deadline)
        for t, (a, b) in c.items():
          at = routes[t][s][a:b]
          for k, into in out[t].items():
            into[at] = self._answered(got, s, f"{k}/{t}", (b - a, into.shape[1]))

    work = {}
    for s in range(self.num_shards):
      part = {t: arrays[t][routes[t][s]] for t in arrays if routes[t][s].shape[0]}
      if part:
        chunks = self._chunks(s, part, fields, False, "export_rows")
        work[s] = functools.partial(send, s, part, chunks)
    if work:
      self._servers.fan("control", work)
    return {t: (v.pop("weights"), {k[len("slot_") :]: a for k, a in v.items()}) for t, v in out.items()}

  def _answered(self, reply: wire.Message, s: int, name: str, shape: Tuple[int, int]) -> np.ndarray:
    """Array ``name`` of server s's ExportRows answer, checked to be float32 of ``shape``."""
    got = reply.arrays.get(name)
    if got is None or got.shape != shape or got.dtype != _F32:
      have = None if got is None else (got.dtype.name, list(got.shape))
      raise RemotePSError(
        f"{self._servers.where(s)}: ExportRows answered {name} as {have}, expected float32 {list(shape)}",
        self.addresses[s],
        "ExportRows",
      )
    return got

  def import_rows_many(self, rows: Mapping[str, Tuple[Any, Any, Mapping[str, Any]]]) -> None:
    """Sets rows and their optimizer slots, creating rows that do not exist (``Table.import_rows``).

    Args:
      rows: {table: (distinct ids, float32 weights [n, dim], {slot: float32 [n, width]})}, every
        slot of the table's optimizer.

    Raises:
      KeyError: an unknown table.
      ValueError: naming the table and what is wrong (ids, shapes, repeats, slot names); every
        table is checked before anything is sent.
      RemotePSError: a server failed or refused (after ``lookup_retries`` retries; see the module
        docstring for what is imported then).
    """
    for t in rows:
      self._check(t)
    checked = {t: check_rows(self.specs[t], i, w, s, "import") for t, (i, w, s) in rows.items()}
    routes = chunking.route({t: c[0] for t, c in checked.items()}, self.shard_of, self.num_shards)
    deadline = time.monotonic() + self.timeout_s  # one for all the chunks and retries

    def send(s, sel, chunks):
      for c in chunks:
        message = {}
        for t, (a, b) in c.items():
          at = sel[t][a:b]
          ids, weights, slots = checked[t]
          message[f"ids/{t}"], message[f"weights/{t}"] = ids[at], weights[at]
          message.update({f"slot_{k}/{t}": v[at] for k, v in slots.items()})
        self._servers.call(s, "ImportRows", {}, message, retries=self.lookup_retries, deadline=deadline)

    work = {}
    for s in range(self.num_shards):
      sel = {t: routes[t][s] for t in checked if routes[t][s].shape[0]}
      if sel:
        chunks = self._chunks(s, {t: checked[t][0][v] for t, v in sel.items()}, {}, True, "import_rows")
        work[s] = functools.partial(send, s, sel, chunks)
    if work:
      self._servers.fan("control", work)
