"""Compiled one-pass parsing of well-formed Criteo and Avazu chunks: the fast path of their ``parse``.

``criteo_columns`` and ``avazu_columns`` walk a chunk's joined bytes once, byte by byte,
decoding and hashing each field as they go. They are compiled with numba (``nogil``, cached in
``__pycache__``, compiled on the first call), so host worker threads parse chunks side by side;
the numpy path (``parse_numpy``, kept as the reference) holds the GIL between its many small
array operations, and costs several times their CPU (``experiments/bench_readers.py``).

Each gives up on the whole chunk (returns ``None``) at the first thing it does not accept: a line
with another number of fields, or any value the format's rules call bad. The caller then parses
the chunk with ``parse_numpy``, which finds and reports every bad line, so what is reported,
where and how, is that path's alone.

The columns are bit for bit ``parse_numpy``'s. Criteo: a decimal of at most 18 digits is read
exactly as an int64 and rounded once to float64 (as ``float(int(text))`` and, for 8 characters
or fewer, the exact SWAR decoding do); ``-0`` of at most 8 characters is -0.0, longer negative
zeros +0.0 (the numpy path reads those with ``float(int(text))``); values of more than 18 digits
are read by the caller with ``float(int(text))`` too. ``log1p_dense`` of the values below 4096 is
looked up in a table that ``base.log1p_dense`` itself computed; larger values go through it.
Hex ids are hashed as ``splitmix64(value ^ seed)`` (``base.hash_ints``). Avazu: FNV-1a over a
value's bytes, NUL bytes skipped, then splitmix64 (``criteo.hash_fields``; values over 64 bytes
by ``base.hash_strings``, as there); the hour's date checked against numpy's calendar.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numba
import numpy as np

from recsys_jax.async_ps.kernels.lookup import splitmix64_one
from recsys_jax.data import base
from recsys_jax.hashing import name_seed

_TAB, _NEWLINE, _MINUS, _PLUS, _ZERO = 9, 10, 45, 43, 48
_MAX_DENSE_CHARS = 32
_MAX_EXACT_DIGITS = 18  # 10**18 < 2**63: the value is exact in int64
_MAX_HEX_DIGITS = 8
_LOG_TABLE_SIZE = 4096  # 16 KiB of float32: stays in L1/L2 next to the text


def _hex_values() -> np.ndarray:
  """Each byte's value as a hex digit (either case), or -1."""
  table = np.full(256, -1, np.int64)
  for i, c in enumerate(b"0123456789abcdef"):
    table[c] = i
    table[ord(chr(c).upper())] = i
  return table


_HEX_VALUES = _hex_values()
_LOG_TABLE = base.log1p_dense(np.arange(_LOG_TABLE_SIZE, dtype=np.float64))
"""``log1p_dense`` of the small dense values, computed by it: the kernel looks them up, so they
are its values by construction (and libm's log1p is most of what the numpy path spends on them)."""
_LOG_NEGATIVE = base.log1p_dense(np.asarray([-1.0]))[0]
_LOG_NEGATIVE_ZERO = base.log1p_dense(np.asarray([-0.0]))[0]


