"""The host workers: batches read, parsed and deduplicated ahead of the training loop, in order.

``config.host_workers`` threads (-1: one per core; 0: none) share the host's reading work:

- the reader's stream parses raw chunks on them, a window ahead (``recsys_jax.data.stream``;
  the synthetic reader generates whole batches on them);
- a *feeder* thread draws the reader's batches in order (cutting files into chunks, gathering
  each batch's records) and hands each batch's ``prepare`` (per-table dedup) to them;
- the prefetcher (``recsys_jax.training.pipeline.Prefetcher``) takes the prepared batches
  in step order, waits on the staleness gate, looks their rows up and places them.

Data flows one way, and nothing a worker computes depends on which worker computes it or when:
a chunk's parse, a batch's records and its dedup are functions of the data alone, results are
taken in order, and bad records are reported in chunk order by the stream. So a run is the
same for every worker count, and each prepared batch carries the reader's position just after
it: the position saved with step t is the one after step t's batch, however far the workers
have read ahead.

Threads, not processes: what they run mostly drops the GIL (numpy's loops, the compiled dedup
kernel), they hand batches over without a copy, and the trainer never forks after jax started
its threads; a worker process would cost the trainer more CPU per record in the trip through
the pipes than parsing the record itself (``experiments/bench_feed.py --transfer``).
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from typing import Any, Callable, Iterator, Optional


class FeedClosed(RuntimeError):
  """Raised in a thread waiting on a feed that has been closed."""


_END = object()


class _Failed:
  def __init__(self, error: BaseException):
    self.error = error


def worker_count(host_workers: int) -> int:
  """The number of host worker threads ``config.host_workers`` asks for (-1: one per core)."""
  return len(os.sched_getaffinity(0)) if host_workers == -1 else int(host_workers)


class Feed:
  """``prepare(item)`` for each item, in order, computed ahead of the consumer on worker threads.

  Args:
    workers: worker threads; 0 draws and prepares each item on the consumer's thread when it
      is asked for (no threads at all).
    ahead: prepared items that may wait for the consumer (default: the workers + 2: one in the
      hands of each worker and two ready; a batch of 65536 Criteo records is ~26 MB prepared).
    name: the threads' name prefix.

  Give the reader ``pool`` (its stream parses on it too), then ``start`` the feed.
  """

  def __init__(self, workers: int, ahead: Optional[int] = None, name: str = "host-worker"):
    if workers < 0:
      raise ValueError(f"host workers must be >= 0, got {workers}")
    self.workers = workers
    self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name) if workers else None
    self._queue: "queue.Queue" = queue.Queue(maxsize=max(1, ahead if ahead is not None else workers + 2))
    self._stop = threading.Event()
    self._items: Optional[Iterator[Any]] = None
    self._prepare: Optional[Callable[[Any], Any]] = None
    self._thread: Optional[threading.Thread] = None
    self._ended = False
    self._name = name

  def start(self, items: Iterator[Any], prepare: Callable[[Any], Any]) -> "Feed":
    """Starts drawing ``items`` (on the feeder thread) and preparing them (on the workers)."""
    self._items, self._prepare = iter(items), prepare
    if self.pool is not None:
      self._thread = threading.Thread(target=self._feed, name=f"{self._name}-feeder", daemon=True)
      self._thread.start()
    return self

  def _put(self, x) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(x, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _feed(self) -> None:
    items, pool, prepare = self._items, self.pool, self._prepare
    assert items is not None and pool is not None and prepare is not None  # started with workers
    try:
      for item in items:
        if not self._put(pool.submit(prepare, item)):
          return
      self._put(_END)
    except BaseException as e:  # noqa: BLE001 - handed to the consumer in order, not swallowed
      self._put(_Failed(e))

  def __iter__(self):
    return self

  def __next__(self) -> Any:
    """The next prepared item; re-raises, in order, what drawing or preparing it raised."""
    if self._ended:
      raise StopIteration
    if self.pool is None:
      assert self._items is not None and self._prepare is not None, "Feed.start first"
      return self._prepare(next(self._items))
    while True:
      if self._stop.is_set():
        raise FeedClosed("the host feed was closed")
      try:
        x = self._queue.get(timeout=0.1)
        break
      except queue.Empty:
        continue
    if x is _END:
      self._ended = True
      raise StopIteration
    if isinstance(x, _Failed):
      self._ended = True
      raise x.error
    return x.result()

  def close(self) -> None:
    """Stops the feeder, drops what was prepared ahead and shuts the workers down (a running
    task finishes first; none is waited for); waiting consumers get ``FeedClosed``."""
    self._stop.set()
    if self.pool is not None:
      self.pool.shutdown(wait=False, cancel_futures=True)
    while True:
      try:
        x = self._queue.get_nowait()
      except queue.Empty:
        break
      if isinstance(x, concurrent.futures.Future):
        x.cancel()
    if self._thread is not None:
      self._thread.join(timeout=10)
