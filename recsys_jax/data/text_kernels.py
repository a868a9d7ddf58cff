"""Compiled one-pass parsing of well-formed Criteo chunks: the fast path of :meth:`CriteoFormat.parse`.

:func:`criteo_columns` walks a chunk's joined bytes once, byte by byte, and decodes the label,
the decimal and the hex fields as it goes, hashing the hex values with ``splitmix64(value ^
seed)`` as :func:`recsys_jax.data.base.hash_ints` does. It is compiled with numba (``nogil``,
cached in ``__pycache__``, compiled on the first call), so host worker threads parse chunks
side by side; the numpy path it replaces held the GIL between its many small array operations.

It gives up on the whole chunk (returns ``None``) at the first thing it does not accept: a line
with another number of fields, a label other than ``0``/``1``, a dense value that is not
``[+-]?[0-9]+`` of at most 32 characters, a categorical that is not 1 to 8 hex digits. The
caller then parses the chunk with the numpy path, which finds and reports every bad line, so
what is reported, where and how, is that path's alone.

The values it returns are bit for bit the numpy path's: a decimal of at most 18 digits is read
exactly as an int64 and rounded once to float64 (as ``float(int(text))`` and, for 8 digits or
fewer, the exact SWAR decoding); ``-0`` and other negative zeros of at most 8 characters are
-0.0, longer ones +0.0 (the numpy path reads those with ``float(int(text))``); values of more
than 18 digits are left to the caller, which reads them with ``float(int(text))`` too.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numba
import numpy as np

from recsys_jax.data import base

_TAB, _NEWLINE, _MINUS, _PLUS, _ZERO = 9, 10, 45, 43, 48
_MAX_DENSE_CHARS = 32
_MAX_EXACT_DIGITS = 18  # 10**18 < 2**63: the value is exact in int64
_MAX_HEX_DIGITS = 8
_LOG_TABLE_SIZE = 4096  # 16 KiB of float32: stays in L1/L2 next to the text
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's constants (recsys_jax.async_ps.hashing)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


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
      z = (np.uint64(v) ^ seeds[j]) + _GOLDEN
      z = (z ^ (z >> np.uint64(30))) * _M1
      z = (z ^ (z >> np.uint64(27))) * _M2
      ids[j, r] = z ^ (z >> np.uint64(31))
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
