"""The bounds of a table: admission, eviction and expiry, and the state they keep.

A ``Table`` may hold at most a row capacity (evicting the least recently used rows, or the
least frequently used with recency as tie-break), forget rows unseen for ``expire_after``
steps, and admit ids selectively (a row is created only once its id was seen ``admit_after``
times, counted in a count-min sketch, or with probability ``admit_probability``).

What these decisions read is state, and a snapshot carries all of it, so that a resume
evicts, expires and admits exactly as the run would have without a stop: per row, the step it
was last looked up and its lookup count (``Table.snapshot_parts`` writes them next to the
weights, with each row's place, RAM or tier); per table and shard, the table's step, the step
of its last expiry check and the sketch (``Table.bounds_state`` / ``restore_bounds_state``).

Eviction chooses from the rows' state alone, never from where rows sit in RAM (a restored
table holds them in another order): ties of the score go to the smaller hash of the id.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import numpy as np

from recsys_jax.async_ps.store.columns import Columns
from recsys_jax.embeddings.specs import TableSpec
from recsys_jax.hashing import splitmix64, uniform01

SKETCH_DEPTH = 4
_TIE_SALT = np.uint64(0x2545F4914F6CDD1D)

EVICT_FRACTION = 0.2  # evict down to 80% of capacity, so rebuilds are amortised
EVICT_INSERTS = 4
"""A tiered table's eviction also makes room for this many times the rows the call that caused it
brought into RAM, so that a table whose misses a step come near its capacity evicts every few
steps, not after every lookup: an eviction's fixed cost (choosing, copying out, appending,
closing holes) is hundreds of microseconds a table, more than its rows' at the main job's shape
(docs/performance.md, "Tables larger than RAM"). A table without a tier loses what it evicts, so
it evicts only down to ``1 - EVICT_FRACTION`` of its capacity."""


def lowest(score: np.ndarray, ids: np.ndarray, k: int, salt: int) -> np.ndarray:
  """Indices of the ``k`` smallest ``score``, ties to the smaller ``splitmix64(id ^ salt)``.

  splitmix64 is a bijection, so distinct ids never tie again: the choice depends on the
  (id, score) pairs only, not on their order.
  """
  if k >= score.shape[0]:
    return np.arange(score.shape[0])
  kth = np.partition(score, k - 1)[k - 1]
  below = np.flatnonzero(score < kth)
  tied = np.flatnonzero(score == kth)
  need = k - below.shape[0]  # >= 1: at most k - 1 scores are below the k-th smallest
  if need < tied.shape[0]:
    keys = splitmix64(ids[tied] ^ np.uint64(salt) ^ _TIE_SALT)
    tied = tied[np.argpartition(keys, need - 1)[:need]]
  return np.concatenate([below, tied])


class Bounds:
  """A table's admission, expiry and eviction choices, and the state they keep of their own.

  The per-row state (last seen, count) is the table's ``Columns``; this object holds the table's
  step, the step of its last expiry check and the admission sketch, decides which unseen ids get
  a row, which rows expire, and which rows an eviction takes. What happens to chosen rows
  (dropped, or spilled to the tier) is the table's business.

  Args:
    spec: the table's spec (``capacity`` aside: the table's shard has its own).
    seed: the table's seed (``name_seed``): salts the sketch, admission by chance and ties.
    capacity: rows the table may hold in RAM (0: unbounded).
    protect_steps: rows looked up within this many steps are never evicted.
    tiered: evicted rows spill to a tier (evict for room ahead) rather than being lost.
  """

  def __init__(self, spec: TableSpec, seed: np.uint64, capacity: int, protect_steps: int, tiered: bool):
    self.spec, self.seed, self.capacity, self.protect_steps, self.tiered = spec, seed, capacity, protect_steps, tiered
    self.admission = spec.admits_selectively
    self.tracks_use = bool(capacity or spec.expire_after)
    """Whether lookups keep each row's last-seen step and count (only eviction and expiry read them)."""
    self._salts = splitmix64(np.arange(1, SKETCH_DEPTH + 1, dtype=np.uint64) ^ seed)
    self.reset()

  def reset(self) -> None:
    """The state of a new table: step 0, no expiry check yet, an empty sketch."""
    s = self.spec
    self.sketch = np.zeros((SKETCH_DEPTH, s.admission_sketch_width), np.uint8) if s.admit_after > 1 else None
    self.step = 0
    self.last_expiry_check = 0
    self.unstamped = False  # some rows were restored without a last-seen step

  @property
  def nbytes(self) -> int:
    return self.sketch.nbytes if self.sketch is not None else 0

  def admit(self, ids: np.ndarray) -> np.ndarray:
    """Which of these unseen ids may get a row now (counts them in the sketch first)."""
    s = self.spec
    ok = np.ones(ids.shape[0], bool)
    if self.sketch is not None:
      w = self.sketch.shape[1]
      cols = (splitmix64(ids[None, :] ^ self._salts[:, None]) % np.uint64(w)).astype(np.int64)
      flat = (np.arange(SKETCH_DEPTH)[:, None] * w + cols).ravel()
      # Several ids of one call may share a cell: add their counts (a count-min sketch must
      # never under-count), saturating at 255.
      cells, n = np.unique(flat, return_counts=True)
      sk = self.sketch.reshape(-1)
      sk[cells] = np.minimum(sk[cells].astype(np.int64) + n, 255).astype(np.uint8)
      ok &= sk[flat].reshape(SKETCH_DEPTH, -1).min(axis=0) >= s.admit_after
    if s.admit_probability < 1.0:
      u = uniform01(splitmix64(ids ^ self.seed ^ np.uint64(self.step * 0x9E3779B97F4A7C15 % 2**64)))
      ok &= u < s.admit_probability
    return ok

  def stamp(self, cols: Columns) -> None:
    """Rows restored without a last-seen step (older snapshots; rows that were in the tier, now
    in RAM) count as seen at this, the first training lookup after the restore."""
    unknown = np.flatnonzero(cols.last_seen[: cols.size] < 0)
    cols.last_seen[unknown] = self.step
    cols.dirty[unknown] = True
    self.unstamped = False

  def expired(self, cols: Columns) -> Optional[np.ndarray]:
    """The rows to forget now (bool over the rows), or None: checked every ``expire_after // 8`` steps."""
    s = self.spec
    if not s.expire_after or self.step - self.last_expiry_check < max(1, s.expire_after // 8):
      return None
    self.last_expiry_check = self.step
    old = cols.last_seen[: cols.size] < self.step - s.expire_after
    return old if old.any() else None

  def victims(self, cols: Columns, inserted: int) -> Optional[np.ndarray]:
    """The rows an eviction takes now (sorted), or None: down to the bound, never a row looked up
    within ``protect_steps``; ``inserted``: the rows the call that caused it brought into RAM (a
    tiered table makes room for ``EVICT_INSERTS`` times as many)."""
    n = cols.size
    if not self.capacity or n <= self.capacity:
      return None
    target = int(self.capacity * (1 - EVICT_FRACTION))
    if self.tiered:  # without a tier an evicted row is lost: evict no more than the bound needs
      target = max(0, min(target, self.capacity - EVICT_INSERTS * inserted))
    candidates = np.flatnonzero(cols.last_seen[:n] < self.step - self.protect_steps + 1)
    k = min(n - target, candidates.shape[0])
    if k <= 0:
      return None
    if self.spec.eviction == "lfu":
      score = cols.freq[candidates].astype(np.int64) * (2**40) + cols.last_seen[candidates]
    else:
      score = cols.last_seen[candidates]
    return np.sort(candidates[lowest(score, cols.keys()[candidates], k, int(self.seed))])

  def state(self) -> Dict[str, Any]:
    """The table's step, the step of its last expiry check and its admission sketch (or None)."""
    sketch = None if self.sketch is None else self.sketch.copy()
    return {"step": int(self.step), "last_expiry_check": int(self.last_expiry_check), "sketch": sketch}

  def check_state(self, state: Mapping[str, Any]) -> None:
    """Raises ValueError if ``state`` cannot be restored here (a sketch of another shape)."""
    sketch = state.get("sketch")
    if sketch is not None and self.sketch is not None and np.shape(sketch) != self.sketch.shape:
      raise ValueError(
        f"table {self.spec.name!r}: snapshot admission sketch {np.shape(sketch)} does not match "
        f"{self.sketch.shape} (was admission_sketch_width changed?)"
      )

  def merge_state(self, state: Mapping[str, Any]) -> None:
    """Merges a ``state()`` into this one: the steps by max, the sketch cell by cell by max.

    All three only grow during a run, so merging the states of a snapshot chain gives the last
    one's. A sketch saved by a table without one (``admit_after`` was 1) leaves it as it is.
    """
    self.check_state(state)
    sketch = state.get("sketch")
    self.step = max(self.step, int(state.get("step", 0)))
    self.last_expiry_check = max(self.last_expiry_check, int(state.get("last_expiry_check", 0)))
    if sketch is not None and self.sketch is not None:
      np.maximum(self.sketch, np.asarray(sketch, np.uint8), out=self.sketch)
