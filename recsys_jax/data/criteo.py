"""Reader for the Criteo click logs: the Kaggle Display Advertising Challenge and the Terabyte logs.

Both publish one record per line, tab-separated, no header (Kaggle ``train.txt``; Terabyte
``day_0`` .. ``day_23``, plain or ``.gz``)::

    label \\t I1 .. I13 \\t C1 .. C26

``label`` is 0 or 1; ``I1..I13`` are integers, possibly negative, possibly empty; ``C1..C26``
are 8-hex-digit strings (hashes published by Criteo), possibly empty. The Kaggle ``test.txt``
has no label column and is not read by this format.

Preprocessing (what ``CriteoFormat.parse`` returns):

- ``dense[:, i] = log(1 + max(I, 0))`` (``base.log1p_dense``). A missing value becomes 0,
  the same as a value of 0 or a negative one: the model gets no separate "missing" signal for
  dense features, which is the usual DLRM/DCN preprocessing of these logs.
- ``sparse['Cj'][:, 0] = base.hash_ints(int(value, 16), 'Cj')``: the hex string is read as an
  integer (1 to 8 hex digits, either case, so ``'0A'`` and ``'0a'`` are one value) and hashed
  per field, so the same value in two fields gets two unrelated ids.
- A missing categorical gets ``base.hash_ints(-1, 'Cj')``, one stable id per field. It can
  never equal the id of a present value of that field: ``hash_ints`` is a bijection per field
  and -1 is outside the range [0, 2**32) of 8-hex-digit values.

Bad records (reported to ``base.BadRecords`` under these field names): a line without
exactly ``1 + num_dense + num_categorical`` fields (``'num_fields'``), a label other than
``0``/``1`` (``'label'``), a dense value that is not an optionally signed decimal integer of at
most 32 characters (``'I5'``), a categorical that is not 1 to 8 hex digits (``'C7'``). A line
with several faults is reported once, for the first of them in that order.

A chunk is parsed by a compiled kernel (``recsys_jax.data.text_kernels``: one pass over its
bytes, no GIL held; ``experiments/bench_readers.py`` times it against numpy) when every line in
it is well formed; a chunk with a bad line goes to ``CriteoFormat.parse_numpy``, which finds
and reports them. The kernel's columns are bit for bit those of ``parse_numpy``, the reference.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np

from recsys_jax.data import base, text_kernels
from recsys_jax.hashing import name_seed, splitmix64

_NEWLINE = 10
_PAD = 64
"""Zero bytes before a chunk's first line, so that a word ending up to this many bytes before a
field's end lies inside the buffer; it bounds the values ``hash_fields`` does in bulk."""
_MAX_DENSE_CHARS = 32
_MAX_HEX_DIGITS = 8
NO_FAULT = np.iinfo(np.int64).max
_FNV_PRIME = np.uint64(0x100000001B3)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
HIGH_BITS = np.uint64(0x8080808080808080)
_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_INT_RE = re.compile(rb"[+-]?[0-9]+")


def _lanes(byte: int) -> np.uint64:
  """``byte`` repeated in the 8 byte lanes of a uint64."""
  return np.uint64(byte * 0x0101010101010101)


def lanes_between(x: np.ndarray, a: int, b: int) -> np.ndarray:
  """0x80 in each byte lane of ``x`` with a <= lane <= b (ASCII bounds; non-ASCII lanes: 0)."""
  y = x & _LOW7
  ge = y | HIGH_BITS
  ge -= _lanes(a)  # lane >= a keeps its high bit
  np.subtract(_lanes(b | 0x80), y, out=y)  # lane <= b keeps its high bit
  y &= ge
  y &= ~x
  y &= HIGH_BITS
  return y


# ---------------------------------------------------------------------------------------------
# Delimited text, vectorised (shared with the Avazu reader).


