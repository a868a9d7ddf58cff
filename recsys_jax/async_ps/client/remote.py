"""``RemotePS``: the parameter-server interface the trainer uses, backed by PS shard servers.

It offers what ``ParameterServer`` offers the trainer (``lookup_many``, ``apply_many``,
``lookup``, ``apply``, ``read_ahead_many``, ``export_rows_many`` and ``import_rows_many``,
``stats``, ``close``, ``specs``, ``num_shards``) plus
``save_snapshot`` / ``load_snapshot``, so the trainer cannot tell which one it holds. Each id
of a table goes to server ``hashing.server_of(table, id, seed, len(addresses))``; a call sends
one request per server, all servers in parallel, and puts the answers back in the caller's
order. Rows come from (table, id, seed) as in-process, so a RemotePS over any number of
servers returns what a ``ParameterServer`` with the same specs and seed returns.

Failures raise ``RemotePSError`` naming the server and the RPC. Every call has a deadline
(``timeout_s``); lookups are retried on UNAVAILABLE / DEADLINE_EXCEEDED (they only read, or
create rows that are a function of the id); pushes carry a request id and are never retried,
so a gradient is applied at most once.

A call whose request or answer to a server would pass that server's message limit (or
``max_request_mb``) goes to it as several chunks (``chunking``), sent one after another within
the call's one deadline; together they do what one call would: the same rows, and a push
that the server applies once, when its last chunk is in (``service``).

Several workers (``num_workers``) may share the servers: each step's pushes are summed over
the workers on the servers, and a lookup of step t waits there until the pushes of steps
<= t - staleness - 1 of every worker are applied.

This module routes and assembles the interface's calls. Beside it: the calls themselves (channels,
deadlines, retries, the fan-out to every server) in ``transport``; the configured servers (where
an id goes, each server's message limit) in ``shards``; rows with their optimizer slots out and
back in ``slot_rows``; snapshots in ``snapshots``, and their layout on disk and the restore of a
chain into an in-process PS in ``snapshot.chain``.
"""

from __future__ import annotations

import functools
import itertools
import time
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

import numpy as np

from recsys_jax.async_ps import wire
from recsys_jax.async_ps.client import slot_rows, snapshots
from recsys_jax.async_ps.client.shards import Shards
from recsys_jax.async_ps.client.transport import RemotePSError as RemotePSError
from recsys_jax.async_ps.client.transport import Transport
from recsys_jax.async_ps.store.ids import as_ids, check_distinct, check_out
from recsys_jax.embeddings.specs import TableSpec


