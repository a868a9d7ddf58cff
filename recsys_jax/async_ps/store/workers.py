"""Runs the per-table (and per-shard) work of one PS call on several threads, balanced by rows.

The row kernels are numba ``nogil`` and bound by memory latency (one random row at a time),
so two threads on different tables overlap their cache misses where one thread waits for
each in turn. Tasks touch disjoint tables (each with its own lock), so the order in which
they run changes no result: a table's rows, optimizer state and created-row order are the
same for every thread count.

Tasks are taken longest first (by rows) by the caller and ``threads - 1`` pool threads, each
the next task when it is free, so one thread costs no hand-over at all and a busy machine,
where a pool thread may wait for a core, costs little: the caller goes on with the tasks. A
call of fewer rows than ``min_rows`` runs on the caller alone: the hand-over to a pool thread
(a queue, a wake-up, a future) costs more than a small request saves.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

MIN_ROWS = 4096
"""Rows below which a call stays on the caller's thread. experiments/bench_ps_threads.py measured
the hand-over at 5-33 us and a row (lookup + push, dim 16) at 165 ns, about half of it in the
GIL-free kernels, so a second thread breaks even near 800 rows at best; its sweep, on a
machine with no core free, lost 59% at 220 rows, 22% at 676 and 3-10% from 2k to 10k: 4096
keeps small calls (eval probes, tests, a remote shard's share) off the pool with a margin."""


_shared: Dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_shared_lock = threading.Lock()


def shared_pool(name: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
  """The process's one pool named ``name`` (its threads' name prefix), made with ``threads``
  threads on first use: the disk tier's readers, the tiered tables' evictors."""
  with _shared_lock:
    pool = _shared.get(name)
    if pool is None:
      pool = _shared[name] = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name)
    return pool


def default_threads() -> int:
  """The cores this process may run on."""
  return len(os.sched_getaffinity(0))


class Workers:
  """A thread pool of ``threads - 1`` workers plus the calling thread.

  Args:
    threads: threads one call may use (None: the core count, ``default_threads``).
    min_rows: calls of fewer rows (summed over their tasks) run on the caller alone.
  """

  def __init__(self, threads: Optional[int] = None, min_rows: int = MIN_ROWS):
    threads = default_threads() if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
      raise ValueError(f"threads must be an int >= 1 (or None for the core count), got {threads!r}")
    self.threads = threads
    self.min_rows = int(min_rows)
    self._pool = (
      concurrent.futures.ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="ps-worker")
      if threads > 1
      else None
    )

  def helpers(self, weights: Sequence[int]) -> int:
    """Pool threads a call of tasks of these rows gets: none below ``min_rows`` rows in all."""
    if self._pool is None or sum(weights) < self.min_rows:
      return 0
    return min(self.threads, len(weights)) - 1

  def run(self, tasks: Sequence[Tuple[int, Callable[[], Any]]]) -> List[Any]:
    """Runs every ``(rows, fn)`` task; returns their results in task order.

    The caller and the helpers take the tasks longest first, each the next one when it is
    free (so rows are balanced as they go, and a helper the OS has not scheduled yet costs
    nothing: the caller takes its share and the helper's start is cancelled). Every task runs
    even when another fails; then the first failure in task order is raised (so no table's
    work is left half done behind an error, and none is lost).
    """
    n = len(tasks)
    results: List[Any] = [None] * n
    errors: List[Optional[BaseException]] = [None] * n
    helpers = self.helpers([w for w, _ in tasks])
    order = sorted(range(n), key=lambda i: -tasks[i][0]) if helpers else list(range(n))
    taken = iter(order)
    lock = threading.Lock()

    def work() -> None:
      while True:
        with lock:
          i = next(taken, None)
        if i is None:
          return
        try:
          results[i] = tasks[i][1]()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the other tasks
          errors[i] = e

    pool = cast(concurrent.futures.ThreadPoolExecutor, self._pool)  # not None when helpers > 0
    futures = [pool.submit(work) for _ in range(helpers)]
    work()
    for f in futures:
      if not f.cancel():  # started: it finishes the task it took (work() catches everything)
        f.result()
    for e in errors:
      if e is not None:
        raise e
    return results

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True)
