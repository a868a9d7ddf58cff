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
restored bounded table goes on exactly as the original would have.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, cast

import numpy as np
from absl import logging

from recsys_jax.async_ps import kernels
from recsys_jax.async_ps.optim import optimizers
from recsys_jax.async_ps.store import initializers
from recsys_jax.async_ps.store.bounds import SKETCH_DEPTH, lowest
from recsys_jax.async_ps.store.idmap import IdMap
from recsys_jax.async_ps.store.ids import check_distinct, distinct_ids
from recsys_jax.async_ps.store.rows import Slots, check_rows
from recsys_jax.async_ps.store.workers import default_threads, shared_pool
from recsys_jax.embeddings.specs import TableSpec
from recsys_jax.hashing import name_seed, splitmix64, uniform01

_EVICT_FRACTION = 0.2  # evict down to 80% of capacity, so rebuilds are amortised
_EVICT_INSERTS = 4
"""A tiered table's eviction also makes room for this many times the rows the call that caused it
brought into RAM, so that a table whose misses a step come near its capacity evicts every few
steps, not after every lookup: an eviction's fixed cost (choosing, copying out, appending,
closing holes) is hundreds of microseconds a table, more than its rows' at the main job's shape
(docs/performance.md, "Tables larger than RAM"). A table without a tier loses what it evicts, so
it evicts only down to ``1 - _EVICT_FRACTION`` of its capacity."""

_INIT_BLOCK_ROWS = 1 << 14  # rows created per block (their initial values and slots)

