"""Per-table dedup of a batch's sparse ids, on the host, into static-shaped arrays.

For every group of tables that share a row width, the unique ids of each table are laid
end to end in one ``rows`` array whose length is rounded up to a bucket from a geometric
grid (four sizes per octave). The jitted step receives that array and an ``inverse`` index
[B, F, L] into it, never raw ids, and because unique counts vary little from batch to
batch a run compiles once or twice per group.

The distinct ids of a table and each id's place among them are found by a compiled kernel
(:func:`unique_inverse`: one pass through a hash table, then a sort of the distinct ids only),
which gives exactly ``np.unique(ids, return_inverse=True)`` at a fraction of its cost (most
tables see far fewer distinct ids than ids) and drops the GIL, so batches can be
deduplicated on several threads at once (``recsys_jax/training/feed.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numba
import numpy as np

from recsys_jax.embeddings.specs import FeatureSpec, TableSpec

MIN_BUCKET = 64
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@numba.njit(nogil=True, cache=True)
def _unique_inverse(ids, inverse, offset):
  """Sorted distinct ``ids`` (uint64 [n]); writes ``inverse[i] = offset + ``the place of ``ids[i]`` among them."""
  n = ids.shape[0]
  cap = 16
  while cap < 2 * n:
    cap *= 2
  mask = np.uint64(cap - 1)
  slot_key = np.empty(cap, np.uint64)
  slot_of = np.full(cap, -1, np.int64)  # index into ``seen`` of the id in each slot; -1: empty
  seen = np.empty(n, np.uint64)  # distinct ids in order of first occurrence
  local = np.empty(n, np.int64)
  k = 0
  for i in range(n):
    x = ids[i]
    h = x ^ (x >> np.uint64(31))  # splitmix64's finaliser: test ids are small, real ids hashed already
    h *= _MIX1
    h ^= h >> np.uint64(27)
    h *= _MIX2
    pos = np.int64(h & mask)
    while True:
      j = slot_of[pos]
      if j < 0:
        slot_key[pos] = x
        slot_of[pos] = k
        seen[k] = x
        local[i] = k
        k += 1
        break
      if slot_key[pos] == x:
        local[i] = j
        break
      pos = (pos + 1) & np.int64(mask)
  order = np.argsort(seen[:k])
  rank = np.empty(k, np.int64)
  uniq = np.empty(k, np.uint64)
  for r in range(k):
    rank[order[r]] = r
    uniq[r] = seen[order[r]]
  for i in range(n):
    inverse[i] = offset + rank[local[i]]
  return uniq


def unique_inverse(ids: np.ndarray, offset: int = 0) -> Tuple[np.ndarray, np.ndarray]:
  """``(np.unique(ids), inverse + offset as int32)`` of ``np.unique(ids, return_inverse=True)``, compiled."""
  ids = np.ascontiguousarray(ids, np.uint64).reshape(-1)
  inverse = np.empty(ids.shape[0], np.int32)
  return _unique_inverse(ids, inverse, np.int64(offset)), inverse


def bucket_size(n: int, min_bucket: int = MIN_BUCKET) -> int:
  """The smallest size >= n on the grid {4, 5, 6, 7} x 2^e (at least ``min_bucket``)."""
  if n <= min_bucket:
    return min_bucket
  e = max(0, math.floor(math.log2(n)) - 2)
  for m in (4, 5, 6, 7, 8):
    if m << e >= n:
      return m << e
  raise AssertionError("unreachable")


@dataclasses.dataclass
class Group:
  """The deduplicated ids of all tables of one row width, ready for PS lookup."""

  dim: int
  features: Tuple[str, ...]
  """Features of this group, in the order of the inverse's F axis."""
  tables: List[Tuple[str, np.ndarray, int]]
  """(table name, its distinct ids, offset of its first row in the group's rows array)."""
  inverse: np.ndarray
  """int32 [B, F, L]: row of each id in the group's rows array (padding points at row 0)."""
  weights: Optional[np.ndarray]
  """float32 [B, F, L] pooling weights (0 for padding; scaled for 'mean' and 'sqrtn'; for
  sequences the reader's weights, 0 = padding), or None if all 1."""
  num_rows: int
  """Distinct ids over the group's tables."""
  bucket: int
  """Length of the padded rows array (static shape)."""


def aliased(
  batch: Mapping[str, Any], aliases: Mapping[str, str]
) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
  """(ids, weights) of a batch's features, with each alias reading the ids (and weights) of its
  source feature (e.g. first-order terms read the same ids as the embedding of that feature)."""
  sparse, weights = dict(batch["sparse"]), dict(batch.get("sparse_weights") or {})
  for name, source in aliases.items():
    sparse[name] = sparse[source]
    if source in weights:
      weights[name] = weights[source]
  return sparse, weights


