"""Generic CSV and Parquet click logs: declared columns become a label, dense and sparse features.

``TabularFormat`` reads files whose columns are named (a CSV header line, or the Parquet
schema) and turns the columns the config declares into the reader contract of
``recsys_jax.data.base``: a binary label, dense features (log1p or raw), one-hot categorical
features, multi-hot bags (kind ``'pooled'``) and ordered sequences (kind ``'sequence'``).

Values are hashed through their text form (``hash_strings`` of the string), so the integer 123 in
a Parquet column and the text ``123`` in a CSV file give the same id; an empty or null value gets
the field's own missing id (the hash of the empty string).

CSV records are single physical lines (so that line numbers stay exact and a file can be cut into
chunks without parsing): a quoted field may hold the delimiter and doubled quotes, as in Python's
``csv`` module, but not a newline; a line that leaves a quote open is reported as a bad record
and the lines after it are read as records of their own.
"""

from __future__ import annotations

import csv
import operator
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from recsys_jax.data import base, csv_lines
from recsys_jax.data.csv_lines import floats as _floats

FILE_TYPES = ("csv", "parquet")
DENSE_TRANSFORMS = ("log1p", "none")
_FLOAT32_MAX = float(np.finfo(np.float32).max)


# One fault of one record: (its index in the chunk, or its line number; field; why).
Fault = Tuple[int, str, str]


class _Bag:
  """A multi-hot or sequence column: where it is, how to split it, how many ids to keep."""

  def __init__(self, spec: Sequence[Any], kind: str):
    if len(spec) not in (3, 4):
      raise ValueError(f"{kind} column spec {tuple(spec)!r}: expected (column, separator, max_len[, table])")
    self.column, self.separator, max_len = str(spec[0]), str(spec[1]), spec[2]
    self.table: Optional[str] = str(spec[3]) if len(spec) == 4 and spec[3] else None
    if not self.separator:
      raise ValueError(f"{kind} column {self.column!r}: the separator must not be empty")
    if int(max_len) != max_len or max_len < 2:
      # max_len 1 would need weights to mark an empty bag, which base's one-hot features lack.
      raise ValueError(f"{kind} column {self.column!r}: max_len {max_len!r} must be an integer >= 2 (use categorical)")
    self.max_len = int(max_len)
    self.kind = kind
    # Ids of a bag that shares a table with another feature must be hashed like that feature's.
    self.hash_field = self.table or self.column


