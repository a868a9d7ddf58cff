"""Several plain tables in one call: lookups, resolves ahead and pushes with only their kernels.

A plain table (``Table.plain``: no bound, no tier, float32 rows, a fused optimizer) only finds or
creates rows on lookup, and its rows never move. So a call over several of them takes the locks
once and does per table a probe of its id map and a gather of its rows (two compiled calls), with
Python of its own only for unseen ids: a ``Table.lookup`` makes a dozen numpy calls a table, which
held the GIL longer than its kernels ran at the main job's shape. Results, counters and the rows
kept for the push (``Table.looked_up``) are those of the one-table calls, table by table.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Iterator, List, Optional, Sequence

import numpy as np

from recsys_jax.async_ps import kernels

if TYPE_CHECKING:
  from recsys_jax.async_ps.store.table import Table


@contextlib.contextmanager
def all_locked(tables: Sequence["Table"]) -> Iterator[None]:
  """Every table's lock, taken in one order (by identity) so that two such calls cannot deadlock;
  a plain table never hands its lock to an evictor, so the locks are all there is to wait for."""
  order = sorted(tables, key=id)
  taken = []
  try:
    for t in order:
      t.lock.acquire()
      taken.append(t)
    yield
  finally:
    for t in reversed(taken):
      t.lock.release()


def lookup(
  tables: Sequence["Table"], ids: Sequence[np.ndarray], outs: Sequence[np.ndarray], create: bool, step: Optional[int]
) -> None:
  """``tables[i].lookup(ids[i], create, step, outs[i])`` for plain tables, in one call.

  A training lookup whose ids ``resolve`` resolved for its step (the same arrays) only gathers
  the rows it found.

  Args:
    tables: distinct plain tables.
    ids: per table, its distinct uint64 ids (kept by the table for its push: the same array).
    outs: per table, float32 [len(ids), dim] (C-contiguous) to write the rows into.
    create: a training lookup (see ``Table.lookup``).
    step: the lookup's training step (or None).
  """
  t0 = time.perf_counter()
  with all_locked(tables):
    for t, i, o in zip(tables, ids, outs):
      if o.dtype != np.float32 or o.shape != (i.shape[0], t.spec.dim) or not o.flags.c_contiguous:
        raise ValueError(
          f"table {t.spec.name!r}: out is {o.dtype} {o.shape}, expected C-contiguous float32 ({i.shape[0]}, {t.spec.dim})"
        )
      rows = t.looked_up.resolved(step, i) if create else None
      if rows is None:
        rows = _resolve(t, i, create, step, o)
      if kernels.gather_rows(t.cols.weights, rows, o) >= 0:
        raise IndexError(f"table {t.spec.name!r}: a row out of range (a corrupt id map)")
  share = (time.perf_counter() - t0) / max(1, len(tables))
  for t in tables:
    t.timers["lookup_s"] += share
    t.timers["lookup_calls"] += 1


def resolve(tables: Sequence["Table"], ids: Sequence[np.ndarray], step: int) -> None:
  """The part of ``lookup(tables, ids, ..., create=True, step)`` that reads no row value: each
  id's row found, unseen ids' rows created, counted, kept for the lookup and the push of ``step``.
  The lookup of ``step`` with these very arrays then only gathers.

  Exact whenever it runs before that lookup: a plain table's rows never move, creating a row
  touches no other, and a push changes values, not where rows lie. So a trainer resolves a
  step's ids while the step before it still trains, and only the gather waits for that step's
  push (the staleness bound)."""
  with all_locked(tables):
    for t, i in zip(tables, ids):
      if t.looked_up.resolved(step, i) is None:
        _resolve(t, i, True, step, None)


def _resolve(t: "Table", ids: np.ndarray, create: bool, step: Optional[int], out: Optional[np.ndarray]) -> np.ndarray:
  """A plain table's rows of ``ids`` (its lock held): found, the unseen ones created (``create``)
  or their initial values written into ``out``; counted and kept for the push if ``create``."""
  if step is not None and create:
    t.step = max(t.step, int(step))
  if create and t.bounds.unstamped:
    t.bounds.stamp(t.cols)
  m = t.cols.ids
  rows = np.empty(ids.shape[0], np.int64)
  absent = kernels.find(m.slot_keys, m.slot_rows, m.mask, m.salt, kernels.read_only(ids), rows)
  if absent:
    rest = np.flatnonzero(rows < 0)
    if create:
      rows[rest] = t.cols.insert(ids[rest], None, None, t.step, absent=True)
      t.counters["created"] += rest.shape[0]
    else:  # rounded as a created row would be
      assert out is not None  # a lookup that does not create passes its out
      out[rest] = t.initial_rows(ids[rest])
  if create:
    c = t.counters
    c["lookups"] += ids.shape[0]
    c["hits"] += ids.shape[0] - absent
    c["misses"] += absent
    if step is not None:
      t.looked_up.remember(step, ids, rows)
  return rows


def apply(
  tables: Sequence["Table"], ids: Sequence[np.ndarray], grads: Sequence[np.ndarray], step: Optional[int]
) -> None:
  """``tables[i].apply(ids[i], grads[i], step, distinct=True)`` for plain tables, in one call.

  The rows are those each table's lookup of ``step`` kept (``LookedUp.recall``), or found by a
  probe; every table's are known before any table changes, so ids never looked up refuse the call
  (``KeyError``, as ``Table.apply``) with every table as it was; then each table is updated by its
  optimizer's kernel without the per-call checks of arrays it owns (``FusedUpdate.apply_owned``).

  Args:
    tables: distinct plain tables.
    ids: per table, its distinct uint64 ids (the caller checked them distinct).
    grads: per table, float32 [len(ids), dim].
    step: the push's training step (or None).
  """
  t0 = time.perf_counter()
  grads = [np.ascontiguousarray(g, np.float32) for g in grads]
  for t, i, g in zip(tables, ids, grads):
    if g.shape != (i.shape[0], t.spec.dim):
      raise ValueError(f"table {t.spec.name!r}: gradient shape {g.shape} does not match ({i.shape[0]}, {t.spec.dim})")
  with all_locked(tables):
    rows: List[np.ndarray] = []
    for t, i in zip(tables, ids):
      r = t.looked_up.recall(step, i)
      if r is None:
        m, r = t.cols.ids, np.empty(i.shape[0], np.int64)
        if kernels.find(m.slot_keys, m.slot_rows, m.mask, m.salt, kernels.read_only(np.asarray(i, np.uint64)), r):
          if step is not None:
            for table, kept, i_ in zip(tables, rows, ids):  # the rows recalled go back for a retry
              table.looked_up.remember(step, i_, kept)
          bad = np.asarray(i)[r < 0][:3].tolist()
          raise KeyError(f"table {t.spec.name!r}: gradient for ids never looked up, e.g. {bad}")
      rows.append(r)
    for t, r, g in zip(tables, rows, grads):
      t.opt.fused.apply_owned(t.cols.weights, t.cols.slots, r, g)  # type: ignore[union-attr]  # plain tables: FusedUpdate
      t.cols.dirty[r] = True
      t.counters["applied_rows"] += r.shape[0]
  share = (time.perf_counter() - t0) / max(1, len(tables))
  for t in tables:
    t.timers["apply_s"] += share
    t.timers["apply_calls"] += 1