@dataclasses.dataclass
class FieldSplit:
  """The fields of a chunk of delimited lines, located in one byte buffer."""

  buf: np.ndarray
  """uint8: ``_PAD`` zero bytes, then the lines each followed by ``\\n``."""
  rows: np.ndarray
  """int64 [m]: index in the chunk of each line with the expected number of fields."""
  ends: np.ndarray
  """int64 [m, num_fields]: one past the last byte of each field of those lines."""
  lens: np.ndarray
  """int64 [m, num_fields]: length of each field in bytes."""
  bad_rows: np.ndarray
  """int64: index of each line with another number of fields."""
  bad_counts: np.ndarray
  """int64: the number of fields of each of those lines."""

  def value(self, i: int, col: int) -> bytes:
    """The bytes of field ``col`` of well-formed line ``i`` (an index into ``rows``)."""
    e = int(self.ends[i, col])
    return self.buf[e - int(self.lens[i, col]) : e].tobytes()


def split_fields(lines: Sequence[bytes], sep: bytes, num_fields: int) -> FieldSplit:
  """Locates the ``sep``-separated fields of ``lines`` (which hold no newline).

  Args:
    lines: the records of a chunk, without line terminators.
    sep: the one-byte field separator.
    num_fields: the number of fields a well-formed line has.

  Returns:
    A ``FieldSplit``; lines with another number of fields are listed in ``bad_rows``.
  """
  n = len(lines)
  text = np.frombuffer(b"\n".join(lines), np.uint8)
  buf = np.zeros(_PAD + text.shape[0] + 1, np.uint8)
  buf[_PAD:-1] = text
  buf[-1] = _NEWLINE
  pos = np.flatnonzero((buf == sep[0]) | (buf == _NEWLINE))
  lens = np.empty_like(pos)
  lens[0] = pos[0] - _PAD
  np.subtract(pos[1:], pos[:-1] + 1, out=lens[1:])
  is_newline = buf[pos] == _NEWLINE
  # There are exactly n newlines; if every num_fields-th delimiter is one, every line is whole.
  if pos.shape[0] == n * num_fields and is_newline[num_fields - 1 :: num_fields].all():
    ok = np.ones(n, bool)
    ends, lens = pos.reshape(n, num_fields), lens.reshape(n, num_fields)
    counts = np.zeros(0, np.int64)
  else:
    line_of = np.cumsum(is_newline) - is_newline  # the newlines before a delimiter count its line
    counts = np.bincount(line_of, minlength=n)
    ok = counts == num_fields
    keep = ok[line_of]
    ends, lens = pos[keep].reshape(-1, num_fields), lens[keep].reshape(-1, num_fields)
  bad_rows = np.flatnonzero(~ok)
  return FieldSplit(buf, np.flatnonzero(ok), ends, lens, bad_rows, counts[bad_rows])


def field_words(split: FieldSplit, cols: slice, word: int = 0) -> Tuple[np.ndarray, np.ndarray]:
  """Bytes ``[end - 8 (word + 1), end - 8 word)`` of fields ``cols``, as big-endian uint64.

  Word 0 holds a field's last 8 bytes, right-aligned: its last byte is the lowest lane, so a
  number's digits have the same place value in every row whatever its length.

  Args:
    split: the located fields.
    cols: the columns, a slice.
    word: which 8 bytes, counting back from the field's end; ``8 (word + 1) <= _PAD``.

  Returns:
    ``(x, mask)``: uint64 [m, k] with the lanes outside the field zeroed, and the mask of the
    lanes inside it.
  """
  assert 8 * (word + 1) <= _PAD, word
  words = np.ndarray((split.buf.shape[0] - 7,), ">u8", split.buf, 0, (1,))
  x = words[split.ends[:, cols] - 8 * (word + 1)].astype(np.uint64)
  # In-place arithmetic from here on: fresh arrays of this size each cost page faults.
  shift = np.clip(split.lens[:, cols], 8 * word, 8 * word + 8).astype(np.uint64)
  np.subtract(np.uint64(8 * word + 8), shift, out=shift)
  np.left_shift(shift, np.uint64(3), out=shift)  # 8 * (lanes outside the field), up to 64 ...
  half = shift >> np.uint64(1)
  np.subtract(shift, half, out=shift)
  mask = np.right_shift(_ALL, half, out=half)  # ... so two shifts, as x >> 64 is undefined
  np.right_shift(mask, shift, out=mask)
  np.bitwise_and(x, mask, out=x)
  return x, mask


