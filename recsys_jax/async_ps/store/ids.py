"""What the PS takes as ids: unsigned or non-negative integers, as uint64 (``as_ids``), and
distinct where rows are updated (``check_distinct``); the arrays a lookup may write its rows
into (``check_out``).

numpy turns -1 into 2**64 - 1 and 1.5 into 1 without a word when it casts to uint64, and the PS
would create rows for those ids; so the clients of the PS check the ids before they cast.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Type

import numpy as np

from recsys_jax.async_ps.kernels import read_only
from recsys_jax.async_ps.kernels.lookup import first_repeat

# The repeat check's scratch table hashes ids with a salt drawn per process: the answer does not
# depend on it, only the probe chains do, so ids sent to a server cannot be chosen to crowd one.
_REPEAT_SALT = np.uint64(int.from_bytes(os.urandom(8), "little"))


def as_ids(ids: Any, table: str) -> np.ndarray:
  """``ids`` as a uint64 array, refusing anything but unsigned or non-negative integers.

  Args:
    ids: an array or sequence of ids (any shape).
    table: the table they are for, named in the error.

  Returns:
    The ids as uint64 (no copy when they already are).

  Raises:
    ValueError: naming the table, for float, bool, object or negative ids.
  """
  a = np.asarray(ids)
  if a.dtype.kind == "u" or a.size == 0:  # [] is float64 to numpy
    return a.astype(np.uint64, copy=False)
  if a.dtype.kind != "i":
    raise ValueError(f"table {table!r}: ids must be unsigned or non-negative integers, got dtype {a.dtype}")
  if (a < 0).any():
    raise ValueError(f"table {table!r}: ids must be non-negative, got {int(a.min())}")
  return a.astype(np.uint64)


def first_repeat_at(ids: np.ndarray) -> int:
  """The position of the first id that repeats an earlier one, or -1: one pass (``kernels.first_repeat``),
  not a sort."""
  if ids.shape[0] < 2:
    return -1
  return int(first_repeat(read_only(np.ascontiguousarray(ids, np.uint64)), _REPEAT_SALT))  # one kernel signature


def check_distinct(ids: np.ndarray, table: str, error: Type[ValueError] = ValueError, what: str = "ids") -> None:
  """Refuses ids that repeat: an update would apply a repeated id's gradients one after the other
  (twice in float32 storage; the last write wins in bfloat16), where the sum was meant.

  One pass over the ids (``first_repeat_at``), not a sort: ``Table.apply`` runs it on every push.

  Args:
    ids: 1-D uint64 ids.
    table: the table they are for, named in the error.
    what: what the ids are, for the error (e.g. "snapshot ids").
    error: the ``ValueError`` subclass to raise (the server's answers ``INVALID_ARGUMENT``).

  Raises:
    ``error``: naming the table and one repeated id.
  """
  i = first_repeat_at(ids)
  if i >= 0:
    raise error(f"table {table!r}: {what} are not distinct (e.g. {int(ids[i])})")


def distinct_ids(ids: Any, table: str, what: str = "ids") -> np.ndarray:
  """``ids`` as 1-D uint64 that do not repeat (``as_ids``, then ``check_distinct``).

  Raises:
    ValueError: naming the table and ``what``, for ids that are not 1-D unsigned or non-negative
      integers, or repeat.
  """
  a = as_ids(ids, table)
  if a.ndim != 1:
    raise ValueError(f"table {table!r}: {what} must be 1-D, got shape {a.shape}")
  check_distinct(a, table, what=what)
  return a


def check_out(specs: Mapping[str, Any], ids: Mapping[str, np.ndarray], out: Optional[Mapping[str, np.ndarray]]) -> None:
  """Raises ValueError unless ``out`` (if given) holds a float32 [len(ids), dim] array for every table of ``ids``."""
  if out is None:
    return
  for t, v in ids.items():
    o = out.get(t)
    if o is None or o.dtype != np.float32 or o.shape != (v.shape[0], specs[t].dim):
      have = None if o is None else f"{o.dtype} {o.shape}"
      raise ValueError(f"table {t!r}: out is {have}, expected float32 ({v.shape[0]}, {specs[t].dim})")


def route(
  ids: Mapping[str, np.ndarray], shard_of: Callable[[str, np.ndarray], np.ndarray], num_shards: int
) -> Dict[str, List[np.ndarray]]:
  """{table: ids} -> {table: [positions of the ids going to server (or shard) s, for each s]}, in id order.

  Shared by ``RemotePS`` (servers) and ``ParameterServer`` (its in-process shards).
  """
  out = {}
  for t, v in ids.items():
    if num_shards == 1:
      out[t] = [np.arange(v.shape[0])]
      continue
    server = shard_of(t, v)
    order = np.argsort(server, kind="stable")
    bounds = np.searchsorted(server[order], np.arange(num_shards + 1))
    out[t] = [order[bounds[s] : bounds[s + 1]] for s in range(num_shards)]
  return out
