"""A table's rows in bulk: whole-table snapshots and restores, and export / import of chosen rows.

``TableRows`` is a mixin of ``table.Table`` over its storage (the id map, the weight, slot and
per-row state arrays, the tier). Snapshots carry every row (RAM and tier) with its optimizer
slots and the state its bounds read; ``export_rows`` / ``import_rows`` move chosen rows with
their optimizer slots out of the table and back (the trainer's hot rows go to the accelerator
and come back, and are written back before a checkpoint), without touching anything else.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Iterator, Mapping, Tuple

import numpy as np

from recsys_jax.async_ps import optimizers
from recsys_jax.async_ps.ids import distinct_ids
from recsys_jax.embeddings.specs import TableSpec

Slots = Dict[str, np.ndarray]


@functools.lru_cache(maxsize=None)
def slot_widths(spec: TableSpec) -> Dict[str, int]:
  """The optimizer slots of a table's rows: name -> width (float32 values per row); one dict per spec, shared."""
  fresh = optimizers.make(spec.optimizer, **dict(spec.optimizer_kwargs)).init(0, spec.dim)
  return {k: int(v.shape[1]) for k, v in fresh.items()}


def check_rows(
  spec: TableSpec, ids: Any, weights: Any, slots: Mapping[str, Any], what: str = "import"
) -> Tuple[np.ndarray, np.ndarray, Slots]:
  """Checks rows with their optimizer slots for a table, before anything is written.

  Args:
    spec: the table's spec (its optimizer's slots' names and widths).
    ids: distinct ids (unsigned or non-negative integers), 1-D.
    weights: [len(ids), dim] values (converted to float32).
    slots: exactly the optimizer's slots by name, each [len(ids), width] (converted to float32).
    what: what the rows are, for the errors ("import", "snapshot").

  Returns:
    (uint64 ids, float32 weights, float32 slots).

  Raises:
    ValueError: naming the table and what is wrong (ids, shapes, repeated ids, slot names).
  """
  name = spec.name
  ids = distinct_ids(ids, name, f"{what} ids")
  n, dim = ids.shape[0], spec.dim
  weights = np.asarray(weights, np.float32)
  if weights.shape != (n, dim):
    raise ValueError(f"table {name!r}: {what} weights {weights.shape} do not match ids ({n},) and dim {dim}")
  want = {k: (n, w) for k, w in slot_widths(spec).items()}
  extra = sorted(set(slots) - set(want))
  if extra:
    raise ValueError(
      f"table {name!r}: {what} has optimizer slots {extra} that its {spec.optimizer} optimizer does not "
      f"keep (it keeps {sorted(want)})"
    )
  out = {}
  for k, shape in want.items():
    arr = slots.get(k)
    if arr is None:
      raise ValueError(f"table {name!r}: {what} lacks optimizer slot {k!r} of shape {shape}")
    if np.shape(arr) != shape:
      raise ValueError(f"table {name!r}: {what} optimizer slot {k!r} is {np.shape(arr)}, expected {shape}")
    out[k] = np.asarray(arr, np.float32)
  return ids, weights, out


