"""Per-table dedup of a batch's sparse ids, on the host, into static-shaped arrays.

For every group of tables that share a row width, the unique ids of each table are laid
end to end in one ``rows`` array whose length is rounded up to a bucket from a geometric
grid (four sizes per octave). The jitted step receives that array and an ``inverse`` index
[B, F, L] into it, never raw ids, and because unique counts vary little from batch to
batch a run compiles once or twice per group.

The distinct ids of a table and each id's place among them are found by a compiled kernel
(``unique_inverse``: one pass through a hash table, then a sort of the distinct ids only),
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

from recsys_jax.embeddings.gathered import Gathered
from recsys_jax.embeddings.specs import FeatureSpec, TableSpec
from recsys_jax.prefetch import prefetch
from recsys_jax.sorting import radix_sort

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


@numba.njit(nogil=True, cache=True, inline="always")
def _rank(ids, loc, slots, cap, gen, seen, tmp):
  """``(the sorted distinct ids, rank)`` of ``ids`` (uint64 [n], contiguous), writing ``loc[i]`` = the
  index of ``ids[i]`` in order of first occurrence, whose place among the sorted ids is
  ``rank[loc[i]]``; or None if they are more than ``cap / 2`` (nothing to use is written then).

  The hash table is the first ``cap`` (a power of two) slots of ``slots`` (uint64 [>= cap, 2]),
  reused across calls without clearing: a slot belongs to this call only if its tag's high half
  is ``gen`` (0 is never a generation, so a zeroed table is empty); each slot holds an id and
  ``gen << 32 | its index in seen``, in one cache line. A table sized to the distinct ids, not to
  the ids, stays in the core's cache (a Criteo table at batch 65536: 8k distinct of 65k ids, 256
  KB against 2 MB). ``seen`` and ``tmp`` (uint64, >= n) are scratch.
  """
  mask = np.uint64(cap - 1)
  imask = np.int64(mask)
  g = np.uint64(gen) << np.uint64(32)
  full = cap >> 1
  k = 0
  for i in range(ids.shape[0]):
    x = ids[i]
    pos = _home(x, mask)
    while True:
      tag = slots[pos, 1]
      if (tag >> np.uint64(32)) != np.uint64(gen):  # free in this call
        if k == full:
          return None, None
        slots[pos, 0] = x
        slots[pos, 1] = g | np.uint64(k)
        seen[k] = x
        loc[i] = k
        k += 1
        break
      if slots[pos, 0] == x:
        loc[i] = np.int32(tag & np.uint64(0xFFFFFFFF))
        break
      pos = (pos + 1) & imask
  uniq = radix_sort(seen[:k], tmp[:k]).copy()
  rank = np.empty(k, np.int32)
  for r in range(k):  # each distinct id's place among them, through the slot that holds it
    x = uniq[r]
    pos = _home(x, mask)
    while slots[pos, 0] != x:  # no earlier slot of its probe run can hold it from an older call
      pos = (pos + 1) & imask
    rank[np.int64(slots[pos, 1] & np.uint64(0xFFFFFFFF))] = r
  return uniq, rank


@numba.njit(nogil=True, cache=True, inline="always")
def _rank_sized(ids, loc, slots, hint, gen, seen, tmp):
  """``_rank`` with a table of about 4x ``hint`` distinct ids (at least 64 slots, at most
  ``slots``' length, which holds 2x the ids: always enough); grown 4x and run again (with the next
  generation) while too small. Returns ``(uniq, rank, the last generation used)``."""
  cap = 64
  while cap < 4 * hint:
    cap *= 2
  while True:
    cap = min(cap, slots.shape[0])
    uniq, rank = _rank(ids, loc, slots, cap, gen, seen, tmp)
    if uniq is not None:
      return uniq, rank, gen
    cap *= 4
    gen += 1


@numba.njit(nogil=True, cache=True)
def _unique_inverse(ids, inverse, offset, slots, gen, seen, local, tmp):
  """Sorted distinct ``ids`` (uint64 [n], contiguous); writes ``inverse[i] = offset + ``the place
  of ``ids[i]`` among them; returns them and the last generation used (``_rank_sized``, with no
  hint). ``local`` (int32 [>= n]) and the rest: scratch."""
  n = ids.shape[0]
  loc = local[:n]
  uniq, rank, gen = _rank_sized(ids, loc, slots, n // 4, gen, seen, tmp)
  for i in range(n):
    inverse[i] = offset + rank[loc[i]]
  return uniq, gen


@numba.njit(nogil=True, cache=True)
def _dedup_own_tables(ids_list, index, bounds, gathered, inverse, hints, slots, gen, seen, local, tmp, buf):
  """The dedup of a group whose every feature reads a table of its own, with no padding: feature
  ``t``'s ids are table ``t``'s, laid after the tables before it. Writes ``inverse`` (int32 [B, T,
  L]); returns each table's sorted distinct ids and the last generation used.

  The ids of feature ``t`` are ``ids_list[t]`` (uint64 [B, L], contiguous), or with ``gathered``,
  the records of pieces (a ``Gathered``'s): piece ``p``'s are ``index[bounds[p]:bounds[p +
  1]]`` of ``ids_list[p * T + t]`` (uint64 [W, L]: a shuffle window's column). Those are copied
  into ``buf`` (uint64 [>= B * L]) first, the rows a few records ahead prefetched: read where the
  table's dedup reads them next, in cache, rather than gathered on another thread for every
  table first and read back from memory.

  ``hints[t]``: table ``t``'s distinct ids last time (its hash table is sized from it; updated).
  Each table puts its ids' rows (``offset + rank``) into row ``t`` of ``local`` (int32 [>= T, >= B
  * L]); the inverse is then written record by record, in blocks, so every write is sequential
  (per table, each record's entry is a strided write, one cache line each: at batch 65536 that
  cost as much as the dedup).
  """
  B, T, L = inverse.shape
  out = numba.typed.List.empty_list(numba.types.uint64[::1])
  offset = 0
  for t in range(T):
    if gathered:
      for p in range(bounds.shape[0] - 1):
        src = ids_list[p * T + t]
        end = bounds[p + 1]
        for i in range(bounds[p], end):
          if i + _GATHER_AHEAD < end:
            prefetch(src, index[i + _GATHER_AHEAD], 0)
          for j in range(L):
            buf[i * L + j] = src[index[i], j]
      ids = buf[: B * L]
    else:
      ids = ids_list[t].reshape(-1)
    loc = local[t, : ids.shape[0]]
    uniq, rank, gen = _rank_sized(ids, loc, slots, hints[t], gen, seen, tmp)
    gen += 1
    hints[t] = uniq.shape[0]
    for i in range(loc.shape[0]):
      loc[i] = offset + rank[loc[i]]
    out.append(uniq)
    offset += uniq.shape[0]
  block = 512
  if L == 1:  # one-hot features (Criteo's): the inner loop without the bag axis
    flat = inverse.reshape(B, T)
    for b0 in range(0, B, block):
      b1 = min(B, b0 + block)
      for t in range(T):
        for b in range(b0, b1):
          flat[b, t] = local[t, b]
  else:
    for b0 in range(0, B, block):
      b1 = min(B, b0 + block)
      for t in range(T):
        for b in range(b0, b1):
          for j in range(L):
            inverse[b, t, j] = local[t, b * L + j]
  return out, gen - 1


class _Scratch(threading.local):
  """Each thread's hash table and buffers for the dedup kernels, grown as needed, never cleared
  (generations tell this call's slots from older ones: a table of 2 MB cleared per call cost
  more than deduplicating a table of few distinct ids), and the distinct-id counts of the last
  batch per group of tables (``hints``), which size the next batch's hash tables."""

  def __init__(self):
    self.slots = np.zeros((16, 2), np.uint64)
    self.seen = self.tmp = np.empty(0, np.uint64)
    self.local = np.empty((0, 0), np.int32)
    self.gen = 0
    self.hints: Dict[tuple, np.ndarray] = {}
    self._buf = np.empty(0, np.uint64)

  def take(self, n: int, tables: int = 1):
    """(slots, first generation, seen, local [>= tables, >= n], tmp) for ``tables`` tables of <= n
    ids; ``used(last generation)`` after the call."""
    cap = self.slots.shape[0]
    if cap < 2 * n:
      while cap < 2 * n:
        cap *= 2
      self.slots, self.gen = np.zeros((cap, 2), np.uint64), 0
    if self.seen.shape[0] < n:
      self.seen, self.tmp = np.empty(n, np.uint64), np.empty(n, np.uint64)
    if self.local.shape[0] < tables or self.local.shape[1] < n:
      self.local = np.empty((max(tables, self.local.shape[0]), max(n, self.local.shape[1])), np.int32)
    # Each table takes one generation, and one more each time its table is too small and grows
    # (at most log4 of its ids): 64 per table is never exhausted by a call.
    if self.gen + 64 * tables >= 1 << 32:  # every generation used: clear once, start again
      self.slots[:] = 0
      self.gen = 0
    return self.slots, self.gen + 1, self.seen, self.local, self.tmp

  def used(self, last_gen: int) -> None:
    self.gen = int(last_gen)

  def buffer(self, n: int) -> np.ndarray:
    """A uint64 buffer of >= n ids (a gathered table's ids)."""
    if self._buf.shape[0] < n:
      self._buf = np.empty(n, np.uint64)
    return self._buf


