"""Compiled (numba) kernels of the lookup path: the id map's hashing and probing, the row gather,
and the row moves that close an eviction's holes.

Conventions, which the callers (``IdMap``, ``Table``) guarantee: arrays are C-contiguous;
keys ``uint64``, rows ``int64``, gathered rows ``float32``.
"""

from __future__ import annotations

import numpy as np

from recsys_jax.async_ps.kernels.jit import KEYS_AHEAD, ROWS_AHEAD_1, jit, jit_inline, prefetch, prefetch_row

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


# -- hashing and the id map -----------------------------------------------------------------


@jit_inline
def _check_slots(slot_keys, slot_rows, mask):
  cap = slot_rows.shape[0]
  if slot_keys.shape[0] != cap or np.uint64(cap - 1) != mask or cap & (cap - 1) != 0:
    raise ValueError("id map kernel: slot arrays must both have mask + 1 (a power of two) entries")


@jit_inline
def splitmix64_one(x):
  """splitmix64 of one uint64 (wrapping), exactly as ``hashing.splitmix64``."""
  z = x + _GOLDEN
  z = (z ^ (z >> _S30)) * _M1
  z = (z ^ (z >> _S27)) * _M2
  return z ^ (z >> _S31)


@jit
def splitmix64(keys, out):
  """out[i] = splitmix64(keys[i]) (uint64 arrays); for tests against ``hashing.splitmix64``."""
  for i in range(keys.shape[0]):
    out[i] = splitmix64_one(keys[i])


@jit
def find(slot_keys, slot_rows, mask, salt, keys, out_rows):
  """Looks ids up in an open-addressing table with linear probing.

  Args:
    slot_keys: uint64 [cap], the id in each slot (meaningless where the slot is empty).
    slot_rows: int64 [cap], the row of each slot, -1 for an empty slot.
    mask: uint64, cap - 1 (cap a power of two).
    salt: uint64, xored into each id before hashing; the home slot is
      ``splitmix64(id ^ salt) & mask``.
    keys: uint64 [n], the ids (repeats allowed).
    out_rows: int64 [n], written: the row of each id, or -1 where it is absent.

  Returns:
    How many ids are absent.
  """
  _check_slots(slot_keys, slot_rows, mask)
  if out_rows.shape[0] != keys.shape[0]:
    raise ValueError("find: out_rows must be as long as keys")
  imask = np.int64(mask)
  n = keys.shape[0]
  absent = 0
  # First every home slot (into out_rows), so that the probe of key i can prefetch the slots
  # of key i + KEYS_AHEAD.
  for i in range(n):
    out_rows[i] = np.int64(splitmix64_one(keys[i] ^ salt) & mask)
  for i in range(min(n, KEYS_AHEAD)):
    prefetch(slot_rows, out_rows[i], 0)
    prefetch(slot_keys, out_rows[i], 0)
  for i in range(n):
    if i + KEYS_AHEAD < n:
      ahead = out_rows[i + KEYS_AHEAD]
      prefetch(slot_rows, ahead, 0)
      prefetch(slot_keys, ahead, 0)
    k = keys[i]
    pos = out_rows[i]
    row = np.int64(-1)
    while True:
      r = slot_rows[pos]
      if r < 0:
        break
      if slot_keys[pos] == k:
        row = r
        break
      pos = (pos + 1) & imask
    out_rows[i] = row
    absent += row < 0
  return absent


@jit
def place(slot_keys, slot_rows, mask, salt, keys, rows):
  """Inserts ids into the table of ``find``: ``keys[i]`` gets row ``rows[i]``.

  The ids must be distinct and absent (the caller checks), and the table must keep at least
  one empty slot. Each id takes the first empty slot from its home slot on.
  """
  _check_slots(slot_keys, slot_rows, mask)
  if rows.shape[0] != keys.shape[0]:
    raise ValueError("place: rows must be as long as keys")
  imask = np.int64(mask)
  for i in range(keys.shape[0]):
    k = keys[i]
    pos = np.int64(splitmix64_one(k ^ salt) & mask)
    while slot_rows[pos] >= 0:
      pos = (pos + 1) & imask
    slot_keys[pos] = k
    slot_rows[pos] = rows[i]


@jit_inline
def _slot_of(slot_keys, slot_rows, mask, salt, k):
  """The slot holding id ``k``, or the empty slot its probe run ends at (the id is absent then)."""
  imask = np.int64(mask)
  pos = np.int64(splitmix64_one(k ^ salt) & mask)
  while slot_rows[pos] >= 0 and slot_keys[pos] != k:
    pos = (pos + 1) & imask
  return pos


@jit
def remove(slot_keys, slot_rows, mask, salt, keys):
  """Deletes ids from the table of ``find`` (absent ids are skipped); returns how many were present.

  Backward-shift deletion: the ids after the freed slot in its probe run move back into it
  where their home slot allows, so every remaining id is still found from its home slot by
  probing up to the first empty slot, and no tombstones accumulate.
  """
  _check_slots(slot_keys, slot_rows, mask)
  imask = np.int64(mask)
  removed = 0
  for i in range(keys.shape[0]):
    pos = _slot_of(slot_keys, slot_rows, mask, salt, keys[i])
    if slot_rows[pos] < 0:
      continue
    removed += 1
    hole = pos
    j = pos
    while True:
      j = (j + 1) & imask
      if slot_rows[j] < 0:
        break
      home = np.int64(splitmix64_one(slot_keys[j] ^ salt) & mask)
      # The id at j may fill the hole if its home is not in (hole, j], cyclically.
      if (j - home) & imask >= (j - hole) & imask:
        slot_keys[hole] = slot_keys[j]
        slot_rows[hole] = slot_rows[j]
        hole = j
    slot_rows[hole] = -1
  return removed


