"""Deterministic row initialisers: a row's first value depends only on (table, id, seed).

Because nothing depends on the order in which ids arrive or on which shard holds them, a
row is created identically by any number of shards, after a restore, or by a read-only
lookup that does not create it at all.
"""

from __future__ import annotations

from typing import Union

import numpy as np

from recsys_jax.async_ps import kernels
from recsys_jax.hashing import splitmix64, uniform01

_COL = np.uint64(0xD1B54A32D192ED03)
# Rows are made this many values at a time: the hashing and the float64 uniforms take ~6
# temporaries of 8 bytes a value, which for a whole request (a million rows of 64) was 2.4 GB.
_BLOCK_VALUES = 1 << 18


def _uniforms(ids: np.ndarray, dim: int, table_seed: Union[np.uint64, np.ndarray]) -> np.ndarray:
  """Uniforms in [0, 1) per (id, column): what the 'normal' rows are made from (and, in one
  compiled pass, ``kernels.init_uniform``'s)."""
  base = splitmix64(np.asarray(ids, np.uint64) ^ table_seed)
  cols = np.arange(1, dim + 1, dtype=np.uint64) * _COL
  return uniform01(splitmix64(base[:, None] ^ cols[None, :]))


def init_rows(
  ids: np.ndarray, dim: int, table_seed: Union[np.uint64, np.ndarray], kind: str = "uniform", scale: float = 0.05
) -> np.ndarray:
  """Returns float32 rows [len(ids), dim] for the ids.

  Args:
    ids: uint64 ids.
    dim: row width.
    table_seed: the table's seed (``hashing.name_seed(table_name, seed)``), or one per id (uint64
      [len(ids)]): rows of several tables made in one call, each as its own table makes it.
    kind: 'uniform' in [-scale, scale), 'normal' with std ``scale``, or 'zeros'.
    scale: the half-width or standard deviation.
  """
  ids = np.asarray(ids, np.uint64)
  n = ids.shape[0]
  if kind not in ("uniform", "normal", "zeros"):
    raise ValueError(f"unknown initializer {kind!r}; choose 'uniform', 'normal' or 'zeros'")
  seeds = np.asarray(table_seed, np.uint64)
  if seeds.ndim and seeds.shape != (n,):
    raise ValueError(f"init_rows: {seeds.shape[0]} seeds for {n} ids")
  out = np.zeros((n, dim), np.float32)
  if kind == "zeros":
    return out
  if kind == "uniform":  # one compiled pass, the same bits (the numpy form below took most of a creating lookup)
    per_id = bool(seeds.ndim)
    kernels.init_uniform(ids, seeds.reshape(-1) if per_id else seeds.reshape(1), per_id, _COL, float(scale), out)
    return out
  step = max(1, _BLOCK_VALUES // max(dim, 1))
  for a in range(0, n, step):  # element-wise, so the blocks change no value
    block = ids[a : a + step]
    table_seed = seeds[a : a + step] if seeds.ndim else seeds
    u = _uniforms(block, dim, table_seed)
    if kind == "uniform":
      out[a : a + step] = (2.0 * u - 1.0) * scale
    else:
      # Box-Muller on two independent columns of uniforms.
      u2 = _uniforms(block, dim, splitmix64(table_seed))
      out[a : a + step] = np.sqrt(-2.0 * np.log1p(-u)) * np.cos(2.0 * np.pi * u2) * scale
  return out
