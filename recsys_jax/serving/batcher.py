"""Micro-batching: requests that arrive together are scored as one batch by one model version.

Each request is checked and encoded on its caller's thread (``Scorer.encode``), so a bad request
fails alone and before it waits; the good ones join a queue. A worker thread takes the first
request waiting, then more until the batch holds ``max_batch`` records or ``max_wait_s`` has
passed since that first request arrived, takes the model reference ONCE for the batch, and
scores it with one ``predict``: every record of a batch, hence of a response, comes from the
version the response names. A request encoded by an older version than the batch's is encoded
again by the batch's (encodings may depend on the version), and fails alone if that version
refuses it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Any, Callable, List, Mapping, Optional, Sequence

import numpy as np
from absl import logging

from recsys_jax.serving.api import RequestError, Scorer, SnapshotGone


class Overloaded(RuntimeError):
  """More requests are waiting than the batcher holds (``max_pending``): answered 503 / UNAVAILABLE."""


class Prediction(collections.namedtuple("Prediction", ["version", "scores", "dense_version", "row_version", "step"])):
  """One request's answer: the version that scored all its records, and their probabilities in order;
  the steps of the dense parameters and of the rows that version scores with, and of the checkpoint
  it was loaded from (None: not known)."""

  def __new__(cls, version, scores, dense_version=None, row_version=None, step=None):
    return super().__new__(cls, version, scores, dense_version, row_version, step)


def checkpoint_step(scorer: Any) -> Optional[int]:
  """The step of the checkpoint a version was loaded from (a fresh version's too: its base's), or None."""
  ck = getattr(scorer, "checkpoint", None)
  step = getattr(ck, "step", None) if ck is not None else getattr(scorer, "step", None)
  return None if step is None else int(step)


class _Pending:
  __slots__ = ("records", "scorer", "encoded", "n", "arrived", "future")

  def __init__(self, records, scorer, encoded, arrived):
    self.records, self.scorer, self.encoded, self.n = records, scorer, encoded, len(records)
    self.arrived, self.future = arrived, concurrent.futures.Future()


class Batcher:
  """Scores requests of records in micro-batches.

  Args:
    current: returns the model version to use now (``reload.ModelHolder.current``); called once
      per request (to encode it) and once per batch (to score it).
    max_batch: most records in one batch (a request is never split; one over this is refused by
      the front before it gets here).
    max_wait_s: longest a request waits for others to join its batch.
    workers: batches scored at once (while one is in ``predict``, the next one fills).
    max_pending: requests waiting at most; more are refused with ``Overloaded``.
    on_gone: called when ``predict`` raises ``SnapshotGone`` (``ModelHolder.check``: load the newest
      checkpoint); if it returns True the batch is scored again, once, by the version now current.
  """

  def __init__(
    self,
    current: Callable[[], Scorer],
    max_batch: int = 512,
    max_wait_s: float = 0.002,
    workers: int = 1,
    max_pending: int = 4096,
    on_gone: Optional[Callable[[], bool]] = None,
  ):
    if max_batch < 1 or max_wait_s < 0 or workers < 1 or max_pending < 1:
      raise ValueError(
        f"need max_batch >= 1, max_wait_s >= 0, workers >= 1, max_pending >= 1; got {max_batch}, {max_wait_s}, "
        f"{workers}, {max_pending}"
      )
    self._current, self.max_batch, self.max_wait_s, self._max_pending = current, max_batch, max_wait_s, max_pending
    self._on_gone = on_gone
    self._queue: collections.deque = collections.deque()
    self._cond = threading.Condition()
    self._closed = False
    self._take = threading.Lock()  # one worker gathers a batch at a time, so batches keep arrival order
    self._stats: collections.Counter = collections.Counter()
    self._sizes: List[int] = []  # records per batch, the last 10000 (for tests and the bench)
    self._sample: List[Mapping[str, Any]] = []  # records of recent batches, to warm a new version with
    self._threads = [threading.Thread(target=self._work, name=f"serve-batch-{i}", daemon=True) for i in range(workers)]
    for t in self._threads:
      t.start()

  # -- the caller's side ---------------------------------------------------------------
  def submit(self, records: Sequence[Mapping[str, Any]]) -> concurrent.futures.Future:
    """Encodes ``records`` now (``RequestError`` if the model refuses them) and queues them.

    Returns:
      A future of the ``Prediction``; it fails with ``RequestError`` if the version that scores the
      batch refuses the records, or with the model's error if ``predict`` fails.
    """
    if not records:
      raise RequestError("no records to score", field="records")
    scorer = self._current()
    encoded = scorer.encode(records)
    item = _Pending(records, scorer, encoded, time.monotonic())
    with self._cond:
      if self._closed:
        raise Overloaded("the server is shutting down")
      if len(self._queue) >= self._max_pending:
        self._stats["overloaded"] += 1
        raise Overloaded(f"{len(self._queue)} requests are waiting already; try again")
      self._queue.append(item)
      self._cond.notify()
    return item.future

  def predict(self, records: Sequence[Mapping[str, Any]], timeout: Optional[float] = None) -> Prediction:
    """``submit`` and wait for the answer."""
    return self.submit(records).result(timeout)

  def stats(self) -> dict:
    """Counts: batches, records, requests, overloaded, failed_batches; ``batch_sizes`` of the last batches."""
    with self._cond:
      out = dict(self._stats)
      out["batch_sizes"] = list(self._sizes)
    return out

  def warm(self, scorer: Scorer) -> List[int]:
    """Scores recent requests' records with ``scorer`` at the batch sizes served lately (each rounded
    up to a power of two), before it serves: a new version compiles its batch shapes here, not in a
    request. Off the request path (the reload poller calls it).

    Returns:
      The batch sizes scored (none before the first request).
    """
    with self._cond:
      sample, sizes = list(self._sample), set(self._sizes[-1000:])
    if not sample:
      return []
    done = sorted({min(self.max_batch, 1 << (n - 1).bit_length()) for n in sizes})
    for n in done:
      recs = [sample[i % len(sample)] for i in range(n)]
      scorer.predict(scorer.encode(recs))
    return done

  def close(self) -> None:
    """Stops the workers once the requests queued are answered."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()
    for t in self._threads:
      t.join()

  # -- the workers ---------------------------------------------------------------------
  def _gather(self) -> List[_Pending]:
    """The next batch: the first request waiting, then those that come within its wait (in order)."""
    with self._cond:
      while not self._queue and not self._closed:
        self._cond.wait()
      if not self._queue:
        return []
      batch = [self._queue.popleft()]
      n = batch[0].n
      deadline = batch[0].arrived + self.max_wait_s
      while n < self.max_batch:
        if self._queue:
          if n + self._queue[0].n > self.max_batch:
            break  # the next request fits only in the next batch; it starts that one
          item = self._queue.popleft()
          batch.append(item)
          n += item.n
          continue
        left = deadline - time.monotonic()
        if left <= 0 or self._closed:
          break
        self._cond.wait(left)
      return batch

  def _work(self) -> None:
    while True:
      with self._take:
        batch = self._gather()
      if not batch:
        return
      self._score(batch)

  def _predict(self, scorer: Scorer, batch: List[_Pending]):
    """-> (requests that encoded, their scores or the exception predict raised); a request the
    version refuses gets its ``RequestError`` here."""
    ok: List[_Pending] = []
    parts: List[Any] = []
    for item in batch:
      if item.scorer is not scorer:
        try:
          item.encoded, item.scorer = scorer.encode(item.records), scorer
        except RequestError as e:
          item.future.set_exception(e)
          continue
        except Exception as e:  # noqa: BLE001 - the model's bug fails this request, not the server
          logging.exception("encode by %s failed", scorer.version)
          item.future.set_exception(e)
          continue
      ok.append(item)
      parts.append(item.encoded)
    if not ok:
      return ok, None
    n = sum(item.n for item in ok)
    try:
      scores = np.asarray(scorer.predict(scorer.concat(parts) if len(parts) > 1 else parts[0]), np.float32)
      if scores.shape != (n,):
        raise RuntimeError(f"model {scorer.version} returned scores of shape {scores.shape} for {n} records")
    except Exception as e:  # noqa: BLE001 - answer every request of the batch, keep serving
      return ok, e
    return ok, scores

  def _score(self, batch: List[_Pending]) -> None:
    scorer = self._current()  # once per batch: the whole batch is scored by this version
    ok, scores = self._predict(scorer, batch)
    if not ok:
      return
    if isinstance(scores, SnapshotGone) and self._on_gone is not None and self._on_gone():
      # The trainer deleted rows this version reads lazily, after saving a newer checkpoint: the
      # batch is scored again, whole, by the version now loaded (its responses name that one).
      logging.warning("%s: %s; scoring the batch again with %s", scorer.version, scores, self._current().version)
      scorer = self._current()
      ok, scores = self._predict(scorer, ok)
    if isinstance(scores, Exception):
      logging.error("predict of %d requests by %s failed", len(ok), scorer.version, exc_info=scores)
      with self._cond:
        self._stats["failed_batches"] += 1
      for item in ok:
        item.future.set_exception(scores)
      return
    n = len(scores)
    with self._cond:
      self._stats["batches"] += 1
      self._stats["records"] += n
      self._stats["requests"] += len(ok)
      self._sizes.append(n)
      del self._sizes[:-10000]
      if len(self._sample) < self.max_batch:
        self._sample.extend(r for item in ok for r in item.records)
        del self._sample[self.max_batch :]
    start = 0
    for item in ok:
      item.future.set_result(
        Prediction(
          scorer.version,
          scores[start : start + item.n].tolist(),
          getattr(scorer, "dense_version", None),
          getattr(scorer, "row_version", None),
          checkpoint_step(scorer),
        )
      )
      start += item.n
