"""One parsed chunk on disk: its columns as raw arrays, its bad records, and a checksum.

The preprocessed cache (``recsys_jax.data.cache``) keeps each parsed raw chunk in one file::

    MAGIC (8 bytes) | header length (uint32 LE) | crc32 of the header (uint32 LE) | header (JSON)
    | zero padding to a multiple of 64 | data: the arrays, each at a multiple of 64 bytes

The header lists every array (name such as ``label``, ``dense``, ``sparse/C1``,
``sparse_weights/genres``; dtype; shape; offset in the data), the data's length and checksum,
and the chunk's bad records: their total and the first ``MAX_FAULTS`` of them as
``(line, field, why)``, so that reading the chunk reports them to a ``base.BadRecords``
exactly as parsing it would (same count, same first messages, same error under 'error').

Raw arrays read with one ``readinto``, not Arrow IPC or ``np.memmap``: Arrow IPC reads no
faster and would still need a checksum of its own; a mapping gains nothing once the stream
copies every chunk into its shuffle window, and a file truncated under a mapping kills the
process (SIGBUS) where a read gets an error (``experiments/bench_cache.py``).

The checksum is a wrapping 64-bit sum of the data's uint64 words (``sum64``), verified on every
read: with the exact length in the header it catches any flipped bit and any truncation, at a
tenth of the cost of zlib's crc32 (``experiments/bench_cache.py``). What a sum misses (words
swapped within a file) is not how files go bad. The header has its own crc32 (it is small).
Files are written to a temporary name and renamed, so a reader never sees a half-written file
under the real name; without fsync a crash can still leave a short or zeroed file, which the
length and checksum catch.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import struct
import zlib
from typing import Dict, List, Sequence, Tuple

import numpy as np

from recsys_jax.data import base

MAGIC = b"RJXCHNK1"
VERSION = 1
MAX_FAULTS = 64
"""Bad records kept per chunk with their messages (BadRecords logs its first 5); the rest are counted."""
_PREFIX = struct.Struct("<8sII")
_ALIGN = 64

Fault = base.Fault


class CorruptChunk(ValueError):
  """A chunk file that is truncated, altered or not a chunk file; the message says which check failed."""


def _align(n: int) -> int:
  return -(-n // _ALIGN) * _ALIGN


def sum64(data: np.ndarray) -> int:
  """The wrapping sum of ``data`` (uint8, length a multiple of 8) read as little-endian uint64 words."""
  return int(data.view("<u8").sum(dtype=np.uint64))


def _flatten(cols: base.Columns) -> List[Tuple[str, np.ndarray]]:
  out = [("label", cols["label"]), ("dense", cols["dense"])]
  out += [(f"sparse/{k}", v) for k, v in cols["sparse"].items()]
  out += [(f"sparse_weights/{k}", v) for k, v in (cols.get("sparse_weights") or {}).items()]
  return out


def write_chunk(path: str, cols: base.Columns, faults: Sequence[Fault], bad_count: int) -> int:
  """Writes parsed columns and their bad records to ``path`` (atomically: temporary file, rename).

  Args:
    path: the chunk file.
    cols: the parsed columns (``label``, ``dense``, ``sparse``, optional ``sparse_weights``).
    faults: ``(line, field, why)`` of the chunk's first bad records (at most ``MAX_FAULTS`` kept).
    bad_count: how many bad records the chunk had in all.

  Returns:
    The file's size in bytes.
  """
  arrays, offset = [], 0
  for name, a in _flatten(cols):
    a = np.ascontiguousarray(a)
    arrays.append((name, a, offset))
    offset = _align(offset + a.nbytes)
  data = np.zeros(offset, np.uint8)
  for _, a, off in arrays:
    data[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
  header = json.dumps(
    {
      "version": VERSION,
      "arrays": [[name, a.dtype.str, list(a.shape), off] for name, a, off in arrays],
      "data_bytes": int(data.nbytes),
      "sum64": sum64(data),
      "bad_count": int(bad_count),
      "faults": [list(f) for f in faults[:MAX_FAULTS]],
    },
    separators=(",", ":"),
  ).encode()
  prefix = _PREFIX.pack(MAGIC, len(header), zlib.crc32(header)) + header
  prefix += b"\0" * (_align(len(prefix)) - len(prefix))
  tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
  try:
    with open(tmp, "wb") as f:
      f.write(prefix)
      f.write(memoryview(data))
    os.replace(tmp, path)  # several processes may write the same chunk: identical bytes, last one wins
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return len(prefix) + data.nbytes


def read_chunk(path: str, verify: bool = True, mmap: bool = False) -> Tuple[base.Columns, List[Fault], int]:
  """Reads a chunk file written by ``write_chunk``.

  Args:
    path: the chunk file.
    verify: check the data's checksum (the header's crc32 and the length are always checked).
    mmap: map the file (``np.memmap``) instead of reading it: for comparisons only, as a file
      truncated while mapped kills the process (SIGBUS) where a read gets an error.

  Returns:
    ``(columns, faults, bad_count)``; the arrays are views of one buffer read from the file.

  Raises:
    FileNotFoundError: no such file.
    CorruptChunk: the file is truncated, altered, or not a chunk file (the message says which).
  """
  with open(path, "rb", buffering=0) as f:
    size = os.fstat(f.fileno()).st_size
    if mmap and size:
      buf, got = np.memmap(f, np.uint8, "r", shape=(size,)), size
    else:
      buf = np.empty(size, np.uint8)
      got = f.readinto(memoryview(buf))
  if got != size or size < _PREFIX.size:
    raise CorruptChunk(f"{size} bytes, shorter than a chunk file's prefix" if got == size else "short read")
  magic, header_len, header_crc = _PREFIX.unpack(buf[: _PREFIX.size].tobytes())
  if magic != MAGIC:
    raise CorruptChunk(f"starts with {magic!r}, not {MAGIC!r}")
  if _PREFIX.size + header_len > size:
    raise CorruptChunk(f"truncated: {size} bytes, the header alone needs {_PREFIX.size + header_len}")
  header_bytes = buf[_PREFIX.size : _PREFIX.size + header_len].tobytes()
  if zlib.crc32(header_bytes) != header_crc:
    raise CorruptChunk("the header's crc32 does not match")
  header = json.loads(header_bytes)
  if header.get("version") != VERSION:
    raise CorruptChunk(f"version {header.get('version')!r}, this code reads {VERSION}")
  start = _align(_PREFIX.size + header_len)
  if size != start + header["data_bytes"]:
    raise CorruptChunk(f"truncated or extended: {size} bytes, the header says {start + header['data_bytes']}")
  data = buf[start:]
  if verify and sum64(data) != header["sum64"]:
    raise CorruptChunk("the data's checksum (sum64) does not match: the file was altered")
  cols: base.Columns = {"sparse": {}, "sparse_weights": {}}
  dtypes: Dict[str, np.dtype] = {}
  for name, dtype, shape, off in header["arrays"]:
    dt = dtypes.get(dtype) or dtypes.setdefault(dtype, np.dtype(dtype))
    # math.prod, not np.prod: a numpy call per array held the GIL longer than the read (42 arrays a chunk).
    a = data[off : off + dt.itemsize * math.prod(shape)].view(dt).reshape(shape)
    group, _, key = name.partition("/")
    if key:
      cols[group][key] = a
    else:
      cols[name] = a
  faults = [(int(line), str(field), str(why)) for line, field, why in header["faults"]]
  return cols, faults, int(header["bad_count"])
