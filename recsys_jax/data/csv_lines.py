"""CSV lines of the generic tabular reader as fields: decoding, splitting, numbers.

Records are single physical lines (see ``recsys_jax.data.tabular``): a line that is not
UTF-8, does not split, leaves a quote open or holds a field longer than ``MAX_FIELD_CHARS`` is a
fault of that line alone.
"""

from __future__ import annotations

import csv
import itertools
from typing import Any, List, Optional, Tuple

import numpy as np

MAX_FIELD_CHARS = 4096
"""The longest field read: values become numpy str arrays as wide as their longest value, for a
whole chunk (8192 records x a 200 kB value would be 6.5 GB), so a longer one is a bad record.
A multi-hot or sequence field of this length still holds hundreds of ids."""


def decode(payload: List[bytes]) -> Tuple[List[str], List[Tuple[int, str, str]]]:
  """Lines as str; a line that is not UTF-8 becomes a fault (and an empty, skipped line)."""
  try:
    # Lines hold no newline, so one decode and split is exact (and faster than one per line).
    return b"\n".join(payload).decode("utf-8").split("\n") if payload else [], []
  except UnicodeDecodeError:
    texts, faults = [], []
    for i, raw in enumerate(payload):
      try:
        texts.append(raw.decode("utf-8"))
      except UnicodeDecodeError as e:
        texts.append("")
        faults.append((i, "<line>", f"not UTF-8 ({e.reason} at byte {e.start})"))
    return texts, faults


def split_csv(texts: List[str], delimiter: str) -> Tuple[List[Optional[List[str]]], List[Tuple[int, str, str]]]:
  """Splits each line into fields with the csv module; lines that do not split are faults (row None).

  csv.reader would join a line that leaves a quote open with the next one; we see that in
  ``line_num`` and restart the reader after the opening line, so that every record is one line.
  A blank sentinel line at the end makes an open quote on the last line show the same way.
  """
  m = len(texts)
  rows: List[Optional[List[str]]] = [None] * m
  faults: List[Tuple[int, str, str]] = []
  source = texts + [""]
  start = 0
  while start < m:
    reader = csv.reader(itertools.islice(source, start, None), delimiter=delimiter)
    i = start
    try:
      for row in reader:
        if i == m:  # the sentinel
          break
        if reader.line_num != i - start + 1:
          faults.append((i, "<line>", "a quoted field is not closed on its line (embedded newlines are not supported)"))
          break
        rows[i] = row
        i += 1
    except csv.Error as e:
      faults.append((i, "<line>", f"malformed CSV: {e}"))
    start = i + 1
  for i in range(m):  # only a line longer than the limit can hold a field longer than it
    if rows[i] is not None and len(texts[i]) > MAX_FIELD_CHARS:
      longest = max(range(len(rows[i])), key=lambda k: len(rows[i][k]))
      if len(rows[i][longest]) > MAX_FIELD_CHARS:
        why = f"field {longest + 1} has {len(rows[i][longest])} characters, more than {MAX_FIELD_CHARS}"
        faults.append((i, "<line>", why))
        rows[i] = None
  return rows, faults


def floats(values: Any) -> Tuple[np.ndarray, np.ndarray, List[Tuple[int, str]]]:
  """Parses decimal strings (a sequence or a numpy str array) as Python's float() does.

  Returns:
    (values float64 with 0 where empty or invalid, empty mask, [(index, why)] of invalid values).
  """
  n = len(values)
  if n == 0:
    return np.zeros(0), np.zeros(0, bool), []
  arr = np.asarray(values, dtype=np.str_)
  empty = arr == ""
  try:
    # numpy's str -> float cast accepts exactly what float() does (checked in the tests), in C.
    return np.where(empty, "0", arr).astype(np.float64), empty, []
  except ValueError:
    pass
  x = np.zeros(n)
  invalid: List[Tuple[int, str]] = []
  for i, v in enumerate(arr.tolist()):
    if v:
      try:
        x[i] = float(v)
      except ValueError:
        invalid.append((i, f"not a number: {v[:40]!r}"))
  return x, empty, invalid
