"""The bounds of a table: admission, eviction and expiry, and the state they keep.

A ``Table`` may hold at most a row capacity (evicting the least recently used rows, or the
least frequently used with recency as tie-break), forget rows unseen for ``expire_after``
steps, and admit ids selectively (a row is created only once its id was seen ``admit_after``
times, counted in a count-min sketch, or with probability ``admit_probability``).

What these decisions read is state, and a snapshot carries all of it, so that a resume
evicts, expires and admits exactly as the run would have without a stop: per row, the step it
was last looked up and its lookup count (``Table.snapshot_parts`` writes them next to the
weights, with each row's place, RAM or tier); per table and shard, the table's step, the step
of its last expiry check and the sketch (``bounds_state`` / ``restore_bounds_state`` here).

Eviction chooses from the rows' state alone, never from where rows sit in RAM (a restored
table holds them in another order): ties of the score go to the smaller hash of the id.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

import numpy as np

from recsys_jax.async_ps.hashing import splitmix64, uniform01

_EVICT_FRACTION = 0.2  # evict down to 80% of capacity, so rebuilds are amortised
SKETCH_DEPTH = 4
_TIE_SALT = np.uint64(0x2545F4914F6CDD1D)


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


def merge_states(states: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
  """One bounds state from several shards' (``Bounds.bounds_state``): the latest step and
  expiry check of any, and the sketches' maximum cell by cell (None if none has a sketch).

  Every shard hashes an id into the same cells, and an id is counted in one shard only, so
  the maximum never counts an id below its count (a count-min sketch may over-count, never
  under-count), whichever shard it goes to now, and over-counts less than the sum would.
  """
  sketches = [np.asarray(st["sketch"], np.uint8) for st in states if st.get("sketch") is not None]
  return {
    "step": max((int(st.get("step", 0)) for st in states), default=0),
    "last_expiry_check": max((int(st.get("last_expiry_check", 0)) for st in states), default=0),
    "sketch": np.maximum.reduce(sketches) if sketches else None,
  }


class Bounds:
  """Admission, eviction and expiry of a ``Table`` (a mixin over its rows, step and counters).

  Per row the table keeps ``_last_seen`` (the step of its last training lookup; -1: not known,
  stamped at the next one) and ``_freq`` (its lookups since it came to RAM).
  """

  def _init_bounds(self) -> None:
    s = self.spec
    self._admission = s.admit_after > 1 or s.admit_probability < 1.0
    self._sketch = np.zeros((SKETCH_DEPTH, s.admission_sketch_width), np.uint8) if s.admit_after > 1 else None
    self._sketch_salts = splitmix64(np.arange(1, SKETCH_DEPTH + 1, dtype=np.uint64) ^ self.seed)
    self.step = 0
    self._last_expiry_check = 0
    self._unstamped = False  # some rows were restored without a last-seen step

  @property
  def tracks_use(self) -> bool:
    """Whether lookups keep each row's last-seen step and count (only eviction and expiry read them)."""
    return bool(self.capacity or self.spec.expire_after)

  # -- admission ----------------------------------------------------------------------
  def _admit(self, ids: np.ndarray) -> np.ndarray:
    """Which of these unseen ids may get a row now (counts them in the sketch first)."""
    s = self.spec
    ok = np.ones(ids.shape[0], bool)
    if self._sketch is not None:
      w = self._sketch.shape[1]
      cols = (splitmix64(ids[None, :] ^ self._sketch_salts[:, None]) % np.uint64(w)).astype(np.int64)
      flat = (np.arange(SKETCH_DEPTH)[:, None] * w + cols).ravel()
      # Several ids of one call may share a cell: add their counts (a count-min sketch must
      # never under-count), saturating at 255.
      cells, n = np.unique(flat, return_counts=True)
      sk = self._sketch.reshape(-1)
      sk[cells] = np.minimum(sk[cells].astype(np.int64) + n, 255).astype(np.uint8)
      ok &= sk[flat].reshape(SKETCH_DEPTH, -1).min(axis=0) >= s.admit_after
    if s.admit_probability < 1.0:
      u = uniform01(splitmix64(ids ^ self.seed ^ np.uint64(self.step * 0x9E3779B97F4A7C15 % 2**64)))
      ok &= u < s.admit_probability
    return ok

  # -- bounds -------------------------------------------------------------------------
  def _stamp(self) -> None:
    """Rows restored without a last-seen step (older snapshots; rows that were in the tier, now
    in RAM) count as seen at this, the first training lookup after the restore."""
    n = self.num_rows
    unknown = np.flatnonzero(self._last_seen[:n] < 0)
    self._last_seen[unknown] = self.step
    self._dirty[unknown] = True
    self._unstamped = False

  def _evict(self) -> None:
    n = self.num_rows
    s = self.spec
    if s.expire_after and self.step - self._last_expiry_check >= max(1, s.expire_after // 8):
      self._last_expiry_check = self.step
      old = self._last_seen[:n] < self.step - s.expire_after
      if old.any():
        # Expired rows are forgotten (not spilled); rows already in the tier stay there.
        self._deleted.append(self._ids.keys()[old].copy())
        self.counters["expirations"] += int(old.sum())
        self._keep_only(~old)
        n = self.num_rows
    if not self.capacity or n <= self.capacity:
      return
    target = int(self.capacity * (1 - _EVICT_FRACTION))
    candidates = np.flatnonzero(self._last_seen[:n] < self.step - self.protect_steps + 1)
    k = min(n - target, candidates.shape[0])
    if k <= 0:
      return
    if s.eviction == "lfu":
      score = self._freq[candidates].astype(np.int64) * (2**40) + self._last_seen[candidates]
    else:
      score = self._last_seen[candidates]
    victims = np.sort(candidates[lowest(score, self._ids.keys()[candidates], k, self.seed)])
    ids = self._ids.keys()[victims].copy()
    if self.tier is not None:
      self.tier.write(ids, self._weights[victims], {k2: v[victims] for k2, v in self._slots.items()})
      self._spilled_ids.append(ids)
      self.counters["spilled"] += k
    else:
      self._deleted.append(ids)
    self.counters["evictions"] += k
    keep = np.ones(n, bool)
    keep[victims] = False
    self._keep_only(keep)

  # -- the table's state in snapshots ---------------------------------------------------
  def bounds_state(self) -> Dict[str, Any]:
    """The table's step, the step of its last expiry check and its admission sketch (or None)."""
    with self.lock:
      sketch = None if self._sketch is None else self._sketch.copy()
      return {"step": int(self.step), "last_expiry_check": int(self._last_expiry_check), "sketch": sketch}

  def check_bounds_state(self, state: Mapping[str, Any]) -> None:
    """Raises ValueError if ``state`` cannot be restored into this table (a sketch of another shape)."""
    sketch = state.get("sketch")
    if sketch is not None and self._sketch is not None and np.shape(sketch) != self._sketch.shape:
      raise ValueError(
        f"table {self.spec.name!r}: snapshot admission sketch {np.shape(sketch)} does not match "
        f"{self._sketch.shape} (was admission_sketch_width changed?)"
      )

  def restore_bounds_state(self, state: Mapping[str, Any]) -> None:
    """Merges a ``bounds_state`` into this table's: the steps by max, the sketch cell by cell by max.

    All three only grow during a run, so merging the states of a snapshot chain gives the last
    one's. A sketch saved by a table without one (``admit_after`` was 1) leaves it as it is.
    """
    self.check_bounds_state(state)
    sketch = state.get("sketch")
    with self.lock:
      self.step = max(self.step, int(state.get("step", 0)))
      self._last_expiry_check = max(self._last_expiry_check, int(state.get("last_expiry_check", 0)))
      if sketch is not None and self._sketch is not None:
        np.maximum(self._sketch, np.asarray(sketch, np.uint8), out=self._sketch)
