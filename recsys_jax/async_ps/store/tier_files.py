"""Reads the disk tier's committed rows straight from its chunk files, memory-mapped.

The tier's arrays are zarr3 arrays of uncompressed chunks (``bytes`` codec, little endian,
C order), each chunk one file ``<array>/c/<chunk>/0`` holding ``chunk_rows`` whole rows.
On a local file system (a ``file`` kvstore) a row is therefore ``width * itemsize`` bytes
at a known offset of a known file, and a read of scattered rows is a gather from memory-
mapped files: the operating system's page cache serves it, and a row costs a copy, not a
request. Through tensorstore the same read costs about as much for one row of a chunk as
for the whole chunk (docs/performance.md: 0.18M rows/s for a step's misses against 7M
from the mapped files on this machine), so the disk tier reads this way where it can and
keeps tensorstore for writing, for every other kvstore, and as the storage format.

Only whole chunks that tensorstore has committed are mapped (``TierStore`` serves the rows
still in its RAM buffers itself). A committed chunk is never rewritten in place, except by
a compaction, which forgets every mapping (``forget``).
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Dict, Tuple

import numpy as np


class ChunkFiles:
  """Memory maps of the committed chunk files of the tier's arrays, opened on first use.

  Thread-safe: maps are opened and forgotten under a lock; reads copy out of them.

  Args:
    root: the directory that holds one sub-directory per array (the kvstore path).
    fields: the array name -> (row width, storage dtype).
    chunk_rows: rows per chunk.
  """

  def __init__(self, root: str, fields: Dict[str, Tuple[int, np.dtype]], chunk_rows: int):
    self.root = root
    self._fields = fields
    self.chunk_rows = chunk_rows
    self._maps: Dict[Tuple[str, int], np.ndarray] = {}
    self._lock = threading.Lock()

  def _chunk(self, field: str, c: int) -> np.ndarray:
    key = (field, c)
    a = self._maps.get(key)
    if a is not None:
      return a
    with self._lock:
      a = self._maps.get(key)
      if a is not None:
        return a
      width, dt = self._fields[field]
      path = os.path.join(self.root, field, "c", str(c), "0")
      want = self.chunk_rows * width * dt.itemsize
      with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != want:
          raise OSError(f"disk tier chunk file {path} holds {size} bytes, expected {want} (an uncompressed chunk)")
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
      a = np.frombuffer(m, dtype=dt).reshape(self.chunk_rows, width)
      self._maps[key] = a
      return a

  def read(self, rows: np.ndarray) -> Dict[str, np.ndarray]:
    """Each field's rows at disk rows ``rows`` (committed, in whole chunks; any order), as float32.

    Raises:
      OSError: naming the chunk file that is missing or not the size of a chunk.
    """
    C = self.chunk_rows
    order = np.argsort(rows, kind="stable")
    chunk = rows[order] // C
    cuts = np.flatnonzero(np.diff(chunk)) + 1
    starts = np.concatenate([[0], cuts])
    stops = np.concatenate([cuts, [rows.shape[0]]])
    out = {f: np.empty((rows.shape[0], w), np.float32) for f, (w, _) in self._fields.items()}
    for a, b in zip(starts.tolist(), stops.tolist()):
      if a == b:
        continue
      c = int(chunk[a])
      at = order[a:b]
      within = rows[at] - c * C
      for f, o in out.items():
        o[at] = self._chunk(f, c)[within]
    return out

  def forget(self) -> None:
    """Drops every mapping (after chunks were rewritten or deleted)."""
    with self._lock:
      self._maps = {}