@numba.njit(nogil=True, cache=True)
def _criteo_kernel(
  buf, n, seeds, hex_values, log_table, log_negative, log_negative_zero, label, dense, ids, big_index, big_value, slow
):
  """Fills ``label`` [n], ``dense`` [n, num_dense] (log1p_dense'd) and ``ids`` [num_cat, n] from ``buf``.

  ``buf`` holds ``n`` lines, each ending in ``\\n``. A dense value v of ``log_table`` is written
  as ``log_table[v]``; larger ones are left to the caller as ``big_index[k]`` (the flat index
  into ``dense``) and ``big_value[k]`` (the value); values of more than 18 digits as
  ``slow[k] = (flat index, start, end)``. Returns ``(number of big ones, number of slow ones)``,
  or ``(-1, -1)`` if the chunk holds anything the kernel does not accept.
  """
  end = buf.shape[0]
  num_dense = dense.shape[1]
  num_cat = seeds.shape[0]
  p = 0
  num_big = 0
  num_slow = 0
  for r in range(n):
    if p + 1 >= end:
      return -1, -1
    c = buf[p]
    if c != _ZERO and c != _ZERO + 1:
      return -1, -1
    label[r] = np.float32(c - _ZERO)
    p += 1
    for j in range(num_dense):
      if buf[p] != _TAB:
        return -1, -1
      p += 1
      start = p
      c = buf[p]
      neg = c == _MINUS
      if neg or c == _PLUS:
        p += 1
      v = np.int64(0)
      digits = 0
      while True:
        d = np.int64(buf[p]) - _ZERO
        if d < 0 or d > 9:
          break
        if digits < _MAX_EXACT_DIGITS:
          v = v * 10 + d
        digits += 1
        p += 1
      length = p - start
      if length > _MAX_DENSE_CHARS or (digits == 0 and length > 0):
        return -1, -1
      if digits > _MAX_EXACT_DIGITS:
        slow[num_slow, 0], slow[num_slow, 1], slow[num_slow, 2] = r * num_dense + j, start, p
        num_slow += 1
      elif neg and v != 0:
        dense[r, j] = log_negative
      elif neg and length <= 8:  # -0.0; float(int(b'-000000000')) is +0.0
        dense[r, j] = log_negative_zero
      elif v < log_table.shape[0]:
        dense[r, j] = log_table[v]
      else:
        big_index[num_big] = r * num_dense + j
        big_value[num_big] = np.float64(v)
        num_big += 1
    for j in range(num_cat):
      if buf[p] != _TAB:
        return -1, -1
      p += 1
      start = p
      v = np.int64(0)
      while True:
        d = hex_values[buf[p]]
        if d < 0:
          break
        v = (v << 4) | d
        p += 1
      digits = p - start
      if digits > _MAX_HEX_DIGITS:
        return -1, -1
      if digits == 0:
        v = -1  # a missing value hashes as -1
      ids[j, r] = splitmix64_one(np.uint64(v) ^ seeds[j])
    if buf[p] != _NEWLINE:
      return -1, -1
    p += 1
  if p != end:
    return -1, -1
  return num_big, num_slow


def criteo_columns(text: bytes, n: int, num_dense: int, seeds: np.ndarray) -> Optional[Tuple[np.ndarray, ...]]:
  """Parses ``n`` well-formed Criteo lines, each ending in ``\\n``, in one compiled pass.

  Args:
    text: the lines, joined, each followed by ``\\n``.
    n: how many lines.
    num_dense: integer columns after the label; the hex columns follow them.
    seeds: uint64 [num_categorical], each hex column's hash seed.

  Returns:
    ``(label float32 [n], dense float32 [n, num_dense], ids uint64 [num_categorical, n])``, the
    dense values through ``base.log1p_dense``; None if any line is not well formed.
  """
  label = np.empty(n, np.float32)
  dense = np.empty((n, num_dense), np.float32)
  ids = np.empty((seeds.shape[0], n), np.uint64)
  big_index = np.empty(n * num_dense, np.int64)  # untouched pages of np.empty cost nothing
  big_value = np.empty(n * num_dense, np.float64)
  slow = np.empty((n * num_dense, 3), np.int64)
  buf = np.frombuffer(text, np.uint8)
  num_big, num_slow = _criteo_kernel(
    buf,
    n,
    seeds,
    _HEX_VALUES,
    _LOG_TABLE,
    _LOG_NEGATIVE,
    _LOG_NEGATIVE_ZERO,
    label,
    dense,
    ids,
    big_index,
    big_value,
    slow,
  )
  if num_big < 0:
    return None
  flat = dense.reshape(-1)
  flat[big_index[:num_big]] = base.log1p_dense(big_value[:num_big])
  for index, start, stop in slow[:num_slow]:
    flat[index] = base.log1p_dense(np.asarray([float(int(text[start:stop]))]))[0]
  return label, dense, ids


# ---------------------------------------------------------------------------------------------
# Avazu: id, click, hour (YYMMDDHH), then 21 columns hashed as strings.

_COMMA = 44
_FNV_PRIME = np.uint64(0x100000001B3)
_MAX_HASHED_BYTES = 64  # criteo._PAD: the numpy path hashes longer values with base.hash_strings
_FIRST_DAYS = (
  ((2000 - 1970) * 12 + np.arange(100 * 12 + 1)).astype("datetime64[M]").astype("datetime64[D]").astype(np.int64)
)
"""Days from 1970-01-01 to the first of each month of 2000 .. 2099 (and of 2100-01), by numpy's
calendar, as the numpy path computes them."""
_EPOCH_WEEKDAY = 3  # 1970-01-01 was a Thursday (Monday = 0)