def dedup(
  sparse: Mapping[str, np.ndarray],
  features: Sequence[FeatureSpec],
  tables: Mapping[str, TableSpec],
  sparse_weights: Optional[Mapping[str, np.ndarray]] = None,
  min_bucket: Union[int, Mapping[int, int]] = MIN_BUCKET,
) -> Dict[int, Group]:
  """Deduplicates the ids of a batch per table and groups tables by row width.

  Args:
    sparse: feature name -> uint64 ids [B, L] with L <= the feature's ``max_len``.
    features: the feature specs, in model order.
    tables: table specs by name.
    sparse_weights: optional feature name -> float32 [B, L]; 0 marks padding.
    min_bucket: the smallest rows bucket, or one per row width (several trainer processes
      pass each group's worst case, so every process's rows array has the same static shape).

  Returns:
    Row width -> ``Group``.
  """
  sparse_weights = sparse_weights or {}
  by_dim: Dict[int, List[FeatureSpec]] = {}
  for f in features:
    by_dim.setdefault(tables[f.table].dim, []).append(f)
  out = {}
  for dim, feats in by_dim.items():
    batch = None
    max_len = max(f.max_len for f in feats)
    ids_of, valid_of, w_of = {}, {}, {}
    any_weights = False
    for f in feats:
      if f.name not in sparse:
        raise KeyError(f"batch has no sparse feature {f.name!r}")
      ids = np.asarray(sparse[f.name])
      if ids.ndim == 1:
        ids = ids[:, None]
      if ids.ndim != 2 or ids.shape[1] > f.max_len:
        raise ValueError(f"feature {f.name!r}: ids have shape {ids.shape}, expected [B, <= {f.max_len}]")
      if batch is None:
        batch = ids.shape[0]
      elif ids.shape[0] != batch:
        raise ValueError(f"feature {f.name!r} has {ids.shape[0]} rows, others {batch}")
      w = sparse_weights.get(f.name)
      pad = max_len - ids.shape[1]
      ids_of[f.name] = ids.astype(np.uint64, copy=False)
      if w is None and not pad and (f.kind != "pooled" or f.combiner == "sum" or ids.shape[1] == 1):
        valid_of[f.name], w_of[f.name] = None, None  # every weight 1 (a one-hot bag's mean is its id too)
        continue
      w = np.ones(ids.shape, np.float32) if w is None else np.asarray(w, np.float32).reshape(ids.shape)
      if f.kind == "pooled" and f.combiner == "mean":
        w = w / np.maximum(w.sum(axis=1, keepdims=True), np.float32(1e-12))
      elif f.kind == "pooled" and f.combiner == "sqrtn":
        w = w / np.maximum(np.sqrt((w * w).sum(axis=1, keepdims=True)), np.float32(1e-12))
      if pad:
        ids_of[f.name] = np.pad(ids_of[f.name], ((0, 0), (0, pad)))
        w = np.pad(w, ((0, 0), (0, pad)))
      any_weights |= bool((w != 1.0).any())
      valid_of[f.name], w_of[f.name] = w != 0, w
    inverse = np.zeros((batch, len(feats), max_len), np.int32)
    group_tables = []
    offset = 0
    for tname in dict.fromkeys(f.table for f in feats):
      cols = [i for i, f in enumerate(feats) if f.table == tname]
      parts = []
      for i in cols:
        name, valid = feats[i].name, valid_of[feats[i].name]
        parts.append(ids_of[name].reshape(-1) if valid is None else ids_of[name][valid])
      uniq, inv = unique_inverse(np.concatenate(parts) if len(parts) > 1 else parts[0], offset)
      start = 0
      for i, part in zip(cols, parts):
        valid, n = valid_of[feats[i].name], part.shape[0]
        if valid is None:  # every slot holds an id (no padding in this feature)
          inverse[:, i, :] = inv[start : start + n].reshape(batch, max_len)
        else:
          inverse[:, i, :][valid] = inv[start : start + n]
        start += n
      group_tables.append((tname, uniq, offset))
      offset += uniq.shape[0]
    weights = None
    if any_weights:
      weights = np.stack(
        [np.ones((batch, max_len), np.float32) if w_of[f.name] is None else w_of[f.name] for f in feats], axis=1
      )
    out[dim] = Group(
      dim,
      tuple(f.name for f in feats),
      group_tables,
      inverse,
      weights,
      offset,
      bucket_size(offset, min_bucket.get(dim, MIN_BUCKET) if isinstance(min_bucket, Mapping) else min_bucket),
    )
  return out
