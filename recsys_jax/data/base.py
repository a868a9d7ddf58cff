"""What every file reader shares: the schema, raw chunks, columns, bad-record policy, hashing.

A *format* (Criteo TSV, Avazu CSV, generic CSV/Parquet, MovieLens) knows how to cut a file
into raw chunks of consecutive records (cheap: no parsing, so a resumed run can skip them
quickly) and how to parse a raw chunk into *columns*:

``{'label': float32 [n], 'dense': float32 [n, num_dense], 'sparse': {feature: uint64 [n, L]},
'sparse_weights': {feature: float32 [n, L]}}``

``sparse_weights`` holds, for a feature whose bags have variable length or per-id weights,
the weight of each slot (0 = padding); a feature absent from it has weight 1 everywhere.
Bad records are reported to a ``BadRecords``, which either raises (naming file, line and
field) or counts them and drops the record. ``recsys_jax.data.stream`` turns a format and a
list of files into shuffled, resumable, per-process batches.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import io
import zlib
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
from absl import logging

from recsys_jax.embeddings.gathered import Gathered
from recsys_jax.hashing import name_seed, splitmix64

Columns = Dict[str, Any]
POLICIES = ("error", "skip")


@dataclasses.dataclass(frozen=True)
class FeatureInfo:
  """A sparse feature as a reader produces it (the config may override kind and table)."""

  name: str
  max_len: int = 1
  """Ids per example: 1 one-hot; more for multi-hot bags and sequences (padded, weight 0)."""
  kind: str = "pooled"
  """'pooled' (a bag, pooled by a combiner) or 'sequence' (kept in order, padded and masked)."""
  table: Optional[str] = None
  """The table it reads by default (None: its own name); e.g. a history of movies reads 'movie'."""


@dataclasses.dataclass(frozen=True)
class Schema:
  """What a reader produces: the number of dense features and the sparse features."""

  num_dense: int
  features: Tuple[FeatureInfo, ...]

  def feature_max_len(self) -> Dict[str, int]:
    return {f.name: f.max_len for f in self.features}


@dataclasses.dataclass
class RawChunk:
  """Consecutive records of one file, unparsed."""

  path: str
  first_line: int
  """1-based line (text) or row (Parquet) number of the first record, for error messages."""
  payload: Any
  """A list of lines (bytes, no newline) for text formats; a pyarrow table for Parquet."""

  def __len__(self) -> int:
    return len(self.payload) if isinstance(self.payload, list) else self.payload.num_rows


class Format(Protocol):
  """A file format: raw chunks out of a file, columns out of a raw chunk."""

  schema: Schema

  def chunks(self, path: str, chunk_records: int) -> Iterator[RawChunk]:
    """Cuts ``path`` into raw chunks of ``chunk_records`` records (the last may be shorter)."""
    ...

  def parse(self, chunk: RawChunk, bad: "BadRecords") -> Columns:
    """Parses a raw chunk; bad records go to ``bad`` (and are dropped if it does not raise)."""
    ...


class BadRecordError(ValueError):
  """A malformed record under ``on_bad_record='error'``; the message names file, line, field."""


class BadRecords:
  """The bad-record policy: ``'error'`` raises, ``'skip'`` counts and logs the first few."""

  def __init__(self, policy: str = "error", log_first: int = 5):
    if policy not in POLICIES:
      raise ValueError(f"config.data.on_bad_record = {policy!r}: choose one of {POLICIES}")
    self.policy, self.log_first = policy, log_first
    self.count = 0
    self.examples: List[str] = []

  def report(self, path: str, line: int, field: str, why: str) -> None:
    """One bad record at ``path``:``line``; ``field`` names the column at fault."""
    msg = f"{path}:{line}: field {field!r}: {why}"
    if self.policy == "error":
      raise BadRecordError(f"bad record {msg} (config.data.on_bad_record='error'; 'skip' drops and counts them)")
    self.count += 1
    if len(self.examples) < self.log_first:
      self.examples.append(msg)
      logging.warning("skipped bad record %s", msg)


Fault = Tuple[int, str, str]
"""A bad record as a ``Recorder`` keeps it: (line, field, why); its file is its chunk's."""


