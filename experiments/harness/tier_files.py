"""The disk tier's rows as zarr3 files in several layouts, read two ways: tensorstore, and the same bytes with preadv.

A ``Layout`` is one table's rows (``fields``: name -> width in float32 columns) stored as uncompressed
zarr3 arrays under a folder:

* ``separate``: one array per field, as ``TierStore`` stores them (``weights/``, ``slot_<name>/``),
  chunks of ``chunk_rows`` rows x all columns;
* ``combined``: one array whose row is every field side by side (one read instead of one per field);
* ``sharded``: the combined array in shards of ``shard_rows`` rows (one file each) holding inner
  chunks of ``inner_rows`` rows, zarr3's ``sharding_indexed`` codec, its index at the shard's end.

``read_ts`` reads rows with one index-array read per array, as ``TierStore._read_store`` does.
``FloorReader`` reads the bytes those rows need from the same files, in sorted row order, with one
``os.preadv`` per row (per inner chunk for a sharded layout) into preallocated buffers: an
uncompressed zarr3 chunk file is the chunk's C-order bytes, little endian, so row ``r``'s bytes are
at ``(r % chunk_rows) * row_bytes`` in file ``c/<r // chunk_rows>/0``; a shard's inner chunk is
wherever the shard's index (read once, when the reader is made) says.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import tensorstore as ts

KINDS = ("separate", "combined", "sharded")
# TierStore's context: no chunk cache, no fsync per chunk.
CONTEXT = {"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": False}
_ITEM = 4  # float32
_MISSING = np.uint64(2**64 - 1)  # a shard index entry for an inner chunk never written


class Layout:
  """One table of ``rows`` rows in one layout under ``root``; ``create`` writes it."""

  def __init__(
    self,
    root: str,
    kind: str,
    fields: Mapping[str, int],
    rows: int,
    chunk_rows: int = 1024,
    shard_rows: Optional[int] = None,
    inner_rows: Optional[int] = None,
  ):
    if kind not in KINDS:
      raise ValueError(f"Layout: kind {kind!r} is not one of {KINDS}")
    if kind == "sharded" and (not shard_rows or not inner_rows or shard_rows % inner_rows):
      raise ValueError(f"Layout: a sharded layout needs inner_rows ({inner_rows}) dividing shard_rows ({shard_rows})")
    self.kind, self.rows, self.given = kind, rows, dict(fields)
    self.fields = dict(fields) if kind == "separate" else {"row": sum(fields.values())}
    self.chunk_rows = shard_rows if kind == "sharded" else chunk_rows  # rows per file
    self.inner_rows = inner_rows if kind == "sharded" else None
    self.name = f"{kind} c{chunk_rows}" if kind != "sharded" else f"sharded s{shard_rows} i{inner_rows}"
    self.root = os.path.join(root, self.name.replace(" ", "_"))
    self.row_bytes = sum(self.fields.values()) * _ITEM
    self.n_chunks = -(-rows // self.chunk_rows)  # files per field

  def like(self, root: str) -> "Layout":
    """The same layout under another folder."""
    return Layout(root, self.kind, self.given, self.rows, self.chunk_rows, self.chunk_rows, self.inner_rows)

  def spec(self, field: str) -> Dict[str, Any]:
    w = self.fields[field]
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if self.kind == "sharded":
      codecs = [
        {
          "name": "sharding_indexed",
          "configuration": {
            "chunk_shape": [self.inner_rows, w],
            "codecs": codecs,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "index_location": "end",
          },
        }
      ]
    return {
      "driver": "zarr3",
      "kvstore": {"driver": "file", "path": os.path.join(self.root, field) + "/"},
      "metadata": {
        "shape": [self.rows, w],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [self.chunk_rows, w]}},
        "chunk_key_encoding": {"name": "default"},
        "data_type": "float32",
        "codecs": codecs,
      },
    }

  def split(self, data: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """``data`` (the caller's fields) as this layout's arrays: the fields side by side when combined."""
    if self.kind == "separate":
      return {f: data[f] for f in self.fields}
    return {"row": np.concatenate(list(data.values()), axis=1)}

  def create(self, data: Mapping[str, np.ndarray]) -> None:
    """Writes ``data`` (field -> [rows, width] float32, every row non-zero: zarr3 skips chunks equal to the
    fill value) as this layout's files."""
    ctx = ts.Context(CONTEXT)
    arrays = self.open(ctx, create=True)
    for f in [arrays[f].write(a) for f, a in self.split(data).items()]:
      f.result()

  def open(self, context: ts.Context, create: bool = False, cache_index: bool = False) -> Dict[str, ts.TensorStore]:
    """The arrays, opened in ``context``; ``cache_index``: with the shard indexes (and the metadata) cached in
    the context's ``cache_pool#index`` (``index_cache_context``), while the data stays uncached."""
    kw = {"create": True, "delete_existing": True} if create else {}
    extra = {"metadata_cache_pool": "cache_pool#index"} if cache_index else {}
    futures = {f: ts.open({**self.spec(f), **extra}, context=context, **kw) for f in self.fields}
    return {f: fut.result() for f, fut in futures.items()}

  def file(self, field: str, chunk: int) -> str:
    """The file of chunk (or shard) ``chunk`` of ``field``: zarr3's default key encoding, ``c/<i>/<j>``."""
    return os.path.join(self.root, field, "c", str(chunk), "0")

  def files(self) -> List[str]:
    return [self.file(f, c) for f in self.fields for c in range(self.n_chunks)]

  def index_bytes(self) -> int:
    """The bytes of every shard index (0 unless sharded): 16 per inner chunk and a 4-byte checksum per shard."""
    if self.kind != "sharded":
      return 0
    return len(self.fields) * self.n_chunks * (16 * (self.chunk_rows // self.inner_rows) + 4)

  def index_cache_context(self) -> Dict[str, Any]:
    """``CONTEXT`` plus a ``cache_pool#index`` that holds every shard index (1.25x their bytes and 256 KiB)."""
    return {**CONTEXT, "cache_pool#index": {"total_bytes_limit": int(1.25 * self.index_bytes()) + (256 << 10)}}

  def drop_from_page_cache(self) -> None:
    """``posix_fadvise(DONTNEED)`` on every file, so that the next read comes from the disk (pages not yet
    written back stay: ``os.sync()`` first)."""
    for path in self.files():
      fd = os.open(path, os.O_RDONLY)
      try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def read_ts(arrays: Mapping[str, ts.TensorStore], rows: np.ndarray, batch: Optional[ts.Batch] = None) -> Dict[str, Any]:
  """Issues one index-array read of ``rows`` per array (as ``TierStore`` does); returns field -> future."""
  return {f: a[rows].read(batch=batch) for f, a in arrays.items()}


class FloorReader:
  """Reads rows from a ``Layout``'s files with ``os.preadv``: the bytes a read of those rows must fetch
  (see the module's docstring). The files are either held open beforehand (``open_files``, as a
  plain-file store would) or each opened and closed around its reads, as tensorstore's file kvstore
  does. ``read`` may run in several threads at once on files held open."""

  def __init__(self, layout: Layout):
    self.layout = layout
    self._fds: Dict[tuple, int] = {}
    self.offsets: Dict[str, np.ndarray] = {}  # sharded: field -> [shards, inner chunks per shard] byte offsets
    if layout.kind == "sharded":
      per = layout.chunk_rows // layout.inner_rows
      want = layout.inner_rows * layout.row_bytes
      for f in layout.fields:
        offs = []
        for s in range(layout.n_chunks):
          with open(layout.file(f, s), "rb") as fh:
            fh.seek(-(16 * per + 4), os.SEEK_END)
            index = np.frombuffer(fh.read(16 * per), "<u8").reshape(per, 2)
          live = -(-min(layout.rows - s * layout.chunk_rows, layout.chunk_rows) // layout.inner_rows)
          if (index[:live, 0] == _MISSING).any() or (index[:live, 1] != want).any():
            raise ValueError(f"FloorReader: shard {layout.file(f, s)} has inner chunks missing or not {want} bytes")
          offs.append(index[:, 0].astype(np.int64))
        self.offsets[f] = np.stack(offs)

  def open_files(self, rows: np.ndarray, random: bool = False) -> None:
    """Opens (and holds until ``close``) the files that ``read(rows)`` reads; ``random``: with
    ``posix_fadvise(RANDOM)`` on each, so that the kernel reads no more than asked (no read-ahead)."""
    for f in self.layout.fields:
      for c in np.unique(rows // self.layout.chunk_rows).tolist():
        if (f, c) not in self._fds:
          fd = self._fds[(f, c)] = os.open(self.layout.file(f, c), os.O_RDONLY)
          if random:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

  def close(self) -> None:
    for fd in self._fds.values():
      os.close(fd)
    self._fds.clear()

  def read(self, rows: np.ndarray) -> Dict[str, np.ndarray]:
    """Field -> [len(rows), width] float32: rows ``rows`` (sorted, distinct), read in that order."""
    lay = self.layout
    C = lay.chunk_rows
    out = {}
    for f, w in lay.fields.items():
      rb = w * _ITEM
      if lay.kind == "sharded":
        c = lay.inner_rows
        inner = rows // c  # global inner-chunk number, sorted
        uniq, pos = np.unique(inner, return_inverse=True)
        buf = np.empty((uniq.shape[0], c, w), np.float32)
        files = (uniq * c // C).tolist()
        offs = self.offsets[f][uniq * c // C, (uniq * c % C) // c].tolist()
        self._preadv(f, buf, c * rb, files, offs)
        out[f] = buf.reshape(-1, w)[pos * c + rows % c]
      else:
        buf = np.empty((rows.shape[0], w), np.float32)
        self._preadv(f, buf, rb, (rows // C).tolist(), ((rows % C) * rb).tolist())
        out[f] = buf
    return out

  def _preadv(self, field: str, buf: np.ndarray, size: int, files: list, offsets: list) -> None:
    """Reads ``size`` bytes at ``offsets[i]`` of file ``files[i]`` (non-decreasing) into piece i of ``buf``."""
    mv = memoryview(buf).cast("B")
    held = self._fds
    fd, open_c = -1, -1
    try:
      for i, (c, off) in enumerate(zip(files, offsets)):
        if c != open_c:
          if fd >= 0 and not held:
            os.close(fd)
          fd = held[(field, c)] if held else os.open(self.layout.file(field, c), os.O_RDONLY)
          open_c = c
        if os.preadv(fd, [mv[i * size : (i + 1) * size]], off) != size:
          raise OSError(f"FloorReader: short read of {self.layout.file(field, c)} at {off}")
    finally:
      if fd >= 0 and not held:
        os.close(fd)

  def bytes_per_read(self, rows: np.ndarray) -> int:
    """The bytes ``read(rows)`` fetches."""
    if self.layout.kind == "sharded":
      return int(np.unique(rows // self.layout.inner_rows).shape[0]) * self.layout.inner_rows * self.layout.row_bytes
    return int(rows.shape[0]) * self.layout.row_bytes


def io_counters() -> Dict[str, int]:
  """This process's ``/proc/self/io``: ``rchar`` (bytes read by syscalls, page cache or not), ``syscr`` (read
  syscalls) and ``read_bytes`` (bytes fetched from the storage device); ``self_bytes``: the bytes of this read."""
  fd = os.open("/proc/self/io", os.O_RDONLY)
  try:
    text = os.read(fd, 1 << 16)  # one read syscall: its figures were taken before it counted
  finally:
    os.close(fd)
  out = {k: int(v) for k, v in (ln.split(": ") for ln in text.decode().splitlines())}
  return {**out, "self_bytes": len(text)}


def io_delta(before: Dict[str, int], after: Dict[str, int]) -> Dict[str, int]:
  """``after - before`` of two ``io_counters()``, less ``before``'s own read of ``/proc/self/io``."""
  d = {k: after[k] - before[k] for k in before if k != "self_bytes"}
  d["rchar"] -= before["self_bytes"]
  d["syscr"] -= 1
  return d
