"""The disk tier's rows in plain files on a local file system, read and written with pread / pwrite.

``FileRowStore`` is the disk tier's storage when its kvstore is a local directory (a
``file`` kvstore, the default); ``tier_store.TierStore`` (zarr3 arrays through tensorstore)
is kept for every other kvstore (memory, gcs, s3, ...). Both offer ``DiskTier`` the same
operations, so the index, the live / garbage bookkeeping and compaction policy above them
are one.

Why not tensorstore for local files: a step's misses are a few hundred rows scattered
over a table's spill area. Tensorstore reads a zarr3 chunk whole whatever the rows asked of
it, so a step's misses cost about as much as reading the table (0.18M rows/s for 577 rows of
a 87,500-row array in 1024-row chunks on this machine; smaller chunks were slower still),
while reading just the rows moves only their bytes (``experiments/bench_tier_layout.py`` and
docs/performance.md give the figures).

Layout: one file per field under the kvstore path, ``<field>.rows``, holding rows of the
field's storage dtype, little endian, C order (row r at byte r * width * itemsize). An append
is one ``pwrite`` per field of the whole block: the rows are in the page cache when it
returns, every reader sees them at once, and the operating system writes them to the disk
in its own time (write-behind), so there is nothing to flush and no write in flight to wait
for. A full disk fails the ``pwrite`` with an ``OSError`` naming the file.

Reads are one ``pread`` per row and field, in a compiled loop without the GIL
(``kernels.fileio``), on the caller's thread or, for ``DiskTier.read_ahead``, on a reader
thread (``READ_THREADS`` shared by every tier of the process). Nothing is memory-mapped, so
the files' pages are the kernel's page cache and never count in the process's RSS: an
earlier memory-mapped version had to unmap them (``madvise``) to keep RSS bounded, after
which every read cost a page fault, and read a bench_ps step's misses at about half the
speed of these reads (docs/performance.md).

The files are always created fresh (any previous ones are deleted).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Callable, Dict, List, Tuple

import numpy as np

from recsys_jax.async_ps.kernels.fileio import pread_rows

READ_THREADS = 2
"""Threads that read ahead from the files, shared by every ``FileRowStore`` of the process."""

_pool_lock = threading.Lock()
_pool = None

_COMPACT_BLOCK = 1 << 14  # rows a compaction moves per read / write


def _readers() -> concurrent.futures.ThreadPoolExecutor:
  global _pool
  with _pool_lock:
    if _pool is None:
      _pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tier-read")
    return _pool


class FileRowStore:
  """Rows of each field in one file, addressed by disk row number.

  Not thread-safe for writes: ``DiskTier`` calls it under its own lock. A read running on a
  reader thread may overlap later appends (they write other rows).

  Attributes:
    end: disk rows [0, end) are written (appended since the last compaction).
    cap: rows the files hold (``end``: a file grows with its appends).
  """

  def __init__(self, path: str, fields: Dict[str, Tuple[int, np.dtype]], initial_rows: int, counters: Dict[str, int]):
    """Creates the files under ``path`` (a directory, made if absent; earlier files replaced).

    Args:
      fields: the field name -> (row width, storage dtype).
      initial_rows: unused (the files grow with their appends); kept for ``TierStore``'s signature.
      counters: the dict whose ``bytes_written``, ``bytes_read`` and ``rows_written`` entries
        this store adds to.

    Raises:
      ValueError: if the directory or the files cannot be created (naming the path).
    """
    del initial_rows
    self.path = path
    self._fields = fields
    self._row_bytes = sum(w * dt.itemsize for w, dt in fields.values())
    self._counters = counters
    self.read_method = "index"  # accepted for TierStore's sake; reads here are one pread a row
    self.max_pending_bytes = 0  # nothing is ever pending
    self.end = 0
    self._fds: Dict[str, int] = {}
    self._in_flight: List[concurrent.futures.Future] = []
    try:
      os.makedirs(path, exist_ok=True)
      for f in fields:
        p = self.file(f)
        if os.path.exists(p):
          os.remove(p)
        self._fds[f] = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
      self.release()
      raise ValueError(f"DiskTier: cannot create the tier's files under {path!r}: {e}") from e

  @property
  def cap(self) -> int:
    return self.end

  def file(self, field: str) -> str:
    """The path of a field's file."""
    return os.path.join(self.path, f"{field}.rows")

  # ------------------------------------------------------------------------ writes

  def stage(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The batch as ``append`` takes it (no copy: ``append`` writes it out)."""
    return batch

  def _write(self, field: str, rows: np.ndarray, at: int) -> None:
    """Writes rows (already of the field's storage dtype) from disk row ``at`` on."""
    w, dt = self._fields[field]
    data = memoryview(np.ascontiguousarray(rows, dt)).cast("B")
    pos, off = 0, at * w * dt.itemsize
    try:
      while pos < len(data):  # a write may be short (a signal); the rest follows
        pos += os.pwrite(self._fds[field], data[pos:], off + pos)
    except OSError as e:
      raise OSError(e.errno, f"disk tier: cannot write {len(data)} bytes to {self.file(field)}: {e.strerror}") from e

  def append(self, staged: Dict[str, np.ndarray]) -> None:
    """Writes the rows to disk rows [end, end + n).

    Raises:
      OSError: naming the file, if a write fails (e.g. the disk is full); ``end`` is then
        unchanged, so the rows written in part are never read.
    """
    n = next(iter(staged.values())).shape[0]
    for f, a in staged.items():
      self._write(f, a, self.end)  # casts to the storage dtype
    self.end += n
    self._counters["bytes_written"] += n * self._row_bytes
    self._counters["rows_written"] += n

  def reap(self) -> None:
    """Forgets finished reads (nothing is written asynchronously here)."""
    self._in_flight = [f for f in self._in_flight if not f.done()]

  def flush(self) -> None:
    """Nothing to do: appended rows are in the page cache, which every reader sees."""

  def pending_rows(self) -> int:
    """0: appends complete in the page cache (the OS's write-back of dirty pages is not counted)."""
    return 0

  def release(self) -> None:
    """Waits for reads in flight and closes the files (on close)."""
    self._wait_reads()
    for fd in self._fds.values():
      os.close(fd)
    self._fds = {}

  def _wait_reads(self) -> None:
    for f in self._in_flight:
      f.exception()  # waits; a failed read is raised to whoever waits for its result
    self._in_flight = []

  # ------------------------------------------------------------------------ reads

  def _read(self, field: str, rows: np.ndarray) -> np.ndarray:
    """The rows (int64, each < ``end``) of a field, in its storage dtype.

    Raises:
      OSError: naming the file and the row, if a read fails or comes back short.
    """
    w, dt = self._fields[field]
    row_bytes = w * dt.itemsize
    buf = np.empty((rows.shape[0], row_bytes), np.uint8)
    bad = pread_rows(self._fds[field], rows, row_bytes, buf)
    if bad >= 0:
      path, off = self.file(field), int(rows[bad]) * row_bytes
      try:
        got = len(os.pread(self._fds[field], row_bytes, off))
      except OSError as e:
        raise OSError(e.errno, f"disk tier: cannot read row {rows[bad]} of {path}: {e.strerror}") from e
      raise OSError(f"disk tier: {path} ends inside row {rows[bad]} (read {got} of {row_bytes} bytes at {off})")
    return buf.view(dt).reshape(rows.shape[0], w)

  def _gather(self, rows: np.ndarray, sel: np.ndarray, out: Dict[str, np.ndarray]) -> None:
    at = np.ascontiguousarray(rows[sel], np.int64)
    every = bool(sel.all())
    for f in self._fields:
      got = self._read(f, at)
      if every:
        out[f][...] = got  # casts to float32
      else:
        out[f][sel] = got

  def gather(
    self, rows: np.ndarray, found: np.ndarray, out: Dict[str, np.ndarray], background: bool = False
  ) -> Callable[[], None]:
    """Fills ``out`` at the found positions; returns a function that waits until it is filled.

    ``background``: read on a reader thread (the returned function waits for it); else at once.
    """
    n = int(found.sum())
    self._counters["bytes_read"] += n * self._row_bytes
    if not background or n == 0:  # nothing to wait for: no reader thread
      if n:
        self._gather(rows, found, out)
      return _nothing
    fut = _readers().submit(self._gather, rows, found, out)
    self._in_flight.append(fut)
    return fut.result

  # ------------------------------------------------------------------------ compaction

  def move_to_front(self, src: np.ndarray) -> None:
    """Rewrites disk rows ``src`` (sorted, distinct) as rows [0, len(src)); ``end`` becomes len(src)."""
    self._wait_reads()  # a read ahead of these rows is dropped by its epoch, but must not see them torn
    m = src.shape[0]
    # Row i comes from src[i] >= i, and a block's sources are read before the block is
    # written, so no row is overwritten before it is moved.
    for lo in range(0, m, _COMPACT_BLOCK):
      hi = min(lo + _COMPACT_BLOCK, m)
      if np.array_equal(src[lo:hi], np.arange(lo, hi)):
        continue
      at = np.ascontiguousarray(src[lo:hi], np.int64)
      for f in self._fields:
        self._write(f, self._read(f, at), lo)
      self._counters["bytes_read"] += (hi - lo) * self._row_bytes
      self._counters["bytes_written"] += (hi - lo) * self._row_bytes
      self._counters["rows_written"] += hi - lo
    self.end = m

  def truncate(self) -> None:
    """Shrinks the files to the rows [0, end)."""
    self._wait_reads()  # a read of a row past the new end would come back short
    for f, (w, dt) in self._fields.items():
      os.ftruncate(self._fds[f], self.end * w * dt.itemsize)


def _nothing() -> None:
  return None