class Recorder(BadRecords):
  """Collects the bad records of one chunk (the first ``limit``, all if None) without logging or
  raising, to be reported later to the run's ``BadRecords`` by ``replay``: a chunk parsed
  on a worker thread, or read back from the preprocessed cache, then counts, logs and raises
  exactly as parsing it there and then would have."""

  def __init__(self, limit: Optional[int] = None):
    super().__init__("skip", log_first=0)
    self.limit = limit
    self.faults: List[Fault] = []

  def report(self, path: str, line: int, field: str, why: str) -> None:
    self.count += 1
    if self.limit is None or len(self.faults) < self.limit:
      self.faults.append((int(line), str(field), str(why)))


def replay(bad: BadRecords, path: str, faults: Sequence[Fault], count: int) -> None:
  """Reports a chunk's recorded bad records to ``bad`` as parsing it would (raises under 'error');
  ``count`` is the chunk's total, beyond the ``faults`` kept."""
  for line, field, why in faults:
    bad.report(path, line, field, why)
  bad.count += count - len(faults)


def run_ahead(executor, fn: Callable[[Any], Any], items: Iterator[Any], ahead: int) -> Iterator[Tuple[Any, Any]]:
  """``(item, future of fn(item))`` for each of ``items``, in order, with up to ``ahead`` more
  submitted to ``executor`` than taken. The items are drawn on the calling thread."""
  pending: Deque[Tuple[Any, Any]] = collections.deque()
  for item in items:
    pending.append((item, executor.submit(fn, item)))
    if len(pending) > ahead:
      yield pending.popleft()
  while pending:
    yield pending.popleft()


# ---------------------------------------------------------------------------------------------
# Text files.


def open_text(path: str) -> io.BufferedIOBase:
  """Opens a plain or gzip file (by its ``.gz`` suffix) for binary line reading."""
  if path.endswith(".gz"):
    return gzip.open(path, "rb")
  return open(path, "rb")


# What reading a damaged or unreadable file raises: gzip's BadGzipFile and other OSErrors,
# EOFError for a gzip stream cut short, zlib.error for corrupt deflate data.
READ_ERRORS = (OSError, EOFError, zlib.error)


def one_line(e: BaseException) -> str:
  """An exception's message on one line (pyarrow's and thrift's end in newlines)."""
  return " ".join(str(e).split())


def unreadable(path: str, after_line: int, e: BaseException) -> ValueError:
  """The error for a file that cannot be read past ``after_line`` (0: not at all)."""
  where = f"after line {after_line}" if after_line else "from its start"
  return ValueError(f"{path}: cannot be read {where} ({type(e).__name__}: {one_line(e)}); is it damaged or cut short?")


def first_line(path: str) -> bytes:
  """The first line of a plain or gzip text file (b'' if it is empty)."""
  try:
    with open_text(path) as f:
      return f.readline()
  except READ_ERRORS as e:
    raise unreadable(path, 0, e) from None


_BLOCK = 1 << 18
"""Bytes read at a time by ``text_chunks`` (256 KiB cut fastest: 64 KiB and 1 MiB within 10%,
4 MiB 2x slower, each block a fresh allocation)."""


def text_chunks(path: str, chunk_records: int, header_lines: int = 0) -> Iterator[RawChunk]:
  """Cuts a text file into chunks of ``chunk_records`` lines (after ``header_lines``).

  Lines keep no trailing newline (``\\n`` or ``\\r\\n``); an empty last line is not a record.
  The file is read in blocks, each cut at its newlines by one ``bytes.split``, on the thread
  that feeds the parsers: 0.25 us of CPU a Criteo record against 0.35 iterating over lines.

  Raises:
    ValueError: naming the file and the last line read, if it cannot be read (e.g. a
      damaged or truncated gzip file).
  """
  line_no = header_lines + 1
  lines: List[bytes] = []
  try:
    with open_text(path) as f:
      for _ in range(header_lines):
        f.readline()
      tail = b""
      while True:
        block = f.read(_BLOCK)
        if not block:
          break
        data = tail + block if tail else block
        parts = data.split(b"\n")
        tail = parts.pop()  # after the last newline: the start of a line the next block ends
        if b"\r" in data:
          parts = [x.rstrip(b"\r") for x in parts]
        lines += parts
        while len(lines) >= chunk_records:
          yield RawChunk(path, line_no, lines[:chunk_records])
          line_no += chunk_records
          del lines[:chunk_records]
      if tail:
        lines.append(tail.rstrip(b"\r"))
  except READ_ERRORS as e:
    # A block read that fails gives none of its lines; count the ones the stream does give.
    raise unreadable(path, header_lines + _readable_lines(path, header_lines), e) from None
  if lines:  # fewer than chunk_records are left
    yield RawChunk(path, line_no, lines)


