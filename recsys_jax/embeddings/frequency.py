"""Per-table access frequencies in bounded memory, to choose the hot rows that live on the device.

For every step and table the host passes the step's distinct ids; an id's count is the number
of steps it appeared in (what a device-resident row saves: one host->device transfer per step
it is used). Tables can hold billions of distinct ids, so counts are not kept per id:

- a count-min sketch per table (``depth`` rows of ``width`` uint32 counters, one hash per row)
  estimates any id's count from above (never below the truth). With conservative update (the
  default) an add raises only the counters that are at the id's current minimum, which cuts the
  over-estimate of rare ids several-fold at the same memory;
- a candidate pool per table, the ids that may be among the ``capacity`` most frequent: an id
  joins when its estimate reaches the table's threshold; when the pool grows past
  ``2 * capacity`` it is cut to the ``capacity`` ids of highest estimate and the threshold rises
  above the cut. The pool holds ids only; their counts are read from the sketch when asked.

Invariant: every id whose estimate reached the threshold when it was last seen is in the pool,
so with exact estimates ``top(n)`` (n <= capacity) is the exact top n up to ties at the cut.

An ``add`` is one compiled pass (the sketch, then a search of the pool for the ids at the
threshold, which ascend, so each search starts where the last one ended); new candidates wait in
a list and are merged into the pool (a compiled merge, O(pool + new log new)) once they are as
many as the pool's ids, or past ``2 * capacity`` merged and cut to ``capacity`` (a compiled
selection, O(pool)), so it is O(log capacity) per id amortised, never O(pool) per call. Every
kernel drops the GIL: an ``add`` holds it for a few microseconds whatever its size.
Results depend only on the sequence of calls (ties broken by id). Calls for different tables may
run on different threads at once (the kernels drop the GIL; each table has its own lock).
No jax here: the host feed calls this.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Sequence, Tuple

import numba
import numpy as np

from recsys_jax.prefetch import prefetch
from recsys_jax.sorting import radix_sort

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@numba.njit(nogil=True, cache=True, inline="always")
def _mix(x):
  """splitmix64's finaliser: a bijection on uint64 that spreads small and structured ids."""
  z = x
  z = (z ^ (z >> np.uint64(30))) * _MIX1
  z = (z ^ (z >> np.uint64(27))) * _MIX2
  return z ^ (z >> np.uint64(31))


@numba.njit(nogil=True, cache=True)
def _first_unsorted(ids):
  """Index of the first id not strictly greater than the one before it; -1 if strictly ascending."""
  for i in range(1, ids.shape[0]):
    if ids[i] <= ids[i - 1]:
      return i
  return -1


_AHEAD = 16  # ids whose sketch counters are prefetched ahead of the one being counted


@numba.njit(nogil=True, cache=True, inline="always")
def _column(x, seed, width):
  h = _mix(x + seed)
  if width & (width - np.uint64(1)) == np.uint64(0):  # a power of two (the default): the same as %, no division
    return np.int64(h & (width - np.uint64(1)))
  return np.int64(h % width)


@numba.njit(nogil=True, cache=True, inline="always")
def _columns(sketch, seeds, ids):
  """Each id's counter column in every row of the sketch, ``[len(ids), depth]``."""
  depth, width = sketch.shape
  w = np.uint64(width)
  cols = np.empty((ids.shape[0], depth), np.int64)
  for i in range(ids.shape[0]):
    for d in range(depth):
      cols[i, d] = _column(ids[i], seeds[d], w)
  return cols


@numba.njit(nogil=True, cache=True, inline="always")
def _min_count(sketch, cols, i):
  """The minimum of the counters of the id in row ``i`` of ``cols``, once the counters of the id
  ``_AHEAD`` rows on are asked for (prefetched)."""
  depth = sketch.shape[0]
  if i + _AHEAD < cols.shape[0]:
    for d in range(depth):
      prefetch(sketch, d, cols[i + _AHEAD, d])
  m = np.uint32(0xFFFFFFFF)
  for d in range(depth):
    v = sketch[d, cols[i, d]]
    if v < m:
      m = v
  return m