class TabularFormat:
  """Named columns of CSV or Parquet files as label, dense, categorical, multi-hot and sequence features.

  Feature names are column names. Dense values that are empty or null count as 0 (Criteo's
  convention); a dense value that is not a finite number makes the record bad. Multi-hot bags keep
  their first ``max_len`` tokens; sequences keep their last ``max_len`` tokens (the most recent) in
  order. Both are padded at the end with weight 0; empty tokens (``a||b``, a trailing separator) are
  dropped, so an empty value is an empty bag. A fourth element of a multi-hot or sequence spec
  names a table the feature shares (e.g. a history of items and the ``item`` column): its ids are
  then hashed as that table's field's, and its ``FeatureInfo`` reads it.
  """

  def __init__(
    self,
    *,
    file_type: str = "csv",
    label: str,
    label_threshold: Optional[float] = None,
    dense: Sequence[str] = (),
    dense_transform: str = "log1p",
    categorical: Sequence[str] = (),
    multi_hot: Sequence[Sequence[Any]] = (),
    sequence: Sequence[Sequence[Any]] = (),
    delimiter: str = ",",
  ):
    """Declares the columns to read.

    Args:
      file_type: ``'csv'`` (plain or ``.gz``, with a header line) or ``'parquet'``.
      label: the label column.
      label_threshold: the label is ``value >= label_threshold``; None: the value must be 0 or 1.
      dense: dense feature columns, in the order of the dense vector.
      dense_transform: ``'log1p'`` (log(1 + max(x, 0))) or ``'none'``.
      categorical: one-hot categorical columns.
      multi_hot: ``(column, separator, max_len[, table])`` per multi-hot bag column.
      sequence: ``(column, separator, max_len[, table])`` per sequence column (order kept).
      delimiter: the CSV field delimiter (one character).
    """
    if file_type not in FILE_TYPES:
      raise ValueError(f"file_type {file_type!r}: choose one of {FILE_TYPES}")
    if dense_transform not in DENSE_TRANSFORMS:
      raise ValueError(f"dense_transform {dense_transform!r}: choose one of {DENSE_TRANSFORMS}")
    if len(delimiter) != 1:
      raise ValueError(f"delimiter {delimiter!r} must be one character")
    self.file_type, self.label, self.delimiter = file_type, str(label), delimiter
    self.label_threshold = None if label_threshold is None else float(label_threshold)
    self.dense = tuple(str(c) for c in dense)
    self.dense_transform = dense_transform
    self.categorical = tuple(str(c) for c in categorical)
    self.bags = tuple(_Bag(s, "multi_hot") for s in multi_hot) + tuple(_Bag(s, "sequence") for s in sequence)

    features = [base.FeatureInfo(c, 1, "pooled") for c in self.categorical]
    for b in self.bags:
      features.append(base.FeatureInfo(b.column, b.max_len, "pooled" if b.kind == "multi_hot" else "sequence", b.table))
    names = [f.name for f in features]
    used = [self.label, *self.dense, *names]
    dup = sorted({c for c in used if used.count(c) > 1})
    if dup:
      raise ValueError(f"column(s) {dup} declared more than once (label, dense and features must be distinct)")
    self.columns = tuple(used)
    self.schema = base.Schema(num_dense=len(self.dense), features=tuple(features))
    # CSV header layouts by path; filled by chunks(), or lazily by parse() in another process.
    self._layouts: Dict[str, Tuple[int, Tuple[int, ...]]] = {}

  def cache_params(self) -> Dict[str, Any]:
    """What the parsed columns depend on besides the code (for ``recsys_jax.data.cache``)."""
    return {
      "file_type": self.file_type,
      "label": self.label,
      "label_threshold": self.label_threshold,
      "dense": list(self.dense),
      "dense_transform": self.dense_transform,
      "categorical": list(self.categorical),
      "bags": [[b.column, b.separator, b.max_len, b.table, b.kind] for b in self.bags],
      "delimiter": self.delimiter,
    }

  # -------------------------------------------------------------------------------------------
  # Cutting files into raw chunks.

  def chunks(self, path: str, chunk_records: int) -> Iterator[base.RawChunk]:
    """Cuts ``path`` into raw chunks of ``chunk_records`` records (the last may be shorter).

    Args:
      path: a CSV file (plain or ``.gz``) or a Parquet file, as ``file_type`` says.
      chunk_records: records per chunk.

    Returns:
      An iterator of raw chunks; for CSV, lines after the header with exact 1-based line numbers;
      for Parquet, pyarrow tables of the declared columns with 1-based row numbers.

    Raises:
      ValueError: a declared column is not in the file (the message lists the available ones).
    """
    if chunk_records < 1:
      raise ValueError(f"chunk_records {chunk_records} must be >= 1")
    if self.file_type == "csv":
      self._layouts[path] = self._read_layout(path)
      return base.text_chunks(path, chunk_records, header_lines=1)
    return self._parquet_chunks(path, chunk_records)

  def _missing_columns_error(self, path: str, available: Sequence[str]) -> ValueError:
    missing = [c for c in self.columns if c not in available]
    return ValueError(
      f"{path}: declared column(s) {missing} not found in the file (config.data names columns); "
      f"available columns: {list(available)}"
    )

  def _read_layout(self, path: str) -> Tuple[int, Tuple[int, ...]]:
    """(number of fields, index of each declared column) from a CSV file's header line."""
    raw = base.first_line(path)
    if not raw:
      raise ValueError(f"{path}: empty file, expected a header line naming the columns")
    try:
      header = next(csv.reader([raw.decode("utf-8-sig").rstrip("\r\n")], delimiter=self.delimiter), [])
    except (UnicodeDecodeError, csv.Error) as e:
      raise ValueError(f"{path}:1: the header line is not UTF-8 CSV ({e})") from None
    header = [h.strip() for h in header]
    if any(c not in header for c in self.columns):
      raise self._missing_columns_error(path, header)
    twice = sorted({c for c in self.columns if header.count(c) > 1})
    if twice:
      raise ValueError(f"{path}: declared column(s) {twice} appear more than once in the header {header}")
    return len(header), tuple(header.index(c) for c in self.columns)

  def _parquet_chunks(self, path: str, chunk_records: int) -> Iterator[base.RawChunk]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
      pf = pq.ParquetFile(path)
      names = pf.schema_arrow.names
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # not Parquet, cut short, a damaged footer or name
      raise ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {base.one_line(e)})") from None
    if any(c not in names for c in self.columns):
      raise self._missing_columns_error(path, names)

    def gen() -> Iterator[base.RawChunk]:
      # Some pyarrow versions stop batches at row-group ends: regroup so every chunk but the last is full.
      row, pending, held = 1, [], 0
      try:
        for batch in pf.iter_batches(batch_size=chunk_records, columns=list(self.columns)):
          pending.append(pa.Table.from_batches([batch]))
          held += batch.num_rows
          while held >= chunk_records:
            table = pa.concat_tables(pending)
            yield base.RawChunk(path, row, table.slice(0, chunk_records))
            row += chunk_records
            rest = table.slice(chunk_records)
            pending, held = ([rest] if rest.num_rows else []), rest.num_rows
      except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # a damaged page or row group
        raise ValueError(
          f"{path}: cannot be read after row {row + held - 1} ({type(e).__name__}: {base.one_line(e)})"
        ) from None
      if held:
        yield base.RawChunk(path, row, pa.concat_tables(pending))

    return gen()

  # -------------------------------------------------------------------------------------------
  # Parsing.

  def parse(self, chunk: base.RawChunk, bad: base.BadRecords) -> base.Columns:
    """Parses a raw chunk into columns; bad records go to ``bad`` and are dropped.

    Args:
      chunk: a raw chunk from ``chunks``.
      bad: the bad-record policy (raises on the first bad record under ``'error'``).

    Returns:
      Columns as ``recsys_jax.data.base`` defines them, in record order, bad records left out.
    """
    if self.file_type == "csv":
      lines, values, faults = self._csv_values(chunk)
    else:
      import pyarrow as pa

      try:
        lines, values, faults = self._parquet_values(chunk)
      except (pa.ArrowException, UnicodeDecodeError) as e:  # a type that does not convert, text that is not UTF-8
        raise ValueError(
          f"{chunk.path}: rows from {chunk.first_line}: {type(e).__name__}: {base.one_line(e)}"
        ) from None
    return self._assemble(chunk.path, lines, values, faults, bad)

  def _csv_values(self, chunk: base.RawChunk) -> Tuple[np.ndarray, Dict[str, Any], List[Fault]]:
    """Splits lines into fields; returns (line numbers, raw values per column, faults) of good rows."""
    layout = self._layouts.get(chunk.path)
    if layout is None:
      layout = self._layouts[chunk.path] = self._read_layout(chunk.path)
    num_fields, index = layout
    texts, faults = csv_lines.decode(chunk.payload)
    rows, row_faults = csv_lines.split_csv(texts, self.delimiter)
    faults += row_faults
    keep: List[int] = []
    for i, row in enumerate(rows):
      if row is None:
        continue
      if len(row) == num_fields:
        keep.append(i)
      elif row:  # blank lines are skipped, as csv.DictReader does
        faults.append((i, "<line>", f"wrong field count: {len(row)} fields, the header has {num_fields}"))
    good = rows if len(keep) == len(rows) else [rows[i] for i in keep]
    at = dict(zip(self.columns, index))
    values: Dict[str, Any] = {}
    # One 2-d str array for the numbers is ~4x faster than a list and an array per column; the
    # other columns go one at a time, so that one long text value widens one column's array only.
    numeric = [at[c] for c in (self.label, *self.dense)]
    if len(numeric) == 1:
      picked = [(row[numeric[0]],) for row in good]
    else:
      picked = list(map(operator.itemgetter(*numeric), good))
    block = np.array(picked, dtype=np.str_).reshape(len(good), len(numeric))
    for k, name in enumerate((self.label, *self.dense)):
      values[name] = _floats(block[:, k])
    for name in self.categorical:
      j = at[name]
      values[name] = np.asarray([row[j] for row in good], dtype=np.str_)
    for b in self.bags:
      j, sep = at[b.column], b.separator
      values[b.column] = [[t for t in row[j].split(sep) if t] for row in good]
    # Faults so far index the chunk's lines; the column checks index the kept rows.
    keep_arr = np.asarray(keep, np.int64)
    lines = chunk.first_line + keep_arr
    faults = [(chunk.first_line + i, f, why) for i, f, why in faults]
    return lines, values, faults

  def _parquet_values(self, chunk: base.RawChunk) -> Tuple[np.ndarray, Dict[str, Any], List[Fault]]:
    import pyarrow as pa
    import pyarrow.compute as pc

    table = chunk.payload
    n = table.num_rows
    values: Dict[str, Any] = {}
    for name in (self.label, *self.dense):
      col = table.column(name)
      if pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type):
        x = pc.cast(col, pa.float64(), safe=False).to_numpy(zero_copy_only=False)  # ints beyond 2**53 round
        missing = col.is_null().to_numpy(zero_copy_only=False)
        values[name] = (np.where(missing, 0.0, x), missing, [])
      else:
        values[name] = _floats(_as_strings(col))
    for name in self.categorical:
      values[name] = np.asarray(_as_strings(table.column(name)), dtype=np.str_)
    for b in self.bags:
      col = table.column(b.column)
      if pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type):
        bags = pc.cast(col, pa.list_(pa.string())).to_pylist()
        values[b.column] = [[t for t in bag if t] if bag else [] for bag in bags]
      else:
        sep = b.separator
        values[b.column] = [[t for t in v.split(sep) if t] for v in _as_strings(col)]
    return chunk.first_line + np.arange(n, dtype=np.int64), values, []

  def _assemble(
    self, path: str, lines: np.ndarray, values: Dict[str, Any], faults: List[Fault], bad: base.BadRecords
  ) -> base.Columns:
    """Checks label and dense values, reports the bad records in line order and builds the columns.

    ``faults`` already hold (line, field, why) of records that never got columns (CSV lines that
    did not split); ``lines`` gives the line of each record in ``values``.
    """
    n = len(lines)
    row_faults: List[Fault] = []  # (record index in values, field, why)
    # Missing and unparsable values hold 0 in x, so the value checks below pass them by.
    x, missing, invalid = values[self.label]
    row_faults += [(i, self.label, why) for i, why in invalid]
    row_faults += [(int(i), self.label, "missing label") for i in np.flatnonzero(missing)]
    finite = np.isfinite(x)
    row_faults += [(int(i), self.label, f"label {x[i]} is not a finite number") for i in np.flatnonzero(~finite)]
    if self.label_threshold is None:
      for i in np.flatnonzero(finite & (x != 0) & (x != 1)):
        row_faults.append((int(i), self.label, f"label {x[i]:g} is not 0 or 1 (set label_threshold to binarise)"))
      label = x == 1
    else:
      label = x >= self.label_threshold

    dense = np.zeros((n, len(self.dense)), np.float64)
    for j, name in enumerate(self.dense):
      d, _, invalid = values[name]  # empty or null: 0 (d holds 0 there)
      row_faults += [(i, name, why) for i, why in invalid]
      # Raw values go to float32: a finite float64 beyond its range would become inf there.
      out_of_range = ~np.isfinite(d) if self.dense_transform == "log1p" else ~(np.abs(d) <= _FLOAT32_MAX)
      for i in np.flatnonzero(out_of_range):
        row_faults.append((int(i), name, f"dense value {d[i]} is not a finite float32 number"))
      dense[:, j] = d  # non-finite values belong to bad records, dropped below

    # Report each bad record once (its first fault by column order), in line order, so that the
    # 'error' policy names the first bad line of the chunk.
    all_faults = faults + [(int(lines[i]), f, why) for i, f, why in row_faults]
    order = {c: k for k, c in enumerate(self.columns)}
    all_faults.sort(key=lambda t: (t[0], order.get(t[1], -1)))
    seen = set()
    for line, field, why in all_faults:
      if line not in seen:
        seen.add(line)
        bad.report(path, line, field, why)
    keep = np.ones(n, bool)
    keep[[i for i, _, _ in row_faults]] = False
    idx = np.flatnonzero(keep)

    out: base.Columns = {
      "label": label[idx].astype(np.float32),
      "dense": base.log1p_dense(dense[idx]) if self.dense_transform == "log1p" else dense[idx].astype(np.float32),
      "sparse": {},
      "sparse_weights": {},
    }
    kept = idx.tolist()  # Python ints: indexing lists with numpy ints is several times slower
    everything = len(kept) == n
    for name in self.categorical:
      strs = values[name]
      out["sparse"][name] = base.hash_strings(strs if everything else strs[idx], name).reshape(-1, 1)
    for b in self.bags:
      bags = values[b.column] if everything else [values[b.column][i] for i in kept]
      # Sequences keep their most recent (last) tokens; multi_hot() keeps the first max_len.
      toks = bags if b.kind == "multi_hot" else [t[-b.max_len :] for t in bags]
      ids, w = base.multi_hot(toks, b.hash_field, b.max_len)
      out["sparse"][b.column], out["sparse_weights"][b.column] = ids, w
    return out


# ---------------------------------------------------------------------------------------------
# Helpers.


def _as_strings(col: Any) -> List[str]:
  """An Arrow column as Python strings, null as '' (integers in decimal, as a CSV would hold them)."""
  import pyarrow as pa
  import pyarrow.compute as pc

  if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
    col = pc.cast(col, pa.string())
  return [v if v is not None else "" for v in col.to_pylist()]
