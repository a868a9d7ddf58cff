"""A table's rows in bulk: chosen rows exported and imported with their optimizer slots, and the
whole table's snapshot and restore, each row with what its bounds read.

Every function takes the table's lock (``Table.locked``: after any eviction in flight) for the
whole call, reads the table's rows through its ``Columns`` and its tier, and leaves the table as
the one-row calls would have.
"""

from __future__ import annotations

import threading
from typing import Any, ContextManager, Dict, Iterator, Mapping, Protocol, Tuple

import numpy as np

from recsys_jax.async_ps.optim.optimizers import RowOptimizer
from recsys_jax.async_ps.store.bounds import Bounds
from recsys_jax.async_ps.store.columns import Columns
from recsys_jax.async_ps.store.ids import distinct_ids
from recsys_jax.async_ps.store.looked_up import LookedUp
from recsys_jax.async_ps.store.rows import Slots
from recsys_jax.embeddings.specs import TableSpec


class Table(Protocol):
  """What these functions use of a ``table.Table`` (which calls them: no import back)."""

  spec: TableSpec
  opt: RowOptimizer
  cols: Columns
  bounds: Bounds
  looked_up: LookedUp
  tier: Any  # a tier.disk.DiskTier or None (not imported: tensorstore only where a tier is used)
  capacity: int
  protect_steps: int
  lock: threading.Lock
  step: int

  def locked(self) -> ContextManager[None]: ...
  def initial_rows(self, ids: np.ndarray) -> np.ndarray: ...
  def evict(self, inserted: int = 0) -> None: ...
  def wait_read_ahead(self) -> None: ...
  def check_rows(
    self, ids: Any, weights: Any, slots: Mapping[str, Any], what: str = "import"
  ) -> Tuple[np.ndarray, np.ndarray, Slots]: ...


def export_rows(t: Table, ids: Any, checked: bool = False) -> Tuple[np.ndarray, Slots]:
  """Rows of distinct ids with their optimizer slots, from RAM or the tier; changes nothing.

  An id without a row reads what ``lookup(create=False)`` reads (its initial value; zeros
  under admission) with fresh optimizer slots (``opt.init``): what it would start from.
  No counter, recency, count or dirty flag changes, and spilled rows stay in the tier.

  Args:
    ids: distinct ids (unsigned or non-negative integers), 1-D.
    checked: the caller has passed them through ``ids.distinct_ids`` already.

  Returns:
    (float32 weights [n, dim], {slot: float32 [n, width]}), in the order of ``ids``.

  Raises:
    ValueError: ids that are not 1-D non-negative integers, or repeat.
  """
  if not checked:
    ids = distinct_ids(ids, t.spec.name, "export ids")
  n = ids.shape[0]
  weights = np.empty((n, t.spec.dim), np.float32)
  slots = t.opt.init(n, t.spec.dim)  # what ids without a row start from; the rest overwritten
  with t.locked():
    c = t.cols
    rows = c.ids.find(ids)
    have = np.flatnonzero(rows >= 0)
    weights[have] = c.weights[rows[have]]  # float32 exactly, from any storage dtype
    for k, v in slots.items():
      v[have] = c.slots[k][rows[have]]
    rest = np.flatnonzero(rows < 0)
    del rows, have
    if rest.shape[0] and t.tier is not None:
      found, w, tier_slots = t.tier.read(ids[rest])
      weights[rest[found]] = w[found]
      for k, v in slots.items():
        v[rest[found]] = tier_slots[k][found]
      rest = rest[~found]
    if rest.shape[0]:
      # Rounded like a created row would be, as ``lookup(create=False)`` reads it.
      weights[rest] = 0.0 if t.bounds.admission else t.initial_rows(ids[rest])
  return weights, slots


