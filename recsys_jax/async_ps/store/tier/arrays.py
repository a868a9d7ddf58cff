"""The disk tier's tensorstore I/O: zarr3 arrays of rows, appended by whole chunks.

``TierStore`` holds the rows that ``DiskTier`` (``disk``) spills, addressed by disk row
number; which id lives in which row is ``DiskTier``'s index, not this module's business.

Layout under the kvstore (one zarr3 array each, rows chunked by ``chunk_rows`` with all
columns in one chunk, uncompressed):

* ``weights/``: [capacity, dim] in the storage dtype (float32, bfloat16 or float16);
* ``slot_<name>/``: [capacity, width] float32, one per optimizer slot.

Capacity is grown with tensorstore ``resize`` (doubling, metadata only) and shrunk after a
compaction (which deletes the chunks past the live rows), so the store never holds more
than about ``max(live rows, previous end) + one chunk`` rows of data.

Writes are asynchronous: an append copies the batch, issues tensorstore writes of whole
chunks and returns; the rows of the last, partial chunk stay in a RAM buffer until more
rows complete the chunk (or ``flush`` writes it). A read always sees every earlier
append: rows still in the RAM buffer or in writes that have not committed yet are served
from the RAM copies, and only committed rows are read from the store.

A read fetches the store's rows with one tensorstore index-array read per array (the
distinct rows, sorted) and gathers them in numpy. Reading every row of the covering chunks
in one read and gathering (``read_method='chunks'``) is also available, but slower (see
docs/experiments.md).

The arrays are always created fresh (deleting any previous ``weights/`` and ``slot_*/``
arrays under the kvstore path).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np
import tensorstore as ts

from recsys_jax.embeddings.specs import STORAGE_DTYPES, storage_numpy_dtype

# Context defaults: no chunk cache (the PS table's RAM cache is the cache, and whole-chunk
# appends never need to read a chunk back) and no fsync per chunk (the tier is a spill
# area that does not outlive the process, so durability buys nothing).
_DEFAULT_CONTEXT = {
  "cache_pool": {"total_bytes_limit": 0},
  "file_io_sync": False,
}

READ_METHODS = ("index", "chunks")


class _Pending:
  """One issued, not yet committed, write of rows [start, stop): its futures and RAM copy."""

  __slots__ = ("start", "stop", "data", "futures", "nbytes")

  def __init__(self, start: int, stop: int, data: Dict[str, np.ndarray], futures: list):
    self.start = start
    self.stop = stop
    self.data = data
    self.futures = futures
    self.nbytes = sum(a.nbytes for a in data.values())

  def done(self) -> bool:
    return all(f.done() for f in self.futures)

  def wait(self) -> None:
    for f in self.futures:
      try:
        f.result()
      except Exception as e:  # re-raised with the rows that were lost
        raise OSError(f"DiskTier write of rows [{self.start}, {self.stop}) failed: {e}") from e


def storage_dtype(dtype: Any) -> np.dtype:
  """The numpy dtype of a weights storage dtype given by name or as a dtype; ValueError if unsupported."""
  if isinstance(dtype, str):
    key = dtype
  else:
    try:
      key = np.dtype(dtype).name
    except TypeError:
      key = repr(dtype)
  if key not in STORAGE_DTYPES:
    raise ValueError(f"DiskTier: unsupported dtype {dtype!r}; use one of {sorted(STORAGE_DTYPES)}")
  return storage_numpy_dtype(key)


def _nothing() -> None:
  return None


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


class TierStore:
  """Append-only zarr3 arrays of rows (one per field) under a tensorstore kvstore.

  Not thread-safe: ``DiskTier`` calls it under its own lock.

  Attributes:
    end: disk rows [0, end) are allocated (appended since the last compaction).
    cap: the arrays' capacity in rows.
  """

  def __init__(
    self,
    spec: Any,
    fields: Dict[str, Tuple[int, np.dtype]],
    chunk_rows: int,
    initial_rows: Optional[int],
    read_method: str,
    max_pending_bytes: int,
    context: Optional[Mapping[str, Any]],
    counters: Dict[str, int],
  ):
    """Creates the arrays; see ``DiskTier.__init__`` for the arguments.

    Args:
      fields: the array name under the kvstore -> (row width, storage dtype).
      counters: the dict whose ``bytes_written``, ``bytes_read`` and ``rows_written``
        entries this store adds to.
    """
    self._fields = fields
    self._row_bytes = sum(w * dt.itemsize for w, dt in self._fields.values())
    self.chunk_rows = chunk_rows
    self.read_method = read_method
    self.max_pending_bytes = max_pending_bytes
    self._counters = counters
    C = self.chunk_rows
    self.cap = _round_up(max(int(initial_rows) if initial_rows is not None else 64 * C, C), C)
    self._arrays = self._open_arrays(spec, context)

    self.end = 0  # rows >= _tail_start sit in _tail
    self._tail_start = 0
    self._tail = self._empty_tail()
    self._flushed_to = 0  # tail rows below this row were written by flush() or move_to_front()
    self._pending: collections.deque = collections.deque()
    self._pending_bytes = 0

  def _open_arrays(self, spec: Any, context: Optional[Mapping[str, Any]]) -> Dict[str, ts.TensorStore]:
    try:
      kv = ts.KvStore.Spec(spec if isinstance(spec, str) else dict(spec)).to_json()
    except Exception as e:  # any parse failure means a bad spec
      raise ValueError(f"DiskTier: invalid tensorstore kvstore spec {spec!r}: {e}") from e
    try:
      self._context = ts.Context({**_DEFAULT_CONTEXT, **dict(context or {})})
    except Exception as e:
      raise ValueError(f"DiskTier: invalid tensorstore context {context!r}: {e}") from e
    base = kv.get("path", "")
    if base and not base.endswith("/"):
      base += "/"
    futures = {}
    for field, (width, dt) in self._fields.items():
      array_spec = {
        "driver": "zarr3",
        "kvstore": {**kv, "path": f"{base}{field}/"},
        "metadata": {
          "shape": [self.cap, width],
          "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [self.chunk_rows, width]}},
          "data_type": np.dtype(dt).name,
        },
      }
      try:
        futures[field] = ts.open(array_spec, create=True, delete_existing=True, context=self._context)
      except Exception as e:
        raise ValueError(f"DiskTier: cannot create arrays under kvstore spec {spec!r}: {e}") from e
    arrays = {}
    for field, fut in futures.items():
      try:
        arrays[field] = fut.result()
      except Exception as e:
        raise ValueError(f"DiskTier: cannot create arrays under kvstore spec {spec!r}: {e}") from e
    return arrays

  def _empty_tail(self) -> Dict[str, np.ndarray]:
    return {f: np.zeros((self.chunk_rows, w), dt) for f, (w, dt) in self._fields.items()}

  # ------------------------------------------------------------------------ writes

  def stage(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Copies the buffered tail rows and then ``batch`` (cast to the storage dtypes).

    The new rows become disk rows ``[end, end + len(batch))`` once ``append`` takes the result.
    """
    t = self.end - self._tail_start
    staged = {}
    for f, (w, dt) in self._fields.items():
      a = np.empty((t + batch[f].shape[0], w), dt)
      a[:t] = self._tail[f][:t]
      a[t:] = batch[f]  # casts to the storage dtype, and copies the caller's data
      staged[f] = a
    return staged

  def append(self, staged: Dict[str, np.ndarray]) -> None:
    """Appends the rows that ``stage`` copied: issues the whole chunks, buffers the rest.

    Waits for the oldest writes while those in flight hold more than ``max_pending_bytes``.
    """
    C = self.chunk_rows
    t = self.end - self._tail_start
    m = next(iter(staged.values())).shape[0] - t
    self.end += m
    n_full = (t + m) // C * C
    if n_full:
      self._ensure_capacity(self._tail_start + n_full)
      start, stop = self._tail_start, self._tail_start + n_full
      data = {f: a[:n_full] for f, a in staged.items()}
      self._issue(start, stop, data)
      self._tail_start = stop
      tail = self._empty_tail()
      for f, a in staged.items():
        tail[f][: t + m - n_full] = a[n_full:]
      self._tail = tail
    else:
      self._tail = {f: np.concatenate([a, np.zeros((C - a.shape[0], a.shape[1]), a.dtype)]) for f, a in staged.items()}
    while self._pending_bytes > self.max_pending_bytes and self._pending:
      p = self._pending.popleft()
      self._pending_bytes -= p.nbytes
      p.wait()

  def _issue(self, start: int, stop: int, data: Dict[str, np.ndarray]) -> None:
    """Starts the writes of rows [start, stop); ``data`` must not be modified afterwards."""
    futures = [self._arrays[f][start:stop].write(a) for f, a in data.items()]
    p = _Pending(start, stop, data, futures)
    self._pending.append(p)
    self._pending_bytes += p.nbytes
    self._counters["bytes_written"] += (stop - start) * self._row_bytes
    self._counters["rows_written"] += stop - start

  def reap(self) -> None:
    """Drops committed writes from the front of the pending queue (raising their errors)."""
    while self._pending and self._pending[0].done():
      p = self._pending.popleft()
      self._pending_bytes -= p.nbytes
      p.wait()

  def _wait_pending(self) -> None:
    while self._pending:
      p = self._pending.popleft()
      self._pending_bytes -= p.nbytes
      p.wait()

  def flush(self) -> None:
    """Writes the buffered partial chunk and waits until every write has committed.

    Raises:
      OSError: if an asynchronous write failed.
    """
    t = self.end - self._tail_start
    if t:
      self._ensure_capacity(self.end)
      # The rows stay in the tail buffer: the next full-chunk write rewrites this chunk.
      data = {f: a[:t].copy() for f, a in self._tail.items()}
      futures = [self._arrays[f][self._tail_start : self.end].write(a) for f, a in data.items()]
      for f in futures:
        try:
          f.result()
        except Exception as e:
          raise OSError(f"DiskTier write of rows [{self._tail_start}, {self.end}) failed: {e}") from e
      self._flushed_to = self.end
      self._counters["bytes_written"] += t * self._row_bytes
    self._wait_pending()

  def pending_rows(self) -> int:
    """Rows not yet committed to the store: the unflushed tail and the writes in flight."""
    tail = self.end - max(self._tail_start, self._flushed_to)
    return max(tail, 0) + sum(p.stop - p.start for p in self._pending)

  def release(self) -> None:
    """Drops the arrays and the RAM copies (after a flush, on close)."""
    self._arrays = {}
    self._pending.clear()
    self._tail = {}

  # ------------------------------------------------------------------------ capacity

  def _resize(self, cap: int, shrink: bool) -> None:
    futures = {
      f: a.resize(
        exclusive_max=[cap, None], shrink_only=shrink, expand_only=not shrink, resize_metadata_only=not shrink
      )
      for f, a in self._arrays.items()
    }
    self._arrays = {f: fut.result() for f, fut in futures.items()}
    self.cap = cap

  def _ensure_capacity(self, rows: int) -> None:
    if rows <= self.cap:
      return
    # Writes in flight were issued against the old bounds: let them land before resizing.
    self._wait_pending()
    self._resize(_round_up(max(rows, 2 * self.cap), self.chunk_rows), shrink=False)

  # ------------------------------------------------------------------------ reads

  def _read_store(self, rows: np.ndarray) -> Callable[[], Dict[str, np.ndarray]]:
    """Issues the reads of committed disk rows (any order, repeats allowed), one per array.

    Returns a function that waits for them and returns each field's rows in ``rows`` order.
    """
    u, inv = np.unique(rows, return_inverse=True)
    C = self.chunk_rows
    if self.read_method == "index":
      where, take = u, inv
    else:
      chunks = np.unique(u // C)
      where = (chunks[:, None] * C + np.arange(C)).reshape(-1)
      where = where[where < self.cap]
      take = np.searchsorted(chunks, u // C) * C + u % C
      take = take[inv]
    futures = {f: a[where].read() for f, a in self._arrays.items()}
    self._counters["bytes_read"] += int(where.shape[0]) * self._row_bytes

    def wait() -> Dict[str, np.ndarray]:
      out = {}
      for f, fut in futures.items():
        try:
          out[f] = fut.result()[take]
        except Exception as e:  # re-raised with the rows that could not be read
          raise OSError(f"DiskTier read of {u.shape[0]} rows in [{u[0]}, {u[-1]}] failed: {e}") from e
      return out

    return wait

  def gather(self, rows: np.ndarray, found: np.ndarray, out: Dict[str, np.ndarray]) -> Callable[[], None]:
    """Fills ``out`` at the found positions from the tail buffer, pending writes, or the store.

    Rows in RAM (the tail buffer, writes not yet committed) are copied at once; the store's
    rows are read asynchronously. Returns a function that waits for those reads and fills
    their positions: until it has returned, ``out`` is complete only where the rows were in
    RAM. It may be called from any thread, and needs no lock: the store's rows a read was
    issued for do not change until the disk tier's next compaction.
    """
    todo = found.copy()
    in_tail = todo & (rows >= self._tail_start)
    if in_tail.any():
      pos = rows[in_tail] - self._tail_start
      for f, a in self._tail.items():
        out[f][in_tail] = a[pos]
      todo &= ~in_tail
    if self._pending and todo.any():
      starts = np.array([p.start for p in self._pending], np.int64)
      stops = np.array([p.stop for p in self._pending], np.int64)
      idx = np.searchsorted(starts, rows, side="right") - 1
      hit = todo & (idx >= 0) & (rows < stops[np.maximum(idx, 0)])
      for k in np.unique(idx[hit]):
        sel = hit & (idx == k)
        p = self._pending[int(k)]
        pos = rows[sel] - p.start
        for f, a in p.data.items():
          out[f][sel] = a[pos]
      todo &= ~hit
    if not todo.any():
      return _nothing
    fetch = self._read_store(rows[todo])

    def finish() -> None:
      for f, a in fetch().items():
        out[f][todo] = a

    return finish

  # ------------------------------------------------------------------------ compaction

  def move_to_front(self, src: np.ndarray) -> None:
    """Flushes, then rewrites disk rows ``src`` (sorted, distinct) as rows [0, len(src)).

    Afterwards ``end`` is ``len(src)``; the chunks past it stay until ``truncate``.
    """
    self.flush()
    C = self.chunk_rows
    m = src.shape[0]
    # Row i of the result comes from src[i] >= i (sorted, distinct), so each destination
    # batch [lo, hi) only overwrites rows already read; batches are whole chunks except the
    # last, so only the final chunk is read-modified-written.
    step = max(C, _round_up(1 << 16, C))
    last: Dict[str, np.ndarray] = {}
    for lo in range(0, m, step):
      hi = min(lo + step, m)
      futures = {f: a[src[lo:hi]].read() for f, a in self._arrays.items()}
      data = {f: fut.result() for f, fut in futures.items()}
      self._counters["bytes_read"] += (hi - lo) * self._row_bytes
      if not np.array_equal(src[lo:hi], np.arange(lo, hi)):
        writes = [self._arrays[f][lo:hi].write(a) for f, a in data.items()]
        for w in writes:
          w.result()
        self._counters["bytes_written"] += (hi - lo) * self._row_bytes
        self._counters["rows_written"] += hi - lo
      last = data
      last_lo = lo
    self.end = m
    self._flushed_to = m
    self._tail_start = m // C * C
    tail = self._empty_tail()
    if m > self._tail_start:
      for f, a in last.items():
        tail[f][: m - self._tail_start] = a[self._tail_start - last_lo :]
    self._tail = tail

  def truncate(self) -> None:
    """Shrinks the arrays to the chunks that hold rows [0, end) (at least one chunk)."""
    # Deletes every chunk past the live rows (the partial last chunk keeps stale rows past
    # row end, which nothing points at and the next append overwrites).
    C = self.chunk_rows
    self._resize(max(_round_up(self.end, C), C), shrink=True)
