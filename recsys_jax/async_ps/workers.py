"""Runs the per-table (and per-shard) work of one PS call on several threads, balanced by rows.

The row kernels are numba ``nogil`` and bound by memory latency (one random row at a time),
so two threads on different tables overlap their cache misses where one thread waits for
each in turn. Tasks touch disjoint tables (each with its own lock), so the order in which
they run changes no result: a table's rows, optimizer state and created-row order are the
same for every thread count.

Tasks are dealt longest first to the least loaded of ``threads`` bins (by rows); the caller
runs one bin itself, the pool the others, so one thread costs no hand-over at all. A call of
fewer rows than ``min_rows`` runs on the caller alone: the hand-over to a pool thread (a
queue, a wake-up, a future) costs more than a small request saves.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import os
from typing import Any, Callable, List, Optional, Sequence, Tuple

MIN_ROWS = 2048
"""Rows below which a call stays on the caller's thread; measured with experiments/bench_ps.py
--sweep_min_rows (see experiments/README.md, "bench_ps")."""


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

  def deal(self, weights: Sequence[int]) -> List[List[int]]:
    """Task indices per bin: longest first to the least loaded bin; each bin in task order."""
    n = len(weights)
    bins = 1 if self._pool is None or sum(weights) < self.min_rows else min(self.threads, n)
    if bins <= 1:
      return [list(range(n))] if n else []
    heap = [(0, b) for b in range(bins)]
    out: List[List[int]] = [[] for _ in range(bins)]
    for i in sorted(range(n), key=lambda i: -weights[i]):  # stable: ties keep task order
      load, b = heapq.heappop(heap)
      out[b].append(i)
      heapq.heappush(heap, (load + weights[i], b))
    return [sorted(b) for b in out if b]

  def run(self, tasks: Sequence[Tuple[int, Callable[[], Any]]]) -> List[Any]:
    """Runs every ``(rows, fn)`` task; returns their results in task order.

    Every task runs even when another fails; then the first failure in task order is raised
    (so no table's work is left half done behind an error, and none is silently lost).
    """
    results: List[Any] = [None] * len(tasks)
    errors: List[Optional[BaseException]] = [None] * len(tasks)

    def work(idx: List[int]) -> None:
      for i in idx:
        try:
          results[i] = tasks[i][1]()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the other tasks
          errors[i] = e

    bins = self.deal([w for w, _ in tasks])
    futures = [self._pool.submit(work, b) for b in bins[1:]] if len(bins) > 1 else []
    if bins:
      work(bins[0])
    for f in futures:
      f.result()  # work() catches everything, so this only waits
    for e in errors:
      if e is not None:
        raise e
    return results

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True)
