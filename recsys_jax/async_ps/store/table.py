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
last snapshot, for incremental snapshots): the table's ``Columns``. Snapshots carry the first
two as well, so a restored bounded table goes on exactly as the original would have.

The table is the one-table calls and the locking; its parts are their own modules: the rows in
RAM (``columns``), the bounds' choices (``bounds``), rows in bulk, snapshots and restores
(``bulk``), several plain tables in one call (``plain``), and the rows kept for a step's push
(``looked_up``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np
from absl import logging

from recsys_jax.async_ps import kernels
from recsys_jax.async_ps.optim import optimizers
from recsys_jax.async_ps.store import bulk, initializers
from recsys_jax.async_ps.store.bounds import Bounds
from recsys_jax.async_ps.store.columns import Columns
from recsys_jax.async_ps.store.ids import check_distinct
from recsys_jax.async_ps.store.looked_up import LookedUp
from recsys_jax.async_ps.store.rows import Slots, check_rows
from recsys_jax.async_ps.store.workers import default_threads, shared_pool
from recsys_jax.embeddings.specs import TableSpec
from recsys_jax.hashing import name_seed

EVICT_THREADS = max(1, default_threads() // 4)
"""Threads that run tiered tables' evictions after their lookups (write-behind), shared by every
table of the process: a quarter of the cores (one on 2 cores), so that they leave
the lookups most of them; an eviction costs about what its lookup's misses cost."""

AHEAD_THREADS = max(1, default_threads() // 4)
"""Threads that run tiered tables' read-aheads (``Table.read_ahead``), shared by every table of
the process: a quarter of the cores (one on 2 cores), as for the evictions."""


class Table:
  """A growable, optionally bounded table; ``lookup`` creates rows, ``apply`` runs the optimizer.

  Thread-safe: one lock per table, so a prefetcher and a pusher can work on different
  tables (or shards) at once; numpy drops the GIL for large copies. Admission, eviction and
  expiry follow the ``bounds`` module's rules; snapshots, restores and ``export_rows`` /
  ``import_rows`` carry rows with their optimizer slots (``bulk``). A tiered table's lookup
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
    self.bounds = Bounds(spec, self.seed, self.capacity, self.protect_steps, tiered=tier is not None)
    self.cols = Columns(spec.dim, spec.numpy_dtype, self.opt, int(self.seed), self.capacity, self._init)
    self.looked_up = LookedUp()  # rows kept for their step's push: only where rows never move
    self._remembers = not (self.capacity or spec.expire_after or self.bounds.admission or tier is not None)
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

  @property
  def step(self) -> int:
    """The latest training step seen."""
    return self.bounds.step

  @step.setter
  def step(self, value: int) -> None:
    self.bounds.step = value

  @property
  def num_rows(self) -> int:
    """Rows in RAM (not counting rows spilled to the tier), after any eviction in flight."""
    self.wait_evicted()
    return self.cols.size

  def wait_evicted(self) -> None:
    """Returns once the eviction a lookup left running (write-behind) is done: what the table's
    tier holds is then what it will hold until the next call (the table's calls wait by themselves)."""
    self._idle.wait()

  def _init(self, ids: np.ndarray) -> np.ndarray:
    s = self.spec
    return initializers.init_rows(ids, s.dim, self.seed, s.initializer, s.init_scale)

  def initial_rows(self, ids: np.ndarray) -> np.ndarray:
    """The rows unseen ids would be created with, rounded to the storage dtype (what reading them reads)."""
    return self._init(ids).astype(self._wdtype, copy=False)

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
      if create and self.bounds.unstamped:
        self.bounds.stamp(self.cols)
      rows = self.cols.ids.find(ids)
      size0 = self.cols.ids.size
      hit = rows >= 0
      n_miss = int((~hit).sum())
      if out is None:
        out = np.empty((ids.shape[0], self.spec.dim), np.float32)
      if create:
        self.counters["lookups"] += ids.shape[0]
        self.counters["hits"] += ids.shape[0] - n_miss
        self.counters["misses"] += n_miss
        if self.bounds.tracks_use:
          self._seen(rows[hit])
      if n_miss:
        self._fill_misses(ids, rows, np.flatnonzero(~hit), out, create)
        del hit
      if self._wdtype is np.float32:
        kernels.gather_rows(self.cols.weights, rows, out)  # skips rows == -1 (already filled)
      else:
        have = rows >= 0
        out[have] = self.cols.weights[rows[have]]
      if create:
        self._remember(step, ids, rows)
        inserted = self.cols.ids.size - size0
        # Over its capacity, a tiered table spills after returning (write-behind): the rows
        # are the caller's already, and the eviction's gathers, writes and moves overlap the
        # caller's next work. Evicting here, before any other call, keeps every result the same.
        behind = self.tier is not None and bool(self.capacity) and self.cols.ids.size > self.capacity
        if not behind:
          self.evict(inserted)
    finally:
      if not behind:
        self.lock.release()
    self.timers["lookup_s"] += time.perf_counter() - t0
    self.timers["lookup_calls"] += 1
    if behind:
      self._evict_behind(inserted)
    return out

  def _seen(self, hr: np.ndarray) -> None:
    """A training lookup found rows ``hr`` in RAM: their last-seen step and count move on."""
    if self.tier is None:
      self.cols.last_seen[hr] = self.step
    else:  # rows a read-ahead pinned for this step or a later one keep their pin
      seen = self.cols.last_seen[hr]
      # (A row another lookup of this step found first counts too: several workers' lookups of a step.)
      self.counters["read_ahead_hits"] += int(np.count_nonzero(seen >= self.step))
      self.cols.last_seen[hr] = np.maximum(seen, self.step)
    self.cols.freq[hr] += 1
    self.cols.dirty[hr] = True  # an incremental snapshot must carry the new last-seen and count

  def _fill_misses(self, ids: np.ndarray, rows: np.ndarray, rest: np.ndarray, out: np.ndarray, create: bool) -> None:
    """The miss path of ``lookup`` (the lock held): ``rest``, the positions of ``ids`` not in RAM.

    A training lookup takes the tier's rows back into RAM and creates the others (those
    admitted), setting their ``rows``; an evaluation reads the tier's rows in place and the
    others' initial values (zeros under admission) into ``out``. Positions only, narrowed in
    place: a request of millions of new ids keeps few arrays of its size.
    """
    if self.tier is not None:
      mids = ids[rest]
      if create:  # the rows come to RAM: taken out of the tier, the found ones only
        found, w, slots = self._take_tier(mids)
        if w.shape[0]:
          rows[rest[found]] = self.cols.insert(mids[found], w, slots, self.step, absent=True)
          self.counters["tier_reads"] += w.shape[0]
      else:
        found, w, _ = self.tier.read(mids)
        out[rest[found]] = w[found]
      rest = rest[~found]
    if rest.shape[0] and create:
      if self.bounds.admission:
        ok = self.bounds.admit(ids[rest])
        out[rest[~ok]] = 0.0
        self.counters["rejected"] += int((~ok).sum())
        rest = rest[ok]
        self.counters["admitted"] += rest.shape[0]
      if rest.shape[0]:
        rows[rest] = self.cols.insert(ids[rest], None, None, self.step, absent=True)
        self.counters["created"] += rest.shape[0]
    elif rest.shape[0]:
      # Rounded like a created row would be, so reading never depends on create.
      out[rest] = 0.0 if self.bounds.admission else self.initial_rows(ids[rest])

  def _remember(self, step: Optional[int], ids: np.ndarray, rows: np.ndarray) -> None:
    """Keeps a training lookup's rows for the push of its step, where rows never move (``looked_up``)."""
    if step is not None and self._remembers:
      self.looked_up.remember(step, ids, rows)

  # -- write-behind -------------------------------------------------------------------
  @contextlib.contextmanager
  def locked(self) -> Iterator[None]:
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
      self.evict(inserted)
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
    with self.locked():
      return self.cols.ids.find(np.asarray(ids, np.uint64)) >= 0

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
      n = self.cols.ids.size
      rows = self.cols.ids.find(ids)
      hit = rows >= 0
      miss = ids[~hit]
      hr = rows[hit]
      hr = hr[self.cols.last_seen[hr] < step]  # not yet pinned for this step or a later one
      # Within the budget, the tier's rows first (reading them is what the lookup would wait
      # for), then the pins of rows already in RAM (so that no eviction takes them before their step).
      room = max(0, self.read_ahead_rows - int(np.count_nonzero(self.cols.last_seen[:n] > self.step)))
      if miss.shape[0] + hr.shape[0] > room:
        self.counters["read_ahead_skipped"] += miss.shape[0] + hr.shape[0] - room
        miss = miss[:room]
        hr = hr[: room - miss.shape[0]]
      self.cols.last_seen[hr] = step
      self.cols.dirty[hr] = True  # an incremental snapshot carries the new last-seen step
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
      new = self.cols.insert(miss[found], w, slots, self.step, absent=True)
      self.cols.last_seen[new] = step
      self.counters["tier_reads"] += w.shape[0]
      self.counters["read_ahead_rows"] += w.shape[0]
      self._evict_keeping_error(self.cols.ids.size - n)

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
    with self.locked():
      rows = self.looked_up.recall(step, ids)
      if rows is None:
        rows = self.cols.ids.find(ids)
      missing = rows < 0
      if missing.any():
        if not (self.capacity or self.bounds.admission or self.spec.expire_after):
          bad = ids[missing][:3].tolist()
          raise KeyError(f"table {self.spec.name!r}: gradient for ids never looked up, e.g. {bad}")
        self.counters["dropped_grads"] += int(missing.sum())
        rows, grads = rows[~missing], grads[~missing]
      if self.opt.fused is not None and self._wdtype is np.float32:
        self.opt.fused(self.cols.weights, self.cols.slots, rows, grads)  # one pass, in place
      else:  # reduced-precision storage: gather, update in float32, round, scatter
        slots = {k: v[rows] for k, v in self.cols.slots.items()}
        w, slots = self.opt.update(self.cols.weights[rows].astype(np.float32), slots, grads)
        self.cols.weights[rows] = w.astype(self._wdtype)
        for k, v in slots.items():
          self.cols.slots[k][rows] = v
      self.cols.dirty[rows] = True
      self.counters["applied_rows"] += rows.shape[0]
    self.timers["apply_s"] += time.perf_counter() - t0
    self.timers["apply_calls"] += 1

  def stats(self) -> Dict[str, float]:
    """Rows (RAM and tier), bytes in RAM, counters and mean latencies, under the table's lock (a
    lookup on another thread may be growing the id map, whose slot arrays are briefly None)."""
    with self.lock:
      return self._stats()

  def _stats(self) -> Dict[str, float]:
    n = self.cols.size
    tier_rows = len(self.tier) if self.tier is not None else 0
    index_bytes = self.cols.ids.capacity * 16 + (self.tier.index_nbytes() if self.tier is not None else 0)
    c = self.counters
    return {
      "rows": n,
      "tier_rows": tier_rows,
      "bytes": n * self.cols.row_bytes() + index_bytes + self.bounds.nbytes,
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
      "read_ahead_pinned": int(np.count_nonzero(self.cols.last_seen[:n] > self.step)) if self.tier is not None else 0,
      "write_behind_rows": self.tier.stats()["pending_rows"] if self.tier is not None else 0,
    }

  @property
  def plain(self) -> bool:
    """No bound (capacity, expiry, admission), no tier, float32 rows with a fused optimizer: a
    lookup only finds or creates rows, and rows never move. Such tables are worked several at a
    time, with only their kernels per table (the ``plain`` module)."""
    return self._remembers and self._wdtype is np.float32 and isinstance(self.opt.fused, optimizers.FusedUpdate)

  # -- bounds ---------------------------------------------------------------------------
  def evict(self, inserted: int = 0) -> None:
    """Expires, then evicts down to the bound (the lock held); ``inserted``: the rows the call that
    caused it brought into RAM. The bounds choose the rows; here they are dropped or spilled."""
    c = self.cols
    old = self.bounds.expired(c)
    if old is not None:
      # Expired rows are forgotten (not spilled); rows already in the tier stay there.
      c.deleted.append(c.keys()[old].copy())
      self.counters["expirations"] += int(old.sum())
      c.keep_only(~old)
    victims = self.bounds.victims(c, inserted)
    if victims is None:
      return
    k = victims.shape[0]
    ids = c.keys()[victims].copy()
    if self.tier is not None:
      self.tier.write(ids, c.weights[victims], {k2: v[victims] for k2, v in c.slots.items()})
      c.spilled.append(ids)
      self.counters["spilled"] += k
    else:
      c.deleted.append(ids)
    self.counters["evictions"] += k
    keep = np.ones(c.size, bool)
    keep[victims] = False
    c.keep_only(keep)

  def bounds_state(self) -> Dict[str, Any]:
    """The table's step, the step of its last expiry check and its admission sketch (or None)."""
    with self.locked():
      return self.bounds.state()

  def check_bounds_state(self, state: Mapping[str, Any]) -> None:
    """Raises ValueError if ``state`` cannot be restored into this table (a sketch of another shape)."""
    self.bounds.check_state(state)

  def restore_bounds_state(self, state: Mapping[str, Any]) -> None:
    """Merges a ``bounds_state`` into this table's (``Bounds.merge_state``)."""
    self.bounds.check_state(state)
    with self.locked():
      self.bounds.merge_state(state)

  # -- rows in bulk (the ``bulk`` module) -------------------------------------------------
  def check_rows(
    self, ids: Any, weights: Any, slots: Mapping[str, Any], what: str = "import"
  ) -> Tuple[np.ndarray, np.ndarray, Slots]:
    """``check_rows`` for this table's spec and optimizer."""
    return check_rows(self.spec, ids, weights, slots, what)

  def export_rows(self, ids: Any, checked: bool = False) -> Tuple[np.ndarray, Slots]:
    """Rows of distinct ids with their optimizer slots, from RAM or the tier; changes nothing (``bulk.export_rows``)."""
    return bulk.export_rows(self, ids, checked)

  def import_rows(self, ids: Any, weights: Any, slots: Mapping[str, Any], checked: bool = False) -> None:
    """Sets the rows of distinct ids and their optimizer slots (an upsert; ``bulk.import_rows``)."""
    bulk.import_rows(self, ids, weights, slots, checked)

  def snapshot_parts(self, incremental: bool = False, max_rows: int = 1 << 14) -> Iterator[Dict[str, np.ndarray]]:
    """The table in parts of at most ``max_rows`` rows, the tier's too (``bulk.snapshot_parts``)."""
    return bulk.snapshot_parts(self, incremental, max_rows)

  def snapshot(self, incremental: bool = False) -> Dict[str, np.ndarray]:
    """The whole table in one dict (``bulk.snapshot``)."""
    return bulk.snapshot(self, incremental)

  def validate_snapshot(self, snap: Mapping[str, np.ndarray]) -> Tuple[np.ndarray, np.ndarray, Slots]:
    """Checks a snapshot of this table; returns (ids, float32 weights, float32 slots) (``bulk.validate_snapshot``)."""
    return bulk.validate_snapshot(self, snap)

  def restore(self, snap: Mapping[str, np.ndarray], merge: bool = False) -> None:
    """Loads a ``snapshot()``, or with ``merge`` applies one on top (``bulk.restore``)."""
    bulk.restore(self, snap, merge)
