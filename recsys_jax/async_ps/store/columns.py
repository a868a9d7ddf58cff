"""The rows of one table that are in RAM: the id map and, per row, its weights, optimizer slots,
the step it was last looked up, its lookup count and whether it changed since the last snapshot.

Row ``r`` of every column belongs to the id the map sends to ``r``; rows are dense (``0 ..
size - 1``) and keep no order: inserting appends, dropping moves the last rows into the holes.
What the bounds read (last seen, count) and what snapshots read (the dirty flags, and the ids
deleted or spilled since the last snapshot) are columns here too, so that one object says what
a table holds in RAM and every part of the table reads it the same way.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional

import numpy as np

from recsys_jax.async_ps import kernels
from recsys_jax.async_ps.optim.optimizers import RowOptimizer
from recsys_jax.async_ps.store.idmap import IdMap

INIT_BLOCK_ROWS = 1 << 14  # rows created per block (their initial values and slots)


class Columns:
  """A table's rows in RAM, one array per column, grown by doubling (at most 1.25x a bound).

  Args:
    dim: the rows' width.
    dtype: the weights' storage dtype (the slots are the optimizer's, float32).
    opt: the row optimizer (its ``init`` makes the slots).
    salt: the id map's hash salt.
    bound: the rows a bounded table may hold (0: unbounded); growth stops near it.
    init_rows: ``ids -> float32 [len(ids), dim]``, the initial values of created rows.
  """

  def __init__(
    self,
    dim: int,
    dtype: np.dtype,
    opt: RowOptimizer,
    salt: int,
    bound: int,
    init_rows: Callable[[np.ndarray], np.ndarray],
  ):
    self.dim, self.dtype, self.opt, self.salt, self.bound = dim, dtype, opt, salt, bound
    self.init_rows = init_rows
    self.clear()

  def clear(self) -> None:
    """Holds no row; forgets what changed since the last snapshot."""
    d = self.dim
    self.ids = IdMap(capacity=1, salt=self.salt)
    self.weights = np.zeros((0, d), self.dtype)
    self.slots: Dict[str, np.ndarray] = self.opt.init(0, d)
    self.last_seen = np.zeros((0,), np.int64)
    self.freq = np.zeros((0,), np.uint32)
    self.dirty = np.zeros((0,), bool)
    self.forget_changes()

  def forget_changes(self) -> None:
    """A snapshot took every change: no row is dirty, no id deleted or spilled since."""
    self.dirty[: self.size] = False
    self.deleted: List[np.ndarray] = []  # ids dropped (eviction without tier, expiry) since the last snapshot
    self.spilled: List[np.ndarray] = []  # ids whose rows went to the tier since the last snapshot

  @property
  def size(self) -> int:
    return self.ids.size

  def keys(self) -> np.ndarray:
    """The id of each row, ``[size]`` (a view: copy before the rows change)."""
    return self.ids.keys()

  def reserve(self, n: int) -> None:
    cap = self.weights.shape[0]
    if n <= cap:
      return
    grow_to = 2 * cap
    if self.bound:  # a bounded table never needs much more than its capacity
      grow_to = min(grow_to, self.bound + self.bound // 4)
    cap = max(n, grow_to, 1024)
    used = self.ids.size

    def grown(a: np.ndarray) -> np.ndarray:
      # Uninitialised on purpose: every row past ``used`` is written by insert before it is read.
      out = np.empty((cap,) + a.shape[1:], a.dtype)
      out[:used] = a[:used]
      return out

    self.weights = grown(self.weights)
    self.last_seen, self.freq, self.dirty = grown(self.last_seen), grown(self.freq), grown(self.dirty)
    self.slots = {k: grown(v) for k, v in self.slots.items()}

  def insert(
    self,
    ids: np.ndarray,
    weights: Optional[np.ndarray],
    slots: Optional[Mapping[str, np.ndarray]],
    step: int,
    absent: bool = False,
  ) -> np.ndarray:
    """Adds rows for absent ids, seen at ``step``: ``weights`` and ``slots`` given, or (None) their
    initial values; returns their rows.

    ``absent``: the caller has just found none of the ids in RAM (``IdMap.insert`` skips that check).
    """
    self.reserve(self.ids.size + ids.shape[0])
    rows = self.ids.insert(ids, absent=absent)
    if weights is not None:
      self.weights[rows] = weights.astype(self.dtype, copy=False)
    if slots is not None:
      for k in self.slots:
        self.slots[k][rows] = slots[k]
    if weights is None or slots is None:
      # A block at a time, so creating many rows holds no temporaries of their full size.
      for a in range(0, ids.shape[0], INIT_BLOCK_ROWS):
        r = rows[a : a + INIT_BLOCK_ROWS]
        if weights is None:
          self.weights[r] = self.init_rows(ids[a : a + INIT_BLOCK_ROWS])
        if slots is None:
          fresh = self.opt.init(r.shape[0], self.dim)
          for k in self.slots:
            self.slots[k][r] = fresh[k]
    self.last_seen[rows] = step
    self.freq[rows] = 0
    self.dirty[rows] = True
    return rows

  def keep_only(self, keep: np.ndarray) -> None:
    """Shrinks to the rows where ``keep`` is True.

    The kept rows past the new end move into the holes below it (``IdMap.drop_rows``), so an
    eviction costs as many rows as it drops, not the whole cache, and needs no second copy of
    it. Row order changes; nothing depends on it (eviction breaks ties by id).
    """
    holes, movers = self.ids.drop_rows(np.flatnonzero(~keep[: self.ids.size]))
    if holes.shape[0]:
      for arr in (self.weights, self.last_seen, self.freq, self.dirty, *self.slots.values()):
        kernels.move_rows(arr.reshape(arr.shape[0], -1).view(np.uint8), holes, movers)

  def row_bytes(self) -> int:
    """Bytes a row takes in RAM: weights, slots, last seen, count, dirty flag and its id."""
    slot_bytes = sum(v.dtype.itemsize * int(np.prod(v.shape[1:])) for v in self.slots.values())
    return self.weights.dtype.itemsize * self.dim + slot_bytes + 8 + 8 + 4 + 1