def import_rows(t: Table, ids: Any, weights: Any, slots: Mapping[str, Any], checked: bool = False) -> None:
  """Sets the rows of distinct ids and their optimizer slots to the given values (an upsert).

  Weights are rounded to the storage dtype; slots stay float32. Rows that exist (in RAM or
  in the tier) take the values in place; those in RAM keep their last-seen step and count,
  those in the tier come to RAM, as do ids without a row (created whatever the admission:
  the row was trained elsewhere), counted as seen at the table's step. A bounded table with a
  tier evicts at once (the new copies first), so RAM keeps its bound; without a tier it may
  hold more rows than its capacity until its next training lookup evicts as usual.
  The rows are dirty: the next incremental snapshot carries them.

  Args:
    ids: distinct ids (unsigned or non-negative integers), 1-D.
    weights: [len(ids), dim] float32 values.
    slots: every slot of the table's optimizer by name, [len(ids), width] float32 each.
    checked: the caller has passed them through ``check_rows`` already.

  Raises:
    ValueError: naming the table and what is wrong (see ``check_rows``); nothing is written then.
  """
  if not checked:
    ids, weights, slots = t.check_rows(ids, weights, slots, "import")
  with t.locked():
    c = t.cols
    rows = c.ids.find(ids)
    have = np.flatnonzero(rows >= 0)
    if have.shape[0]:
      r = rows[have]
      c.weights[r] = weights[have].astype(c.dtype, copy=False)
      for k, v in c.slots.items():
        v[r] = slots[k][have]
      c.dirty[r] = True
    new = np.flatnonzero(rows < 0)
    if new.shape[0]:
      if t.tier is not None:  # its copy there is stale now (and a snapshot would carry both)
        t.tier.remove(ids[new])
      c.insert(ids[new], weights[new], {k: v[new] for k, v in slots.items()}, t.step)
      if t.tier is not None and t.capacity:
        # Rows trained elsewhere (hot rows written back from the device) are a copy here: they may
        # go to the tier first, so RAM keeps its bound (without a tier they wait for the next lookup).
        c.last_seen[c.ids.find(ids[new])] = t.step - t.protect_steps
        t.evict(int(new.shape[0]))


def snapshot_parts(t: Table, incremental: bool = False, max_rows: int = 1 << 14) -> Iterator[Dict[str, np.ndarray]]:
  """Yields the table in parts of at most ``max_rows`` rows: ``ids`` [n], ``weights`` [n, dim]
  (float32), one array per slot; the first part also carries ``deleted`` when incremental.

  A bounded table's parts also carry what its bounds read of each row: with a capacity or
  expiry, ``last_seen`` (int64; -1 for rows in the tier, which keep none) and ``freq``
  (uint32); with a tier, ``spilled`` (bool: the row is in the tier, not in RAM). The table's
  own state (step, expiry cadence, sketch) is ``Table.bounds_state``.

  Includes the rows spilled to the tier, read back ``max_rows`` at a time, so a snapshot
  never holds more than one part in RAM. With ``incremental``, only rows changed (created,
  updated, looked up, read back or spilled) since the previous snapshot, plus ``deleted``:
  ids dropped since then (evicted without a tier, or expired). The table is locked until the
  last part is taken; the change tracking is reset only when every part was taken.
  """
  with t.locked():
    c = t.cols
    n = c.size
    sel = np.flatnonzero(c.dirty[:n]) if incremental else np.arange(n)
    extra = np.zeros(0, np.uint64)
    if t.tier is not None:
      live = t.tier.live_ids()
      if incremental:
        spilled = np.unique(np.concatenate(c.spilled)) if c.spilled else extra
        extra = spilled[np.isin(spilled, live)]
        extra = extra[c.ids.find(extra) < 0]
      else:
        extra = live
    deleted = np.unique(np.concatenate(c.deleted)) if c.deleted else np.zeros(0, np.uint64)
    if incremental:
      # An id deleted and later re-created is among the rows; it is not deleted any more.
      kept = np.concatenate([c.keys()[sel], extra])
      deleted = deleted[~np.isin(deleted, kept)]
    first = True
    for a in range(0, max(sel.shape[0], 1), max_rows):
      rows = sel[a : a + max_rows]
      part = {"ids": c.keys()[rows], "weights": c.weights[rows].astype(np.float32)}
      part.update({f"slot_{k}": v[rows] for k, v in c.slots.items()})
      _add_row_state(t, part, c.last_seen[rows], c.freq[rows], spilled=False)
      if incremental and first:
        part["deleted"] = deleted
      first = False
      yield part
    for a in range(0, extra.shape[0], max_rows):
      ids = extra[a : a + max_rows]
      found, w, slots = t.tier.read(ids)
      part = {"ids": ids[found], "weights": w[found]}
      part.update({f"slot_{k}": v[found] for k, v in slots.items()})
      m = int(found.sum())
      _add_row_state(t, part, np.full(m, -1, np.int64), np.zeros(m, np.uint32), spilled=True)
      yield part
    c.forget_changes()