@numba.njit(nogil=True, cache=True)
def _two_digits(buf, p):
  """The 2-digit decimal number at ``buf[p:p + 2]``, or -1."""
  a, b = np.int64(buf[p]) - _ZERO, np.int64(buf[p + 1]) - _ZERO
  if a < 0 or a > 9 or b < 0 or b > 9:
    return -1
  return 10 * a + b


@numba.njit(nogil=True, cache=True)
def _avazu_kernel(buf, n, seeds, first_days, label, ids, slow):
  """Fills ``label`` [n] and ``ids`` [num_features, n] (hour of day, weekday, the hashed columns).

  ``seeds``: hour of day's, weekday's, then each hashed column's. A hashed value of more than
  64 bytes is left to the caller as ``slow[k] = (flat index into ids, start, end)``. Returns
  the number of those, or -1 if the chunk holds anything the kernel does not accept.
  """
  end = buf.shape[0]
  p = 0
  num_slow = 0
  for r in range(n):
    while p < end and buf[p] != _COMMA and buf[p] != _NEWLINE:  # id: not read
      p += 1
    if p + 11 >= end or buf[p] != _COMMA or buf[p + 2] != _COMMA:
      return -1
    c = buf[p + 1]
    if c != _ZERO and c != _ZERO + 1:
      return -1
    label[r] = np.float32(c - _ZERO)
    p += 3
    yy, mm, dd, hh = _two_digits(buf, p), _two_digits(buf, p + 2), _two_digits(buf, p + 4), _two_digits(buf, p + 6)
    if yy < 0 or mm < 1 or mm > 12 or dd < 1 or hh < 0 or hh > 23:
      return -1
    month = yy * 12 + mm - 1
    if dd > first_days[month + 1] - first_days[month]:
      return -1
    weekday = (first_days[month] + dd - 1 + _EPOCH_WEEKDAY) % 7
    ids[0, r] = splitmix64_one(np.uint64(hh) ^ seeds[0])
    ids[1, r] = splitmix64_one(np.uint64(weekday) ^ seeds[1])
    p += 8
    for j in range(2, ids.shape[0]):
      if buf[p] != _COMMA:
        return -1
      p += 1
      start = p
      h = seeds[j]
      while True:
        c = buf[p]
        if c == _COMMA or c == _NEWLINE:
          break
        if c != 0:  # NUL bytes are skipped, as the numpy path's padding is
          h = (h ^ np.uint64(c)) * _FNV_PRIME
        p += 1
      if p - start > _MAX_HASHED_BYTES:
        slow[num_slow, 0], slow[num_slow, 1], slow[num_slow, 2] = j * n + r, start, p
        num_slow += 1
      ids[j, r] = splitmix64_one(h)
    if buf[p] != _NEWLINE:
      return -1
    p += 1
  if p != end:
    return -1
  return num_slow


def avazu_columns(text: bytes, n: int, names: Tuple[str, ...]) -> Optional[Tuple[np.ndarray, np.ndarray]]:
  """Parses ``n`` well-formed Avazu records, each ending in ``\\n``, in one compiled pass.

  Args:
    text: the lines, joined, each followed by ``\\n``.
    n: how many lines.
    names: the features: ``hour_of_day``, ``weekday``, then the hashed columns in file order.

  Returns:
    ``(label float32 [n], ids uint64 [len(names), n])``; None if any line is not well formed.
  """
  seeds = np.asarray([name_seed(name) for name in names], np.uint64)
  label = np.empty(n, np.float32)
  ids = np.empty((len(names), n), np.uint64)
  slow = np.empty((ids.size, 3), np.int64)
  num_slow = _avazu_kernel(np.frombuffer(text, np.uint8), n, seeds, _FIRST_DAYS, label, ids, slow)
  if num_slow < 0:
    return None
  flat = ids.reshape(-1)
  for index, start, stop in slow[:num_slow]:
    flat[index] = base.hash_strings([text[start:stop]], names[index // n])[0]
  return label, ids