@numba.njit(nogil=True, cache=True)
def _add(sketch, seeds, ids, conservative, threshold, pool):
  """Counts a step's sorted distinct ``ids`` once each in ``sketch`` [depth, width]; returns
  ``(-1, the ids whose estimate after the add reached threshold and that are not in the sorted
  ``pool``)``, or ``(i, empty)`` if ``ids[i]`` is not above ``ids[i - 1]`` (nothing is counted then).

  The counters an id touches are at random in a sketch larger than the core's cache, so their
  columns are computed first and the counters of the id ``_AHEAD`` places on are prefetched
  (3.6x over waiting on each miss, 26 tables of 8,000 ids in sketches of 1 MiB)."""
  bad = _first_unsorted(ids)
  if bad >= 0:
    return bad, np.empty(0, np.uint64)
  depth = sketch.shape[0]
  n = ids.shape[0]
  cols = _columns(sketch, seeds, ids)
  for i in range(min(n, _AHEAD)):
    for d in range(depth):
      prefetch(sketch, d, cols[i, d])
  new = np.empty(n, np.uint64)
  n_new = 0
  p = pool.shape[0]
  lo = 0  # ids ascend: each one's place in the pool is at or after the last one's
  for i in range(n):
    m = _min_count(sketch, cols, i)
    # m >= the id's true count so far, so m + 1 bounds it after this step: conservative update
    # raises only the counters below m + 1; plain count-min adds 1 to all. Either way the new
    # minimum is m + 1 (counters saturate instead of wrapping).
    new_m = m + np.uint32(1) if m < np.uint32(0xFFFFFFFF) else m
    for d in range(depth):
      c = cols[i, d]
      if conservative:
        if sketch[d, c] < new_m:
          sketch[d, c] = new_m
      elif sketch[d, c] < np.uint32(0xFFFFFFFF):
        sketch[d, c] += np.uint32(1)
    if np.int64(new_m) >= threshold:
      x = ids[i]
      # The first pool id >= x, galloping from the last one's place: consecutive ids lie a few
      # places apart in the pool, so a few probes near ``lo`` find it (a binary search over
      # the rest of the pool would start with misses far away).
      step = 1
      while lo + step < p and pool[lo + step] < x:
        lo += step
        step *= 2
      hi = min(p, lo + step)
      while lo < hi:
        mid = (lo + hi) >> 1
        if pool[mid] < x:
          lo = mid + 1
        else:
          hi = mid
      if lo >= p or pool[lo] != x:
        new[n_new] = x
        n_new += 1
  return -1, new[:n_new].copy()


@numba.njit(nogil=True, cache=True)
def _merge(pool, pending):
  """The sorted distinct ids of the sorted distinct ``pool`` and ``pending`` (any order, repeats)."""
  pending = radix_sort(pending.copy(), np.empty_like(pending))
  out = np.empty(pool.shape[0] + pending.shape[0], np.uint64)
  i = j = n = 0
  while i < pool.shape[0] or j < pending.shape[0]:
    if j >= pending.shape[0] or (i < pool.shape[0] and pool[i] <= pending[j]):
      x = pool[i]
      i += 1
    else:
      x = pending[j]
      j += 1
    if n == 0 or out[n - 1] != x:
      out[n] = x
      n += 1
  return out[:n].copy()


@numba.njit(nogil=True, cache=True)
def _keep_top(sketch, seeds, pool, capacity):
  """``(the capacity ids of the sorted distinct pool of highest estimate, ties by id ascending,
  still sorted; the estimate of the last one kept)``: what sorting by (estimate descending, id
  ascending) and keeping the first ``capacity`` keeps, in O(pool)."""
  n = pool.shape[0]
  est = np.empty(n, np.int64)
  _estimate(sketch, seeds, pool, est)
  cut = np.partition(-est, capacity - 1)[capacity - 1] * -1  # the capacity-th highest estimate
  above = 0
  for i in range(n):
    if est[i] > cut:
      above += 1
  at_cut = capacity - above  # ids with the cut's estimate that stay: the smallest ones
  out = np.empty(capacity, np.uint64)
  k = 0
  for i in range(n):
    if est[i] > cut or (est[i] == cut and at_cut > 0):
      if est[i] == cut:
        at_cut -= 1
      out[k] = pool[i]
      k += 1
  return out, cut


@numba.njit(nogil=True, cache=True)
def _estimate(sketch, seeds, ids, out):
  """``out[i]`` = the estimate of ``ids[i]``: its counters' minimum (prefetched ahead, as in ``_add``)."""
  cols = _columns(sketch, seeds, ids)
  for i in range(ids.shape[0]):
    out[i] = _min_count(sketch, cols, i)


@numba.njit(nogil=True, cache=True)
def _mix_all(xs):
  out = np.empty_like(xs)
  for i in range(xs.shape[0]):
    out[i] = _mix(xs[i])
  return out