def _add_row_state(t: Table, part: Dict[str, np.ndarray], last_seen, freq, spilled: bool) -> None:
  if t.bounds.tracks_use:
    part["last_seen"], part["freq"] = last_seen, freq
  if t.tier is not None:
    part["spilled"] = np.full(last_seen.shape[0], spilled)


def snapshot(t: Table, incremental: bool = False) -> Dict[str, np.ndarray]:
  """The whole table in one dict (``snapshot_parts`` concatenated); see there."""
  parts = list(snapshot_parts(t, incremental))
  out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k != "deleted"}
  if incremental:
    out["deleted"] = parts[0]["deleted"]
  return out


def validate_snapshot(t: Table, snap: Mapping[str, np.ndarray]) -> Tuple[np.ndarray, np.ndarray, Slots]:
  """Checks a snapshot of this table; returns (ids, float32 weights, float32 slots).

  Raises:
    ValueError: naming the table and what is wrong (shapes, repeated ids, missing slots).
  """
  n = np.shape(snap["ids"])[0] if np.ndim(snap["ids"]) else 0
  for k in ("last_seen", "freq", "spilled"):
    if k in snap and np.shape(snap[k]) != (n,):
      raise ValueError(f"table {t.spec.name!r}: snapshot {k} {np.shape(snap[k])} does not match ids ({n},)")
  # Slots of another optimizer are left out, not refused (a snapshot restores into a table whose
  # optimizer keeps fewer slots); missing ones are refused.
  names = t.opt.init(0, t.spec.dim)
  slots = {k: snap[f"slot_{k}"] for k in names if f"slot_{k}" in snap}
  return t.check_rows(snap["ids"], snap["weights"], slots, "snapshot")


def restore(t: Table, snap: Mapping[str, np.ndarray], merge: bool = False) -> None:
  """Loads a ``snapshot()``: replaces the contents, or with ``merge`` upserts its rows and
  removes its ``deleted`` ids (applying an incremental snapshot on top of a full one).

  Rows go where they were (RAM or tier, by ``spilled``), with their last-seen step and
  count; restored rows are not dirty. A full restore also resets the table's step, expiry
  cadence and sketch (``Table.restore_bounds_state`` brings them back). A snapshot without these
  arrays (older ones) puts rows in RAM up to the capacity and the rest in the tier, and its
  rows count as seen at the next training lookup.
  """
  ids, weights, slots = validate_snapshot(t, snap)
  n = ids.shape[0]
  last_seen = np.asarray(snap["last_seen"], np.int64) if "last_seen" in snap else np.full(n, -1, np.int64)
  freq = np.asarray(snap["freq"], np.uint32) if "freq" in snap else np.zeros(n, np.uint32)
  t.wait_read_ahead()  # none runs on the restored table for a step of the run before
  with t.lock:
    c = t.cols
    if not merge:
      c.clear()
      t.looked_up.clear()
      t.bounds.reset()
      if t.tier is not None:
        t.tier.remove(t.tier.live_ids())
    else:
      gone = np.concatenate([np.asarray(snap.get("deleted", np.zeros(0, np.uint64)), np.uint64), ids])
      present = c.ids.find(gone)
      if (present >= 0).any():
        keep = np.ones(c.size, bool)
        keep[present[present >= 0]] = False
        c.keep_only(keep)
      if t.tier is not None:
        t.tier.remove(gone)
    # Without a tier every row goes to RAM, even past the capacity (a snapshot restored into
    # more shards can give one shard more than its share); later lookups evict as usual.
    if t.tier is None or not t.capacity:
      to_ram = np.ones(n, bool)
    elif "spilled" in snap:
      to_ram = ~np.asarray(snap["spilled"], bool)
    else:
      to_ram = np.arange(n) < t.capacity - c.size
    ram = slice(None) if to_ram.all() else np.flatnonzero(to_ram)
    if ids[ram].shape[0]:
      rows = c.insert(ids[ram], weights[ram], {k: v[ram] for k, v in slots.items()}, t.step)
      c.last_seen[rows], c.freq[rows] = last_seen[ram], freq[ram]
      t.bounds.unstamped |= t.bounds.tracks_use and bool((last_seen[ram] < 0).any())
    if not to_ram.all():
      disk = np.flatnonzero(~to_ram)
      t.tier.write(ids[disk], weights[disk].astype(c.dtype), {k: v[disk] for k, v in slots.items()})
    c.forget_changes()
