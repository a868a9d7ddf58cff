"""The disk tier's rows in plain files on a local file system, memory-mapped.

``FileRowStore`` is the disk tier's storage when its kvstore is a local directory (a
``file`` kvstore, the default); ``tier_store.TierStore`` (zarr3 arrays through tensorstore)
is kept for every other kvstore (memory, gcs, s3, ...). Both offer ``DiskTier`` the same
operations, so the index, the live / garbage bookkeeping and compaction policy above them
are one.

Why not tensorstore for local files: a step's misses are a few hundred rows scattered
over a table's spill area. Tensorstore reads a zarr3 chunk whole whatever the rows asked of
it, so a step's misses cost about as much as reading the table (0.18M rows/s for 577 rows of
a 87,500-row array in 1024-row chunks on this machine; smaller chunks were slower still),
while a gather from a memory-mapped file moves only the rows' bytes (7M rows/s, the same
run: ``experiments/bench_tier_layout.py`` and docs/performance.md give the figures).

Layout: one file per field under the kvstore path, ``<field>.rows``, holding [capacity,
width] rows of the field's storage dtype, little endian, C order (row r at byte r * width *
itemsize). Appends copy the rows into the mapping: the operating system writes the dirty
pages back in its own time (write-behind), and every thread sees the new rows at once, so
there is nothing to flush and no write in flight to wait for. The capacity grows by
doubling (``ftruncate`` and a new mapping; readers still holding the old mapping keep it,
and it stays valid because a file only shrinks when no read is in flight).

Reads gather on the caller's thread, or, for ``DiskTier.read_ahead``, on a reader thread
(``READ_THREADS`` shared by every tier of the process), so rows not in the page cache are
faulted in while the trainer does other work.

The files are always created fresh (any previous ones are deleted).
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading
from typing import Callable, Dict, List, Tuple

import numpy as np

READ_THREADS = 2
"""Threads that read ahead from the files, shared by every ``FileRowStore`` of the process."""

RESIDENT_BYTES = int(os.environ.get("RECSYS_JAX_TIER_RESIDENT_BYTES", 16 << 20))
"""The file pages one store may leave mapped into the process before it unmaps them.