def _readable_lines(path: str, header_lines: int) -> int:
  """The lines after the header that ``path`` gives, line by line, before it fails to read."""
  n = 0
  try:
    with open_text(path) as f:
      for _ in range(header_lines):
        f.readline()
      for _ in f:
        n += 1
  except READ_ERRORS:
    pass
  return n


# ---------------------------------------------------------------------------------------------
# Hashing categorical values per field into uint64.

_FNV_PRIME = np.uint64(0x100000001B3)


def hash_strings(values: Sequence[Any], field: str) -> np.ndarray:
  """Hashes strings (str or bytes) of one field into uint64, vectorised.

  FNV-1a over the UTF-8 bytes, seeded by the field's name, finished by splitmix64: the same
  value in two fields gets two unrelated ids, and the result does not depend on the batch.
  """
  if not isinstance(values, np.ndarray) and len(values) and max(map(len, values)) > _LONG:
    # A numpy array of these would be as wide as the longest value for every value.
    lengths = [len(v) for v in values]
    out = np.empty(len(values), np.uint64)
    short = [i for i, n in enumerate(lengths) if n <= _LONG]
    out[short] = hash_strings([values[i] for i in short], field) if short else []
    for i in (i for i, n in enumerate(lengths) if n > _LONG):
      v = values[i]
      out[i] = _fnv(np.frombuffer(v.encode() if isinstance(v, str) else bytes(v), np.uint8)[None], field)[0]
    return out
  arr = np.asarray(values) if len(values) else np.zeros(0, np.bytes_)
  if arr.dtype.kind == "U" and arr.dtype.itemsize:
    # ASCII text: a numpy str array holds the code points (= the UTF-8 bytes) as NUL-padded
    # uint32, so the same FNV runs without encoding each value in Python.
    code = np.ascontiguousarray(arr).view(np.uint32).reshape(arr.shape[0], -1)
    if code.max() < 128:
      return _fnv(code, field)
  if arr.dtype.kind != "S":
    arr = np.asarray([v.encode() if isinstance(v, str) else bytes(v) for v in values], dtype=np.bytes_)
  n = arr.shape[0]
  if n == 0 or arr.dtype.itemsize == 0:
    return splitmix64(np.full(n, name_seed(field), np.uint64))
  return _fnv(np.frombuffer(arr.tobytes(), np.uint8).reshape(n, arr.dtype.itemsize), field)


_LONG = 1024
"""Values longer than this are hashed one by one: the vectorised FNV loops over columns, which
for a chunk with one 200 kB value meant 200k numpy calls (seconds) instead of one pass over it."""
_MASK64 = (1 << 64) - 1


def _fnv(code: np.ndarray, field: str) -> np.ndarray:
  """FNV-1a over the columns of ``code`` [n, width] (0 = padding, skipped), then splitmix64."""
  seed = name_seed(field)
  h = np.full(code.shape[0], seed, np.uint64)
  if code.shape[1] > _LONG:
    nonzero = code != 0
    length = np.where(nonzero.any(axis=1), code.shape[1] - np.argmax(nonzero[:, ::-1], axis=1), 0)
    for i in np.flatnonzero(length > _LONG):
      x = int(seed)
      for c in code[i, : length[i]].tolist():
        if c:
          x = ((x ^ c) * 0x100000001B3) & _MASK64
      h[i] = x
    short = np.flatnonzero(length <= _LONG)
    h[short] = _fnv_columns(code[short, :_LONG], h[short])
    return splitmix64(h)
  return splitmix64(_fnv_columns(code, h))


def _fnv_columns(code: np.ndarray, h: np.ndarray) -> np.ndarray:
  """FNV-1a of every row of ``code`` from ``h``, one column at a time (all rows at once)."""
  for j in range(code.shape[1]):  # NUL padding of shorter strings is skipped (text has no NUL bytes)
    col = code[:, j].astype(np.uint64)
    h = np.where(col != 0, (h ^ col) * _FNV_PRIME, h)
  return h


def hash_ints(values: np.ndarray, field: str) -> np.ndarray:
  """Hashes integer values of one field into uint64 (a bijection per field)."""
  v = np.asarray(values).astype(np.int64).view(np.uint64)
  return splitmix64(v ^ name_seed(field))


