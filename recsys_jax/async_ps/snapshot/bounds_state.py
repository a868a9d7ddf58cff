"""The bounds state a snapshot carries per table and shard (``Table.bounds_state``: the table's
step, the step of its last expiry check, the admission sketch), merged when a restore puts
several old shards' rows into one new shard."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

import numpy as np


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