EVICT_THREADS = max(1, default_threads() // 4)
"""Threads that run tiered tables' evictions after their lookups (write-behind), shared by every
table of the process: a quarter of the cores (one on 2 cores), so that they leave
the lookups most of them; an eviction costs about what its lookup's misses cost."""

AHEAD_THREADS = max(1, default_threads() // 4)
"""Threads that run tiered tables' read-aheads (``Table.read_ahead``), shared by every table of
the process: a quarter of the cores (one on 2 cores), as for the evictions."""


"""``TableSpec.storage_dtype`` names -> numpy dtypes (the names are validated by ``TableSpec``)."""


class Table:
  """A growable, optionally bounded table; ``lookup`` creates rows, ``apply`` runs the optimizer.

  Thread-safe: one lock per table, so a prefetcher and a pusher can work on different
  tables (or shards) at once; numpy drops the GIL for large copies. Admission, eviction and
  expiry follow the ``bounds`` module's rules; snapshots, restores and ``export_rows`` /
  ``import_rows`` carry rows with their optimizer slots (``rows``). A tiered table's lookup
  returns before its eviction: the eviction runs on an evictor thread holding the table's
  lock (write-behind), and the table's next call waits for it and raises its error, if any.

  Args:
    spec: the table's spec.
    seed: global seed (row initialisation depends on table name, id and seed only).
    capacity: rows this table may hold in RAM (0: unbounded).
    tier: a ``DiskTier`` that evicted rows spill to, or None (evicted rows are dropped).
    protect_steps: rows looked up within this many steps are never evicted (rows whose
      gradients are still in flight at staleness k need k + 1).
    read_ahead_rows: the most rows ``read_ahead`` may hold pinned in RAM for later steps (0:
      half the capacity, so that evictions always find rows to take); a read-ahead that would
      pass it is not made.
  """

  step: int  # the latest training step seen (``_init_bounds`` sets it)

  def __init__(
    self,
    spec: TableSpec,
    seed: int = 0,
    capacity: int = 0,
    tier=None,
    protect_steps: int = 1,
    read_ahead_rows: int = 0,
  ):
    self.spec = spec
    self.seed = name_seed(spec.name, seed)
    self.opt = optimizers.make(spec.optimizer, **dict(spec.optimizer_kwargs))
    self.capacity = int(capacity)
    self.tier = tier
    self.protect_steps = int(protect_steps)
    if read_ahead_rows < 0:
      raise ValueError(f"table {spec.name!r}: read_ahead_rows must be >= 0, got {read_ahead_rows}")
    self.read_ahead_rows = int(read_ahead_rows) or max(1, self.capacity // 2)
    self._ahead_jobs: List[concurrent.futures.Future] = []  # read-aheads submitted, not known done
    self._ahead_jobs_lock = threading.Lock()
    self.lock = threading.Lock()
    # A lookup that leaves a tiered table over its capacity hands the lock to an evictor thread
    # (``_evict_then_release``), which releases it once the eviction is done: every later call
    # waits for it, so the table goes on exactly as if the lookup had evicted before returning.
    self._idle = threading.Event()  # cleared while an eviction is in flight
    self._idle.set()
    self._evict_error: Optional[BaseException] = None  # raised by the next call on the table
    self._wdtype = spec.numpy_dtype.type
    self._init_bounds()
    self._clear(0)
    self._deleted: List[np.ndarray] = []  # ids dropped (eviction without tier, expiry) since the last snapshot
    self._spilled_ids: List[np.ndarray] = []  # rows that went to the tier since the last snapshot
    self.counters = {
      k: 0
      for k in (
        "lookups", "hits", "misses", "created", "tier_reads", "rejected", "admitted", "evictions",
        "expirations", "spilled", "dropped_grads", "applied_rows",
        "read_ahead_rows", "read_ahead_hits", "read_ahead_skipped", "read_ahead_late",
      )
    }  # fmt: skip
    self.timers = {
      "lookup_s": 0.0, "lookup_calls": 0, "apply_s": 0.0, "apply_calls": 0, "tier_wait_s": 0.0, "evict_s": 0.0,
    }  # fmt: skip

  # -- storage ------------------------------------------------------------------------
  def _clear(self, cap: int) -> None:
    d = self.spec.dim
    self._looked_up: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}  # step -> (ids, their rows): _remember
    self._ids = IdMap(capacity=max(cap, 1), salt=int(self.seed))
    self._weights = np.zeros((cap, d), self._wdtype)
    self._slots: Dict[str, np.ndarray] = self.opt.init(cap, d)
    self._last_seen = np.zeros((cap,), np.int64)
    self._freq = np.zeros((cap,), np.uint32)
    self._dirty = np.zeros((cap,), bool)

  @property
  def num_rows(self) -> int:
    """Rows in RAM (not counting rows spilled to the tier), after any eviction in flight."""
    self.wait_evicted()
    return self._ids.size

  def wait_evicted(self) -> None:
    """Returns once the eviction a lookup left running (write-behind) is done: what the table's
    tier holds is then what it will hold until the next call (the table's calls wait by themselves)."""
    self._idle.wait()

  def _reserve(self, n: int) -> None:
    cap = self._weights.shape[0]
    if n <= cap:
      return
    grow_to = 2 * cap
    if self.capacity:  # a bounded table never needs much more than its capacity
      grow_to = min(grow_to, self.capacity + self.capacity // 4)
    cap = max(n, grow_to, 1024)
    used = self._ids.size

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
    self,
    ids: np.ndarray,
    weights: Optional[np.ndarray],
    slots: Optional[Mapping[str, np.ndarray]],
    absent: bool = False,
  ) -> np.ndarray:
    """Adds rows for absent ids: ``weights`` and ``slots`` given, or (None) their initial values.

    ``absent``: the caller has just found none of the ids in RAM (``IdMap.insert`` skips that check).
    """
    self._reserve(self._ids.size + ids.shape[0])
    rows = self._ids.insert(ids, absent=absent)
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
    """Shrinks the table to the rows where ``keep`` is True.

    The kept rows past the new end move into the holes below it (``IdMap.drop_rows``), so an
    eviction costs as many rows as it drops, not the whole cache, and needs no second copy of
    it. Row order changes; nothing depends on it (eviction breaks ties by id).
    """
    holes, movers = self._ids.drop_rows(np.flatnonzero(~keep[: self._ids.size]))
    if holes.shape[0]:
      for arr in (self._weights, self._last_seen, self._freq, self._dirty, *self._slots.values()):
        kernels.move_rows(arr.reshape(arr.shape[0], -1).view(np.uint8), holes, movers)

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
    behind = False
    self.lock.acquire()
    try:
      self._raise_evict_error()
      if step is not None and create:
        self.step = max(self.step, int(step))
      if create and self._unstamped:
        self._stamp()
      rows = self._ids.find(ids)
      size0 = self._ids.size
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
          if self.tier is None:
            self._last_seen[hr] = self.step
          else:  # rows a read-ahead pinned for this step or a later one keep their pin
            seen = self._last_seen[hr]
            # (A row another lookup of this step found first counts too: several workers' lookups of a step.)
            self.counters["read_ahead_hits"] += int(np.count_nonzero(seen >= self.step))
            self._last_seen[hr] = np.maximum(seen, self.step)
          self._freq[hr] += 1
          self._dirty[hr] = True  # an incremental snapshot must carry the new last-seen and count
      if n_miss:
        # Positions only, narrowed in place: a request of millions of new ids keeps few arrays of its size.
        rest = np.flatnonzero(~hit)
        del hit
        if self.tier is not None:
          mids = ids[rest]
          if create:  # the rows come to RAM: taken out of the tier, the found ones only
            found, w, slots = self._take_tier(mids)
            if w.shape[0]:
              rows[rest[found]] = self._insert(mids[found], w, slots, absent=True)
              self.counters["tier_reads"] += w.shape[0]
          else:
            found, w, _ = self.tier.read(mids)
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
            rows[rest] = self._insert(ids[rest], None, None, absent=True)
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
        self._remember(step, ids, rows)
        inserted = self._ids.size - size0
        # Over its capacity, a tiered table spills after returning (write-behind): the rows
        # are the caller's already, and the eviction's gathers, writes and moves overlap the
        # caller's next work. Evicting here, before any other call, keeps every result the same.
        behind = self.tier is not None and bool(self.capacity) and self._ids.size > self.capacity
        if not behind:
          self._evict(inserted)
    finally:
      if not behind:
        self.lock.release()
    self.timers["lookup_s"] += time.perf_counter() - t0
    self.timers["lookup_calls"] += 1
    if behind:
      self._evict_behind(inserted)
    return out

  # -- write-behind -------------------------------------------------------------------
  @contextlib.contextmanager
  def _locked(self) -> Iterator[None]:
    """The table's lock, taken once any eviction in flight is done; raises what it raised."""
    with self.lock:
      self._raise_evict_error()
      yield

  def _raise_evict_error(self) -> None:
    """Raises (once) the error of the last eviction run after a lookup; its rows stayed in RAM."""
    err, self._evict_error = self._evict_error, None
    if err is not None:
      raise OSError(
        f"table {self.spec.name!r}: the eviction after a lookup or a read-ahead failed; its rows stayed in RAM: {err}"
      ) from err

  def _evict_behind(self, inserted: int) -> None:
    """Runs ``_evict`` on an evictor thread, which releases the lock the caller still holds."""
    self._idle.clear()
    try:
      shared_pool("ps-evict", EVICT_THREADS).submit(self._evict_then_release, inserted)
    except RuntimeError:  # the interpreter is shutting down: no new threads
      self._evict_then_release(inserted)

  def _evict_then_release(self, inserted: int) -> None:
    try:
      self._evict_keeping_error(inserted)
    finally:
      self._idle.set()
      self.lock.release()

  def _evict_keeping_error(self, inserted: int) -> None:
    """``_evict``, timed in ``evict_s``, off the caller's thread: an error is kept for the
    table's next call to raise (``_raise_evict_error``)."""
    t0 = time.perf_counter()
    try:
      self._evict(inserted)
    except BaseException as e:  # raised by the table's next call, which the caller makes
      self._evict_error = e
    finally:
      self.timers["evict_s"] += time.perf_counter() - t0

  def close(self) -> None:
    """Waits for the read-aheads and the eviction in flight and closes the tier; raises the
    error of a failed eviction."""
    self.wait_read_ahead()
    with self.lock:
      try:
        self._raise_evict_error()
      finally:
        if self.tier is not None:
          self.tier.close()

  def in_ram(self, ids: np.ndarray) -> np.ndarray:
    """Whether each id has a row in RAM now (a lookup would not go to the tier or create it)."""
    with self._locked():
      return self._ids.find(np.asarray(ids, np.uint64)) >= 0

  def read_ahead(self, ids: np.ndarray, step: int) -> int:
    """Brings into RAM, on a reader thread, the tier's rows that a later lookup of ``ids`` (at
    ``step``) would read, and pins them and the ids' rows already in RAM until that step.

    Returns at once. The reader thread takes the table's lock as a lookup does: it takes the
    rows out of the tier, inserts them into the RAM cache (stamped with ``step`` as their last
    lookup), and evicts as a lookup does. Eviction never takes a row stamped with a step the
    table has not reached, so the lookup of ``step`` finds every row in RAM. Values are what
    they would be without the read-ahead, bit for bit: a row has the same values in RAM and in
    the tier. Only where rows lie changes (and with it which rows later spill), which is why a
    table that expires rows (``TableSpec.expire_after``, which forgets rows in RAM but never
    those in the tier) does not read ahead.

    The pinned rows count against the capacity like any other, and at most ``read_ahead_rows``
    rows are pinned for later steps: a read-ahead that would pass that reads (and pins) the
    tier's rows first and then pins rows already in RAM, as many as fit; the rest of its ids
    are counted in ``read_ahead_skipped``, and the lookup of their step finds them as it would
    without the read-ahead. One that runs after its step's lookup started does nothing
    (``read_ahead_late``). A read that fails costs no row: the ids stay in the tier and the
    lookup reads them (and raises if that fails too).

    Args:
      ids: the distinct uint64 ids the lookup of ``step`` will ask for.
      step: the training step of that lookup.

    Returns:
      The number of ids handed to the reader thread (0 without a tier, or with expiry).
    """
    if self.tier is None or self.spec.expire_after:
      return 0
    ids = np.asarray(ids, np.uint64)
    if ids.shape[0] == 0:
      return 0
    with self._ahead_jobs_lock:
      self._ahead_jobs = [f for f in self._ahead_jobs if not f.done()]
      try:
        self._ahead_jobs.append(shared_pool("ps-ahead", AHEAD_THREADS).submit(self._read_ahead_now, ids, int(step)))
      except RuntimeError:  # the interpreter is shutting down: no new threads
        return 0
    return ids.shape[0]

  def _read_ahead_now(self, ids: np.ndarray, step: int) -> None:
    """The work of ``read_ahead``, on a reader thread."""
    with self.lock:
      if self._evict_error is not None:  # left for the caller's next call to raise
        return
      if step < self.step:
        self.counters["read_ahead_late"] += ids.shape[0]
        return
      n = self._ids.size
      rows = self._ids.find(ids)
      hit = rows >= 0
      miss = ids[~hit]
      hr = rows[hit]
      hr = hr[self._last_seen[hr] < step]  # not yet pinned for this step or a later one
      # Within the budget, the tier's rows first (reading them is what the lookup would wait
      # for), then the pins of rows already in RAM (so that no eviction takes them before their step).
      room = max(0, self.read_ahead_rows - int(np.count_nonzero(self._last_seen[:n] > self.step)))
      if miss.shape[0] + hr.shape[0] > room:
        self.counters["read_ahead_skipped"] += miss.shape[0] + hr.shape[0] - room
        miss = miss[:room]
        hr = hr[: room - miss.shape[0]]
      self._last_seen[hr] = step
      self._dirty[hr] = True  # an incremental snapshot carries the new last-seen step
      if miss.shape[0] == 0:
        return
      try:
        found, w, slots = self.tier.take(miss)
      except OSError as e:
        logging.warning(
          "table %r: a read-ahead of %d rows failed; the lookup reads them: %s", self.spec.name, miss.shape[0], e
        )
        return
      if w.shape[0] == 0:
        return
      new = self._insert(miss[found], w, slots, absent=True)
      self._last_seen[new] = step
      self.counters["tier_reads"] += w.shape[0]
      self.counters["read_ahead_rows"] += w.shape[0]
      self._evict_keeping_error(self._ids.size - n)

  def wait_read_ahead(self) -> None:
    """Returns once every read-ahead submitted so far has run."""
    with self._ahead_jobs_lock:
      jobs, self._ahead_jobs = self._ahead_jobs, []
    for f in jobs:
      f.result()

  def _take_tier(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray, Slots]:
    """``tier.take(ids)``, timed in ``tier_wait_s`` (the time lookups waited on the tier)."""
    t0 = time.perf_counter()
    try:
      return self.tier.take(ids)
    finally:
      self.timers["tier_wait_s"] += time.perf_counter() - t0

  # -- several plain tables in one call ------------------------------------------------
  @property
  def plain(self) -> bool:
    """No bound (capacity, expiry, admission), no tier, float32 rows with a fused optimizer: a
    lookup only finds or creates rows, and rows never move. Such tables are worked several at a
    time, with only their kernels per table (``lookup_plain``, ``apply_plain``)."""
    return not (self.capacity or self.spec.expire_after or self._admission or self.tier is not None) and (
      self._wdtype is np.float32 and isinstance(self.opt.fused, optimizers.FusedUpdate)
    )

  @staticmethod
  @contextlib.contextmanager
  def _all_locked(tables: Sequence["Table"]) -> Iterator[None]:
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

  @staticmethod
  def lookup_plain(
    tables: Sequence["Table"], ids: Sequence[np.ndarray], outs: Sequence[np.ndarray], create: bool, step: Optional[int]
  ) -> None:
    """``tables[i].lookup(ids[i], create, step, outs[i])`` for plain tables (``plain``), in one call.

    The locks are taken once, and each table does only what a plain table needs: a probe of its
    id map and a gather of its rows (two compiled calls), and Python of its own only for unseen
    ids (creating their rows, or reading their initial values): a ``lookup`` makes a dozen numpy
    calls a table, which held the GIL longer than its kernels ran at the main job's shape. Results,
    counters and the rows kept for the push (``_remember``) are those of ``lookup``, table by table.
    A training lookup whose ids ``resolve_plain`` resolved for its step (the same arrays) only
    gathers the rows it found.

    Args:
      tables: distinct plain tables.
      ids: per table, its distinct uint64 ids (kept by the table for its push: the same array).
      outs: per table, float32 [len(ids), dim] (C-contiguous) to write the rows into.
      create: a training lookup (see ``lookup``).
      step: the lookup's training step (or None).
    """
    t0 = time.perf_counter()
    with Table._all_locked(tables):
      for t, i, o in zip(tables, ids, outs):
        if o.dtype != np.float32 or o.shape != (i.shape[0], t.spec.dim) or not o.flags.c_contiguous:
          raise ValueError(
            f"table {t.spec.name!r}: out is {o.dtype} {o.shape}, expected C-contiguous float32 ({i.shape[0]}, {t.spec.dim})"
          )
        rows = t._resolved(step, i) if create else None
        if rows is None:
          rows = t._resolve(i, create, step, o)
        if kernels.gather_rows(t._weights, rows, o) >= 0:
          raise IndexError(f"table {t.spec.name!r}: a row out of range (a corrupt id map)")
    share = (time.perf_counter() - t0) / max(1, len(tables))
    for t in tables:
      t.timers["lookup_s"] += share
      t.timers["lookup_calls"] += 1

  @staticmethod
  def resolve_plain(tables: Sequence["Table"], ids: Sequence[np.ndarray], step: int) -> None:
    """The part of ``lookup_plain(tables, ids, ..., create=True, step)`` that reads no row value:
    each id's row found, unseen ids' rows created, counted, kept for the lookup and the push of
    ``step`` (``_remember``). The lookup of ``step`` with these very arrays then only gathers.

    Exact whenever it runs before that lookup: a plain table's rows never move, creating a row
    touches no other, and a push changes values, not where rows lie. So a trainer resolves a
    step's ids while the step before it still trains, and only the gather waits for that step's
    push (the staleness bound)."""
    with Table._all_locked(tables):
      for t, i in zip(tables, ids):
        if t._resolved(step, i) is None:
          t._resolve(i, True, step, None)

  def _resolve(self, ids: np.ndarray, create: bool, step: Optional[int], out: Optional[np.ndarray]) -> np.ndarray:
    """A plain table's rows of ``ids`` (the lock held): found, the unseen ones created (``create``)
    or their initial values written into ``out``; counted and kept (``_remember``) if ``create``."""
    if step is not None and create:
      self.step = max(self.step, int(step))
    if create and self._unstamped:
      self._stamp()
    m = self._ids
    rows = np.empty(ids.shape[0], np.int64)
    absent = kernels.find(m.slot_keys, m.slot_rows, m.mask, m.salt, kernels.read_only(ids), rows)
    if absent:
      rest = np.flatnonzero(rows < 0)
      if create:
        rows[rest] = self._insert(ids[rest], None, None, absent=True)
        self.counters["created"] += rest.shape[0]
      else:  # rounded as a created row would be
        assert out is not None  # a lookup that does not create passes its out
        out[rest] = self._init(ids[rest]).astype(self._wdtype, copy=False)
    if create:
      c = self.counters
      c["lookups"] += ids.shape[0]
      c["hits"] += ids.shape[0] - absent
      c["misses"] += absent
      self._remember(step, ids, rows)
    return rows

  @staticmethod
  def apply_plain(
    tables: Sequence["Table"], ids: Sequence[np.ndarray], grads: Sequence[np.ndarray], step: Optional[int]
  ) -> None:
    """``tables[i].apply(ids[i], grads[i], step, distinct=True)`` for plain tables, in one call.

    The rows are those each table's lookup of ``step`` kept (``_recall``), or found by a probe;
    every table's are known before any table changes, so ids never looked up refuse the call
    (``KeyError``, as ``apply``) with every table as it was; then each table is updated by its
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
    with Table._all_locked(tables):
      rows: List[np.ndarray] = []
      for t, i in zip(tables, ids):
        r = t._recall(step, i)
        if r is None:
          m, r = t._ids, np.empty(i.shape[0], np.int64)
          if kernels.find(m.slot_keys, m.slot_rows, m.mask, m.salt, kernels.read_only(np.asarray(i, np.uint64)), r):
            for table, kept, i_ in zip(tables, rows, ids):  # the rows recalled go back for a retry
              table._remember(step, i_, kept)
            bad = np.asarray(i)[r < 0][:3].tolist()
            raise KeyError(f"table {t.spec.name!r}: gradient for ids never looked up, e.g. {bad}")
        rows.append(r)
      for t, r, g in zip(tables, rows, grads):
        t.opt.fused.apply_owned(t._weights, t._slots, r, g)  # type: ignore[union-attr]  # plain tables: FusedUpdate
        t._dirty[r] = True
        t.counters["applied_rows"] += r.shape[0]
    share = (time.perf_counter() - t0) / max(1, len(tables))
    for t in tables:
      t.timers["apply_s"] += share
      t.timers["apply_calls"] += 1

  _REMEMBERED_STEPS = 8
  """Lookups whose rows a table keeps for their step's push: more than any staleness bound in use
  keeps in flight (k + 2 at most are); older ones are dropped, and their pushes look the ids up."""

  def _remember(self, step: Optional[int], ids: np.ndarray, rows: np.ndarray) -> None:
    """Keeps a training lookup's rows for the push of its step (``_recall``), where they cannot
    move before it: in a table that never evicts, expires or refuses rows and has no tier, a row
    stays where it was created until a restore. So the push, which the trainer makes with the
    very ids array it looked up, needs no second probe of the id map (a random read per id:
    about a fifth of the push at batch 65536)."""
    if step is None or self.capacity or self.spec.expire_after or self._admission or self.tier is not None:
      return
    ids.flags.writeable = False  # what the trainer pushes is what it looked up: no one edits it meanwhile
    self._looked_up[int(step)] = (ids, rows)
    while len(self._looked_up) > self._REMEMBERED_STEPS:
      del self._looked_up[min(self._looked_up)]

  def _resolved(self, step: Optional[int], ids: np.ndarray) -> Optional[np.ndarray]:
    """The rows ``_remember`` kept for ``step`` if ``ids`` is the array that lookup (or resolve) was
    given, kept for the push; None otherwise."""
    if step is None:
      return None
    kept = self._looked_up.get(int(step))
    return kept[1] if kept is not None and kept[0] is ids else None

  def _recall(self, step: Optional[int], ids: np.ndarray) -> Optional[np.ndarray]:
    """``_resolved``, forgotten then (the push of ``step`` is its last use)."""
    rows = self._resolved(step, ids)
    if rows is not None:
      assert step is not None  # _resolved finds rows for a step only
      del self._looked_up[int(step)]
    return rows

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
    with self._locked():
      rows = self._recall(step, ids)
      if rows is None:
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
    n = self._ids.size
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
      # What the cache held by itself: hits less the rows a read-ahead brought from the tier
      # (each is hit once, by its step's lookup).
      "cache_hit_rate": (c["hits"] - c["read_ahead_rows"]) / c["lookups"] if c["lookups"] else float("nan"),
      "lookup_ms": 1e3 * self.timers["lookup_s"] / max(1, self.timers["lookup_calls"]),
      "apply_ms": 1e3 * self.timers["apply_s"] / max(1, self.timers["apply_calls"]),
      "tier_wait_s": self.timers["tier_wait_s"],
      "evict_s": self.timers["evict_s"],
      "reads_in_flight": sum(not f.done() for f in self._ahead_jobs),
      # Only a read-ahead pins, and only a tiered table reads ahead: no pass over every row otherwise.
      "read_ahead_pinned": int(np.count_nonzero(self._last_seen[:n] > self.step)) if self.tier is not None else 0,
      "write_behind_rows": self.tier.stats()["pending_rows"] if self.tier is not None else 0,
    }

  # Bounds: admission, eviction and expiry, and the state they keep (see the ``bounds`` module).
  def _init_bounds(self) -> None:
    s = self.spec
    self._admission = s.admits_selectively
    self._sketch = np.zeros((SKETCH_DEPTH, s.admission_sketch_width), np.uint8) if s.admit_after > 1 else None
    self._sketch_salts = splitmix64(np.arange(1, SKETCH_DEPTH + 1, dtype=np.uint64) ^ self.seed)
    self.step = 0
    self._last_expiry_check = 0
    self._unstamped = False  # some rows were restored without a last-seen step

  @property
  def tracks_use(self) -> bool:
    """Whether lookups keep each row's last-seen step and count (only eviction and expiry read them)."""
    return bool(self.capacity or self.spec.expire_after)

  # -- admission ----------------------------------------------------------------------
  def _admit(self, ids: np.ndarray) -> np.ndarray:
    """Which of these unseen ids may get a row now (counts them in the sketch first)."""
    s = self.spec
    ok = np.ones(ids.shape[0], bool)
    if self._sketch is not None:
      w = self._sketch.shape[1]
      cols = (splitmix64(ids[None, :] ^ self._sketch_salts[:, None]) % np.uint64(w)).astype(np.int64)
      flat = (np.arange(SKETCH_DEPTH)[:, None] * w + cols).ravel()
      # Several ids of one call may share a cell: add their counts (a count-min sketch must
      # never under-count), saturating at 255.
      cells, n = np.unique(flat, return_counts=True)
      sk = self._sketch.reshape(-1)
      sk[cells] = np.minimum(sk[cells].astype(np.int64) + n, 255).astype(np.uint8)
      ok &= sk[flat].reshape(SKETCH_DEPTH, -1).min(axis=0) >= s.admit_after
    if s.admit_probability < 1.0:
      u = uniform01(splitmix64(ids ^ self.seed ^ np.uint64(self.step * 0x9E3779B97F4A7C15 % 2**64)))
      ok &= u < s.admit_probability
    return ok

  # -- bounds -------------------------------------------------------------------------
  def _stamp(self) -> None:
    """Rows restored without a last-seen step (older snapshots; rows that were in the tier, now
    in RAM) count as seen at this, the first training lookup after the restore."""
    n = self._ids.size
    unknown = np.flatnonzero(self._last_seen[:n] < 0)
    self._last_seen[unknown] = self.step
    self._dirty[unknown] = True
    self._unstamped = False

  def _evict(self, inserted: int = 0) -> None:
    """Expires, then evicts down to the bound; ``inserted``: the rows the call that caused it
    brought into RAM (a tiered table makes room for ``_EVICT_INSERTS`` times as many)."""
    n = self._ids.size
    s = self.spec
    if s.expire_after and self.step - self._last_expiry_check >= max(1, s.expire_after // 8):
      self._last_expiry_check = self.step
      old = self._last_seen[:n] < self.step - s.expire_after
      if old.any():
        # Expired rows are forgotten (not spilled); rows already in the tier stay there.
        self._deleted.append(self._ids.keys()[old].copy())
        self.counters["expirations"] += int(old.sum())
        self._keep_only(~old)
        n = self._ids.size
    if not self.capacity or n <= self.capacity:
      return
    target = int(self.capacity * (1 - _EVICT_FRACTION))
    if self.tier is not None:  # without a tier an evicted row is lost: evict no more than the bound needs
      target = max(0, min(target, self.capacity - _EVICT_INSERTS * inserted))
    candidates = np.flatnonzero(self._last_seen[:n] < self.step - self.protect_steps + 1)
    k = min(n - target, candidates.shape[0])
    if k <= 0:
      return
    if s.eviction == "lfu":
      score = self._freq[candidates].astype(np.int64) * (2**40) + self._last_seen[candidates]
    else:
      score = self._last_seen[candidates]
    victims = np.sort(candidates[lowest(score, self._ids.keys()[candidates], k, cast(int, self.seed))])
    ids = self._ids.keys()[victims].copy()
    if self.tier is not None:
      self.tier.write(ids, self._weights[victims], {k2: v[victims] for k2, v in self._slots.items()})
      self._spilled_ids.append(ids)
      self.counters["spilled"] += k
    else:
      self._deleted.append(ids)
    self.counters["evictions"] += k
    keep = np.ones(n, bool)
    keep[victims] = False
    self._keep_only(keep)

  # -- the table's state in snapshots ---------------------------------------------------
  def bounds_state(self) -> Dict[str, Any]:
    """The table's step, the step of its last expiry check and its admission sketch (or None)."""
    with self._locked():
      sketch = None if self._sketch is None else self._sketch.copy()
      return {"step": int(self.step), "last_expiry_check": int(self._last_expiry_check), "sketch": sketch}

  def check_bounds_state(self, state: Mapping[str, Any]) -> None:
    """Raises ValueError if ``state`` cannot be restored into this table (a sketch of another shape)."""
    sketch = state.get("sketch")
    if sketch is not None and self._sketch is not None and np.shape(sketch) != self._sketch.shape:
      raise ValueError(
        f"table {self.spec.name!r}: snapshot admission sketch {np.shape(sketch)} does not match "
        f"{self._sketch.shape} (was admission_sketch_width changed?)"
      )

  def restore_bounds_state(self, state: Mapping[str, Any]) -> None:
    """Merges a ``bounds_state`` into this table's: the steps by max, the sketch cell by cell by max.

    All three only grow during a run, so merging the states of a snapshot chain gives the last
    one's. A sketch saved by a table without one (``admit_after`` was 1) leaves it as it is.
    """
    self.check_bounds_state(state)
    sketch = state.get("sketch")
    with self._locked():
      self.step = max(self.step, int(state.get("step", 0)))
      self._last_expiry_check = max(self._last_expiry_check, int(state.get("last_expiry_check", 0)))
      if sketch is not None and self._sketch is not None:
        np.maximum(self._sketch, np.asarray(sketch, np.uint8), out=self._sketch)

  # Rows in bulk: snapshots and restores of the whole table, export and import of chosen rows.
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
    with self._locked():
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
    with self._locked():
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
          self._evict(int(new.shape[0]))

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
    with self._locked():
      n = self._ids.size
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
    self.wait_read_ahead()  # none runs on the restored table for a step of the run before
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
          keep = np.ones(self._ids.size, bool)
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
        to_ram = np.arange(n) < self.capacity - self._ids.size
      ram = slice(None) if to_ram.all() else np.flatnonzero(to_ram)
      if ids[ram].shape[0]:
        rows = self._insert(ids[ram], weights[ram], {k: v[ram] for k, v in slots.items()})
        self._last_seen[rows], self._freq[rows] = last_seen[ram], freq[ram]
        self._unstamped |= self.tracks_use and bool((last_seen[ram] < 0).any())
      if not to_ram.all():
        disk = np.flatnonzero(~to_ram)
        self.tier.write(ids[disk], weights[disk].astype(self._wdtype), {k: v[disk] for k, v in slots.items()})
      self._dirty[: self._ids.size] = False
      self._deleted, self._spilled_ids = [], []