Pages of a mapped file that were touched count in the process's RSS until unmapped
(``madvise(MADV_DONTNEED)``), though they are the kernel's page cache and stay cached: a
store counts the pages its appends and reads may have touched (a page per row read, at
most) and drops them past this. Dropping them costs the next reads a page fault each: a
4 MiB budget read a bench_ps workload's misses at 0.6x the speed of an unbounded one, 16
MiB at about 0.8x. The memory bound (docs/parameter-server.md) counts it per table shard.
``RECSYS_JAX_TIER_RESIDENT_BYTES`` sets it."""

_PAGE = mmap.PAGESIZE

_pool_lock = threading.Lock()
_pool = None

_MIN_ROWS = 1024  # the smallest capacity a store shrinks to


def _readers() -> concurrent.futures.ThreadPoolExecutor:
  global _pool
  with _pool_lock:
    if _pool is None:
      _pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tier-read")
    return _pool


class FileRowStore:
  """Rows of each field in one memory-mapped file, addressed by disk row number.

  Not thread-safe for writes: ``DiskTier`` calls it under its own lock. A read running on a
  reader thread may overlap later appends (they write other rows) and capacity growth.

  Attributes:
    end: disk rows [0, end) are allocated (appended since the last compaction).
    cap: the files' capacity in rows.
  """

  def __init__(self, path: str, fields: Dict[str, Tuple[int, np.dtype]], initial_rows: int, counters: Dict[str, int]):
    """Creates the files under ``path`` (a directory, made if absent; earlier files replaced).

    Args:
      fields: the field name -> (row width, storage dtype).
      initial_rows: the initial capacity in rows (at least ``_MIN_ROWS``). The files hold their
        capacity's bytes on disk, reserved when they grow, and double when an append needs more.
      counters: the dict whose ``bytes_written``, ``bytes_read`` and ``rows_written`` entries
        this store adds to.

    Raises:
      ValueError: if the directory or the files cannot be created (naming the path).
    """
    self.path = path
    self._fields = fields
    self._row_bytes = sum(w * dt.itemsize for w, dt in fields.values())
    self._counters = counters
    self.read_method = "index"  # accepted for TierStore's sake; reads here are gathers
    self.max_pending_bytes = 0  # nothing is ever pending
    self.end = 0
    self.cap = 0
    self._maps: Dict[str, np.ndarray] = {}  # each field's rows, over its mapping
    self._mmaps: Dict[str, mmap.mmap] = {}
    self._touched = 0  # bytes of pages touched since the mappings were last dropped (an upper bound)
    self._in_flight: List[concurrent.futures.Future] = []
    try:
      os.makedirs(path, exist_ok=True)
      for f in fields:
        p = self.file(f)
        if os.path.exists(p):
          os.remove(p)
      self._resize(max(int(initial_rows), _MIN_ROWS))
    except OSError as e:
      raise ValueError(f"DiskTier: cannot create the tier's files under {path!r}: {e}") from e

  def file(self, field: str) -> str:
    """The path of a field's file."""
    return os.path.join(self.path, f"{field}.rows")

  def _resize(self, cap: int) -> None:
    """Sets the files' capacity and maps them again.

    Growing reserves the disk blocks (``posix_fallocate``): a store on a full disk then fails
    here with ENOSPC, naming its file, where a write into a sparse mapping would kill the
    process with SIGBUS.
    """
    maps, mmaps = {}, {}
    for f, (w, dt) in self._fields.items():
      path, size = self.file(f), cap * w * dt.itemsize
      with open(path, "a+b") as fh:
        try:
          if size > os.fstat(fh.fileno()).st_size:
            os.posix_fallocate(fh.fileno(), 0, size)
          else:
            fh.truncate(size)
        except OSError as e:
          raise OSError(e.errno, f"disk tier: cannot size {path} to {size} bytes ({cap} rows): {e.strerror}") from e
        m = mmap.mmap(fh.fileno(), size)
      mmaps[f] = m
      maps[f] = np.frombuffer(m, dtype=dt).reshape(cap, w)
    self._maps, self._mmaps = maps, mmaps
    self.cap = cap

  # ------------------------------------------------------------------------ writes

  def stage(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The batch as ``append`` takes it (no copy: ``append`` copies into the files)."""
    return batch

  def append(self, staged: Dict[str, np.ndarray]) -> None:
    """Copies the rows to disk rows [end, end + n), growing the files if needed."""
    n = next(iter(staged.values())).shape[0]
    if self.end + n > self.cap:
      self._resize(max(self.end + n, 2 * self.cap))
    for f, a in staged.items():
      self._maps[f][self.end : self.end + n] = a  # casts to the storage dtype
    self.end += n
    self._counters["bytes_written"] += n * self._row_bytes
    self._counters["rows_written"] += n
    self._touch(n * self._row_bytes + 2 * _PAGE * len(self._maps))

  def reap(self) -> None:
    """Forgets finished reads (nothing is written asynchronously here)."""
    self._in_flight = [f for f in self._in_flight if not f.done()]

  def flush(self) -> None:
    """Nothing to do: appended rows are in the mapping, which every reader sees."""

  def pending_rows(self) -> int:
    """0: appends complete in the mapping (the OS's write-back of dirty pages is not counted)."""
    return 0

  def release(self) -> None:
    """Waits for reads in flight and drops the mappings (on close)."""
    self._wait_reads()
    self._maps, self._mmaps = {}, {}

  def _wait_reads(self) -> None:
    for f in self._in_flight:
      f.exception()  # waits; a failed read is raised to whoever waits for its result
    self._in_flight = []

  # ------------------------------------------------------------------------ reads

  def _gather(self, maps: Dict[str, np.ndarray], rows: np.ndarray, sel: np.ndarray, out: Dict[str, np.ndarray]) -> None:
    at = rows[sel]
    for f, a in maps.items():
      out[f][sel] = a[at]

  def gather(
    self, rows: np.ndarray, found: np.ndarray, out: Dict[str, np.ndarray], background: bool = False
  ) -> Callable[[], None]:
    """Fills ``out`` at the found positions; returns a function that waits until it is filled.

    ``background``: gather on a reader thread (the returned function waits for it); else at once.
    """
    n = int(found.sum())
    self._counters["bytes_read"] += n * self._row_bytes
    maps = self._maps  # the mapping of this moment: a later growth does not disturb the read
    if not background or n == 0:  # nothing to wait for: no reader thread
      self._gather(maps, rows, found, out)
      self._touch(n * _PAGE * len(maps))
      return _nothing
    fut = _readers().submit(self._gather, maps, rows, found, out)
    self._in_flight.append(fut)
    self._touch(n * _PAGE * len(maps))
    return fut.result

  def _touch(self, nbytes: int) -> None:
    """Counts pages touched; past ``RESIDENT_BYTES`` unmaps every page of the files (they
    stay in the page cache, and a later access maps them again)."""
    self._touched += nbytes
    if self._touched <= RESIDENT_BYTES:
      return
    for m in self._mmaps.values():
      m.madvise(mmap.MADV_DONTNEED)
    self._touched = 0

  # ------------------------------------------------------------------------ compaction

  def move_to_front(self, src: np.ndarray) -> None:
    """Rewrites disk rows ``src`` (sorted, distinct) as rows [0, len(src)); ``end`` becomes len(src)."""
    self._wait_reads()  # a read ahead of these rows is dropped by its epoch, but must not see them torn
    m = src.shape[0]
    step = 1 << 16
    # Row i comes from src[i] >= i, and a block's sources are read (copied out by the fancy
    # index) before the block is written, so no row is overwritten before it is moved.
    for lo in range(0, m, step):
      hi = min(lo + step, m)
      if np.array_equal(src[lo:hi], np.arange(lo, hi)):
        continue
      for a in self._maps.values():
        a[lo:hi] = a[src[lo:hi]]
      self._counters["bytes_read"] += (hi - lo) * self._row_bytes
      self._counters["bytes_written"] += (hi - lo) * self._row_bytes
      self._counters["rows_written"] += hi - lo
    self.end = m

  def truncate(self) -> None:
    """Shrinks the files to about the rows [0, end) (at least ``_MIN_ROWS``)."""
    self._wait_reads()  # a read past the new end would fault on a page no longer in the file
    cap = max(self.end, _MIN_ROWS)
    if cap < self.cap:
      self._maps, self._mmaps = {}, {}
      self._resize(cap)


def _nothing() -> None:
  return None