@jit
def relabel(slot_keys, slot_rows, mask, salt, keys, rows):
  """Gives present ids new rows: ``keys[i]`` -> ``rows[i]``; returns how many ids were absent (skipped)."""
  _check_slots(slot_keys, slot_rows, mask)
  if rows.shape[0] != keys.shape[0]:
    raise ValueError("relabel: rows must be as long as keys")
  absent = 0
  for i in range(keys.shape[0]):
    pos = _slot_of(slot_keys, slot_rows, mask, salt, keys[i])
    if slot_rows[pos] < 0:
      absent += 1
    else:
      slot_rows[pos] = rows[i]
  return absent


@jit
def first_repeat(keys, salt):
  """The index of the first id that already occurred earlier in ``keys``, or -1.

  Strictly increasing ids are distinct: the ids a trainer pushes come sorted out of its dedup
  (``np.unique`` order), so one compare per id answers for them (~0.3 ns an id against ~7 for
  the table below; the check runs on every push). Otherwise a scratch table of at least twice
  ``len(keys)`` slots: O(n), unlike a sort.
  """
  n = keys.shape[0]
  i = 1
  while i < n and keys[i - 1] < keys[i]:
    i += 1
  if i >= n:
    return -1
  cap = 16
  while cap < 2 * n:
    cap *= 2
  mask = np.uint64(cap - 1)
  imask = np.int64(cap - 1)
  seen_keys = np.empty(cap, np.uint64)
  used = np.zeros(cap, np.bool_)
  for i in range(n):
    k = keys[i]
    pos = np.int64(splitmix64_one(k ^ salt) & mask)
    while used[pos]:
      if seen_keys[pos] == k:
        return i
      pos = (pos + 1) & imask
    used[pos] = True
    seen_keys[pos] = k
  return -1


# -- the row gather -------------------------------------------------------------------------


@jit
def gather_rows(src, rows, out):
  """out[i] = src[rows[i]] where rows[i] >= 0; rows of ``out`` for rows[i] < 0 are left as they are.

  ``src`` [R, dim] and ``out`` [len(rows), dim] are float32. Returns -1, or the index of the
  first row >= R (then nothing was written).
  """
  num_rows = src.shape[0]
  n = rows.shape[0]
  if out.shape[0] != n or out.shape[1] != src.shape[1]:
    raise ValueError("gather_rows: out must be [len(rows), dim]")
  for i in range(n):
    if rows[i] >= num_rows:
      return i
  dim = src.shape[1]
  for i in range(n):
    if i + ROWS_AHEAD_1 < n and rows[i + ROWS_AHEAD_1] >= 0:
      prefetch_row(src, rows[i + ROWS_AHEAD_1])
    r = rows[i]
    if r >= 0:
      for j in range(dim):
        out[i, j] = src[r, j]
  return -1


# -- moving rows ----------------------------------------------------------------------------


@jit
def move_rows(a, holes, movers):
  """a[holes[i]] = a[movers[i]] for each i in turn, in place.

  ``a`` is any per-row array seen as uint8 [rows, bytes per row] (the caller's views of its
  float, int and bool arrays), so one compiled loop serves every dtype; ``holes`` and
  ``movers`` are int64 and as long as each other. One pass per row, where numpy's
  ``a[holes] = a[movers]`` gathers into a temporary first (2.5-3.5x slower for an eviction of
  2,000 rows of 64 float32 on this machine).
  """
  if holes.shape[0] != movers.shape[0]:
    raise ValueError("move_rows: holes and movers must be as long as each other")
  n = a.shape[0]
  for i in range(holes.shape[0]):
    if holes[i] < 0 or holes[i] >= n or movers[i] < 0 or movers[i] >= n:
      raise IndexError("move_rows: a row number is out of range")
  width = a.shape[1]
  for i in range(holes.shape[0]):
    h = holes[i]
    m = movers[i]
    for j in range(width):
      a[h, j] = a[m, j]


# -- initial rows ---------------------------------------------------------------------------


@jit
def init_uniform(ids, seeds, per_id, col, scale, out):
  """``out[i, j]`` = the 'uniform' initial value of id ``ids[i]``, column ``j``, exactly as
  ``store.initializers.init_rows`` computes it with numpy: ``u = uniform01(splitmix64(splitmix64(
  id ^ seed) ^ (j + 1) * col))``, then ``float32((2u - 1) * scale)`` in float64 (every step exact or
  correctly rounded, so the same bits). ``seeds``: one table seed (``per_id`` False: ``seeds[0]``)
  or one per id."""
  dim = out.shape[1]
  for i in range(ids.shape[0]):
    s = seeds[i] if per_id else seeds[0]
    base = splitmix64_one(ids[i] ^ s)
    for j in range(dim):
      h = splitmix64_one(base ^ (np.uint64(j + 1) * col))
      u = np.float64(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)
      out[i, j] = np.float32((2.0 * u - 1.0) * scale)