def hash_fields(split: FieldSplit, cols: slice, names: Sequence[str]) -> np.ndarray:
  """Hashes fields ``cols`` of every well-formed line; equal to ``base.hash_strings(values, name)``.

  Args:
    split: the located fields.
    cols: the columns, a slice.
    names: the feature name of each column, which seeds its hash.

  Returns:
    uint64 [m, k] ids.
  """
  lens = split.lens[:, cols]
  seeds = np.asarray([name_seed(name) for name in names], np.uint64)
  h = np.broadcast_to(seeds, lens.shape).copy()
  num_words = -(-int(min(lens.max(initial=0), _PAD)) // 8)
  for word in reversed(range(num_words)):  # the farthest word holds the first bytes
    x, _ = field_words(split, cols, word)
    for lane in range(8):  # FNV-1a, highest lane first, skipping NUL padding as hash_strings does
      b = (x >> np.uint64(8 * (7 - lane))) & np.uint64(0xFF)
      h = np.where(b != 0, (h ^ b) * _FNV_PRIME, h)
  ids = splitmix64(h)
  for i, j in zip(*np.nonzero(lens > _PAD)):  # rare: longer than the words read in bulk
    ids[i, j] = base.hash_strings([split.value(int(i), cols.start + int(j))], names[j])[0]
  return ids


def parse_label(split: FieldSplit, col: int) -> Tuple[np.ndarray, np.ndarray]:
  """Reads a 0/1 label column.

  Args:
    split: the located fields.
    col: the label's column.

  Returns:
    ``(label float32 [m], bad bool [m])``: bad where the field is not exactly ``0`` or ``1``.
  """
  last = split.buf[split.ends[:, col] - 1]
  bad = (split.lens[:, col] != 1) | ((last != ord("0")) & (last != ord("1")))
  return (last == ord("1")).astype(np.float32), bad


def parse_ints(split: FieldSplit, cols: slice) -> Tuple[np.ndarray, np.ndarray]:
  """Reads columns of optionally signed decimal integers; an empty field reads as 0.

  Args:
    split: the located fields.
    cols: the columns, a slice.

  Returns:
    ``(values float64 [m, k], bad bool [m, k])``; bad where a field is not ``[+-]?[0-9]+`` or
    is longer than 32 characters. Values of more than 8 characters are read one by one.
  """
  lens = split.lens[:, cols]
  x, mask = field_words(split, cols)
  # The sign, if any, is the field's first byte: lane len - 1 of word 0.
  shift = (np.clip(lens, 1, 8).astype(np.uint64) - np.uint64(1)) * np.uint64(8)
  first = (x >> shift) & np.uint64(0xFF)
  signed = (first == ord("-")) | (first == ord("+"))
  sign_lane = (signed.astype(np.uint64) * np.uint64(0xFF)) << shift
  digits = x & ~sign_lane
  not_digit = mask & ~sign_lane & HIGH_BITS & ~lanes_between(digits, 0x30, 0x39)
  is_bad = (not_digit != 0) | (signed & (lens == 1))
  d = digits & _lanes(0x0F)  # zero lanes (padding, sign) read as leading zeros
  d = ((d >> np.uint64(8)) & np.uint64(0x00FF00FF00FF00FF)) * np.uint64(10) + (d & np.uint64(0x00FF00FF00FF00FF))
  d = ((d >> np.uint64(16)) & np.uint64(0x0000FFFF0000FFFF)) * np.uint64(100) + (d & np.uint64(0x0000FFFF0000FFFF))
  d = (d >> np.uint64(32)) * np.uint64(10000) + (d & np.uint64(0xFFFFFFFF))
  values = d.astype(np.float64)
  values[first == ord("-")] *= -1.0
  for i, j in zip(*np.nonzero(lens > 8)):
    text = split.value(int(i), cols.start + int(j))
    ok = len(text) <= _MAX_DENSE_CHARS and _INT_RE.fullmatch(text) is not None
    values[i, j], is_bad[i, j] = (float(int(text)) if ok else 0.0), not ok
  return values, is_bad


def parse_hex(split: FieldSplit, cols: slice) -> Tuple[np.ndarray, np.ndarray]:
  """Reads columns of 1 to 8 hex digits (either case); an empty field reads as -1.

  Args:
    split: the located fields.
    cols: the columns, a slice.

  Returns:
    ``(values int64 [m, k], bad bool [m, k])``.
  """
  lens = split.lens[:, cols]
  x, mask = field_words(split, cols)
  is_hex = lanes_between(x, 0x30, 0x39)
  is_hex |= lanes_between(x | _lanes(0x20), 0x61, 0x66)
  np.bitwise_and(mask, HIGH_BITS, out=mask)
  np.bitwise_and(mask, ~is_hex, out=mask)
  is_bad = mask != 0
  is_bad |= lens > _MAX_HEX_DIGITS
  # A hex digit's value is its low nibble, plus 9 for a letter (bit 6 set); padding reads as 0.
  v = x >> np.uint64(6)
  v &= _lanes(0x01)
  v *= np.uint64(9)
  x &= _lanes(0x0F)
  v += x
  for shift, keep in ((4, 0x00FF00FF00FF00FF), (8, 0x0000FFFF0000FFFF), (16, 0xFFFFFFFF)):
    np.right_shift(v, np.uint64(shift), out=x)  # nibbles, then bytes, then pairs: side by side
    v |= x
    v &= np.uint64(keep)
  v[lens == 0] = _ALL
  return v.view(np.int64), is_bad


def first_fault(fault_col: np.ndarray, cols: slice, is_bad: np.ndarray) -> np.ndarray:
  """Records, for lines with no earlier fault, the first column of ``cols`` that ``is_bad``.

  Args:
    fault_col: int64 [m], each line's first faulty column so far (``NO_FAULT``: none).
    cols: the columns just checked, in order, a slice.
    is_bad: bool [m, k], which of them are faulty.

  Returns:
    The updated ``fault_col``.
  """
  any_bad = is_bad.any(axis=1)
  if not any_bad.any():
    return fault_col
  first = cols.start + np.argmax(is_bad, axis=1)
  return np.where(any_bad & (fault_col == NO_FAULT), first, fault_col)


def report_faults(bad: base.BadRecords, path: str, first_line: int, faults: List[Tuple[int, str, str]]) -> None:
  """Reports bad lines to ``bad`` in line order (so 'error' names the first one).

  Args:
    bad: the bad-record policy (raises at the first fault under 'error').
    path: the file, for the message.
    first_line: the 1-based line number of the chunk's first record.
    faults: ``(chunk index, field, why)`` of each bad line, at most one per line.
  """
  for i, field, why in sorted(faults, key=lambda f: f[0]):
    bad.report(path, first_line + i, field, why)


def columns_of(ids: np.ndarray, names: Sequence[str]) -> Dict[str, np.ndarray]:
  """Splits ids [m, k] into one contiguous [m, 1] array per feature name."""
  by_feature = np.ascontiguousarray(ids.T)
  return {name: by_feature[j][:, None] for j, name in enumerate(names)}


def show(value: bytes, limit: int = 40) -> str:
  """A field's bytes for an error message, cut at ``limit``."""
  return repr(value[:limit] + (b"..." if len(value) > limit else b""))


# ---------------------------------------------------------------------------------------------
# Criteo.


class CriteoFormat:
  """The Criteo Kaggle / Terabyte TSV click logs (see the module docstring)."""

  def __init__(self, num_dense: int = 13, num_categorical: int = 26):
    """Sets the column counts (13 and 26 in both published data sets).

    Args:
      num_dense: integer columns I1..I{num_dense} after the label.
      num_categorical: hex columns C1..C{num_categorical} after them.
    """
    self.num_dense, self.num_categorical = num_dense, num_categorical
    self.dense_names = tuple(f"I{i + 1}" for i in range(num_dense))
    self.cat_names = tuple(f"C{i + 1}" for i in range(num_categorical))
    self.num_fields = 1 + num_dense + num_categorical
    self.schema = base.Schema(num_dense, tuple(base.FeatureInfo(name) for name in self.cat_names))
    self._dense_cols = slice(1, 1 + num_dense)
    self._cat_cols = slice(1 + num_dense, self.num_fields)
    self._cat_seeds = np.asarray([name_seed(name) for name in self.cat_names], np.uint64)

  def cache_params(self) -> Dict[str, int]:
    """What the parsed columns depend on besides the code (for ``recsys_jax.data.cache``)."""
    return {"num_dense": self.num_dense, "num_categorical": self.num_categorical}

  def chunks(self, path: str, chunk_records: int) -> Iterator[base.RawChunk]:
    """Cuts ``path`` (plain or ``.gz``) into chunks of ``chunk_records`` lines.

    Args:
      path: a Criteo file.
      chunk_records: lines per chunk (the last may be shorter).

    Returns:
      An iterator of raw chunks.
    """
    return base.text_chunks(path, chunk_records)

  def parse(self, chunk: base.RawChunk, bad: base.BadRecords) -> base.Columns:
    """Parses a chunk of lines into columns; bad lines are reported and dropped.

    Args:
      chunk: consecutive lines of a Criteo file.
      bad: the bad-record policy.

    Returns:
      Columns of the good lines, in file order.
    """
    lines = chunk.payload
    if not lines:
      return base.empty_columns(self.schema)
    fast = text_kernels.criteo_columns(b"\n".join(lines + [b""]), len(lines), self.num_dense, self._cat_seeds)
    if fast is None:  # some line is bad: the numpy path finds and reports them all
      return self.parse_numpy(chunk, bad)
    label, dense, ids = fast
    return {
      "label": label,
      "dense": dense,
      "sparse": {name: ids[j][:, None] for j, name in enumerate(self.cat_names)},
      "sparse_weights": {},
    }

  def parse_numpy(self, chunk: base.RawChunk, bad: base.BadRecords) -> base.Columns:
    """``parse`` with numpy alone: the path for chunks with bad lines, and the reference the kernel is tested on.

    Vectorised over the chunk: the lines are joined into one byte buffer, the delimiters located
    once, and the last 8 bytes of every field read as one big-endian uint64 (an unaligned strided
    view of the buffer), which is checked and decoded 8 characters at a time with SWAR ("SIMD
    within a register") arithmetic; the rare longer dense values are decoded one by one. The
    helpers (``split_fields``, ``field_words``, ``hash_fields``, ``first_fault``,
    ``report_faults``) are shared with ``recsys_jax.data.avazu``.
    """
    lines = chunk.payload
    if not lines:
      return base.empty_columns(self.schema)
    split = split_fields(lines, b"\t", self.num_fields)
    m = split.rows.shape[0]
    fault_col = np.full(m, NO_FAULT, np.int64)

    label, label_bad = parse_label(split, 0)
    fault_col = first_fault(fault_col, slice(0, 1), label_bad[:, None])

    dense = np.zeros((m, self.num_dense), np.float32)
    if self.num_dense:
      values, is_bad = parse_ints(split, self._dense_cols)
      dense = base.log1p_dense(values)
      fault_col = first_fault(fault_col, self._dense_cols, is_bad)

    ids = np.zeros((m, self.num_categorical), np.uint64)
    if self.num_categorical:
      values, is_bad = parse_hex(split, self._cat_cols)
      ids = splitmix64(values.view(np.uint64) ^ self._cat_seeds)  # base.hash_ints, all fields at once
      fault_col = first_fault(fault_col, self._cat_cols, is_bad)

    faults = [
      (int(r), "num_fields", f"expected {self.num_fields} tab-separated fields, got {int(c)}")
      for r, c in zip(split.bad_rows, split.bad_counts)
    ]
    for i in np.flatnonzero(fault_col != NO_FAULT):
      faults.append((int(split.rows[i]), *self._why(split, int(i), int(fault_col[i]))))
    report_faults(bad, chunk.path, chunk.first_line, faults)

    keep = fault_col == NO_FAULT
    if not keep.all():
      label, dense, ids = label[keep], dense[keep], ids[keep]
    return {
      "label": label,
      "dense": dense,
      "sparse": columns_of(ids, self.cat_names),
      "sparse_weights": {},
    }

  def _why(self, split: FieldSplit, i: int, col: int) -> Tuple[str, str]:
    value = show(split.value(i, col))
    if col == 0:
      return "label", f"label must be 0 or 1, got {value}"
    if col <= self.num_dense:
      return self.dense_names[col - 1], f"not an integer of at most {_MAX_DENSE_CHARS} characters: {value}"
    return self.cat_names[col - 1 - self.num_dense], f"not 1 to {_MAX_HEX_DIGITS} hex digits: {value}"
