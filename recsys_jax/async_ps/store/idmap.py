"""A collision-free map from uint64 ids to dense row numbers, with compiled probing.

Open addressing with linear probing: an id's home slot is ``splitmix64(id ^ salt) & mask``
(``hashing.splitmix64``) and it sits in the first slot from there on that was empty when it
was inserted. Every operation works on a whole batch of ids at once, in one compiled loop
(``kernels.find`` / ``kernels.place``) that hashes and probes each id in turn; with the load
factor kept at or below one half almost all ids resolve at their home slot. No id is ever
merged with another (keys are compared exactly), unlike the hashing-trick tables that
trade collisions for memory.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

from recsys_jax.async_ps import kernels

_MAX_LOAD = 0.5
# The repeat check hashes with another salt, so that ids crowding one probe chain of the map
# (e.g. adversarial ones) are spread out in its scratch table.
_SCRATCH_SALT = np.uint64(0x5851F42D4C957F2D)


class IdMap:
  """Maps uint64 ids to row numbers 0..size-1, assigned in order of insertion."""

  def __init__(self, capacity: int = 1024, salt: int = 0):
    cap = 1 << max(4, int(np.ceil(np.log2(max(capacity, 1) / _MAX_LOAD))))
    self._salt = np.uint64(salt)
    self._alloc(cap)
    self.size = 0
    self._row_keys = np.zeros((0,), np.uint64)

  def _alloc(self, cap: int) -> None:
    self._mask = np.uint64(cap - 1)
    self._slot_keys = np.zeros((cap,), np.uint64)
    self._slot_rows = np.full((cap,), -1, np.int64)

  # The table itself, for kernels that probe several maps in one call (``kernels.find_many``).
  @property
  def slot_keys(self) -> np.ndarray:
    return self._slot_keys

  @property
  def slot_rows(self) -> np.ndarray:
    return self._slot_rows

  @property
  def mask(self) -> np.uint64:
    return self._mask

  @property
  def salt(self) -> np.uint64:
    return self._salt

  @property
  def capacity(self) -> int:
    return self._slot_rows.shape[0]

  def keys(self) -> np.ndarray:
    """The ids in row order (row i holds keys()[i])."""
    return self._row_keys[: self.size]

  def find(self, keys: np.ndarray) -> np.ndarray:
    """Returns the row of each id, or -1 where the id is absent. Repeats are allowed."""
    keys = np.ascontiguousarray(keys, np.uint64)
    out = np.empty(keys.shape, np.int64)
    kernels.find(
      self._slot_keys, self._slot_rows, self._mask, self._salt, kernels.read_only(keys.reshape(-1)), out.reshape(-1)
    )
    return out

  def insert(self, keys: np.ndarray, absent: bool = False) -> np.ndarray:
    """Adds ids that are absent and distinct; returns their new rows.

    ``absent``: the caller has just looked the ids up and found none (skips that check; repeats
    within ``keys`` are still refused).

    Raises:
      ValueError: if an id repeats in ``keys`` or is already present; the map is then
        unchanged.
    """
    keys = np.ascontiguousarray(keys, np.uint64)
    m = keys.shape[0]
    if m == 0:
      return np.zeros((0,), np.int64)
    # Checked before anything is written, so a refused insert leaves the map as it was.
    if kernels.first_repeat(kernels.read_only(keys), self._salt ^ _SCRATCH_SALT) >= 0:
      raise ValueError("IdMap.insert got an id twice in one call; deduplicate first")
    present = np.zeros(0, bool) if absent else self.find(keys) >= 0
    if present.any():
      raise ValueError(f"IdMap.insert got ids already present, e.g. {keys[present][:3].tolist()}")
    if (self.size + m) > _MAX_LOAD * self.capacity:
      self._grow(self.size + m)
    rows = np.arange(self.size, self.size + m, dtype=np.int64)
    self._place(keys, rows)
    if self.size + m > self._row_keys.shape[0]:
      new = np.zeros((max(2 * self._row_keys.shape[0], self.size + m, 16),), np.uint64)
      new[: self.size] = self._row_keys[: self.size]
      self._row_keys = new
    self._row_keys[self.size : self.size + m] = keys
    self.size += m
    return rows

  def drop_rows(self, drop: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Removes the ids of rows ``drop``; the last rows move into the holes, so rows stay 0..size-1.

    Costs O(len(drop)), not O(size): the dropped ids leave the slots (backward-shift deletion)
    and only the ids that move get new rows.

    Args:
      drop: sorted, distinct row numbers below ``size``.

    Returns:
      ``(holes, movers)``: the id of row ``movers[i]`` is now at row ``holes[i]``; the caller
      moves its own per-row arrays the same way (``a[holes] = a[movers]``).
    """
    drop = np.asarray(drop, np.int64)
    n = self.size
    m = n - drop.shape[0]
    holes = drop[drop < m]
    tail = np.ones(n - m, bool)
    tail[drop[drop >= m] - m] = False
    movers = np.flatnonzero(tail) + m
    kernels.remove(self._slot_keys, self._slot_rows, self._mask, self._salt, self._row_keys[drop])
    if holes.shape[0]:
      self._row_keys[holes] = self._row_keys[movers]
      kernels.relabel(self._slot_keys, self._slot_rows, self._mask, self._salt, self._row_keys[holes], holes)
    self.size = m
    return holes, movers

  def _place(self, keys: np.ndarray, rows: np.ndarray) -> None:
    """Writes distinct absent ids into the slots (the caller keeps the load <= one half)."""
    kernels.place(
      self._slot_keys,
      self._slot_rows,
      self._mask,
      self._salt,
      np.ascontiguousarray(keys, np.uint64),
      np.ascontiguousarray(rows, np.int64),
    )

  def _grow(self, need: int) -> None:
    cap = self.capacity
    while need > _MAX_LOAD * cap:
      cap *= 2
    # The ids are placed again from _row_keys: the old slots go first, not after the new exist.
    self._slot_keys = self._slot_rows = None  # type: ignore[assignment]  # freed here; _alloc sets them next
    self._alloc(cap)
    if self.size:
      self._place(self._row_keys[: self.size], np.arange(self.size, dtype=np.int64))
