"""Compiled (numba) kernels for the parameter server's hot loops: id lookup and row updates.

The numpy versions of these loops (``IdMap``'s vectorised probing rounds, gather -> update ->
scatter through the pure ``RowOptimizer.update``) make many full passes over the touched rows
and allocate a temporary per operation, which kept the PS at a few percent of memcpy
bandwidth. Here each id is hashed and probed once, and each touched row is read and written
once, in place.

The kernels live by path: ``kernels_lookup`` (the id map's hashing and probing, the row
gather), ``kernels_update`` (the fused row-optimizer updates); ``kernels_jit`` holds the
numba options and the prefetching they share. This module gathers their public names.
"""

from __future__ import annotations

from recsys_jax.async_ps.kernels_lookup import find, first_repeat, gather_rows, place, splitmix64
from recsys_jax.async_ps.kernels_update import (
  adagrad_apply,
  adam_apply,
  ftrl_apply,
  rowwise_adagrad_apply,
  sgd_apply,
)

__all__ = [
  "splitmix64",
  "find",
  "place",
  "first_repeat",
  "gather_rows",
  "sgd_apply",
  "adagrad_apply",
  "rowwise_adagrad_apply",
  "adam_apply",
  "ftrl_apply",
]
