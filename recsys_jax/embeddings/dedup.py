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
import threading
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numba
import numpy as np

from recsys_jax.embeddings.specs import FeatureSpec, TableSpec

MIN_BUCKET = 64
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@numba.njit(nogil=True, cache=True, inline="always")
def _home(x, mask):
  h = x ^ (x >> np.uint64(31))  # splitmix64's finaliser: test ids are small, real ids hashed already
  h *= _MIX1
  h ^= h >> np.uint64(27)
  h *= _MIX2
  return np.int64(h & mask)


@numba.njit(nogil=True, cache=True)
def radix_sort(x, tmp):
  """Sorts uint64 ``x`` with ``tmp`` (as long) as scratch, by bytes from the lowest (LSD radix,
  skipping bytes every key shares); returns whichever of the two holds the result. Four times
  numba's ``np.sort`` on the distinct ids of a table at batch 65536, 2x numpy's own."""
  n = x.shape[0]
  counts = np.zeros((8, 256), np.int64)
  for i in range(n):
    v = x[i]
    for d in range(8):
      counts[d, np.int64((v >> np.uint64(8 * d)) & np.uint64(255))] += 1
  src, dst = x, tmp
  for d in range(8):
    c = counts[d]
    if c.max() == n:  # every key has the same byte here
      continue
    total = 0
    for b in range(256):
      here = c[b]
      c[b] = total
      total += here
    shift = np.uint64(8 * d)
    for i in range(n):
      v = src[i]
      b = np.int64((v >> shift) & np.uint64(255))
      dst[c[b]] = v
      c[b] += 1
    src, dst = dst, src
  return src


@numba.njit(nogil=True, cache=True)
def _unique_inverse(ids, inverse, offset, slots, gen, seen, local, tmp):
  """Sorted distinct ``ids`` (uint64 [B, L]); writes ``inverse[b, l] = offset + ``the place of
  ``ids[b, l]`` among them (``inverse`` may be a strided view, e.g. one feature of [B, F, L]).

  ``slots`` (uint64 [cap, 2], cap a power of two >= 2 * B * L) is the caller's scratch hash
  table, reused across calls without clearing: a slot belongs to this call only if its tag's
  high half is ``gen`` (0 is never a generation, so a zeroed table is empty); each slot holds an
  id and ``gen << 32 | its index in seen``, in one cache line. ``seen`` (uint64) and ``local``
  (int32) and ``tmp`` (uint64), at least B * L long, are scratch too.
  """
  mask = np.uint64(slots.shape[0] - 1)
  imask = np.int64(mask)
  g = np.uint64(gen) << np.uint64(32)
  k = 0
  i = 0
  for b in range(ids.shape[0]):
    for j in range(ids.shape[1]):
      x = ids[b, j]
      pos = _home(x, mask)
      while True:
        tag = slots[pos, 1]
        if (tag >> np.uint64(32)) != np.uint64(gen):  # free in this call
          slots[pos, 0] = x
          slots[pos, 1] = g | np.uint64(k)
          seen[k] = x
          local[i] = k
          k += 1
          break
        if slots[pos, 0] == x:
          local[i] = np.int32(tag & np.uint64(0xFFFFFFFF))
          break
        pos = (pos + 1) & imask
      i += 1
  uniq = radix_sort(seen[:k], tmp[:k]).copy()
  rank = np.empty(k, np.int32)
  for r in range(k):  # each distinct id's place among them, through the slot that holds it
    x = uniq[r]
    pos = _home(x, mask)
    while slots[pos, 0] != x:  # no earlier slot of its probe run can hold it from an older call
      pos = (pos + 1) & imask
    rank[np.int64(slots[pos, 1] & np.uint64(0xFFFFFFFF))] = r
  i = 0
  for b in range(ids.shape[0]):
    for j in range(ids.shape[1]):
      inverse[b, j] = offset + rank[local[i]]
      i += 1
  return uniq


class _Scratch(threading.local):
  """Each thread's hash table and buffers for ``unique_inverse``, grown as needed, never cleared
  (generations tell this call's slots from older ones): a table of 2 MB cleared per call cost
  more than deduplicating a table of few distinct ids."""

  def __init__(self):
    self.slots = np.zeros((16, 2), np.uint64)
    self.seen = np.empty(0, np.uint64)
    self.local = np.empty(0, np.int32)
    self.tmp = np.empty(0, np.uint64)
    self.gen = 0

  def take(self, n: int):
    cap = self.slots.shape[0]
    if cap < 2 * n:
      while cap < 2 * n:
        cap *= 2
      self.slots, self.gen = np.zeros((cap, 2), np.uint64), 0
    if self.seen.shape[0] < n:
      self.seen, self.local, self.tmp = np.empty(n, np.uint64), np.empty(n, np.int32), np.empty(n, np.uint64)
    self.gen += 1
    if self.gen >= 1 << 32:  # every generation used: clear once, start again
      self.slots[:] = 0
      self.gen = 1
    return self.slots, self.gen, self.seen, self.local, self.tmp


_scratch = _Scratch()


def unique_inverse(ids: np.ndarray, offset: int = 0, out: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
  """``(np.unique(ids), inverse + offset as int32)`` of ``np.unique(ids, return_inverse=True)``, compiled.

  Args:
    ids: uint64 ids, any shape (a 2-D [B, L] array is read in place, strided or not).
    offset: added to every inverse index.
    out: int32 array of ``ids``' 2-D shape to write the inverse into (e.g. a strided view of one
      feature's columns in a [B, F, L] inverse); None: a new flat array.

  Returns:
    The sorted distinct ids and the inverse (``out`` if given).
  """
  ids = np.asarray(ids)
  if ids.dtype != np.uint64:
    ids = ids.astype(np.uint64)
  ids2 = ids.reshape(ids.shape[0], -1) if ids.ndim == 2 else ids.reshape(-1, 1)
  inverse = np.empty(ids2.shape, np.int32) if out is None else out
  if inverse.shape != ids2.shape or inverse.dtype != np.int32:
    raise ValueError(f"unique_inverse: out is {inverse.dtype} {inverse.shape}, expected int32 {ids2.shape}")
  uniq = _unique_inverse(ids2, inverse, np.int64(offset), *_scratch.take(ids2.size))
  return uniq, (inverse.reshape(-1) if out is None else out)


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
      if len(cols) == 1 and valid_of[feats[cols[0]].name] is None:  # one feature, no padding: in place
        uniq, _ = unique_inverse(ids_of[feats[cols[0]].name], offset, out=inverse[:, cols[0], :])
        group_tables.append((tname, uniq, offset))
        offset += uniq.shape[0]
        continue
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
