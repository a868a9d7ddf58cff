"""The in-process parameter server: tables split over N shards behind one interface.

An id goes to shard ``hash(table, id) mod N``; each shard holds its part of every table
(``Table``), with its own lock, so the tables of a call, and their shards, are worked in
parallel by a thread pool (``workers.Workers``; the row kernels drop the GIL), dealt by rows;
no result depends on the thread count. The interface (``protocol.RowStore``: ``lookup_many``,
``apply_many``, ``export_rows_many``, ``import_rows_many``, ``save_snapshot``, ``load_snapshot``,
``stats``...) is what the trainer talks to; ``RemotePS`` implements the same protocol, so the
trainer cannot tell which one it has. Row values never depend on the shard count: initial rows come from
(table, id, seed), and snapshots restore into any number of shards.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, cast

import numpy as np

from recsys_jax.async_ps.optim import optimizers
from recsys_jax.async_ps.snapshot.bounds_state import merge_states
from recsys_jax.async_ps.store import plain as plain_tables
from recsys_jax.async_ps.store.ids import as_ids, check_distinct, check_out, distinct_ids, route
from recsys_jax.async_ps.store.table import Table
from recsys_jax.async_ps.store.workers import MIN_ROWS, Workers
from recsys_jax.embeddings.specs import TableSpec
from recsys_jax.hashing import name_seed, splitmix64

_ROUTE_SALT = np.uint64(0x5851F42D4C957F2D)


def _tier_spec(base: Mapping[str, Any], table: str, shard: int) -> Dict[str, Any]:
  spec = copy.deepcopy(dict(base))
  path = spec.get("path", "")
  if path and not path.endswith("/"):
    path += "/"
  spec["path"] = f"{path}{table}/shard_{shard:03d}/"
  return spec


def _check_step(step: Optional[int]) -> None:
  # A row's last step, expiry and admission count from step 0; a negative one would read as a
  # row used before training began.
  if step is not None and step < 0:
    raise ValueError(f"step {step} is negative: steps count from 0")


class ParameterServer:
  """Holds every embedding table of a model in host memory (and optionally on disk).

  Args:
    tables: the table specs.
    num_shards: shards per table; ids are routed by a hash of (table, id).
    seed: global seed; row initialisation depends on (table, id, seed) only.
    tier: None (RAM only) or a tensorstore kvstore spec (e.g. ``{'driver': 'file', 'path':
      '/tmp/ps'}``) under which each bounded table spills the rows its RAM capacity cannot
      hold; each (table, shard) gets its own sub-path.
    protect_steps: rows looked up within this many steps are never evicted (staleness k
      needs k + 1, so pushes in flight still find their rows).
    threads: threads one call works its tables (and shards) on, the caller's included (None:
      the cores this process may run on). Results are bit-identical for every count.
    min_rows: calls of fewer rows than this run on the caller's thread alone (handing work to
      a pool thread costs more than a small call saves).
    read_ahead_rows: per table shard, the most rows ``read_ahead_many`` may hold pinned in RAM for
      later steps (0: half the shard's capacity); see ``Table.read_ahead``.
    tier_backend: the tier's storage (``DiskTier``'s ``backend``): ``'auto'`` (plain files for a
      local directory, tensorstore for any other kvstore), ``'file'`` or ``'tensorstore'``.
  """

  def __init__(
    self,
    tables: Sequence[TableSpec],
    num_shards: int = 1,
    seed: int = 0,
    tier: Optional[Mapping[str, Any]] = None,
    protect_steps: int = 1,
    threads: Optional[int] = None,
    min_rows: int = MIN_ROWS,
    read_ahead_rows: int = 0,
    tier_backend: str = "auto",
  ):
    if num_shards < 1:
      raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    self.specs = {t.name: t for t in tables}
    if len(self.specs) != len(tables):
      raise ValueError("table names must be distinct")
    self.num_shards = num_shards
    # A uint64 scalar hashes as a 0-d array.
    self._route_salt = {t.name: splitmix64(cast(np.ndarray, name_seed(t.name, seed) ^ _ROUTE_SALT)) for t in tables}
    self.shards: List[Dict[str, Table]] = []
    for i in range(num_shards):
      shard = {}
      for t in tables:
        cap = -(-t.capacity // num_shards) if t.capacity else 0
        disk = None
        if tier is not None and t.capacity:
          from recsys_jax.async_ps.store.tier.disk import DiskTier  # tensorstore only where needed

          slots = optimizers.make(t.optimizer, **dict(t.optimizer_kwargs)).init(1, t.dim)
          disk = DiskTier(
            _tier_spec(tier, t.name, i),
            t.dim,
            {k: v.shape[1] for k, v in slots.items()},
            dtype=t.storage_dtype,
            max_pending_bytes=4 << 20,  # bounds the RAM that writes in flight may hold (8 chunks)
            backend=tier_backend,
          )
        shard[t.name] = Table(
          t, seed, capacity=cap, tier=disk, protect_steps=protect_steps, read_ahead_rows=read_ahead_rows
        )
      self.shards.append(shard)
    self._workers = Workers(threads, min_rows)
    self.threads = self._workers.threads

  # -- routing ------------------------------------------------------------------------
  def _check(self, table: str) -> None:
    if table not in self.specs:
      raise KeyError(f"unknown table {table!r}; this PS holds {sorted(self.specs)}")

  def shard_of(self, table: str, ids: np.ndarray) -> np.ndarray:
    """The shard of each id of ``table``."""
    self._check(table)
    if self.num_shards == 1:
      return np.zeros(np.shape(ids), np.int64)
    h = splitmix64(np.asarray(ids, np.uint64) ^ self._route_salt[table])
    return ((h >> np.uint64(16)) % np.uint64(self.num_shards)).astype(np.int64)

  def _split(self, table: str, ids: np.ndarray) -> List[np.ndarray]:
    """The positions of the ids of ``table`` that go to each shard, in shard order."""
    return route({table: ids}, self.shard_of, self.num_shards)[table]

  def _fan_out(self, ids: Mapping[str, np.ndarray], fn, plain_fn=None) -> List[Any]:
    """Calls ``fn(table_shard, table, sel)`` for every shard's part ``sel`` of each table's ids
    (``sel`` None: all of them, with one shard), one task per (shard, table), on the workers;
    returns their results.

    ``plain_fn(names)``: with one shard, the plain tables (``Table.plain``) are worked several
    at a time by it instead, in as many groups as the call gets threads, balanced by ids (their
    results are not returned: it is given for lookups and pushes only)."""
    tasks = []
    if self.num_shards == 1:
      plain = [t for t in ids if plain_fn is not None and self.shards[0][t].plain]
      for group in self._groups(plain, ids):
        tasks.append((sum(ids[t].shape[0] for t in group), functools.partial(plain_fn, group)))
      for t, v in ids.items():
        if t not in plain:
          tasks.append((v.shape[0], functools.partial(fn, self.shards[0][t], t, None)))
    else:
      for t, v in ids.items():
        for s, sel in enumerate(self._split(t, v)):
          if sel.shape[0]:
            tasks.append((sel.shape[0], functools.partial(fn, self.shards[s][t], t, sel)))
    return self._workers.run(tasks)

  def _groups(self, names: Sequence[str], ids: Mapping[str, np.ndarray]) -> List[List[str]]:
    """``names`` dealt into as many groups as a call of their ids gets threads (``Workers.helpers``
    + the caller), largest first to the lightest group, so the groups carry about equal ids."""
    if not names:
      return []
    n = 1 + self._workers.helpers([ids[t].shape[0] for t in names])
    groups: List[List[str]] = [[] for _ in range(min(n, len(names)))]
    load = [0] * len(groups)
    for t in sorted(names, key=lambda t: -ids[t].shape[0]):
      k = load.index(min(load))
      groups[k].append(t)
      load[k] += ids[t].shape[0]
    return [sorted(g, key=list(names).index) for g in groups]

  # -- the interface ------------------------------------------------------------------
  def lookup_many(
    self,
    ids: Mapping[str, np.ndarray],
    create: bool = True,
    step: Optional[int] = None,
    out: Optional[Mapping[str, np.ndarray]] = None,
  ) -> Dict[str, np.ndarray]:
    """Rows for distinct ids of several tables: {table: ids} -> {table: float32 [n, dim]}.

    ``out``: {table: float32 [n, dim]} to write each table's rows into (views of the step's
    row buffer, say), so rows are copied once, straight from the table; fresh arrays if None.
    """
    _check_step(step)
    for t in ids:
      self._check(t)
    ids = {t: as_ids(v, t) for t, v in ids.items()}
    check_out(self.specs, ids, out)
    if out is None:
      out = {t: np.empty((v.shape[0], self.specs[t].dim), np.float32) for t, v in ids.items()}

    def look(table, t, sel):
      if sel is None:
        table.lookup(ids[t], create, step, out[t])
      else:
        out[t][sel] = table.lookup(ids[t][sel], create, step)

    def look_plain(names):
      plain_tables.lookup(
        [self.shards[0][t] for t in names], [ids[t] for t in names], [out[t] for t in names], create, step
      )

    self._fan_out(ids, look, look_plain)
    return dict(out)

  def resolve_many(self, ids: Mapping[str, np.ndarray], step: int) -> int:
    """Finds and creates the rows that ``lookup_many(ids, create=True, step=step)`` will read, and
    reads no value: that lookup (with these very arrays) then only gathers them.

    Exact whatever happens in between (pushes of earlier steps, above all): only the plain tables
    of a one-shard store (``Table.plain``: their rows never move) resolve ahead; the others do all
    their work in the lookup, as without it. So a trainer resolves step t's ids while step t - 1
    trains, and only the gather waits for the staleness bound.

    Args:
      ids: {table: distinct ids} of a later ``lookup_many(ids, create=True, step=step)``.
      step: that lookup's step.

    Returns:
      The ids resolved ahead (summed over tables).
    """
    _check_step(step)
    for t in ids:
      self._check(t)
    checked = {t: as_ids(v, t) for t, v in ids.items()}  # bad ids refused as a lookup refuses them
    if self.num_shards != 1:
      return 0
    plain = {t: v for t, v in checked.items() if self.shards[0][t].plain}

    def resolve(names):
      plain_tables.resolve([self.shards[0][t] for t in names], [plain[t] for t in names], step)

    self._workers.run(
      [(sum(plain[t].shape[0] for t in g), functools.partial(resolve, g)) for g in self._groups(list(plain), plain)]
    )
    return sum(v.shape[0] for v in plain.values())

  def read_ahead_many(self, ids: Mapping[str, np.ndarray], step: int) -> int:
    """Starts bringing into RAM the tier rows that the lookup of ``ids`` at ``step`` would read,
    pinned until that step (``Table.read_ahead``); returns at once.

    Every row has the values it would have without it, bit for bit: only where rows lie
    (RAM or tier), and so the counts of hits and tier reads, change. Tables without a tier,
    and tables that expire rows, ignore it.

    Args:
      ids: {table: distinct ids} of a later ``lookup_many(ids, create=True, step=step)``.
      step: that lookup's step.

    Returns:
      The ids handed to the tables' reader threads, summed over tables and shards.
    """
    _check_step(step)
    for t in ids:
      self._check(t)
    ids = {t: as_ids(v, t) for t, v in ids.items()}  # every table's: bad ids are refused as a lookup refuses them
    # Handed over in the reverse of the lookups' table order: the reader thread then works
    # on the last tables while the next lookup, a step earlier, works on the first ones, and
    # the two seldom wait for the same table's lock.
    tiered = {t: ids[t] for t in reversed(list(ids)) if self.shards[0][t].tier is not None}

    def ahead(table, t, sel):
      return table.read_ahead(tiered[t] if sel is None else tiered[t][sel], step)

    return int(sum(self._fan_out(tiered, ahead)))

  def wait_read_ahead(self) -> None:
    """Returns once every read-ahead handed to the tables so far has run (tests, benchmarks)."""
    for shard in self.shards:
      for table in shard.values():
        table.wait_read_ahead()

  def apply_many(self, grads: Mapping[str, Tuple[np.ndarray, np.ndarray]], step: Optional[int] = None) -> None:
    """Applies summed row gradients: {table: (distinct ids, float32 [n, dim])}."""
    # Every table is checked before any is changed, so a bad request changes nothing.
    _check_step(step)
    arrays = {}
    for t, (i, g) in grads.items():
      self._check(t)
      if np.shape(g) != (np.shape(i)[0], self.specs[t].dim):
        raise ValueError(
          f"table {t!r}: gradient shape {np.shape(g)} does not match ({np.shape(i)[0]}, {self.specs[t].dim})"
        )
      arrays[t] = (as_ids(i, t), np.asarray(g, np.float32))
      check_distinct(arrays[t][0], t)  # here, not per table shard: a refused request changes no table

    def push(table, t, sel):
      i, g = arrays[t]
      if sel is None:
        table.apply(i, g, step, distinct=True)
      else:
        table.apply(i[sel], g[sel], step, distinct=True)

    def push_plain(names):
      plain_tables.apply(
        [self.shards[0][t] for t in names], [arrays[t][0] for t in names], [arrays[t][1] for t in names], step
      )

    self._fan_out({t: i for t, (i, _) in arrays.items()}, push, push_plain)

  def lookup(self, table: str, ids: np.ndarray, create: bool = True, step: Optional[int] = None) -> np.ndarray:
    """Rows for distinct ids of one table (see ``Table.lookup``)."""
    return self.lookup_many({table: ids}, create, step)[table]

  def apply(self, table: str, ids: np.ndarray, grads: np.ndarray, step: Optional[int] = None) -> None:
    """Applies summed row gradients for distinct ids of one table."""
    self.apply_many({table: (ids, grads)}, step)

  # -- rows with their optimizer slots ----------------------------------------------------
  def export_rows_many(
    self, ids: Mapping[str, np.ndarray], *, step: Optional[int] = None
  ) -> Dict[str, Tuple[np.ndarray, Dict[str, np.ndarray]]]:
    """Rows of distinct ids with their optimizer slots (``Table.export_rows``); changes nothing.

    Args:
      ids: {table: distinct ids}.
      step: taken for the interface's sake (a ``RemotePS``'s servers first wait for the pushes of
        the steps before it); here every push made is applied, so there is nothing to wait for.

    Returns:
      {table: (float32 weights [n, dim], {slot: float32 [n, width]})}, in the order of the ids.

    Raises:
      KeyError: an unknown table.
      ValueError: ids that are not 1-D non-negative integers, or repeat (nothing is read then).
    """
    del step
    for t in ids:
      self._check(t)
    arrays = {t: distinct_ids(v, t, "export ids") for t, v in ids.items()}
    out = {}
    for t, v in arrays.items():
      n, dim = v.shape[0], self.specs[t].dim
      fresh = self.shards[0][t].opt.init(0, dim)
      out[t] = (np.empty((n, dim), np.float32), {k: np.empty((n,) + s.shape[1:], np.float32) for k, s in fresh.items()})

    def export(table, t, sel):
      at = slice(None) if sel is None else sel
      w, slots = table.export_rows(arrays[t][at], checked=True)
      out[t][0][at] = w
      for k, s in slots.items():
        out[t][1][k][at] = s

    self._fan_out(arrays, export)
    return out

  def check_import(self, rows: Mapping[str, Tuple[Any, Any, Mapping[str, Any]]]) -> Dict[str, Tuple[Any, ...]]:
    """Checks an ``import_rows_many`` request without changing anything; returns it as arrays
    (uint64 ids, float32 weights and slots) for ``import_rows_many(..., checked=True)``.

    Raises:
      KeyError: an unknown table.
      ValueError: naming the table and what is wrong (ids, shapes, repeats, slot names).
    """
    for t in rows:
      self._check(t)
    return {t: self.shards[0][t].check_rows(i, w, s, "import") for t, (i, w, s) in rows.items()}

  def import_rows_many(
    self, rows: Mapping[str, Tuple[np.ndarray, np.ndarray, Mapping[str, np.ndarray]]], *, checked: bool = False
  ) -> None:
    """Sets rows and their optimizer slots, creating rows that do not exist (``Table.import_rows``).

    Args:
      rows: {table: (distinct ids, float32 weights [n, dim], {slot: float32 [n, width]})}, every
        slot of the table's optimizer.
      checked: ``rows`` come from ``check_import``.

    Raises:
      KeyError: an unknown table.
      ValueError: naming the table and what is wrong (ids, shapes, repeats, slot names); every
        table is checked before any is changed, so nothing is written then.
    """
    if not checked:
      rows = self.check_import(rows)

    def put(table, t, sel):
      i, w, s = rows[t]
      if sel is not None:
        i, w, s = i[sel], w[sel], {k: v[sel] for k, v in s.items()}
      table.import_rows(i, w, s, checked=True)

    self._fan_out({t: i for t, (i, _, _) in rows.items()}, put)

  # -- snapshots ----------------------------------------------------------------------
  def snapshot(self, incremental: bool = False) -> Dict[str, Dict[str, np.ndarray]]:
    """Every table merged over the shards (call while no pushes are in flight).

    With ``incremental``, only the rows changed since the previous snapshot, and per table a
    ``deleted`` array of ids dropped since then.
    """
    out = {}
    for t in self.specs:
      parts = self._workers.run(
        [
          (self.shards[s][t].num_rows, functools.partial(self.shards[s][t].snapshot, incremental))
          for s in range(self.num_shards)
        ]
      )
      out[t] = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return out

  def restore(self, snap: Mapping[str, Mapping[str, np.ndarray]], merge: bool = False) -> None:
    """Loads a snapshot taken with any number of shards.

    A full snapshot replaces everything (tables absent from it start empty); with ``merge``
    an incremental snapshot is applied on top: its rows upserted, its ``deleted`` removed.
    """
    unknown = set(snap) - set(self.specs)
    if unknown:
      raise ValueError(f"snapshot has tables {sorted(unknown)} that this PS does not declare")
    part: Optional[Mapping[str, np.ndarray]]
    for t, part in snap.items():  # validate everything before any shard or table changes
      self.shards[0][t].validate_snapshot(part)
    for t, spec in self.specs.items():
      part = snap.get(t)
      if part is None:
        if merge:
          continue
        probe = self.shards[0][t]
        part = {"ids": np.zeros(0, np.uint64), "weights": np.zeros((0, spec.dim), np.float32)}
        part.update({f"slot_{k}": v for k, v in probe.opt.init(0, spec.dim).items()})
      ids = np.asarray(part["ids"], np.uint64)
      deleted = np.asarray(part.get("deleted", np.zeros(0, np.uint64)), np.uint64)
      for s, (sel, d_sel) in enumerate(zip(self._split(t, ids), self._split(t, deleted))):
        sub = {k: np.asarray(v)[sel] for k, v in part.items() if k != "deleted"}
        sub["deleted"] = deleted[d_sel]
        self.shards[s][t].restore(sub, merge=merge)

  def save_snapshot(
    self, directory: str, incremental: bool = False, meta: Optional[Dict[str, Any]] = None, step: Optional[int] = None
  ) -> Dict[str, int]:
    """``snapshot.save`` of this PS into ``directory`` (``RemotePS.save_snapshot``'s call, so the
    trainer saves either the same way); returns rows written per table.

    ``step`` is taken for the interface's sake: every push made here is applied already.
    """
    del step
    from recsys_jax.async_ps.snapshot import directory as snapshot  # tensorstore only where needed

    return snapshot.save(self, directory, incremental, meta)

  def load_snapshot(self, chain: Sequence[str], step: Optional[int] = None) -> None:
    """Restores a chain of snapshots taken in-process (``snapshot.load``) or by a ``RemotePS``
    over any number of servers (``snapshot_chain.load_into``); ``step`` as ``save_snapshot``'s."""
    del step
    from recsys_jax.async_ps.snapshot import chain as snapshot_chain
    from recsys_jax.async_ps.snapshot import directory as snapshot

    if any(os.path.exists(os.path.join(d, snapshot_chain.MANIFEST)) for d in chain):
      snapshot_chain.load_into(self, chain)  # parts written by PS servers
    else:
      snapshot.load(self, chain)

  def bounds_states(self) -> Dict[str, List[Dict[str, Any]]]:
    """Per table, each shard's ``Table.bounds_state`` (step, last expiry check, admission
    sketch) in shard order: what a snapshot keeps besides the rows."""
    return {t: [shard[t].bounds_state() for shard in self.shards] for t in self.specs}

  def restore_bounds_states(self, states: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """Merges ``bounds_states`` saved by a PS of any shard count into this one's (after its rows).

    With as many shards as saved, shard s takes shard s's state: every id goes to the same
    shard as before, so this is exact. With another count, every shard takes their
    ``bounds_state.merge_states``: the latest step and expiry check of any, and the sketches'
    maximum cell by cell, which never counts an id below its count wherever it goes now (a
    count-min sketch may over-count, never under-count) and over-counts less than the sum
    would. Tables this PS does not declare are an error; tables absent from ``states`` keep theirs.

    Raises:
      ValueError: an unknown table, or a sketch of another shape; nothing is changed then.
    """
    unknown = set(states) - set(self.specs)
    if unknown:
      raise ValueError(f"snapshot has tables {sorted(unknown)} that this PS does not declare")
    for t, per in states.items():
      for st in per:
        self.shards[0][t].check_bounds_state(st)
    for t, per in states.items():
      if len(per) != self.num_shards:
        per = [merge_states(per)] * self.num_shards
      for s in range(self.num_shards):
        self.shards[s][t].restore_bounds_state(per[s])

  def stats(self) -> Dict[str, Dict[str, float]]:
    """Per table, summed over shards: rows, bytes, counters, hit rate, mean latencies."""
    out = {}
    for t in self.specs:
      per = [self.shards[s][t].stats() for s in range(self.num_shards)]
      agg = {k: sum(p[k] for p in per) for k in per[0] if k not in ("hit_rate", "lookup_ms", "apply_ms")}
      agg["hit_rate"] = agg["hits"] / agg["lookups"] if agg["lookups"] else float("nan")
      agg["lookup_ms"] = max(p["lookup_ms"] for p in per)  # shards run in parallel
      agg["apply_ms"] = max(p["apply_ms"] for p in per)
      out[t] = agg
    return out

  def close(self) -> None:
    self._workers.close()
    failed = None
    for shard in self.shards:
      for table in shard.values():
        try:
          table.close()
        except OSError as e:  # every table is closed; the first failure is raised
          failed = failed or e
    if failed is not None:
      raise failed
