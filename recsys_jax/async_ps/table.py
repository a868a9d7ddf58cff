"""One embedding table on one PS shard: ids, rows and optimizer slots in host RAM.

Optionally bounded: a row capacity with eviction (LRU, or LFU with LRU tie-break), expiry of
rows unseen for T steps, and admission (a row is created only once its id has been seen m
times, counted in a count-min sketch, or with probability p; until then it reads as zeros
and its gradient is dropped); those decisions and the state they keep are ``bounds``. With a
disk tier, evicted rows spill to it and misses are read back, so the table can be larger than
its RAM cache.

Rows are stored in float32, bfloat16 or float16 (``TableSpec.storage_dtype``); the optimizer
always computes in float32 and its slots stay float32. Every row also carries the step it was
last looked up (for LRU and expiry), a lookup count (LFU) and a dirty flag (changed since the
last snapshot, for incremental snapshots). Snapshots carry the first two as well, so a
restored bounded table goes on exactly as the original would have. Snapshots and restores,
and the export and import of chosen rows with their optimizer slots, are ``table_rows``.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Mapping, Optional

import ml_dtypes
import numpy as np

from recsys_jax.async_ps import initializers, kernels, optimizers
from recsys_jax.async_ps.bounds import Bounds
from recsys_jax.async_ps.hashing import name_seed
from recsys_jax.async_ps.idmap import IdMap
from recsys_jax.async_ps.ids import check_distinct
from recsys_jax.async_ps.table_rows import TableRows
from recsys_jax.embeddings.specs import TableSpec

_INIT_BLOCK_ROWS = 1 << 14  # rows created per block (their initial values and slots)

STORAGE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
"""``TableSpec.storage_dtype`` names -> numpy dtypes (the names are validated by ``TableSpec``)."""


class Table(Bounds, TableRows):
  """A growable, optionally bounded table; ``lookup`` creates rows, ``apply`` runs the optimizer.

  Thread-safe: one lock per table, so a prefetcher and a pusher can work on different
  tables (or shards) at once; numpy drops the GIL for large copies. Admission, eviction and
  expiry, and the table's state they keep, are ``bounds.Bounds``; snapshots, restores and
  ``export_rows`` / ``import_rows`` are ``table_rows.TableRows``.

  Args:
    spec: the table's spec.
    seed: global seed (row initialisation depends on table name, id and seed only).
    capacity: rows this table may hold in RAM (0: unbounded).
    tier: a ``DiskTier`` that evicted rows spill to, or None (evicted rows are dropped).
    protect_steps: rows looked up within this many steps are never evicted (rows whose
      gradients are still in flight at staleness k need k + 1).
  """

  def __init__(self, spec: TableSpec, seed: int = 0, capacity: int = 0, tier=None, protect_steps: int = 1):
    self.spec = spec
    self.seed = name_seed(spec.name, seed)
    self.opt = optimizers.make(spec.optimizer, **dict(spec.optimizer_kwargs))
    self.capacity = int(capacity)
    self.tier = tier
    self.protect_steps = int(protect_steps)
    self.lock = threading.Lock()
    self._wdtype = STORAGE_DTYPES[spec.storage_dtype]
    self._init_bounds()
    self._clear(0)
    self._deleted: List[np.ndarray] = []  # ids dropped (eviction without tier, expiry) since the last snapshot
    self._spilled_ids: List[np.ndarray] = []  # rows that went to the tier since the last snapshot
    self.counters = {
      k: 0
      for k in (
        "lookups", "hits", "misses", "created", "tier_reads", "rejected", "admitted", "evictions",
        "expirations", "spilled", "dropped_grads", "applied_rows",
      )
    }  # fmt: skip
    self.timers = {"lookup_s": 0.0, "lookup_calls": 0, "apply_s": 0.0, "apply_calls": 0}

  # -- storage ------------------------------------------------------------------------
  def _clear(self, cap: int) -> None:
    d = self.spec.dim
    self._ids = IdMap(capacity=max(cap, 1), salt=int(self.seed))
    self._weights = np.zeros((cap, d), self._wdtype)
    self._slots: Dict[str, np.ndarray] = self.opt.init(cap, d)
    self._last_seen = np.zeros((cap,), np.int64)
    self._freq = np.zeros((cap,), np.uint32)
    self._dirty = np.zeros((cap,), bool)

  @property
  def num_rows(self) -> int:
    """Rows in RAM (not counting rows spilled to the tier)."""
    return self._ids.size

  def _reserve(self, n: int) -> None:
    cap = self._weights.shape[0]
    if n <= cap:
      return
    grow_to = 2 * cap
    if self.capacity:  # a bounded table never needs much more than its capacity
      grow_to = min(grow_to, self.capacity + self.capacity // 4)
    cap = max(n, grow_to, 1024)
    used = self.num_rows

    def grown(a: np.ndarray) -> np.ndarray:
      # Uninitialised on purpose: every row past ``used`` is written by _insert before it is read.
      out = np.empty((cap,) + a.shape[1:], a.dtype)
      out[:used] = a[:used]
      return out

    self._weights = grown(self._weights)
    self._last_seen, self._freq, self._dirty = grown(self._last_seen), grown(self._freq), grown(self._dirty)
    self._slots = {k: grown(v) for k, v in self._slots.items()}

  def _init(self, ids: np.ndarray) -> np.ndarray:
    s = self.spec
    return initializers.init_rows(ids, s.dim, self.seed, s.initializer, s.init_scale)

  def _insert(
    self, ids: np.ndarray, weights: Optional[np.ndarray], slots: Optional[Mapping[str, np.ndarray]]
  ) -> np.ndarray:
    """Adds rows for absent ids: ``weights`` and ``slots`` given, or (None) their initial values."""
    self._reserve(self.num_rows + ids.shape[0])
    rows = self._ids.insert(ids)
    if weights is not None:
      self._weights[rows] = weights.astype(self._wdtype, copy=False)
    if slots is not None:
      for k in self._slots:
        self._slots[k][rows] = slots[k]
    if weights is None or slots is None:
      # A block at a time, so creating many rows holds no temporaries of their full size.
      for a in range(0, ids.shape[0], _INIT_BLOCK_ROWS):
        r = rows[a : a + _INIT_BLOCK_ROWS]
        if weights is None:
          self._weights[r] = self._init(ids[a : a + _INIT_BLOCK_ROWS])
        if slots is None:
          fresh = self.opt.init(r.shape[0], self.spec.dim)
          for k in self._slots:
            self._slots[k][r] = fresh[k]
    self._last_seen[rows] = self.step
    self._freq[rows] = 0
    self._dirty[rows] = True
    return rows

  def _keep_only(self, keep: np.ndarray) -> None:
    """Compacts the table to the rows where ``keep`` is True (rebuilding the id map)."""
    n = self.num_rows
    idx = np.flatnonzero(keep[:n])
    ids = self._ids.keys()[idx]
    # In place, a bounded chunk at a time: idx is increasing, so row idx[j] >= j is read
    # before anything overwrites it, and eviction needs no second copy of the cache.
    arrays = [self._weights, self._last_seen, self._freq, self._dirty, *self._slots.values()]
    step = 1 << 16
    for a in range(0, idx.shape[0], step):
      sel = idx[a : a + step]
      if sel[0] == a and sel[-1] == a + sel.shape[0] - 1:
        continue  # already in place
      for arr in arrays:
        arr[a : a + sel.shape[0]] = arr[sel]
    self._ids = IdMap(capacity=max(ids.shape[0], 1), salt=int(self.seed))
    self._ids.insert(ids)

  # -- the interface ------------------------------------------------------------------
  def lookup(
    self, ids: np.ndarray, create: bool = True, step: Optional[int] = None, out: Optional[np.ndarray] = None
  ) -> np.ndarray:
    """Returns float32 rows [len(ids), dim] (a copy) for distinct ids, written into ``out`` if given.

    Args:
      ids: distinct uint64 ids.
      create: training lookup: unseen ids get rows (subject to admission), rows spilled to
        the tier come back into RAM, and recency/frequency are updated. With False
        (evaluation), nothing changes: unseen ids read their initial value (zeros under
        admission) and spilled rows are read from the tier in place.
      step: the training step of this lookup (for LRU, expiry and admission by chance).
      out: float32 [len(ids), dim] to write the rows into (e.g. the caller's slice of a step's
        row buffer), so they are copied once; a fresh array if None.
    """
    t0 = time.perf_counter()
    ids = np.asarray(ids, np.uint64)
    if out is not None and (out.dtype != np.float32 or out.shape != (ids.shape[0], self.spec.dim)):
      raise ValueError(
        f"table {self.spec.name!r}: out is {out.dtype} {out.shape}, expected float32 ({ids.shape[0]}, {self.spec.dim})"
      )
    with self.lock:
      if step is not None and create:
        self.step = max(self.step, int(step))
      if create and self._unstamped:
        self._stamp()
      rows = self._ids.find(ids)
      hit = rows >= 0
      n_miss = int((~hit).sum())
      if out is None:
        out = np.empty((ids.shape[0], self.spec.dim), np.float32)
      if create:
        self.counters["lookups"] += ids.shape[0]
        self.counters["hits"] += ids.shape[0] - n_miss
        self.counters["misses"] += n_miss
        if self.tracks_use:
          hr = rows[hit]
          self._last_seen[hr] = self.step
          self._freq[hr] += 1
          self._dirty[hr] = True  # an incremental snapshot must carry the new last-seen and count
      if n_miss:
        # Positions only, narrowed in place: a request of millions of new ids keeps few arrays of its size.
        rest = np.flatnonzero(~hit)
        del hit
        if self.tier is not None:
          mids = ids[rest]
          found, w, slots = self.tier.read(mids)
          if create and found.any():
            self.tier.remove(mids[found])
            rows[rest[found]] = self._insert(mids[found], w[found], {k: v[found] for k, v in slots.items()})
            self.counters["tier_reads"] += int(found.sum())
          elif found.any():
            out[rest[found]] = w[found]
          rest = rest[~found]
        if rest.shape[0] and create:
          if self._admission:
            ok = self._admit(ids[rest])
            out[rest[~ok]] = 0.0
            self.counters["rejected"] += int((~ok).sum())
            rest = rest[ok]
            self.counters["admitted"] += rest.shape[0]
          if rest.shape[0]:
            rows[rest] = self._insert(ids[rest], None, None)
            self.counters["created"] += rest.shape[0]
        elif rest.shape[0]:
          # Rounded like a created row would be, so reading never depends on create.
          out[rest] = 0.0 if self._admission else self._init(ids[rest]).astype(self._wdtype, copy=False)
      if self._wdtype is np.float32:
        kernels.gather_rows(self._weights, rows, out)  # skips rows == -1 (already filled)
      else:
        have = rows >= 0
        out[have] = self._weights[rows[have]]
      if create:
        self._evict()
    self.timers["lookup_s"] += time.perf_counter() - t0
    self.timers["lookup_calls"] += 1
    return out

  def apply(self, ids: np.ndarray, grads: np.ndarray, step: Optional[int] = None, distinct: bool = False) -> None:
    """Applies the row optimizer to distinct ids.

    ``distinct=True``: the caller has checked that no id repeats (``ParameterServer.apply_many``
    checks every table before changing any), so the check is not paid twice on the hot path.

    Ids without a row in RAM (not admitted, or evicted since their lookup) have their
    gradients dropped and counted in ``dropped_grads`` when the table is bounded or admits
    selectively; for an unbounded table that is a caller's bug.

    Raises:
      KeyError: an unbounded table got a gradient for an id it never looked up.
      ValueError: ``grads`` is not [len(ids), dim], or an id repeats (the table is unchanged).
    """
    del step
    t0 = time.perf_counter()
    ids = np.asarray(ids, np.uint64)
    grads = np.asarray(grads, np.float32)
    if grads.shape != (ids.shape[0], self.spec.dim):
      raise ValueError(
        f"table {self.spec.name!r}: gradient shape {grads.shape} does not match ({ids.shape[0]}, {self.spec.dim})"
      )
    # The update kernels take each row once: a repeat would be updated twice (float32) or
    # keep only its last update (bfloat16), where its gradients were meant to be summed.
    if not distinct:
      check_distinct(ids, self.spec.name)
    with self.lock:
      rows = self._ids.find(ids)
      missing = rows < 0
      if missing.any():
        if not (self.capacity or self._admission or self.spec.expire_after):
          bad = ids[missing][:3].tolist()
          raise KeyError(f"table {self.spec.name!r}: gradient for ids never looked up, e.g. {bad}")
        self.counters["dropped_grads"] += int(missing.sum())
        rows, grads = rows[~missing], grads[~missing]
      if self.opt.fused is not None and self._wdtype is np.float32:
        self.opt.fused(self._weights, self._slots, rows, grads)  # one pass, in place
      else:  # reduced-precision storage: gather, update in float32, round, scatter
        slots = {k: v[rows] for k, v in self._slots.items()}
        w, slots = self.opt.update(self._weights[rows].astype(np.float32), slots, grads)
        self._weights[rows] = w.astype(self._wdtype)
        for k, v in slots.items():
          self._slots[k][rows] = v
      self._dirty[rows] = True
      self.counters["applied_rows"] += rows.shape[0]
    self.timers["apply_s"] += time.perf_counter() - t0
    self.timers["apply_calls"] += 1

  def stats(self) -> Dict[str, float]:
    """Rows (RAM and tier), bytes in RAM, counters and mean latencies, under the table's lock (a
    lookup on another thread may be growing the id map, whose slot arrays are briefly None)."""
    with self.lock:
      return self._stats()

  def _stats(self) -> Dict[str, float]:
    n = self.num_rows
    slot_bytes = sum(v.dtype.itemsize * int(np.prod(v.shape[1:])) for v in self._slots.values())
    row_bytes = self._weights.dtype.itemsize * self.spec.dim + slot_bytes + 8 + 8 + 4 + 1
    tier_rows = len(self.tier) if self.tier is not None else 0
    index_bytes = self._ids.capacity * 16 + (self.tier.index_nbytes() if self.tier is not None else 0)
    c = self.counters
    return {
      "rows": n,
      "tier_rows": tier_rows,
      "bytes": n * row_bytes + index_bytes + (self._sketch.nbytes if self._sketch is not None else 0),
      **c,
      "hit_rate": c["hits"] / c["lookups"] if c["lookups"] else float("nan"),
      "lookup_ms": 1e3 * self.timers["lookup_s"] / max(1, self.timers["lookup_calls"]),
      "apply_ms": 1e3 * self.timers["apply_s"] / max(1, self.timers["apply_calls"]),
    }
