"""The preprocessed binary cache: parsed chunks of text and Parquet files, kept on disk for later epochs and runs.

``CachedFormat`` wraps a ``base.Format``. It works at the granularity of the raw chunk,
the unit the stream splits between processes and resumes at, so a stream reads the same records
in the same order with the same bad-record counts through the cache as from the source, for every
process count and reading position: a chunk is either parsed from the source, or read back from
the file its parse was written to.

Layout, under ``config.data.cache_dir``::

    <file name>-<hash of its absolute path>/
      <format key>-<source key>/        format key: the format's class, parameters, chunk_records
        source.json                       and the source of the parsing code; source key: the
        manifest.json                     file's size, mtime_ns and a hash of its first MiB
        000000.chunk, 000001.chunk, ...   one parsed chunk each (``recsys_jax.data.chunkfile``)

The first pass over a source cuts it (``Format.chunks``), parses the chunks this process
takes and writes each one to its file; the process that cuts the source to its end writes the
manifest (chunk count, first line and records of each chunk). With a valid manifest, ``chunks``
yields references without opening the source: no line cutting, and ``parse`` reads the chunk's
file. Several processes share a cache: each writes the chunks it parses, every file is written to
a temporary name and renamed, and processes that write the same chunk write the same bytes.

What goes wrong, and what happens:

- the source changed (size, mtime or first MiB): its source key changes, the old directory is
  removed with a warning naming it, and the cache is rebuilt in a new one;
- the parsing code or the format's parameters changed: the format key changes (a new directory;
  the old one stays, as another config may still use it);
- a chunk file is truncated or altered (its length and checksum are checked on every read): one
  warning names the file and the check that failed; the chunk is parsed from the source again
  and rewritten;
- the manifest is corrupt, or missing though ``source.json`` says it was written: a warning names
  it, the source is cut again, valid chunk files are reused and the manifest is rewritten (a
  source never read to its end, e.g. eval files read in part, has no manifest and no warning);
- the cache cannot be written (disk full, permissions): one warning, and reading goes on from
  the source.

MovieLens is not cached: it is read whole into memory when the reader is built and its chunks
are slices of arrays, so there is nothing to save.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import inspect
import json
import os
import re
import secrets
import shutil
import threading
from typing import Any, Dict, Iterator, Optional, Tuple

from absl import logging

from recsys_jax import hashing
from recsys_jax.async_ps.kernels import lookup as kernels_lookup
from recsys_jax.data import base, chunkfile, criteo, text_kernels

HEAD_BYTES = 1 << 20
"""Bytes at the start of a source hashed into its key (with its size and mtime)."""
MANIFEST = "manifest.json"
SOURCE = "source.json"
_CODE_MODULES = (
  base,
  chunkfile,
  criteo,
  text_kernels,
  hashing,
  kernels_lookup,
)  # parsing code formats share (criteo: helpers; kernels_lookup: the kernels' splitmix64)


def _digest(data: bytes, n: int = 12) -> str:
  return hashlib.blake2b(data, digest_size=16).hexdigest()[:n]


def _write_json(path: str, obj: Any) -> None:
  tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
  with open(tmp, "w") as f:
    json.dump(obj, f)
  os.replace(tmp, path)


@dataclasses.dataclass
class _Ref:
  """The payload of a chunk read through the cache: where its file is, and its raw chunk if cut."""

  directory: str
  index: int
  num_rows: int
  """Records in the raw chunk, bad ones included (``len(RawChunk)``)."""
  chunk_records: int
  raw: Optional[base.RawChunk]

  @property
  def file(self) -> str:
    return os.path.join(self.directory, f"{self.index:06d}.chunk")


class CachedFormat:
  """A format read through the preprocessed cache under ``cache_dir`` (see the module docstring).

  Args:
    inner: the format of the sources; it must have ``cache_params()`` (its parameters, JSON-able).
    cache_dir: the cache's root directory (created if missing).
  """

  def __init__(self, inner: base.Format, cache_dir: str):
    self.inner, self.schema, self.cache_dir = inner, inner.schema, cache_dir
    code = hashlib.blake2b()
    for module in (inspect.getmodule(type(inner)), *_CODE_MODULES):
      with open(inspect.getsourcefile(module) or module.__file__, "rb") as f:  # any edit to the parsing code rebuilds
        code.update(f.read())
    self._format_key = json.dumps(
      {"format": type(inner).__qualname__, "params": inner.cache_params(), "code": code.hexdigest()[:16]},
      sort_keys=True,
    )
    self._cutters: Dict[str, Tuple[Iterator[base.RawChunk], int]] = {}
    self._lock = threading.Lock()  # the train and eval streams may read through one format in two threads
    self._write_failed = False

  # -- where a source's cache lives ------------------------------------------------------------
  def source_dir(self, path: str, chunk_records: int) -> str:
    """The cache directory of ``path`` as it is now; removes (and warns about) one of an older version."""
    st = os.stat(path)
    with open(path, "rb") as f:
      head = f.read(HEAD_BYTES)
    signature = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "head": _digest(head, 32)}
    absolute = os.path.abspath(path)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(absolute))[:64]
    parent = os.path.join(self.cache_dir, f"{name}-{_digest(absolute.encode())}")
    format_key = _digest(f"{self._format_key}/{chunk_records}".encode())
    directory = os.path.join(parent, f"{format_key}-{_digest(json.dumps(signature, sort_keys=True).encode())}")
    if os.path.isdir(directory):
      return directory
    for stale in glob.glob(os.path.join(parent, f"{format_key}-*")):
      logging.warning(
        "data cache: %s changed (size, mtime or first MiB) since its cache %s was written: removing it, rebuilding in %s",
        path,
        stale,
        directory,
      )
      trash = os.path.join(parent, f".trash-{secrets.token_hex(4)}")
      try:
        os.rename(stale, trash)  # atomic: another process removing it too gets an error, not half a tree
      except OSError:
        continue
      shutil.rmtree(trash, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    self._describe(directory, path, complete=False)
    return directory

  def _describe(self, directory: str, path: str, complete: bool) -> None:
    """Writes ``source.json``: what the directory caches (for people), and whether its manifest was
    written (so that a deleted manifest can be told from one never written)."""
    info = {"path": os.path.abspath(path), "format": json.loads(self._format_key), "complete": complete}
    self._try_write(_write_json, os.path.join(directory, SOURCE), info)

  def _manifest(self, directory: str) -> Optional[Dict[str, Any]]:
    """The manifest if it is valid; None (with a warning if something was wrong) if not."""
    path = os.path.join(directory, MANIFEST)
    try:
      with open(path, "rb") as f:
        text = f.read()
    except FileNotFoundError:
      try:
        with open(os.path.join(directory, SOURCE)) as f:
          complete = json.load(f)["complete"]
      except (OSError, ValueError, KeyError, TypeError):
        complete = False
      if complete:
        logging.warning("data cache: %s is missing though it was written: cutting the source again", path)
      # Otherwise the source was never read to its end (the first pass, or one that stopped early).
      return None
    try:
      m = json.loads(text)
      body = {k: m[k] for k in ("chunks", "first_lines", "records")}
      if m["crc"] != _digest(json.dumps(body, sort_keys=True).encode()):
        raise ValueError("its checksum does not match")
      if not len(body["first_lines"]) == len(body["records"]) == body["chunks"]:
        raise ValueError("its lists do not match its chunk count")
      return m
    except (ValueError, KeyError, TypeError) as e:
      logging.warning("data cache: %s is corrupt (%s): cutting the source again", path, e)
      return None

  # -- the Format protocol ---------------------------------------------------------------------
  def chunks(self, path: str, chunk_records: int) -> Iterator[base.RawChunk]:
    """Chunk references from the manifest if the source's cache is complete; else cuts the source.

    Args:
      path: a source file.
      chunk_records: records per chunk.

    Returns:
      An iterator of raw chunks whose payloads ``parse`` reads from the cache or parses.
    """
    try:
      directory = self.source_dir(path, chunk_records)
    except OSError as e:
      if not os.path.exists(path):
        raise
      self._write_error(self.cache_dir, e)  # an unusable cache directory: read the source uncached
      yield from self.inner.chunks(path, chunk_records)
      return
    manifest = self._manifest(directory)
    if manifest is not None:
      for k, (first, n) in enumerate(zip(manifest["first_lines"], manifest["records"])):
        yield base.RawChunk(path, first, _Ref(directory, k, n, chunk_records, None))
      return
    first_lines, records = [], []
    for k, raw in enumerate(self.inner.chunks(path, chunk_records)):
      first_lines.append(raw.first_line)
      records.append(len(raw))
      yield base.RawChunk(path, raw.first_line, _Ref(directory, k, len(raw), chunk_records, raw))
    body = {"chunks": len(records), "first_lines": first_lines, "records": records}
    self._try_write(
      _write_json,
      os.path.join(directory, MANIFEST),
      {**body, "crc": _digest(json.dumps(body, sort_keys=True).encode())},
    )
    self._describe(directory, path, complete=True)

  def parse(self, chunk: base.RawChunk, bad: base.BadRecords) -> base.Columns:
    """Reads a chunk from its cache file, or parses it (and writes the file); bad records go to ``bad``.

    Args:
      chunk: a chunk from ``chunks`` (or a raw chunk of the inner format, parsed uncached).
      bad: the bad-record policy; it sees the same reports as when parsing the source.

    Returns:
      The chunk's columns, bit for bit those the inner format's ``parse`` returns.
    """
    ref = chunk.payload
    if not isinstance(ref, _Ref):
      return self.inner.parse(chunk, bad)
    try:
      cols, faults, count = chunkfile.read_chunk(ref.file)
    except FileNotFoundError:
      cols = None  # not written yet (this is the first pass, or another process's chunk)
    except (chunkfile.CorruptChunk, OSError, ValueError, KeyError, TypeError) as e:
      logging.warning(
        "data cache: %s (chunk %d of %s) is corrupt (%s): parsing it from the source again",
        ref.file,
        ref.index,
        chunk.path,
        e,
      )
      cols = None
    if cols is None:
      raw = ref.raw if ref.raw is not None else self._cut(chunk.path, ref)
      recorder = base.Recorder(chunkfile.MAX_FAULTS)
      cols = self.inner.parse(raw, recorder)
      faults, count = recorder.faults, recorder.count
      self._try_write(chunkfile.write_chunk, ref.file, cols, faults, count)
    base.replay(bad, chunk.path, faults, count)
    return cols

  # -- helpers ---------------------------------------------------------------------------------
  def _cut(self, path: str, ref: _Ref) -> base.RawChunk:
    """Raw chunk ``ref.index`` of ``path``, cut again: a cursor per source moves forward, so the
    chunks missing from a cache read in order cost one pass over the source, not one each."""
    with self._lock:
      it, next_index = self._cutters.get(ref.directory, (None, 0))
      if it is None or next_index > ref.index:
        it, next_index = iter(self.inner.chunks(path, ref.chunk_records)), 0
      raw = None
      while next_index <= ref.index:
        raw = next(it, None)
        if raw is None:
          break
        next_index += 1
      self._cutters[ref.directory] = (it, next_index)
    if raw is None or len(raw) != ref.num_rows:
      got = "no such chunk" if raw is None else f"{len(raw)} records"
      raise ValueError(
        f"{path} no longer matches its cache {ref.directory} (chunk {ref.index}: {got}, the manifest says "
        f"{ref.num_rows} records) though its size, mtime and first MiB are unchanged: delete that directory"
      )
    return raw

  def _try_write(self, write, path: str, *args) -> None:
    try:
      write(path, *args)
    except OSError as e:
      self._write_error(path, e)

  def _write_error(self, path: str, e: OSError) -> None:
    if not self._write_failed:  # once: a full disk fails every write
      logging.warning("data cache: cannot write %s (%s): reading from the source instead", path, e)
    self._write_failed = True