def log1p_dense(x: np.ndarray) -> np.ndarray:
  """The usual dense preprocessing: log(1 + max(x, 0)), as float32."""
  return np.log1p(np.maximum(np.asarray(x, np.float64), 0.0)).astype(np.float32)


def empty_columns(schema: Schema) -> Columns:
  """Columns with zero records (what a chunk of only bad records parses to)."""
  return {
    "label": np.zeros((0,), np.float32),
    "dense": np.zeros((0, schema.num_dense), np.float32),
    "sparse": {f.name: np.zeros((0, f.max_len), np.uint64) for f in schema.features},
    "sparse_weights": {f.name: np.zeros((0, f.max_len), np.float32) for f in schema.features if f.max_len > 1},
  }


def concat_columns(parts: Sequence[Columns]) -> Columns:
  """Concatenates columns along the record axis (the parts share features)."""
  out: Columns = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k not in ("sparse", "sparse_weights")}
  if all(isinstance(p["sparse"], Gathered) for p in parts):  # still not gathered (``take_records``)
    out["sparse"] = Gathered.concat([p["sparse"] for p in parts])
  else:
    out["sparse"] = {f: np.concatenate([p["sparse"][f] for p in parts]) for f in parts[0]["sparse"]}
  weights = parts[0].get("sparse_weights") or {}
  if weights:
    out["sparse_weights"] = {f: np.concatenate([p["sparse_weights"][f] for p in parts]) for f in weights}
  return out


def take_records(cols: Columns, index: np.ndarray) -> Columns:
  """Records ``index`` (an int array) of every column, the sparse ids as a ``Gathered``: not
  copied out here but where they are used (the dedup reads them from ``cols``). The columns of
  ``cols`` must not change while the result is in use."""
  out = take_columns({k: v for k, v in cols.items() if k != "sparse"}, index)
  out["sparse"] = Gathered([(cols["sparse"], np.asarray(index, np.int64))])
  return out


def take_columns(cols: Columns, index: Union[np.ndarray, slice]) -> Columns:
  """Selects records ``index`` (an int array or slice) of every column."""
  if isinstance(index, slice):
    take = lambda v: v[index]  # noqa: E731 - views
  else:  # np.take copies rows of a 2-d array 2 to 4x faster than v[index] does
    index = np.asarray(index)
    if index.dtype == bool:
      index = np.flatnonzero(index)
    take = lambda v: np.take(v, index, axis=0)  # noqa: E731
  out: Columns = {k: take(v) for k, v in cols.items() if k not in ("sparse", "sparse_weights")}
  if "sparse" in cols:
    out["sparse"] = {f: take(v) for f, v in cols["sparse"].items()}
  if cols.get("sparse_weights"):
    out["sparse_weights"] = {f: take(v) for f, v in cols["sparse_weights"].items()}
  return out


def num_records(cols: Columns) -> int:
  return int(cols["label"].shape[0])


def multi_hot(tokens: Sequence[Sequence[Any]], field: str, max_len: int) -> Tuple[np.ndarray, np.ndarray]:
  """Hashes bags of tokens into ``(ids uint64 [n, max_len], weights float32 [n, max_len])``.

  Bags longer than ``max_len`` keep their first ``max_len`` tokens; padding has weight 0.
  """
  n = len(tokens)
  ids = np.zeros((n, max_len), np.uint64)
  w = np.zeros((n, max_len), np.float32)
  lens = np.fromiter((min(len(t), max_len) for t in tokens), np.int64, n)
  flat = [tok for t in tokens for tok in list(t)[:max_len]]
  if flat:
    h = hash_strings(flat, field)
    rows = np.repeat(np.arange(n), lens)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
    ids[rows, cols] = h
    w[rows, cols] = 1.0
  return ids, w


def read_all(fmt: Format, source: str, bad: Optional[BadRecords] = None, chunk_records: int = 1 << 16) -> Columns:
  """Every record of one source, parsed in file order (small files, tests, baselines).

  Args:
    fmt: the format.
    source: a path (or a name the format understands, e.g. MovieLens's 'train').
    bad: the bad-record policy (default: 'error').
    chunk_records: records per chunk.

  Returns:
    The columns of all good records.
  """
  bad = bad if bad is not None else BadRecords("error")
  parts = [fmt.parse(chunk, bad) for chunk in fmt.chunks(source, chunk_records)]
  return concat_columns(parts) if parts else empty_columns(fmt.schema)