class TableRows:
  """Snapshots, restores, export and import of a ``Table``'s rows (see the module docstring)."""

  def check_rows(
    self, ids: Any, weights: Any, slots: Mapping[str, Any], what: str = "import"
  ) -> Tuple[np.ndarray, np.ndarray, Slots]:
    """``check_rows`` for this table's spec and optimizer."""
    return check_rows(self.spec, ids, weights, slots, what)

  # -- chosen rows with their slots ------------------------------------------------------
  def export_rows(self, ids: Any, checked: bool = False) -> Tuple[np.ndarray, Slots]:
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
      ids = distinct_ids(ids, self.spec.name, "export ids")
    n = ids.shape[0]
    weights = np.empty((n, self.spec.dim), np.float32)
    slots = self.opt.init(n, self.spec.dim)  # what ids without a row start from; the rest overwritten
    with self.lock:
      rows = self._ids.find(ids)
      have = np.flatnonzero(rows >= 0)
      weights[have] = self._weights[rows[have]]  # float32 exactly, from any storage dtype
      for k, v in slots.items():
        v[have] = self._slots[k][rows[have]]
      rest = np.flatnonzero(rows < 0)
      del rows, have
      if rest.shape[0] and self.tier is not None:
        found, w, tier_slots = self.tier.read(ids[rest])
        weights[rest[found]] = w[found]
        for k, v in slots.items():
          v[rest[found]] = tier_slots[k][found]
        rest = rest[~found]
      if rest.shape[0]:
        # Rounded like a created row would be, as ``lookup(create=False)`` reads it.
        weights[rest] = 0.0 if self._admission else self._init(ids[rest]).astype(self._wdtype)
    return weights, slots

  def import_rows(self, ids: Any, weights: Any, slots: Mapping[str, Any], checked: bool = False) -> None:
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
      ids, weights, slots = self.check_rows(ids, weights, slots, "import")
    with self.lock:
      rows = self._ids.find(ids)
      have = np.flatnonzero(rows >= 0)
      if have.shape[0]:
        r = rows[have]
        self._weights[r] = weights[have].astype(self._wdtype, copy=False)
        for k, v in self._slots.items():
          v[r] = slots[k][have]
        self._dirty[r] = True
      new = np.flatnonzero(rows < 0)
      if new.shape[0]:
        if self.tier is not None:  # its copy there is stale now (and a snapshot would carry both)
          self.tier.remove(ids[new])
        self._insert(ids[new], weights[new], {k: v[new] for k, v in slots.items()})
        if self.tier is not None and self.capacity:
          # Rows trained elsewhere (hot rows written back from the device) are a copy here: they may
          # go to the tier first, so RAM keeps its bound (without a tier they wait for the next lookup).
          self._last_seen[self._ids.find(ids[new])] = self.step - self.protect_steps
          self._evict()

  # -- snapshots ----------------------------------------------------------------------
  def snapshot_parts(self, incremental: bool = False, max_rows: int = 1 << 14) -> Iterator[Dict[str, np.ndarray]]:
    """Yields the table in parts of at most ``max_rows`` rows: ``ids`` [n], ``weights`` [n, dim]
    (float32), one array per slot; the first part also carries ``deleted`` when incremental.

    A bounded table's parts also carry what its bounds read of each row: with a capacity or
    expiry, ``last_seen`` (int64; -1 for rows in the tier, which keep none) and ``freq``
    (uint32); with a tier, ``spilled`` (bool: the row is in the tier, not in RAM). The table's
    own state (step, expiry cadence, sketch) is ``bounds_state``.

    Includes the rows spilled to the tier, read back ``max_rows`` at a time, so a snapshot
    never holds more than one part in RAM. With ``incremental``, only rows changed (created,
    updated, looked up, read back or spilled) since the previous snapshot, plus ``deleted``:
    ids dropped since then (evicted without a tier, or expired). The table is locked until the
    last part is taken; the change tracking is reset only when every part was taken.
    """
    with self.lock:
      n = self.num_rows
      sel = np.flatnonzero(self._dirty[:n]) if incremental else np.arange(n)
      extra = np.zeros(0, np.uint64)
      if self.tier is not None:
        live = self.tier.live_ids()
        if incremental:
          spilled = np.unique(np.concatenate(self._spilled_ids)) if self._spilled_ids else extra
          extra = spilled[np.isin(spilled, live)]
          extra = extra[self._ids.find(extra) < 0]
        else:
          extra = live
      deleted = np.unique(np.concatenate(self._deleted)) if self._deleted else np.zeros(0, np.uint64)
      if incremental:
        # An id deleted and later re-created is among the rows; it is not deleted any more.
        kept = np.concatenate([self._ids.keys()[sel], extra])
        deleted = deleted[~np.isin(deleted, kept)]
      first = True
      for a in range(0, max(sel.shape[0], 1), max_rows):
        rows = sel[a : a + max_rows]
        part = {"ids": self._ids.keys()[rows], "weights": self._weights[rows].astype(np.float32)}
        part.update({f"slot_{k}": v[rows] for k, v in self._slots.items()})
        self._add_row_state(part, self._last_seen[rows], self._freq[rows], spilled=False)
        if incremental and first:
          part["deleted"] = deleted
        first = False
        yield part
      for a in range(0, extra.shape[0], max_rows):
        ids = extra[a : a + max_rows]
        found, w, slots = self.tier.read(ids)
        part = {"ids": ids[found], "weights": w[found]}
        part.update({f"slot_{k}": v[found] for k, v in slots.items()})
        m = int(found.sum())
        self._add_row_state(part, np.full(m, -1, np.int64), np.zeros(m, np.uint32), spilled=True)
        yield part
      self._dirty[:n] = False
      self._deleted, self._spilled_ids = [], []

  def _add_row_state(self, part: Dict[str, np.ndarray], last_seen, freq, spilled: bool) -> None:
    if self.tracks_use:
      part["last_seen"], part["freq"] = last_seen, freq
    if self.tier is not None:
      part["spilled"] = np.full(last_seen.shape[0], spilled)

  def snapshot(self, incremental: bool = False) -> Dict[str, np.ndarray]:
    """The whole table in one dict (``snapshot_parts`` concatenated); see there."""
    parts = list(self.snapshot_parts(incremental))
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k != "deleted"}
    if incremental:
      out["deleted"] = parts[0]["deleted"]
    return out

  def validate_snapshot(self, snap: Mapping[str, np.ndarray]):
    """Checks a snapshot of this table; returns (ids, float32 weights, float32 slots).

    Raises:
      ValueError: naming the table and what is wrong (shapes, repeated ids, missing slots).
    """
    n = np.shape(snap["ids"])[0] if np.ndim(snap["ids"]) else 0
    for k in ("last_seen", "freq", "spilled"):
      if k in snap and np.shape(snap[k]) != (n,):
        raise ValueError(f"table {self.spec.name!r}: snapshot {k} {np.shape(snap[k])} does not match ids ({n},)")
    # Slots of another optimizer are left out, not refused (a snapshot restores into a table whose
    # optimizer keeps fewer slots); missing ones are refused.
    names = self.opt.init(0, self.spec.dim)
    slots = {k: snap[f"slot_{k}"] for k in names if f"slot_{k}" in snap}
    return self.check_rows(snap["ids"], snap["weights"], slots, "snapshot")

  def restore(self, snap: Mapping[str, np.ndarray], merge: bool = False) -> None:
    """Loads a ``snapshot()``: replaces the contents, or with ``merge`` upserts its rows and
    removes its ``deleted`` ids (applying an incremental snapshot on top of a full one).

    Rows go where they were (RAM or tier, by ``spilled``), with their last-seen step and
    count; restored rows are not dirty. A full restore also resets the table's step, expiry
    cadence and sketch (``restore_bounds_state`` brings them back). A snapshot without these
    arrays (older ones) puts rows in RAM up to the capacity and the rest in the tier, and its
    rows count as seen at the next training lookup.
    """
    ids, weights, slots = self.validate_snapshot(snap)
    n = ids.shape[0]
    last_seen = np.asarray(snap["last_seen"], np.int64) if "last_seen" in snap else np.full(n, -1, np.int64)
    freq = np.asarray(snap["freq"], np.uint32) if "freq" in snap else np.zeros(n, np.uint32)
    with self.lock:
      if not merge:
        self._clear(0)
        self._init_bounds()
        if self.tier is not None:
          self.tier.remove(self.tier.live_ids())
      else:
        gone = np.concatenate([np.asarray(snap.get("deleted", np.zeros(0, np.uint64)), np.uint64), ids])
        present = self._ids.find(gone)
        if (present >= 0).any():
          keep = np.ones(self.num_rows, bool)
          keep[present[present >= 0]] = False
          self._keep_only(keep)
        if self.tier is not None:
          self.tier.remove(gone)
      # Without a tier every row goes to RAM, even past the capacity (a snapshot restored into
      # more shards can give one shard more than its share); later lookups evict as usual.
      if self.tier is None or not self.capacity:
        to_ram = np.ones(n, bool)
      elif "spilled" in snap:
        to_ram = ~np.asarray(snap["spilled"], bool)
      else:
        to_ram = np.arange(n) < self.capacity - self.num_rows
      ram = slice(None) if to_ram.all() else np.flatnonzero(to_ram)
      if ids[ram].shape[0]:
        rows = self._insert(ids[ram], weights[ram], {k: v[ram] for k, v in slots.items()})
        self._last_seen[rows], self._freq[rows] = last_seen[ram], freq[ram]
        self._unstamped |= self.tracks_use and bool((last_seen[ram] < 0).any())
      if not to_ram.all():
        disk = np.flatnonzero(~to_ram)
        self.tier.write(ids[disk], weights[disk].astype(self._wdtype), {k: v[disk] for k, v in slots.items()})
      self._dirty[: self.num_rows] = False
      self._deleted, self._spilled_ids = [], []
