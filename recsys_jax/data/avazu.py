"""Reader for the Avazu click-through-rate data (Kaggle, 2014): a CSV file with a header line.

The published training file (``train``, often gzipped) starts with the header::

    id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,
    app_category,device_id,device_ip,device_model,device_type,device_conn_type,C14,..,C21

then one record per line, comma-separated, never quoted. The Kaggle ``test`` file has no
``click`` column and is refused by the header check.

Preprocessing (what ``AvazuFormat.parse`` returns):

- ``label`` = ``click`` (0 or 1); ``dense`` has no columns; ``id`` is dropped (unique per row).
- ``hour`` (YYMMDDHH, the year being 20YY) is replaced by two categorical features:
  ``hour_of_day`` = ``base.hash_ints(HH, 'hour_of_day')`` and ``weekday`` =
  ``base.hash_ints(d, 'weekday')`` with d = 0 for Monday .. 6 for Sunday (``date.weekday()``).
  The raw hour is not kept as a feature: its values never recur after the training period.
- Every other column is a categorical feature named after its column, one id per record:
  ``base.hash_strings([value], column)`` over the value's bytes as written (so ``'1005'`` and
  ``'01005'`` differ). An empty value is hashed like any other string (the empty string),
  giving one stable id per column; the published data has none.

Bad records (reported to ``base.BadRecords`` under these field names): a line without
exactly 24 fields (``'num_fields'``), a ``click`` other than ``0``/``1`` (``'click'``), an
``hour`` that is not 8 digits making a real date and an hour 00-23 (``'hour'``). A file whose
header differs from the one above raises ``HeaderError`` naming the file and the first
differing column, whatever the bad-record policy.

A chunk whose lines are all well formed is parsed by a compiled kernel
(``recsys_jax.data.text_kernels``, one pass, no GIL held); one with a bad line by
``AvazuFormat.parse_numpy``, vectorised with the helpers of ``recsys_jax.data.criteo``,
which finds and reports them. Both give the same columns bit for bit.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import numpy as np

from recsys_jax.data import base, criteo, text_kernels

HEADER = (
  "id",
  "click",
  "hour",
  "C1",
  "banner_pos",
  "site_id",
  "site_domain",
  "site_category",
  "app_id",
  "app_domain",
  "app_category",
  "device_id",
  "device_ip",
  "device_model",
  "device_type",
  "device_conn_type",
  "C14",
  "C15",
  "C16",
  "C17",
  "C18",
  "C19",
  "C20",
  "C21",
)
_CLICK, _HOUR = HEADER.index("click"), HEADER.index("hour")
_HASHED = slice(_HOUR + 1, len(HEADER))
HASHED_COLUMNS = HEADER[_HASHED]
"""The columns hashed as they are, in file order."""
_EPOCH_WEEKDAY = 3  # 1970-01-01 was a Thursday (Monday = 0)


class HeaderError(ValueError):
  """A file whose header is not the Avazu header; the message names the file and column."""


def check_header(path: str) -> None:
  """Raises ``HeaderError`` unless ``path`` starts with the Avazu header line.

  Args:
    path: an Avazu CSV file, plain or ``.gz``.
  """
  line = base.first_line(path)
  if not line:
    raise HeaderError(f"{path}: empty file, expected the Avazu header {','.join(HEADER)!r}")
  got = line.rstrip(b"\r\n").decode("utf-8", errors="replace").split(",")
  for i, want in enumerate(HEADER):
    if i >= len(got):
      raise HeaderError(f"{path}: header has {len(got)} columns; column {i + 1} should be {want!r}")
    if got[i] != want:
      raise HeaderError(f"{path}: header column {i + 1} is {got[i]!r}, expected {want!r}")
  if len(got) > len(HEADER):
    raise HeaderError(f"{path}: header has an extra column {len(HEADER) + 1}, {got[len(HEADER)]!r}")


class AvazuFormat:
  """The Avazu CTR CSV (see the module docstring)."""

  def __init__(self):
    self.names = ("hour_of_day", "weekday") + HASHED_COLUMNS
    self.schema = base.Schema(0, tuple(base.FeatureInfo(name) for name in self.names))

  def cache_params(self) -> Dict[str, Any]:
    """What the parsed columns depend on besides the code (nothing: Avazu has no parameters)."""
    return {}

  def chunks(self, path: str, chunk_records: int) -> Iterator[base.RawChunk]:
    """Checks the header, then cuts the records of ``path`` into chunks of ``chunk_records``.

    Args:
      path: an Avazu CSV file, plain or ``.gz``.
      chunk_records: lines per chunk (the last may be shorter).

    Returns:
      An iterator of raw chunks; the first record is line 2. It raises ``HeaderError``
      when iteration starts, if the header differs.
    """
    check_header(path)
    yield from base.text_chunks(path, chunk_records, header_lines=1)

  def parse(self, chunk: base.RawChunk, bad: base.BadRecords) -> base.Columns:
    """Parses a chunk of lines into columns; bad lines are reported and dropped.

    Args:
      chunk: consecutive records of an Avazu file.
      bad: the bad-record policy.

    Returns:
      Columns of the good lines, in file order.
    """
    lines = chunk.payload
    if not lines:
      return base.empty_columns(self.schema)
    fast = text_kernels.avazu_columns(b"\n".join(lines + [b""]), len(lines), self.names)
    if fast is None:  # some line is bad: the numpy path finds and reports them all
      return self.parse_numpy(chunk, bad)
    label, ids = fast
    return {
      "label": label,
      "dense": np.zeros((len(lines), 0), np.float32),
      "sparse": {name: ids[j][:, None] for j, name in enumerate(self.names)},
      "sparse_weights": {},
    }

  def parse_numpy(self, chunk: base.RawChunk, bad: base.BadRecords) -> base.Columns:
    """``parse`` with numpy alone: the path for chunks with bad lines, and the reference the kernel is tested on."""
    lines = chunk.payload
    if not lines:
      return base.empty_columns(self.schema)
    split = criteo.split_fields(lines, b",", len(HEADER))
    fault_col = np.full(split.rows.shape[0], criteo.NO_FAULT, np.int64)

    label, label_bad = criteo.parse_label(split, _CLICK)
    fault_col = criteo.first_fault(fault_col, slice(_CLICK, _CLICK + 1), label_bad[:, None])
    hour_of_day, weekday, hour_bad = parse_hour(split, _HOUR)
    fault_col = criteo.first_fault(fault_col, slice(_HOUR, _HOUR + 1), hour_bad[:, None])
    ids = criteo.hash_fields(split, _HASHED, HASHED_COLUMNS)

    faults = [
      (int(r), "num_fields", f"expected {len(HEADER)} comma-separated fields, got {int(c)}")
      for r, c in zip(split.bad_rows, split.bad_counts)
    ]
    for i in np.flatnonzero(fault_col != criteo.NO_FAULT):
      faults.append((int(split.rows[i]), *_why(split, int(i), int(fault_col[i]))))
    criteo.report_faults(bad, chunk.path, chunk.first_line, faults)

    keep = fault_col == criteo.NO_FAULT
    sparse = {
      "hour_of_day": base.hash_ints(hour_of_day[keep], "hour_of_day")[:, None],
      "weekday": base.hash_ints(weekday[keep], "weekday")[:, None],
    }
    sparse.update(criteo.columns_of(ids[keep], HASHED_COLUMNS))
    return {
      "label": label[keep],
      "dense": np.zeros((int(keep.sum()), 0), np.float32),
      "sparse": sparse,
      "sparse_weights": {},
    }


def _why(split: criteo.FieldSplit, i: int, col: int) -> Tuple[str, str]:
  value = criteo.show(split.value(i, col))
  if col == _CLICK:
    return "click", f"click must be 0 or 1, got {value}"
  return "hour", f"not YYMMDDHH (a real date 20YY-MM-DD, hour 00-23): {value}"


def parse_hour(split: criteo.FieldSplit, col: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Reads a YYMMDDHH column into hour of day and weekday.

  Args:
    split: the located fields.
    col: the column of the hour.

  Returns:
    ``(hour_of_day int64 [m], weekday int64 [m] (Monday = 0), bad bool [m])``; bad where the
    field is not 8 digits, or not a real date of 2000-2099 with an hour 00-23.
  """
  x, _ = criteo.field_words(split, slice(col, col + 1))
  x = x[:, 0]
  all_digits = criteo.lanes_between(x, 0x30, 0x39) == criteo.HIGH_BITS
  digit = [((x >> np.uint64(8 * (7 - k))) & np.uint64(0x0F)).astype(np.int64) for k in range(8)]
  yy, mm, dd, hh = (10 * digit[k] + digit[k + 1] for k in range(0, 8, 2))
  month = (2000 - 1970 + yy) * 12 + np.clip(mm, 1, 12) - 1
  first_day = month.astype("datetime64[M]").astype("datetime64[D]").astype(np.int64)
  next_first = (month + 1).astype("datetime64[M]").astype("datetime64[D]").astype(np.int64)
  valid = (split.lens[:, col] == 8) & all_digits & (mm >= 1) & (mm <= 12) & (dd >= 1) & (dd <= next_first - first_day)
  valid &= hh <= 23
  weekday = (first_day + dd - 1 + _EPOCH_WEEKDAY) % 7
  return hh, weekday, ~valid
