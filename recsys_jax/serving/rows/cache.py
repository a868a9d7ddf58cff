"""A fixed number of embedding rows of one width, CLOCK replacement: the bounded cache in front of
``SnapshotRows``' reads, so RSS stays bounded whatever the
table size."""

from __future__ import annotations

from typing import Dict

import numpy as np


class RowCache:
  """A fixed number of rows of one width, CLOCK replacement; not thread-safe (the caller locks).

  ``rows`` <= ``capacity`` at all times: ``held()`` says how many rows it holds.
  """

  def __init__(self, capacity: int, dim: int):
    self.capacity, self.dim = int(capacity), int(dim)
    self.data = np.zeros((self.capacity, self.dim), np.float32)
    self.key = np.zeros(self.capacity, np.uint64)
    self.used = np.zeros(self.capacity, bool)
    self.ref = np.zeros(self.capacity, bool)
    self.slot: Dict[int, int] = {}
    self.hand = 0
    self.hits = self.misses = 0

  def held(self) -> int:
    return len(self.slot)

  def get(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Writes the cached rows of ``ids`` into ``out``; returns a bool mask of the ids found."""
    get = self.slot.get
    where = np.fromiter((get(i, -1) for i in ids.tolist()), np.int64, ids.shape[0])
    found = where >= 0
    s = where[found]
    out[found] = self.data[s]
    self.ref[s] = True
    n = int(found.sum())
    self.hits += n
    self.misses += ids.shape[0] - n
    return found

  def put(self, ids: np.ndarray, rows: np.ndarray) -> None:
    """Adds rows of ids not held (the last ``capacity`` of them if more), evicting by CLOCK."""
    if self.capacity == 0:
      return
    ids, rows = ids[-self.capacity :], rows[-self.capacity :]
    for i, r in zip(ids.tolist(), rows):
      s = self._victim()
      if self.used[s]:
        del self.slot[int(self.key[s])]
      self.key[s], self.used[s], self.ref[s] = i, True, False
      self.data[s] = r
      self.slot[i] = s

  def _victim(self) -> int:
    while True:  # at most two sweeps: the first clears every reference bit it passes
      s = self.hand
      self.hand = (s + 1) % self.capacity
      if not self.used[s] or not self.ref[s]:
        return s
      self.ref[s] = False
