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

import numpy as np

from recsys_jax.hashing import splitmix64

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