class RemotePS:
  """A client of PS shard servers (``python -m recsys_jax.async_ps.server``).

  Connects to every server and sends it ``Configure`` at construction, so a wrong address, a
  server that is not up within ``timeout_s``, or a server configured differently fails here.

  Args:
    addresses: ``host:port`` of each server, in shard order (server i holds the ids routed
      to i; restart a server at the same place in the list).
    tables: the table specs (must match what the servers hold, if already configured).
    seed: global seed: row initialisation and routing depend on it.
    num_workers: trainers sharing these servers; each step's pushes are summed over them.
    worker: this trainer's index in [0, num_workers).
    staleness: k: a lookup of step t waits until the pushes of steps <= t - k - 1 are applied.
    token: bearer token sent with every call (servers started with ``--token_file``).
    tls_ca: PEM bytes, or a path to them, of the CA that signed the servers' certificates;
      None: plaintext.
    wire_dtype: 'float32', 'bfloat16' or 'float16': rows and gradients travel in it (ids
      always uint64); halves the bytes at the cost of rounding each row and gradient.
    timeout_s: deadline of each call (snapshots and restores: ``snapshot_timeout_s``).
    lookup_retries: retries of a lookup after UNAVAILABLE or DEADLINE_EXCEEDED.
    snapshot_timeout_s: deadline of a snapshot or restore.
    tls_server_name: the name the servers' certificates carry, if not the address's host.
    max_request_mb: the largest request or answer of one call to a server, MiB; a larger
      lookup or push is sent in chunks (0: the server's ``--max_message_mb``, which also
      caps this).
    tier: None (RAM only) or a tensorstore kvstore spec, as ``ParameterServer``'s: each server
      spills what a bounded table's capacity evicts under its own ``server-<i>/`` sub-path of
      it (a ``file`` path is one on the servers' machines, under their ``--snapshot_root``).
      Without it a server drops those rows.
  """

  def __init__(
    self,
    addresses: Sequence[str],
    tables: Sequence[TableSpec],
    *,
    seed: int = 0,
    num_workers: int = 1,
    worker: int = 0,
    staleness: int = 0,
    token: Optional[str] = None,
    tls_ca: Optional[Union[bytes, str]] = None,
    wire_dtype: str = "float32",
    timeout_s: float = 30.0,
    lookup_retries: int = 3,
    snapshot_timeout_s: float = 3600.0,
    tls_server_name: Optional[str] = None,
    max_request_mb: float = 0.0,
    tier: Optional[Mapping[str, Any]] = None,
  ):
    addresses = [str(a) for a in addresses]
    if not addresses:
      raise ValueError("RemotePS needs at least one server address")
    if len(set(addresses)) != len(addresses):
      raise ValueError(f"server addresses must be distinct, got {addresses}")
    if not 0 <= worker < num_workers:
      raise ValueError(f"worker {worker} must be in [0, num_workers={num_workers})")
    if staleness < 0:
      raise ValueError(f"staleness must be >= 0, got {staleness}")
    if timeout_s <= 0 or snapshot_timeout_s <= 0:
      raise ValueError("timeouts must be positive")
    if lookup_retries < 0:
      raise ValueError(f"lookup_retries must be >= 0, got {lookup_retries}")
    if not 0 <= max_request_mb < 1 << 20:  # also refuses nan
      raise ValueError(f"max_request_mb must be in [0, 2**20) (0: the servers' limit), got {max_request_mb}")
    wire.check_wire_dtype(wire_dtype)
    self.specs: Dict[str, TableSpec] = {t.name: t for t in tables}
    if len(self.specs) != len(tables):
      raise ValueError("table names must be distinct")
    self.addresses = addresses
    self.num_shards = len(addresses)
    self.seed, self.num_workers, self.worker, self.staleness = int(seed), int(num_workers), int(worker), int(staleness)
    self.wire_dtype = wire_dtype
    self.tier = None if tier is None else dict(tier)
    self.timeout_s, self.lookup_retries, self.snapshot_timeout_s = (
      float(timeout_s),
      int(lookup_retries),
      snapshot_timeout_s,
    )
    self._nonce = uuid.uuid4().hex[:16]
    self._counter = itertools.count()
    self._servers = Transport(
      addresses, token=token, tls_ca=tls_ca, tls_server_name=tls_server_name, timeout_s=self.timeout_s
    )
    try:
      self._shards = Shards.configure(
        self._servers,
        self.specs,
        seed=self.seed,
        num_workers=self.num_workers,
        staleness=self.staleness,
        tier=self.tier,
        timeout_s=self.timeout_s,
        max_request=int(max_request_mb * (1 << 20)) or None,
      )
    except BaseException:
      self.close()
      raise

  @property
  def message_limits(self) -> List[int]:
    """The largest request or answer of one call to each server, bytes: its ``--max_message_mb``, or
    ``max_request_mb`` if smaller; a call's part over it goes in chunks."""
    return self._shards.message_limits

  @message_limits.setter
  def message_limits(self, limits: Sequence[int]) -> None:
    self._shards.message_limits = list(limits)

  def shard_of(self, table: str, ids: np.ndarray) -> np.ndarray:
    """The server index of each id of ``table``.

    Args:
      table: a declared table.
      ids: uint64 ids.

    Returns:
      int64 server indices, shaped like ``ids``.
    """
    return self._shards.shard_of(table, ids)

  # -- the interface ------------------------------------------------------------------
  def lookup_many(
    self,
    ids: Mapping[str, np.ndarray],
    create: bool = True,
    step: Optional[int] = None,
    out: Optional[Mapping[str, np.ndarray]] = None,
  ) -> Dict[str, np.ndarray]:
    """Rows for distinct ids of several tables: {table: ids} -> {table: float32 [n, dim]}.

    Args:
      ids: distinct uint64 ids per table (or non-negative integers).
      create: training lookup (unseen ids get rows); False reads without changing anything.
      step: the training step; the servers first wait for the pushes of steps <= step - k - 1.
      out: {table: float32 [n, dim]} to write the rows into, copied once from the wire (fresh
        arrays if None).

    Returns:
      The float32 arrays (``out``'s, or fresh ones), in the order of the given ids.

    Raises:
      KeyError: an unknown table.
      ValueError: ids that are not 1-D, or not unsigned or non-negative integers; repeated ids
        in a lookup sent in chunks (nothing is sent then).
      RemotePSError: a server failed or refused (after ``lookup_retries`` retries).
    """
    ids = self._shards.checked_ids(ids)
    check_out(self.specs, ids, out)
    routes = self._shards.route(ids)
    fields = {"step": None if step is None else int(step), "create": bool(create), "wire_dtype": self.wire_dtype}
    deadline = time.monotonic() + self.timeout_s  # one for all the chunks and retries
    size = wire.DTYPES[self.wire_dtype].itemsize
    if out is None:
      out = {t: np.empty((v.shape[0], self.specs[t].dim), np.float32) for t, v in ids.items()}

    def send(s, part, chunks):
      for c in chunks:
        arrays = {f"ids/{t}": part[t][a:b] for t, (a, b) in c.items()}
        got = self._servers.call(s, "Lookup", fields, arrays, retries=self.lookup_retries, deadline=deadline)
        for t, (a, b) in c.items():  # each chunk's rows go in place at once: no reply is kept
          out[t][routes[t][s][a:b]] = self._rows(got, s, t, b - a)

    # With a step, every server sees every step's lookup: each one's staleness bookkeeping
    # starts at the first step it sees, so none may first hear of a later one.
    work = {}
    for s in range(self.num_shards):
      part = {t: ids[t][routes[t][s]] for t in ids if routes[t][s].shape[0]}
      if part or step is not None:
        sizes = ({t: 8 for t in part}, {t: self.specs[t].dim * size for t in part})
        chunks = self._shards.chunks(s, part, fields, (["ids"], ["rows"]), sizes, "lookup")
        work[s] = functools.partial(send, s, part, chunks)
    if work:
      self._servers.fan("lookup", work)
    return cast(Dict[str, np.ndarray], out)  # the caller's ``out`` as given, or the fresh dict

  def resolve_many(self, ids: Mapping[str, np.ndarray], step: int) -> int:
    """Resolves nothing ahead (the servers' lookups do all their work when asked; see the
    protocol): checks what a lookup checks and returns 0, sending nothing."""
    if int(step) < 0:
      raise ValueError(f"step {step} is negative: steps count from 0")
    self._shards.checked_ids(ids)
    return 0

  def read_ahead_many(self, ids: Mapping[str, np.ndarray], step: int) -> int:
    """Has each server start bringing into RAM the tier rows that the lookup of ``ids`` at ``step`` would read.

    Ids are routed and chunked as a lookup's; each server hands them to its tables' reader
    threads (``ParameterServer.read_ahead_many``, which does not wait for them) and answers at
    once, so this waits for a round trip, never for a disk. It changes no row's values, and
    touches no server's step bookkeeping (a read-ahead of step t + k is not step t + k's lookup).
    Retried as a lookup is: doing it twice brings no row twice.

    Args:
      ids: {table: distinct ids} of a later ``lookup_many(ids, create=True, step=step)``.
      step: that lookup's step.

    Returns:
      The ids the servers handed to their reader threads, summed (0 where they have no tier).

    Raises:
      KeyError: an unknown table.
      ValueError: ids that are not 1-D non-negative integers, or a negative step (nothing is
        sent then).
      RemotePSError: a server failed or refused (after ``lookup_retries`` retries).
    """
    step = int(step)
    if step < 0:
      raise ValueError(f"step {step} is negative: steps count from 0")
    ids = self._shards.checked_ids(ids)
    if self.tier is None:  # the servers have no tier (RemotePS configures it): nothing to read
      return 0
    routes = self._shards.route(ids)
    fields = {"step": step}
    deadline = time.monotonic() + self.timeout_s  # one for all the chunks and retries

    def send(s, part, chunks):
      staged = 0
      for c in chunks:
        arrays = {f"ids/{t}": part[t][a:b] for t, (a, b) in c.items()}
        got = self._servers.call(s, "ReadAhead", fields, arrays, retries=self.lookup_retries, deadline=deadline)
        staged += int(got.fields.get("staged", 0))
      return staged

    work = {}
    for s in range(self.num_shards):
      part = {t: ids[t][routes[t][s]] for t in ids if routes[t][s].shape[0]}
      if part:  # unlike a lookup's, a server that gets no ids need not hear of the step
        sizes = ({t: 8 for t in part}, {t: 0 for t in part})  # ids in; a count out
        chunks = self._shards.chunks(s, part, fields, (["ids"], []), sizes, "read_ahead")
        work[s] = functools.partial(send, s, part, chunks)
    return int(sum(self._servers.fan("ahead", work).values())) if work else 0

  def _rows(self, reply: wire.Message, s: int, t: str, n: int) -> np.ndarray:
    """The rows of table t in a Lookup answer of server s, checked to be [n, dim] of a float dtype."""
    dim = self.specs[t].dim
    got = reply.arrays.get(f"rows/{t}")
    if got is None or got.shape != (n, dim) or got.dtype.name not in wire.FLOAT_DTYPES:
      have = None if got is None else (got.dtype.name, list(got.shape))
      raise self._shards.error(s, "Lookup", f"Lookup answered rows/{t} as {have}, expected [{n}, {dim}]")
    return got  # float32 on assignment: bfloat16 / float16 are converted exactly

  def apply_many(
    self,
    grads: Mapping[str, Tuple[np.ndarray, np.ndarray]],
    step: Optional[int] = None,
    *,
    request_id: Optional[str] = None,
  ) -> None:
    """Pushes summed row gradients: {table: (distinct ids, float32 [n, dim])}.

    Never retried: a failed push raises and may or may not have reached a server (each
    server applies a request id at most once, so re-sending the same ``request_id`` is safe;
    a push sent in chunks is applied when its last chunk is in: re-sending it with the same
    ``request_id`` completes it, its chunks already in acknowledged, not applied again).

    Args:
      grads: per table, distinct uint64 ids (or non-negative integers) and their gradients.
      step: the training step (required with several workers; steps must increase).
      request_id: identifies the push for de-duplication (default: a fresh unique id).

    Raises:
      KeyError: an unknown table.
      ValueError: gradients that are not [len(ids), dim]; ids that are not unsigned or
        non-negative integers, or repeat (nothing is sent then).
      RemotePSError: a server failed or refused.
    """
    arrays = {}
    for t, (i, g) in grads.items():
      self._shards.check(t)
      i, g = as_ids(i, t), np.asarray(g, np.float32)
      if i.ndim != 1 or g.shape != (i.shape[0], self.specs[t].dim):
        raise ValueError(
          f"table {t!r}: gradient shape {g.shape} does not match ({np.shape(i)[0]}, {self.specs[t].dim})"
        )
      # Here, not only on the servers: a server refusing its part would leave the others' applied.
      check_distinct(i, t)
      arrays[t] = (i, g)
    rid = request_id or f"{self._nonce}-{next(self._counter)}"
    routes = self._shards.route({t: i for t, (i, _) in arrays.items()})
    fields = {"worker": self.worker, "step": None if step is None else int(step), "request_id": rid}
    deadline = time.monotonic() + self.timeout_s  # one for all the chunks
    size = wire.DTYPES[self.wire_dtype].itemsize

    def send(s, sel, part, chunks):
      for k, c in enumerate(chunks):
        message = {}
        for t, (a, b) in c.items():
          message[f"ids/{t}"] = part[t][a:b]
          message[f"grads/{t}"] = wire.to_wire(arrays[t][1][sel[t][a:b]], self.wire_dtype)
        # The server applies the push once all its chunks are in (a repeated chunk is acknowledged).
        more = {"chunk": k, "chunks": len(chunks)} if len(chunks) > 1 else {}
        got = self._servers.call(s, "Push", {**fields, **more}, message, deadline=deadline)
      missing = got.fields.get("chunks_missing", 0)
      if missing:  # the server lost the earlier chunks: a Restore, or a restart, came in between
        raise self._shards.error(
          s,
          "Push",
          f"Push {rid!r}: {missing} of its {len(chunks)} chunks are missing after the last was sent (a Restore "
          "or restart in between?); nothing of it is applied there",
        )

    work = {}
    for s in range(self.num_shards):
      sel = {t: routes[t][s] for t in arrays if routes[t][s].shape[0]}
      # With a step every server hears from every worker at every step, or it could not
      # tell when a step is complete.
      if sel or step is not None:
        sizes = ({t: 8 + self.specs[t].dim * size for t in sel}, {t: 0 for t in sel})
        part = {t: arrays[t][0][v] for t, v in sel.items()}
        chunks = self._shards.chunks(s, part, fields, (["ids", "grads"], []), sizes, "push")
        work[s] = functools.partial(send, s, sel, part, chunks)
    if work:
      self._servers.fan("push", work)

  def lookup(self, table: str, ids: np.ndarray, create: bool = True, step: Optional[int] = None) -> np.ndarray:
    """Rows for distinct ids of one table (see ``lookup_many``).

    Args:
      table: a declared table.
      ids: distinct uint64 ids.
      create: training lookup (unseen ids get rows).
      step: the training step (see ``lookup_many``).

    Returns:
      float32 [len(ids), dim].
    """
    return self.lookup_many({table: ids}, create, step)[table]

  def apply(self, table: str, ids: np.ndarray, grads: np.ndarray, step: Optional[int] = None) -> None:
    """Pushes summed row gradients for distinct ids of one table (see ``apply_many``).

    Args:
      table: a declared table.
      ids: distinct uint64 ids.
      grads: float32 [len(ids), dim].
      step: the training step.
    """
    self.apply_many({table: (ids, grads)}, step)

  def server_stats(self) -> List[Dict[str, Any]]:
    """Each server's ``Stats`` answer: {'tables': {table: stats}, 'server': its state}.

    Returns:
      One dict per server, in address order.
    """
    work: Dict[int, Callable[..., Any]] = {
      i: (lambda i=i: self._servers.call(i, "Stats", {})) for i in range(self.num_shards)
    }
    got = self._servers.fan("control", work)
    return [got[i].fields for i in range(self.num_shards)]

  def stats(self) -> Dict[str, Dict[str, float]]:
    """Per table, summed over the servers as ``ParameterServer.stats`` sums its shards.

    Returns:
      {table: {rows, bytes, counters, hit_rate, lookup_ms, apply_ms, ...}}.
    """
    per = self.server_stats()
    out = {}
    for t in self.specs:
      parts = [p["tables"][t] for p in per]
      agg = {k: sum(p[k] for p in parts) for k in parts[0] if k not in ("hit_rate", "lookup_ms", "apply_ms")}
      agg["hit_rate"] = agg["hits"] / agg["lookups"] if agg.get("lookups") else float("nan")
      agg["lookup_ms"] = max(p["lookup_ms"] for p in parts)  # servers work in parallel
      agg["apply_ms"] = max(p["apply_ms"] for p in parts)
      out[t] = agg
    return out

  # -- snapshots ----------------------------------------------------------------------
  def save_snapshot(
    self, directory: str, incremental: bool = False, meta: Optional[Dict[str, Any]] = None, step: Optional[int] = None
  ) -> Dict[str, int]:
    """Snapshots every server: server i writes ``<directory>/server-<i>`` (``snapshot.save``
    format), after the pushes of all steps < ``step``; then ``<directory>/remote.json`` is
    written, last, naming the parts.

    The directory must be reachable under the same path by the servers and this client
    (one machine, or a shared file system).

    Args:
      directory: where the snapshot goes (must not hold one already).
      incremental: only rows changed since each server's previous snapshot.
      meta: JSON values recorded in each part's manifest and in remote.json.
      step: wait for the pushes of steps < step first (None: no wait).

    Returns:
      Rows written per table, summed over the servers.

    Raises:
      FileExistsError: ``directory`` already holds a snapshot.
      RemotePSError: a server failed.
    """
    return snapshots.save_remote_snapshot(self._servers, directory, incremental, meta, step, self.snapshot_timeout_s)

  def load_snapshot(self, chain: Sequence[str], step: Optional[int] = None) -> None:
    """Restores every server from a chain of snapshots (one full, then incremental ones),
    each taken by a RemotePS over any number of servers or by ``snapshot.save`` of an
    in-process PS; each server keeps the ids routed to it.

    Args:
      chain: snapshot directories, oldest first.
      step: the next step to be looked up and pushed (the servers count every step before
        it as applied); None: the next lookup's step.

    Raises:
      ValueError, FileNotFoundError: a directory that holds no snapshot.
      RemotePSError: a server failed (then its tables are partial and it refuses to serve
        until a restore succeeds).
    """
    snapshots.restore_remote_snapshot(self._servers, chain, step, self.snapshot_timeout_s)

  def health(self) -> List[Dict[str, Any]]:
    """Each server's ``Health`` answer (ok, configured, applied_step, ...), in address order.

    Returns:
      One dict per server.
    """
    work: Dict[int, Callable[..., Any]] = {
      i: (lambda i=i: self._servers.call(i, "Health", {})) for i in range(self.num_shards)
    }
    got = self._servers.fan("control", work)
    return [got[i].fields for i in range(self.num_shards)]

  def close(self) -> None:
    """Closes the channels and threads; later calls raise ``RemotePSError``."""
    self._servers.close()

  def __enter__(self) -> "RemotePS":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- rows with their optimizer slots, out of the servers and back (``slot_rows``) ---------------
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
    return slot_rows.export_rows(self._shards, ids, step, timeout_s=self.timeout_s, retries=self.lookup_retries)

  def import_rows_many(self, rows: Mapping[str, Tuple[Any, Any, Mapping[str, Any]]]) -> None:
    """Sets rows and their optimizer slots, creating rows that do not exist (``Table.import_rows``).

    Args:
      rows: {table: (distinct ids, float32 weights [n, dim], {slot: float32 [n, width]})}, every
        slot of the table's optimizer.

    Raises:
      KeyError: an unknown table.
      ValueError: naming the table and what is wrong (ids, shapes, repeats, slot names); every
        table is checked before anything is sent.
      RemotePSError: a server failed or refused (after ``lookup_retries`` retries; ``slot_rows`` says
        what is imported then).
    """
    slot_rows.import_rows(self._shards, rows, timeout_s=self.timeout_s, retries=self.lookup_retries)