class _Table:
  """One table's sketch, candidate pool and threshold (guarded by its lock)."""

  def __init__(self, depth: int, width: int):
    self.sketch = np.zeros((depth, width), np.uint32)
    self.pool = np.zeros(0, np.uint64)  # sorted, distinct
    self.pending: List[np.ndarray] = []  # new candidates since the last merge (may repeat ids)
    self.pending_n = 0
    self.threshold = 1
    self.lock = threading.Lock()


class FrequencyCounter:
  """Per-table step counts of ids (count-min sketch) and the candidates for the hot set; see the module docstring.

  capacity: candidates kept per table, the most hot rows a table could ever get.
  width, depth: the sketch of each table (``4 * width * depth`` bytes). An id's over-estimate is
    about (the table's total count) / width for plain count-min, less with conservative update.
  """

  MERGE_MIN = 1 << 16
  """New candidates held unmerged before they are merged into a pool smaller than this."""

  def __init__(
    self,
    tables: Sequence[str],
    capacity: int,
    width: int = 1 << 16,
    depth: int = 4,
    seed: int = 0,
    conservative: bool = True,
  ):
    tables = list(tables)
    if len(set(tables)) != len(tables):
      raise ValueError(f"FrequencyCounter: table names repeat: {tables}")
    for name, v, lo in (("capacity", capacity, 1), ("width", width, 1), ("depth", depth, 1)):
      if int(v) != v or v < lo:
        raise ValueError(f"FrequencyCounter: {name} must be an integer >= {lo}, got {v!r}")
    self.capacity, self.width, self.depth = int(capacity), int(width), int(depth)
    self.conservative = bool(conservative)
    # Independent hashes per sketch row: a splitmix64 stream from the seed.
    steps = np.arange(1, self.depth + 1, dtype=np.uint64) * _GOLDEN
    self._seeds = _mix_all(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) + steps)
    self._tables: Dict[str, _Table] = {t: _Table(self.depth, self.width) for t in tables}

  @property
  def tables(self) -> Tuple[str, ...]:
    return tuple(self._tables)

  def _table(self, table: str) -> _Table:
    try:
      return self._tables[table]
    except KeyError:
      raise KeyError(f"FrequencyCounter: unknown table {table!r}; known: {sorted(self._tables)}") from None

  @staticmethod
  def _ids(table: str, ids, what: str) -> np.ndarray:
    if type(ids) is np.ndarray and ids.dtype == np.uint64 and ids.ndim == 1 and ids.flags.c_contiguous:
      return ids  # what the trainer passes: no check costs more than this one
    ids = np.asarray(ids)
    if ids.ndim != 1:
      raise ValueError(f"FrequencyCounter.{what}({table!r}): ids must be 1-D, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"FrequencyCounter.{what}({table!r}): ids must be integers, got dtype {ids.dtype}")
    return np.ascontiguousarray(ids, np.uint64)

  def add(self, table: str, ids: np.ndarray) -> None:
    """Counts one step's distinct ``ids`` of ``table`` (uint64, sorted ascending, as np.unique gives)."""
    t = self._table(table)
    ids = self._ids(table, ids, "add")
    with t.lock:
      bad, new = _add(t.sketch, self._seeds, ids, self.conservative, t.threshold, t.pool)
      if bad >= 0:  # a repeated id would be counted twice in one step (nothing was counted)
        raise ValueError(
          f"FrequencyCounter.add({table!r}): ids must be distinct and sorted ascending (np.unique); "
          f"ids[{bad - 1}] = {ids[bad - 1]} then ids[{bad}] = {ids[bad]}"
        )
      if new.size:
        t.pending.append(new)
        t.pending_n += new.size
      if t.pool.size + t.pending_n > 2 * self.capacity:
        self._cut(t)
      elif t.pending_n >= max(t.pool.size, self.MERGE_MIN):
        # Ids seen again before a merge are pending twice: merge once the pending list is as large
        # as the pool (each merge costs O(pool + pending), so still O(log) per id amortised), or
        # with a capacity far above the distinct ids it would grow to 2 * capacity of repeats.
        t.pool = self._merged(t)
        t.pending, t.pending_n = [], 0

  def _merged(self, t: _Table) -> np.ndarray:
    if not t.pending:
      return t.pool
    return _merge(t.pool, t.pending[0] if len(t.pending) == 1 else np.concatenate(t.pending))

  def _cut(self, t: _Table) -> None:
    """Merges the new candidates into the pool and keeps the ``capacity`` of highest estimate
    (ties by id ascending)."""
    pool = self._merged(t)
    t.pending, t.pending_n = [], 0
    if pool.size > self.capacity:
      pool, cut = _keep_top(t.sketch, self._seeds, pool, self.capacity)
      # Ids dropped here have estimates <= cut; they come back once seen above it.
      t.threshold = max(t.threshold, int(cut) + 1)
    t.pool = pool

  def _estimate(self, t: _Table, ids: np.ndarray) -> np.ndarray:
    out = np.empty(ids.shape[0], np.int64)
    _estimate(t.sketch, self._seeds, ids, out)
    return out

  def candidates(self, table: str) -> np.ndarray:
    """The table's candidate ids (uint64, sorted ascending, at most 2 * capacity)."""
    t = self._table(table)
    with t.lock:
      return self._merged(t).copy()

  def estimate(self, table: str, ids: np.ndarray) -> np.ndarray:
    """int64 estimated counts of ``ids`` (any order, repeats allowed); never below the true counts."""
    t = self._table(table)
    ids = self._ids(table, ids, "estimate")
    with t.lock:
      return self._estimate(t, ids)

  def top(self, table: str, n: int) -> Tuple[np.ndarray, np.ndarray]:
    """(ids, counts) of the ``n`` candidates of highest estimate: counts descending, ties by id ascending.

    Fewer than ``n`` if the table has fewer candidates; n above ``capacity`` gets candidates that a
    cut may have dropped, so ask for at most ``capacity``.
    """
    if int(n) != n or n < 0:
      raise ValueError(f"FrequencyCounter.top({table!r}): n must be an integer >= 0, got {n!r}")
    t = self._table(table)
    with t.lock:
      pool = self._merged(t)
      est = self._estimate(t, pool)
    order = np.lexsort((pool, -est))[: int(n)]
    return pool[order], est[order]

  def threshold(self, table: str) -> int:
    """The estimate an id of ``table`` must reach when seen to become a candidate (1 until the first cut)."""
    return self._table(table).threshold

  def state(self) -> Dict[str, np.ndarray]:
    """Everything the counts depend on, as arrays (``load_state`` on a counter built with the same
    arguments continues exactly as this one would)."""
    out = {"tables": np.array(self.tables), "shape": np.array([self.capacity, self.width, self.depth])}
    for i, t in enumerate(self._tables.values()):
      with t.lock:
        out[f"sketch_{i}"] = t.sketch.copy()
        out[f"pool_{i}"] = t.pool.copy()
        out[f"pending_{i}"] = np.concatenate(t.pending) if t.pending else np.zeros(0, np.uint64)
        out[f"counts_{i}"] = np.array([t.pending_n, t.threshold], np.int64)
    return out

  def load_state(self, state) -> None:
    """Restores ``state()`` of a counter built with the same tables, capacity, width and depth.

    Raises:
      ValueError: the state is of another counter (tables or sizes differ) or incomplete.
    """
    tables = [str(x) for x in np.asarray(state["tables"]).tolist()]
    shape = np.asarray(state["shape"]).tolist()
    if tables != list(self.tables) or shape != [self.capacity, self.width, self.depth]:
      raise ValueError(
        f"FrequencyCounter.load_state: the state counts tables {tables} with (capacity, width, depth) {shape}, "
        f"this counter {list(self.tables)} with {[self.capacity, self.width, self.depth]}"
      )
    for i, t in enumerate(self._tables.values()):
      sketch = np.asarray(state[f"sketch_{i}"], np.uint32)
      if sketch.shape != t.sketch.shape:
        raise ValueError(f"FrequencyCounter.load_state: sketch {i} has shape {sketch.shape}, expected {t.sketch.shape}")
      pending = np.asarray(state[f"pending_{i}"], np.uint64)
      n, threshold = (int(x) for x in np.asarray(state[f"counts_{i}"]).tolist())
      with t.lock:
        t.sketch = sketch.copy()
        t.pool = np.asarray(state[f"pool_{i}"], np.uint64).copy()
        t.pending, t.pending_n, t.threshold = ([pending] if pending.size else []), n, threshold

  def nbytes(self) -> int:
    """Bytes held by the sketches, pools and pending candidates of all tables."""
    total = self._seeds.nbytes
    for t in self._tables.values():
      total += t.sketch.nbytes + t.pool.nbytes + sum(p.nbytes for p in t.pending)
    return total
