"""The hot set: which ids of which tables live on the device, in which slot (host bookkeeping).

Each row-width group of tables (the groups of ``recsys_jax.embeddings.dedup``) has a fixed
number of device slots, its capacity: a static shape, so the jitted step compiles once. The
tables of a group share its slots, so a table gets as many as its ids earn by frequency: the
budget is split across tables by measured access, without per-table tuning (``choose``).

For a step, ``HotSet.split`` turns a deduplicated group into its cold part (the rows the
parameter server looks up, laid end to end as without a hot set) and the hot slots the step
touches. The step gathers ``concat(cold rows, hot_table[hot_idx])`` and the remapped inverse
indexes it: entry ``i < bucket`` is cold row ``i``, entry ``bucket + j`` is hot slot
``hot_idx[j]``. So hot rows never travel host -> device; only their slot numbers do (4 bytes
instead of 4 * dim).

Nothing here touches a device or the PS: ``recsys_jax.training.hot_rows`` does.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numba
import numpy as np

from recsys_jax.embeddings import dedup as dedup_lib


@numba.njit(nogil=True, cache=True)
def _split_table(hot_ids, hot_slots, ids, off, remap, cold_ids, n_cold, hot_pos, hot_sl, n_hot):
  """One table of a step: each of its distinct ``ids`` (rows ``off + i`` of the group) is looked
  up in its sorted ``hot_ids``. A cold id is appended to ``cold_ids`` and ``remap`` sends its row
  to its cold row; a hot one appends its row to ``hot_pos`` and its slot to ``hot_sl``.
  Returns the new (n_cold, n_hot). One pass, instead of a dozen numpy calls per table."""
  m = hot_ids.shape[0]
  a = 0  # ids ascend (dedup sorts them): each one's place among the hot ids is at or after the last one's
  for i in range(ids.shape[0]):
    x = ids[i]
    step = 1  # gallop from there, then bisect: a few probes near ``a``
    while a + step < m and hot_ids[a + step] < x:
      a += step
      step *= 2
    b = min(m, a + step)
    while a < b:  # the first hot id >= x
      mid = (a + b) >> 1
      if hot_ids[mid] < x:
        a = mid + 1
      else:
        b = mid
    if a < m and hot_ids[a] == x:
      hot_pos[n_hot] = off + i
      hot_sl[n_hot] = hot_slots[a]
      n_hot += 1
    else:
      remap[off + i] = n_cold
      cold_ids[n_cold] = x
      n_cold += 1
  return n_cold, n_hot


_NO_WEIGHTS = np.zeros((1, 1, 1), np.float32)  # what _count_hits reads without weights (nothing)


@numba.njit(nogil=True, cache=True)
def _remap(inverse, remap):
  """``remap[inverse]``, a new array of ``inverse``'s shape (numpy's fancy index holds the GIL)."""
  out = np.empty_like(inverse)
  flat_in, flat_out = inverse.reshape(-1), out.reshape(-1)
  for i in range(flat_in.shape[0]):
    flat_out[i] = remap[flat_in[i]]
  return out


@numba.njit(nogil=True, cache=True)
def _count_hits(inverse, bucket, weights, has_weights):
  """(entries of ``inverse`` >= ``bucket`` with a nonzero weight, entries with a nonzero weight);
  every weight is 1 without ``has_weights``."""
  flat = inverse.reshape(-1)
  hits = counted = 0
  if has_weights:
    w = weights.reshape(-1)
    for i in range(flat.shape[0]):
      if w[i] != 0:
        counted += 1
        if flat[i] >= bucket:
          hits += 1
  else:
    counted = flat.shape[0]
    for i in range(flat.shape[0]):
      if flat[i] >= bucket:
        hits += 1
  return hits, counted


@numba.njit(nogil=True, cache=True)
def _in_sorted(a, b):
  """For ascending uint64 ``a`` and ``b`` (each distinct): whether each of ``a`` is in ``b``, in one
  merge (``np.isin`` sorts both again: most of a re-choice, at a million hot rows)."""
  out = np.zeros(a.shape[0], np.bool_)
  j = 0
  for i in range(a.shape[0]):
    x = a[i]
    while j < b.shape[0] and b[j] < x:
      j += 1
    out[i] = j < b.shape[0] and b[j] == x
  return out


def capacities(
  budget_bytes: int, lookups: Mapping[int, int], row_bytes: Mapping[int, int], limit: Optional[Mapping[int, int]] = None
) -> Dict[int, int]:
  """Slots per row-width group from a byte budget.

  The budget is split across groups by their share of a record's lookups (``lookups``: ids per
  record in each group), and each share buys ``share // row_bytes[dim]`` slots (a row and its
  optimizer slots). ``limit``: at most this many slots per group (e.g. the group's rows in all).
  """
  total = sum(lookups.values())
  out = {}
  for dim, n in lookups.items():
    share = int(budget_bytes) * n // max(1, total)
    rows = share // int(row_bytes[dim])
    if limit is not None and dim in limit:
      rows = min(rows, int(limit[dim]))
    out[dim] = max(0, rows)
  return out


def choose(
  counts: Mapping[str, Tuple[np.ndarray, np.ndarray]],
  groups: Mapping[int, Sequence[str]],
  capacity: Mapping[int, int],
  overrides: Optional[Mapping[str, int]] = None,
  min_count: int = 2,
) -> Dict[str, np.ndarray]:
  """The new hot set: for each group, its most frequent ids across its tables, up to its capacity.

  Args:
    counts: table -> (candidate ids, their counts: steps each id was seen in).
    groups: row width -> the group's table names.
    capacity: row width -> the group's slots.
    overrides: table -> rows: the table gets its top ``rows`` ids (0: never hot) before the
      other tables share what is left.
    min_count: ids seen in fewer steps stay cold (one sighting is no sign of heat).

  Returns:
    table -> sorted ids to hold on the device. Ties are broken by table order, then id, so
    every process given the same counts chooses the same set.
  """
  overrides = dict(overrides or {})
  chosen: Dict[str, np.ndarray] = {}
  for dim, tables in groups.items():
    left = int(capacity.get(dim, 0))
    free_tables, free_ids, free_counts = [], [], []
    for ti, name in enumerate(tables):
      ids, cnt = counts.get(name, (np.zeros(0, np.uint64), np.zeros(0, np.int64)))
      ids, cnt = np.asarray(ids, np.uint64), np.asarray(cnt, np.int64)
      keep = cnt >= min_count
      ids, cnt = ids[keep], cnt[keep]
      if name in overrides:
        order = np.lexsort((ids, -cnt))[: max(0, min(int(overrides[name]), left))]
        chosen[name] = np.sort(ids[order])
        left -= order.shape[0]
      else:
        free_tables.append(np.full(ids.shape[0], ti, np.int64))
        free_ids.append(ids)
        free_counts.append(cnt)
    picked: Dict[int, List[np.ndarray]] = {}
    if free_ids:
      t_all, i_all, c_all = (np.concatenate(x) for x in (free_tables, free_ids, free_counts))
      order = np.lexsort((i_all, t_all, -c_all))[: max(0, left)]
      for ti in np.unique(t_all[order]):
        picked[int(ti)] = [i_all[order][t_all[order] == ti]]
    for ti, name in enumerate(tables):
      if name not in overrides:
        chosen[name] = np.sort(picked[ti][0]) if ti in picked else np.zeros(0, np.uint64)
  return chosen


@dataclasses.dataclass
class Swap:
  """What a re-choice moves: per table, the ids that leave the device and those that come in."""

  demote: Dict[str, Tuple[np.ndarray, np.ndarray]]
  """table -> (ids, the slots they leave): their rows go back to the PS."""
  promote: Dict[str, Tuple[np.ndarray, np.ndarray]]
  """table -> (ids, the slots they take): their rows come from the PS."""

  def rows(self, which: str) -> int:
    return int(sum(ids.shape[0] for ids, _ in getattr(self, which).values()))


@dataclasses.dataclass
class Split:
  """A group's ids split into the cold part (for the PS) and the hot slots the step touches."""

  group: dedup_lib.Group
  """The cold rows: tables, offsets, bucket as the PS lookup and push expect; the inverse remapped."""
  hot_idx: np.ndarray
  """int32 [bucket_h]: the distinct hot slots of the step, padded with the capacity (no slot)."""
  hits: int
  """Lookups (id occurrences that count) served by a hot row."""
  lookups: int
  """Lookups in all."""


class HotSet:
  """Which ids are hot, and in which slot of their group's device table.

  Args:
    groups: row width -> the names of the tables of that width (dedup's groups).
    capacity: row width -> slots on the device.
  """

  def __init__(self, groups: Mapping[int, Sequence[str]], capacity: Mapping[int, int]):
    self.groups = {int(d): tuple(t) for d, t in groups.items()}
    self.capacity = {d: int(capacity.get(d, 0)) for d in self.groups}
    self.group_of = {t: d for d, ts in self.groups.items() for t in ts}
    self._ids = {t: np.zeros(0, np.uint64) for t in self.group_of}  # sorted hot ids per table
    self._slots = {t: np.zeros(0, np.int32) for t in self.group_of}  # their slots
    self._used = {d: np.zeros(c, bool) for d, c in self.capacity.items()}

  def size(self, dim: Optional[int] = None) -> int:
    """Hot rows held (in one group, or in all)."""
    dims = self.groups if dim is None else (dim,)
    return int(sum(self._used[d].sum() for d in dims))

  def hot(self, table: str) -> Tuple[np.ndarray, np.ndarray]:
    """(sorted hot ids, their slots) of a table."""
    return self._ids[table], self._slots[table]

  def load(self, hot: Mapping[str, Tuple[np.ndarray, np.ndarray]]) -> None:
    """Sets the hot set to ``hot`` (table -> (ids, slots), as ``hot`` gives them), e.g. from a checkpoint.

    Raises:
      ValueError: an unknown table, a slot out of range or used twice in a group, or ids and
        slots of different lengths.
    """
    unknown = sorted(set(hot) - set(self.group_of))
    if unknown:
      raise ValueError(f"hot set: unknown table(s) {unknown}; the tables are {sorted(self.group_of)}")
    used = {d: np.zeros(c, bool) for d, c in self.capacity.items()}
    ids_of, slots_of = {}, {}
    for t in self.group_of:
      ids, slots = (np.asarray(a) for a in hot.get(t, (np.zeros(0, np.uint64), np.zeros(0, np.int32))))
      d = self.group_of[t]
      if ids.shape != slots.shape or ids.ndim != 1:
        raise ValueError(f"hot set: table {t!r} has {ids.shape} ids and {slots.shape} slots")
      if slots.size and (slots.min() < 0 or slots.max() >= self.capacity[d] or used[d][slots].any()):
        raise ValueError(f"hot set: table {t!r} has slots out of [0, {self.capacity[d]}) or taken twice")
      if np.unique(slots).size != slots.size:
        raise ValueError(f"hot set: table {t!r} has slots taken twice")
      used[d][slots] = True
      order = np.argsort(ids.astype(np.uint64), kind="stable")
      ids_of[t], slots_of[t] = ids.astype(np.uint64)[order], slots.astype(np.int32)[order]
    self._ids, self._slots, self._used = ids_of, slots_of, used

  def plan(self, chosen: Mapping[str, np.ndarray]) -> Swap:
    """The moves that make ``chosen`` (table -> ids, as ``choose`` gives) the hot set.

    Rows that stay keep their slots; leaving rows free theirs; arriving rows take the lowest
    free slots, tables in group order, ids ascending (the same on every process).

    Raises:
      ValueError: a group's chosen ids exceed its capacity, or a table is unknown.
    """
    unknown = sorted(set(chosen) - set(self.group_of))
    if unknown:
      raise ValueError(f"hot set: unknown table(s) {unknown}; the tables are {sorted(self.group_of)}")
    demote, promote = {}, {}
    for dim, tables in self.groups.items():
      want = {t: np.unique(np.asarray(chosen.get(t, np.zeros(0)), np.uint64)) for t in tables}
      n = sum(w.shape[0] for w in want.values())
      if n > self.capacity[dim]:
        raise ValueError(f"hot set: {n} rows chosen for the width-{dim} group, which has {self.capacity[dim]} slots")
      free = ~self._used[dim]
      for t in tables:
        old, slots = self._ids[t], self._slots[t]
        leaving = ~_in_sorted(old, want[t])  # both ascending (the set keeps its ids sorted)
        demote[t] = (old[leaving], slots[leaving])
        free[slots[leaving]] = True
      free_slots = np.flatnonzero(free).astype(np.int32)
      taken = 0
      for t in tables:
        arriving = want[t][~_in_sorted(want[t], self._ids[t])]
        promote[t] = (arriving, free_slots[taken : taken + arriving.shape[0]])
        taken += arriving.shape[0]
    return Swap(demote, promote)

  def apply(self, swap: Swap) -> None:
    """Makes a planned swap the current hot set (call once its rows have moved)."""
    for t, (ids, slots) in swap.demote.items():
      if ids.shape[0]:
        keep = ~_in_sorted(self._ids[t], ids)  # a plan's leaving ids are a sorted part of them
        self._ids[t], self._slots[t] = self._ids[t][keep], self._slots[t][keep]
        self._used[self.group_of[t]][slots] = False
    for t, (ids, slots) in swap.promote.items():
      if ids.shape[0]:
        all_ids = np.concatenate([self._ids[t], ids])
        all_slots = np.concatenate([self._slots[t], slots])
        order = np.argsort(all_ids, kind="stable")
        self._ids[t], self._slots[t] = all_ids[order], all_slots[order].astype(np.int32)
        self._used[self.group_of[t]][slots] = True

  def split(
    self,
    g: dedup_lib.Group,
    min_bucket: Union[int, Mapping[int, int]] = dedup_lib.MIN_BUCKET,
    min_hot_bucket: Optional[int] = None,
  ) -> Split:
    """Splits a deduplicated group into its cold rows and the hot slots the step reads.

    The cold tables keep dedup's layout (ids ascending, end to end), so the PS lookup and push
    see an ordinary group; the inverse is remapped so cold entries index the cold rows and hot
    entries index ``bucket + j``, where ``hot_idx[j]`` is the slot. Padding of the inverse (weight
    0) may point at any row: it contributes nothing, as before. ``min_bucket`` is the smallest
    cold bucket (one int, or one per row width), ``min_hot_bucket`` the smallest length of
    ``hot_idx`` (default: the same as the cold one).
    """
    mb = min_bucket.get(g.dim, dedup_lib.MIN_BUCKET) if isinstance(min_bucket, Mapping) else int(min_bucket)
    mh = mb if min_hot_bucket is None else int(min_hot_bucket)
    n = g.num_rows
    remap = np.zeros(max(1, n), np.int32)
    cold_ids = np.empty(n, np.uint64)
    hot_pos, slots = np.empty(n, np.int64), np.empty(n, np.int32)
    cold_tables = []
    n_cold = n_hot = 0
    for name, ids, off in g.tables:
      start = n_cold
      n_cold, n_hot = _split_table(
        self._ids[name],
        self._slots[name],
        np.asarray(ids, np.uint64),
        off,
        remap,
        cold_ids,
        n_cold,
        hot_pos,
        slots,
        n_hot,
      )
      cold_tables.append((name, cold_ids[start:n_cold], start))
    bucket = dedup_lib.bucket_size(n_cold, mb)
    bucket_h = dedup_lib.bucket_size(n_hot, mh)
    hot_idx = np.full(bucket_h, self.capacity[g.dim], np.int32)
    hot_idx[:n_hot] = slots[:n_hot]
    remap[hot_pos[:n_hot]] = bucket + np.arange(n_hot, dtype=np.int32)
    inverse = _remap(g.inverse, remap)
    weights = g.weights if g.weights is not None else _NO_WEIGHTS
    hits, counted = _count_hits(inverse, bucket, weights, g.weights is not None)
    cold_group = dataclasses.replace(g, tables=cold_tables, inverse=inverse, num_rows=n_cold, bucket=bucket)
    return Split(cold_group, hot_idx, int(hits), int(counted))
