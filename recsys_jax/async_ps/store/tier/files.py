"""The disk tier's rows in plain files on a local file system, read and written with pread / pwrite.

``FileRowStore`` is the disk tier's storage when its kvstore is a local directory (a
``file`` kvstore, the default); ``arrays.TierStore`` (zarr3 arrays through tensorstore)
is kept for every other kvstore (memory, gcs, s3, ...). Both offer ``DiskTier`` the same
operations, so the index, the live / garbage bookkeeping and compaction policy above them
are one.

Why not tensorstore for local files: a step's misses are a few hundred rows scattered
over a table's spill area. Tensorstore reads a zarr3 chunk whole whatever the rows asked of
it, so a step's misses cost about as much as reading the table (0.18M rows/s for 577 rows of
a 87,500-row array in 1024-row chunks on this machine; smaller chunks were slower still),
while reading just the rows moves only their bytes (``experiments/bench_tier_layout.py`` and
docs/performance.md give the figures).

Layout: one file under the kvstore path, ``tier.rows``, of fixed-size records: record r
(disk row r, at byte r * record bytes) holds every field of the row in turn (the weights,
then each optimizer slot), each in its storage dtype, little endian. A row is one read of
consecutive bytes, where a file per field cost a read per field. An append is one ``pwrite``
of the whole block of records: the rows are in the page cache when it returns, every reader
sees them at once, and the operating system writes them to the disk in its own time
(write-behind), so there is nothing to flush and no write in flight to wait for. A full disk
fails the ``pwrite`` with an ``OSError`` naming the file.

Reads are one ``pread`` per row, in a compiled loop without the GIL (``kernels.fileio``), on
the caller's thread (a lookup's, or a read-ahead's: ``Table.read_ahead``). Nothing is memory-mapped, so
the file's pages are the kernel's page cache and never count in the process's RSS (an earlier
memory-mapped version unmapped them to keep RSS bounded, and then paid a page fault per row
read: ``kernels.fileio`` gives the measurement).

The file is always created fresh (a previous one is deleted).
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Tuple

import numpy as np

from recsys_jax.async_ps.kernels.fileio import pread_rows

_COMPACT_BLOCK = 1 << 14  # rows a compaction moves per read / write


class FileRowStore:
  """Rows of all fields in one file of fixed-size records, addressed by disk row number.

  Not thread-safe: ``DiskTier`` calls it under its own lock.

  Attributes:
    end: disk rows [0, end) are written (appended since the last compaction).
    cap: rows the file holds (``end``: the file grows with its appends).
  """

  FILE = "tier.rows"

  def __init__(self, path: str, fields: Dict[str, Tuple[int, np.dtype]], counters: Dict[str, int]):
    """Creates the file under ``path`` (a directory, made if absent; an earlier file replaced).

    Args:
      fields: the field name -> (row width, storage dtype), in record order.
      counters: the dict whose ``bytes_written``, ``bytes_read`` and ``rows_written`` entries
        this store adds to.

    Raises:
      ValueError: if the directory or the file cannot be created (naming the path).
    """
    self.path = path
    self._fields = fields
    self._spans: Dict[str, Tuple[int, int]] = {}  # field -> (first byte, bytes) in a record
    at = 0
    for f, (w, dt) in fields.items():
      self._spans[f] = (at, w * dt.itemsize)
      at += w * dt.itemsize
    self.row_bytes = at
    self._counters = counters
    self.read_method = "index"  # accepted for TierStore's sake; reads here are one pread a row
    self.max_pending_bytes = 0  # nothing is ever pending
    self.end = 0
    self._fd = -1
    try:
      os.makedirs(path, exist_ok=True)
      self._fd = os.open(self.file(), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
      raise ValueError(f"DiskTier: cannot create the tier's file under {path!r}: {e}") from e

  @property
  def cap(self) -> int:
    return self.end

  def file(self) -> str:
    """The path of the file."""
    return os.path.join(self.path, self.FILE)

  def _field(self, records: np.ndarray, f: str) -> np.ndarray:
    """Field ``f`` of records [n, row_bytes] (uint8), as [n, width] of its storage dtype (a view)."""
    first, nbytes = self._spans[f]
    return records[:, first : first + nbytes].view(self._fields[f][1])

  # ------------------------------------------------------------------------ writes

  def stage(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The batch as ``append`` takes it (no copy: ``append`` writes it out)."""
    return batch

  def _write(self, records: np.ndarray, at: int) -> None:
    """Writes records [n, row_bytes] (uint8, C order) from disk row ``at`` on."""
    data = memoryview(records).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
    pos, off = 0, at * self.row_bytes
    try:
      while pos < len(data):  # a write may be short (a signal); the rest follows
        pos += os.pwrite(self._fd, data[pos:], off + pos)
    except OSError as e:
      raise OSError(e.errno, f"disk tier: cannot write {len(data)} bytes to {self.file()}: {e.strerror}") from e

  def append(self, staged: Dict[str, np.ndarray]) -> None:
    """Writes the rows to disk rows [end, end + n).

    Raises:
      OSError: naming the file, if the write fails (e.g. the disk is full); ``end`` is then
        unchanged, so the rows written in part are never read.
    """
    n = next(iter(staged.values())).shape[0]
    records = np.empty((n, self.row_bytes), np.uint8)
    for f, a in staged.items():
      self._field(records, f)[...] = a  # casts to the storage dtype
    self._write(records, self.end)
    self.end += n
    self._counters["bytes_written"] += n * self.row_bytes
    self._counters["rows_written"] += n

  def reap(self) -> None:
    """Nothing to do: no read or write here is asynchronous."""

  def flush(self) -> None:
    """Nothing to do: appended rows are in the page cache, which every reader sees."""

  def pending_rows(self) -> int:
    """0: appends complete in the page cache (the OS's write-back of dirty pages is not counted)."""
    return 0

  def release(self) -> None:
    """Closes the file (on close)."""
    if self._fd >= 0:
      os.close(self._fd)
      self._fd = -1

  # ------------------------------------------------------------------------ reads

  def _read(self, rows: np.ndarray) -> np.ndarray:
    """The records [n, row_bytes] (uint8) of disk rows (int64, each < ``end``).

    Raises:
      OSError: naming the file and the row, if a read fails or comes back short.
    """
    records = np.empty((rows.shape[0], self.row_bytes), np.uint8)
    bad = pread_rows(self._fd, rows, self.row_bytes, records)
    if bad >= 0:
      path, off = self.file(), int(rows[bad]) * self.row_bytes
      try:
        got = len(os.pread(self._fd, self.row_bytes, off))
      except OSError as e:
        raise OSError(e.errno, f"disk tier: cannot read row {rows[bad]} of {path}: {e.strerror}") from e
      raise OSError(f"disk tier: {path} ends inside row {rows[bad]} (read {got} of {self.row_bytes} bytes at {off})")
    return records

  def _gather(self, rows: np.ndarray, sel: np.ndarray, out: Dict[str, np.ndarray]) -> None:
    records = self._read(np.ascontiguousarray(rows[sel], np.int64))
    every = bool(sel.all())
    for f in self._fields:
      if every:
        out[f][...] = self._field(records, f)  # casts to float32
      else:
        out[f][sel] = self._field(records, f)

  def gather(self, rows: np.ndarray, found: np.ndarray, out: Dict[str, np.ndarray]) -> Callable[[], None]:
    """Fills ``out`` at the found positions now; returns a function with nothing left to wait for
    (``TierStore.gather``'s returns one that waits for its reads)."""
    n = int(found.sum())
    self._counters["bytes_read"] += n * self.row_bytes
    if n:
      self._gather(rows, found, out)
    return _nothing

  # ------------------------------------------------------------------------ compaction

  def move_to_front(self, src: np.ndarray) -> None:
    """Rewrites disk rows ``src`` (sorted, distinct) as rows [0, len(src)); ``end`` becomes len(src)."""
    m = src.shape[0]
    # Row i comes from src[i] >= i, and a block's sources are read before the block is
    # written, so no row is overwritten before it is moved.
    for lo in range(0, m, _COMPACT_BLOCK):
      hi = min(lo + _COMPACT_BLOCK, m)
      if np.array_equal(src[lo:hi], np.arange(lo, hi)):
        continue
      self._write(self._read(np.ascontiguousarray(src[lo:hi], np.int64)), lo)
      self._counters["bytes_read"] += (hi - lo) * self.row_bytes
      self._counters["bytes_written"] += (hi - lo) * self.row_bytes
      self._counters["rows_written"] += hi - lo
    self.end = m

  def truncate(self) -> None:
    """Shrinks the file to the rows [0, end)."""
    os.ftruncate(self._fd, self.end * self.row_bytes)


def _nothing() -> None:
  return None
