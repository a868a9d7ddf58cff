"""Rows with their optimizer slots, as they leave and enter a table: their slots' widths and the checks.

``Table.export_rows`` / ``import_rows`` move chosen rows with their optimizer slots out of a
table and back (the trainer's hot rows go to the accelerator and come back), and snapshots
carry every row with its slots; ``check_rows`` is what every way in (an import, a snapshot,
a remote import) checks before anything is written.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Mapping, Tuple

import numpy as np

from recsys_jax.async_ps.optim import optimizers
from recsys_jax.async_ps.store.ids import distinct_ids
from recsys_jax.embeddings.specs import TableSpec

Slots = Dict[str, np.ndarray]


@functools.lru_cache(maxsize=None)
def slot_widths(spec: TableSpec) -> Dict[str, int]:
  """The optimizer slots of a table's rows: name -> width (float32 values per row); one dict per spec, shared."""
  fresh = optimizers.make(spec.optimizer, **dict(spec.optimizer_kwargs)).init(0, spec.dim)
  return {k: int(v.shape[1]) for k, v in fresh.items()}


def check_rows(
  spec: TableSpec, ids: Any, weights: Any, slots: Mapping[str, Any], what: str = "import"
) -> Tuple[np.ndarray, np.ndarray, Slots]:
  """Checks rows with their optimizer slots for a table, before anything is written.

  Args:
    spec: the table's spec (its optimizer's slots' names and widths).
    ids: distinct ids (unsigned or non-negative integers), 1-D.
    weights: [len(ids), dim] values (converted to float32).
    slots: exactly the optimizer's slots by name, each [len(ids), width] (converted to float32).
    what: what the rows are, for the errors ("import", "snapshot").

  Returns:
    (uint64 ids, float32 weights, float32 slots).

  Raises:
    ValueError: naming the table and what is wrong (ids, shapes, repeated ids, slot names).
  """
  name = spec.name
  ids = distinct_ids(ids, name, f"{what} ids")
  n, dim = ids.shape[0], spec.dim
  weights = np.asarray(weights, np.float32)
  if weights.shape != (n, dim):
    raise ValueError(f"table {name!r}: {what} weights {weights.shape} do not match ids ({n},) and dim {dim}")
  want = {k: (n, w) for k, w in slot_widths(spec).items()}
  extra = sorted(set(slots) - set(want))
  if extra:
    raise ValueError(
      f"table {name!r}: {what} has optimizer slots {extra} that its {spec.optimizer} optimizer does not "
      f"keep (it keeps {sorted(want)})"
    )
  out = {}
  for k, shape in want.items():
    arr = slots.get(k)
    if arr is None:
      raise ValueError(f"table {name!r}: {what} lacks optimizer slot {k!r} of shape {shape}")
    if np.shape(arr) != shape:
      raise ValueError(f"table {name!r}: {what} optimizer slot {k!r} is {np.shape(arr)}, expected {shape}")
    out[k] = np.asarray(arr, np.float32)
  return ids, weights, out
