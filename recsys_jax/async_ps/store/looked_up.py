"""The rows a table's training lookups found, kept for their steps' pushes.

In a table whose rows never move (no bound, no tier: ``Table.plain`` and the unbounded tables of
reduced-precision storage alike), a row stays where it was created until a restore. So the push
of a step, which the trainer makes with the very ids array it looked up, needs no second probe of
the id map (a random read per id: about a fifth of the push at batch 65536).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

REMEMBERED_STEPS = 8
"""Lookups kept: more than any staleness bound in use keeps in flight (k + 2 at most are); older
ones are dropped, and their pushes look the ids up."""


class LookedUp:
  """step -> (the ids array a lookup or resolve was given, its rows); the caller holds the table's lock."""

  def __init__(self) -> None:
    self.steps: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}

  def __contains__(self, step: int) -> bool:
    return step in self.steps

  def __len__(self) -> int:
    return len(self.steps)

  def clear(self) -> None:
    """Forgets every lookup (a restore numbers the rows anew)."""
    self.steps = {}

  def remember(self, step: int, ids: np.ndarray, rows: np.ndarray) -> None:
    """Keeps a training lookup's rows for the push of its step (``recall``)."""
    ids.flags.writeable = False  # what the trainer pushes is what it looked up: no one edits it meanwhile
    self.steps[int(step)] = (ids, rows)
    while len(self.steps) > REMEMBERED_STEPS:
      del self.steps[min(self.steps)]

  def resolved(self, step: Optional[int], ids: np.ndarray) -> Optional[np.ndarray]:
    """The rows kept for ``step`` if ``ids`` is the array that lookup (or resolve) was given; None otherwise."""
    if step is None:
      return None
    kept = self.steps.get(int(step))
    return kept[1] if kept is not None and kept[0] is ids else None

  def recall(self, step: Optional[int], ids: np.ndarray) -> Optional[np.ndarray]:
    """``resolved``, forgotten then (the push of ``step`` is its last use)."""
    rows = self.resolved(step, ids)
    if rows is not None:
      assert step is not None  # resolved finds rows for a step only
      del self.steps[int(step)]
    return rows