_scratch = _Scratch()
_NO_INDEX = np.zeros(0, np.int64)
_GATHER_AHEAD = 32  # records whose rows a gathered dedup prefetches ahead of the one it copies


def unique_inverse(ids: np.ndarray, offset: int = 0) -> Tuple[np.ndarray, np.ndarray]:
  """``(np.unique(ids), inverse + offset as int32)`` of ``np.unique(ids, return_inverse=True)``, compiled."""
  ids = np.ascontiguousarray(ids, np.uint64).reshape(-1)
  inverse = np.empty(ids.shape[0], np.int32)
  slots, gen, seen, local, tmp = _scratch.take(ids.shape[0])
  uniq, last = _unique_inverse(ids, inverse, np.int64(offset), slots, gen, seen, local[0], tmp)
  _scratch.used(last)
  return uniq, inverse


def dedup_own_tables(
  sparse: Mapping[str, np.ndarray], names: Sequence[str], key: Any = None
) -> Tuple[List[np.ndarray], np.ndarray]:
  """Dedup of features that each read a table of their own, with no padding, in one compiled call.

  Args:
    sparse: feature name -> uint64 ids [B, L] (one L for all the features named); a
      ``Gathered`` is read from its pieces' sources, not gathered first.
    names: the features, in the order of the inverse's F axis (and of their tables' rows).
    key: names the group (its tables), so that its hash tables are sized from its last batch's
      distinct ids (None: not remembered).

  Returns:
    ``(each table's sorted distinct ids, the inverse int32 [B, F, L])``: table ``t``'s rows follow
    those of the tables before it, as in ``dedup``.
  """
  gathered = isinstance(sparse, Gathered)

  def flat(a) -> np.ndarray:
    a = np.ascontiguousarray(a, np.uint64)
    return a.reshape(a.shape[0], -1)

  if gathered:
    arrays = numba.typed.List([flat(src[n]) for src, _ in sparse.pieces for n in names])
    index = np.concatenate([idx for _, idx in sparse.pieces]) if len(sparse.pieces) > 1 else sparse.pieces[0][1]
    bounds = np.cumsum([0] + [idx.shape[0] for _, idx in sparse.pieces]).astype(np.int64)
    B = index.shape[0]
  else:
    arrays = numba.typed.List([flat(sparse[n]) for n in names])
    index, bounds, B = _NO_INDEX, _NO_INDEX, arrays[0].shape[0]
  L = arrays[0].shape[1]
  inverse = np.empty((B, len(names), L), np.int32)
  hints = _scratch.hints.get(key) if key is not None else None
  if hints is None or hints.shape[0] != len(names):
    hints = np.full(len(names), B * L // 4, np.int64)
    if key is not None:
      _scratch.hints[key] = hints
  slots, gen, seen, local, tmp = _scratch.take(B * L, len(names))
  buf = _scratch.buffer(B * L) if gathered else tmp
  args = (arrays, np.ascontiguousarray(index, np.int64), bounds, gathered, inverse, hints)
  uniqs, last = _dedup_own_tables(*args, slots, gen, seen, local, tmp, buf)
  _scratch.used(last)
  return list(uniqs), inverse


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
  weights = dict(batch.get("sparse_weights") or {})
  if isinstance(batch["sparse"], Gathered):  # not gathered here: the dedup reads them where they are
    sparse = batch["sparse"].with_aliases(aliases)
  else:
    sparse = dict(batch["sparse"])
    for name, source in aliases.items():
      sparse[name] = sparse[source]
  for name, source in aliases.items():
    if source in weights:
      weights[name] = weights[source]
  return sparse, weights


def _ids_2d(ids) -> np.ndarray:
  ids = np.asarray(ids)
  return (ids[:, None] if ids.ndim == 1 else ids).astype(np.uint64, copy=False)


def dedup(
  sparse: Mapping[str, np.ndarray],
  features: Sequence[FeatureSpec],
  tables: Mapping[str, TableSpec],
  sparse_weights: Optional[Mapping[str, np.ndarray]] = None,
  min_bucket: Union[int, Mapping[int, int]] = MIN_BUCKET,
) -> Dict[int, Group]:
  """Deduplicates the ids of a batch per table and groups tables by row width.

  Args:
    sparse: feature name -> uint64 ids [B, L] with L <= the feature's ``max_len``; a
      ``Gathered`` is read where its records are, not gathered first, where it can be.
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
    gathered = isinstance(sparse, Gathered)
    for f in feats:
      if f.name not in sparse:
        raise KeyError(f"batch has no sparse feature {f.name!r}")
      if gathered:  # its shape, not its ids: the one-call path reads them from the sources
        shape = sparse.feature_shape(f.name)
      else:
        shape = np.shape(sparse[f.name])
      shape = shape + (1,) if len(shape) == 1 else shape
      if len(shape) != 2 or shape[1] > f.max_len:
        raise ValueError(f"feature {f.name!r}: ids have shape {shape}, expected [B, <= {f.max_len}]")
      if batch is None:
        batch = shape[0]
      elif shape[0] != batch:
        raise ValueError(f"feature {f.name!r} has {shape[0]} rows, others {batch}")
      w = sparse_weights.get(f.name)
      pad = max_len - shape[1]
      if w is None and not pad and (f.kind != "pooled" or f.combiner == "sum" or shape[1] == 1):
        valid_of[f.name], w_of[f.name] = None, None  # every weight 1 (a one-hot bag's mean is its id too)
        continue
      ids = ids_of[f.name] = _ids_2d(sparse[f.name])
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
    group_tables = []
    offset = 0
    table_names = list(dict.fromkeys(f.table for f in feats))
    if len(table_names) == len(feats) and all(v is None for v in valid_of.values()):
      # Every feature its own table, no padding (Criteo's shape): one compiled call for the group.
      uniqs, inverse = dedup_own_tables(sparse, [f.name for f in feats], key=tuple(table_names))
      for f, uniq in zip(feats, uniqs):
        group_tables.append((f.table, uniq, offset))
        offset += uniq.shape[0]
      table_names = []
    else:
      inverse = np.zeros((batch, len(feats), max_len), np.int32)
      for f in feats:
        if f.name not in ids_of:
          ids_of[f.name] = _ids_2d(sparse[f.name])
    for tname in table_names:
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
