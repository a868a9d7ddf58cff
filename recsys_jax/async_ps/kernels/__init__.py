"""Compiled (numba) kernels for the parameter server's hot loops: id lookup and row updates.

The numpy versions of these loops (``IdMap``'s vectorised probing rounds, gather -> update ->
scatter through the pure ``RowOptimizer.update``) make many full passes over the touched rows
and allocate a temporary per operation. Here each id is hashed and probed once, and each
touched row is read and written once, in place.

The kernels live by path: ``lookup`` (the id map's hashing and probing, the row gather and
moves), ``update`` (the fused row-optimizer updates), ``fileio`` (reads of rows from files);
``jit`` holds the numba options and the prefetching they share. This module gathers the public
names of the first two, and ``read_only``, which callers pass arrays through so that each
kernel has one signature.
"""

from __future__ import annotations

import numpy as np

from recsys_jax.async_ps.kernels.lookup import (
  find,
  first_repeat,
  gather_rows,
  init_uniform,
  move_rows,
  place,
  relabel,
  remove,
  splitmix64,
)
from recsys_jax.async_ps.kernels.update import (
  adagrad_apply,
  adam_apply,
  ftrl_apply,
  rowwise_adagrad_apply,
  sgd_apply,
)


def read_only(x: np.ndarray) -> np.ndarray:
  """``x``, or a read-only view of it (no copy).

  numba compiles a kernel once per argument type, and a read-only array is another type than a
  writable one: ids and gradients arrive read-only from the wire, or writable from numpy, so
  passing every input through here halves what a server compiles (and warms up, ``warmup``).
  """
  if not x.flags.writeable:
    return x
  v = x.view()
  v.flags.writeable = False
  return v


__all__ = [
  "read_only",
  "splitmix64",
  "find",
  "place",
  "remove",
  "relabel",
  "first_repeat",
  "gather_rows",
  "init_uniform",
  "move_rows",
  "sgd_apply",
  "adagrad_apply",
  "rowwise_adagrad_apply",
  "adam_apply",
  "ftrl_apply",
]
