"""The prefetcher and the pusher: the two host threads around the jitted step.

Data flows one way: the prefetcher reads and deduplicates batch t, waits until the pushes
of steps up to t-k-1 are applied (the staleness bound k), looks the rows up and hands the
placed arrays to the training loop; the loop hands the step's row gradients to the pusher,
which applies them and marks step t as applied. k = 0 is fully synchronous.

This module imports no jax: the trainer passes in the functions that touch devices.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional

from recsys_jax.training.stage_times import thread_time


class Aborted(RuntimeError):
  """Raised in a waiting thread when the pipeline has been stopped or has failed."""


class StalenessGate:
  """Tracks the last step whose pushes are applied; lookups wait on it (and on a hold).

  Resolving a step's ids ahead of its lookup (``wait_resolve``) waits for no push the lookup
  waits for, only for the training loop to have decided whether that step's lookups are held (a
  checkpoint or a publish after the step before it: ``decide``), or for what would let its lookup
  run: at k = 0 no checkpoint's PS snapshot holds rows a later step created, and at k >= 1 the
  resolve and lookup run as far ahead of the loop as the bound lets the lookup alone (k + 1
  steps ahead of the pushes: what hybrid training is for).
  """

  def __init__(self, last_applied: int):
    self._cond = threading.Condition()
    self.last_applied = last_applied
    self._error: Optional[BaseException] = None
    self._held_from: Optional[int] = None
    self._passed = -1  # the last step whose lookup passed the gate
    self._resolved = -1  # the last step whose resolve passed the gate
    self._decided = last_applied + 1  # the last step whose holds the loop has decided (the first step's: none)

  def _wait(self, ready: Callable[[], bool], timeout: Optional[float], what: str) -> None:
    with self._cond:
      ok = self._cond.wait_for(lambda: ready() or self._error is not None, timeout)
      if self._error is not None:
        raise Aborted(f"pipeline stopped: {self._error!r}") from self._error
      if not ok:
        raise TimeoutError(f"{what} within {timeout} s")

  def wait_applied(self, step: int, timeout: Optional[float] = None) -> None:
    """Blocks until the pushes of all steps <= ``step`` are applied."""
    self._wait(lambda: self.last_applied >= step, timeout, f"pushes up to step {step} not applied")

  def wait_lookup(self, step: int, staleness: int, timeout: Optional[float] = None) -> None:
    """Blocks until the lookup of ``step`` may run: the pushes of steps <= step - staleness - 1
    are applied and no ``hold`` covers ``step``."""

    def ready() -> bool:
      ok = self.last_applied >= step - staleness - 1 and (self._held_from is None or step < self._held_from)
      if ok:  # under the lock: a ``hold`` sees the lookup as passed or keeps it waiting
        self._passed = max(self._passed, step)
      return ok

    self._wait(ready, timeout, f"the lookup of step {step} not allowed")

  def wait_resolve(self, step: int, staleness: int, timeout: Optional[float] = None) -> None:
    """Blocks until ``step``'s ids may be resolved ahead of its lookup: no hold covers ``step``,
    and the loop has decided its holds (``decide``) or its lookup could pass (``wait_lookup``; at
    k = 0 that implies the decision, made before the step before is pushed). A resolved step has
    rows in the PS: ``stop_before`` no longer stops before it."""

    def ready() -> bool:
      due = self._decided >= step or self.last_applied >= step - staleness - 1
      ok = due and (self._held_from is None or step < self._held_from)
      if ok:
        self._resolved = max(self._resolved, step)
      return ok

    self._wait(ready, timeout, f"the resolve of step {step} not allowed")

  def decide(self, step: int) -> None:
    """The loop has decided whether the lookups of ``step`` are held (after the step before it)."""
    with self._cond:
      self._decided = max(self._decided, step)
      self._cond.notify_all()

  def hold(self, step: int) -> None:
    """Until ``release``, lookups of steps >= ``step`` wait, however many pushes are applied.

    A checkpoint after step - 1 holds from ``step`` before that step's push is made, so no
    lookup of a later step runs into its PS snapshot: lookups change a bounded table (last
    seen, counts, the admission sketch, evictions), and the resumed run makes them again. (At
    k >= 1 lookups and resolves of later steps may have passed before it, as far ahead as the
    bound lets them: their rows are in the snapshot, found again by the resumed run.)
    """
    with self._cond:
      self._held_from = step

  def stop_before(self, step: int) -> bool:
    """A stop requested while the loop waits for ``step``: holds the lookups of ``step`` on and
    returns True if nothing of ``step`` has reached the PS (neither its lookup nor its resolve
    passed), so the run may end after ``step - 1``; otherwise holds nothing and returns False:
    ``step`` is trained first (a hold would keep its lookup, and so the loop, waiting forever)."""
    with self._cond:
      if self._passed >= step or self._resolved >= step:
        return False
      self._held_from = step
      return True

  def release(self) -> None:
    with self._cond:
      self._held_from = None
      self._cond.notify_all()

  def mark_applied(self, step: int) -> None:
    with self._cond:
      self.last_applied = step
      self._cond.notify_all()

  def abort(self, error: BaseException) -> None:
    with self._cond:
      if self._error is None:
        self._error = error
      self._cond.notify_all()


class Prefetcher:
  """Prepares steps [start, stop) ahead of the training loop.

  Args:
    start, stop: the step range.
    prepare: step -> host batch (read + dedup); runs freely ahead.
    lookup: host batch -> batch with rows (PS lookup); runs once the gate allows.
    resolve: host batch -> host batch, the lookup's work that reads no row (``RowStore.resolve_many``),
      run before the staleness gate, once the loop has decided the step's holds or the lookup
      could run (``StalenessGate.wait_resolve``); None: the lookup does it all.
    place: batch with rows -> device arrays (e.g. ``jax.device_put``).
    gate: the staleness gate shared with the pusher.
    staleness: k; the lookup of step t waits for the pushes of steps <= t - k - 1.
    depth: how many placed steps may wait in the queue.
    on_close: called by ``close`` before it waits for the thread (e.g. to stop the workers
      ``prepare`` waits on).
    times: something with ``add(stage, wall_s, cpu_s)`` (the trainer's ``StageTimes``): ``get``
      adds the time the consumer waited as ``wait``; None: not timed.
    lookup_on_get: the thread stops after the resolve and ``get`` passes the gate, looks the rows
      up and places them on the consumer's thread. At k = 0 a step's lookup waits for the push of
      the step before, which the consumer applies itself (``Pusher(inline=True)``): the chain from
      one step's end to the next one's start (push, lookup, place, dispatch) then crosses no
      thread, and no wake-up of another thread waits for a core the device's work holds.
  """

  def __init__(
    self,
    start: int,
    stop: int,
    prepare: Callable[[int], Any],
    lookup: Callable[[Any], Any],
    place: Callable[[Any], Any],
    gate: StalenessGate,
    staleness: int,
    depth: int = 2,
    on_close: Optional[Callable[[], None]] = None,
    times: Any = None,
    resolve: Optional[Callable[[Any], Any]] = None,
    lookup_on_get: bool = False,
  ):
    if staleness < 0:
      raise ValueError(f"staleness must be >= 0, got {staleness}")
    self._args = (start, stop, prepare, lookup, place)
    self._resolve = resolve
    self._gate = gate
    self._k = staleness
    self._on_close = on_close
    self._times = times
    self._on_get = lookup_on_get
    self._queue: "queue.Queue" = queue.Queue(maxsize=max(1, depth))
    self._stop = threading.Event()
    self.stale_sum = self.stale_max = self.stale_n = 0
    self._thread = threading.Thread(target=self._run, name="prefetcher", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    start, stop, prepare, lookup, place = self._args
    try:
      for t in range(start, stop):
        host = prepare(t)
        if self._resolve is not None:
          self._gate.wait_resolve(t, self._k)
          if self._stop.is_set():
            return
          host = self._resolve(host)
        if not self._on_get:
          self._gate.wait_lookup(t, self._k)
          if self._stop.is_set():
            return
          host = self._looked_up(t, host)
        while not self._stop.is_set():
          try:
            self._queue.put((t, host, None), timeout=0.1)
            break
          except queue.Full:
            continue
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, not swallowed
      if not self._stop.is_set():
        self._queue.put((None, None, e))

  def _looked_up(self, t: int, host: Any) -> Any:
    """Step ``t``'s rows looked up and placed, once its lookup has passed the gate."""
    # Observed staleness: earlier steps whose pushes this lookup does not see.
    stale = max(0, t - 1 - self._gate.last_applied)
    self.stale_sum += stale
    self.stale_max = max(self.stale_max, stale)
    self.stale_n += 1
    _, _, _, lookup, place = self._args
    return place(lookup(host))

  def get(self, timeout: Optional[float] = None):
    """Returns (step, placed item) in step order; re-raises a failure of the thread; raises
    ``queue.Empty`` after ``timeout`` seconds without one (``lookup_on_get``: without a step
    resolved; the gate is then waited on without a timeout)."""
    w, c = time.perf_counter(), thread_time()
    try:
      t, item, err = self._queue.get(timeout=timeout)
      if err is None and self._on_get:
        self._gate.wait_lookup(t, self._k)
    finally:  # a wait that timed out (a stream waiting for files) is waiting too
      if self._times is not None:
        self._times.add("wait", time.perf_counter() - w, thread_time() - c)
    if err is not None:
      raise err
    return t, (self._looked_up(t, item) if self._on_get else item)

  def close(self) -> None:
    self._stop.set()
    if self._on_close is not None:
      self._on_close()
    while True:  # unblock a producer waiting on a full queue
      try:
        self._queue.get_nowait()
      except queue.Empty:
        break
    self._thread.join(timeout=10)


class Pusher:
  """Applies each step's row gradients in step order, on a background thread or (``inline``) on
  the caller's.

  Args:
    apply: (step, payload) -> result; pulls the gradients to the host and updates the PS.
      An exception (a non-finite loss, say) stops the pusher; the step is not marked
      applied, and ``check()`` re-raises it in the training loop.
    gate: the staleness gate; marked after each step.
    inline: ``push`` applies the step itself before it returns (and raises what the apply
      raised). At k = 0 the next lookup waits for this push anyway: a thread would only add
      two wake-ups to every step's chain (``Prefetcher``'s ``lookup_on_get``).
    record: (step, payload, what ``apply`` returned, ``time.perf_counter()`` when it was applied)
      -> None, the step's bookkeeping (its loss, its scores), None: nothing. On the thread it runs
      before the step is marked applied, so that a ``flush`` sees it; inline it runs at the next
      ``push`` (while the next step runs on the device, off the chain) or at a ``flush`` that
      covers the step, whichever comes first.
  """

  def __init__(
    self,
    apply: Callable[[int, Any], Any],
    gate: StalenessGate,
    depth: int = 4,
    inline: bool = False,
    record: Optional[Callable[[int, Any, Any, float], None]] = None,
  ):
    self._apply = apply
    self._record = record
    self._gate = gate
    self._queue: "queue.Queue" = queue.Queue(maxsize=max(1, depth))
    self.error: Optional[BaseException] = None
    self._pending: Optional[tuple] = None  # inline: the last step applied and not yet recorded
    self._thread: Optional[threading.Thread] = None
    if not inline:
      self._thread = threading.Thread(target=self._run, name="pusher", daemon=True)
      self._thread.start()

  def _run(self) -> None:
    while True:
      item = self._queue.get()
      if item is None:
        return
      try:
        self._applied(*item)
      except BaseException:  # noqa: BLE001 - re-raised by check()
        return

  def _fail(self, e: BaseException) -> None:
    self.error = e
    self._gate.abort(e)

  def _applied(self, t: int, payload: Any) -> None:
    """Applies step ``t``'s push and marks it (inline: its record left for later); a failure
    stops the pusher (``check``) and is raised."""
    try:
      result = self._apply(t, payload)
      at = time.perf_counter()
      if self._thread is not None and self._record is not None:
        self._record(t, payload, result, at)
    except BaseException as e:
      self._fail(e)
      raise
    self._gate.mark_applied(t)
    if self._thread is None and self._record is not None:
      self._pending = (t, payload, result, at)

  def _record_pending(self, up_to: Optional[int] = None) -> None:
    pending = self._pending
    if pending is None or (up_to is not None and pending[0] > up_to):
      return
    self._pending = None
    assert self._record is not None
    try:
      self._record(*pending)
    except BaseException as e:
      self._fail(e)
      raise

  def check(self) -> None:
    """Re-raises the pusher's failure, if any."""
    if self.error is not None:
      raise self.error

  def push(self, step: int, payload: Any) -> None:
    if self._thread is None:
      self.check()
      self._record_pending()  # the step before's: the device runs this step's meanwhile
      self._applied(step, payload)
      return
    while True:
      self.check()
      try:
        self._queue.put((step, payload), timeout=0.1)
        return
      except queue.Full:
        continue

  def flush(self, step: int) -> None:
    """Waits until the pushes of all steps <= ``step`` are applied (and recorded)."""
    if self._thread is None:
      self.check()
      self._record_pending(step)
    while True:
      self.check()
      try:
        self._gate.wait_applied(step, timeout=0.1)
        return
      except TimeoutError:
        continue
      except Aborted:
        self.check()
        raise

  def close(self) -> None:
    if self._thread is not None and self._thread.is_alive():
      try:
        self._queue.put(None, timeout=1)
      except queue.Full:
        pass
      self._thread.join(timeout=10)
