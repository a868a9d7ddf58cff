"""A batch's sparse ids as records of larger arrays, gathered where they are used.

A shuffled stream cuts each batch out of a window of records in a permuted order: the batch's
ids of a feature are ``window[feature][index]`` (or, for a batch that spans two windows, those of
the first window's then the second's). Copying them out for every feature on the reading thread
(26 random gathers of 65,536 ids at Criteo's shape, 14 ms a batch on a busy machine, one thread
for all batches) and deduplicating them later on a worker reads every id twice, the second time
from memory. ``Gathered`` keeps the windows and the indices instead: the dedup reads each
feature's ids straight from the windows, on the worker, table by table
(``recsys_jax.embeddings.dedup.dedup``), and anything else that asks for a feature's ids
gets the gathered array (made once, then kept).
"""

from __future__ import annotations

from typing import Dict, Iterator, Mapping, Sequence, Tuple

import numpy as np

Piece = Tuple[Mapping[str, np.ndarray], np.ndarray]
"""(feature name -> an array of records, int64 record numbers into each of them)."""


class Gathered(Mapping[str, np.ndarray]):
  """Feature name -> ids ``[n, L]``: the records ``index`` of ``source[feature]`` of each piece
  (``np.take`` along the first axis), pieces end to end, made on first access.

  Args:
    pieces: ``(source, index)`` pairs; every source has the same features.
  """

  def __init__(self, pieces: Sequence[Piece]):
    if not pieces:
      raise ValueError("Gathered needs at least one piece")
    self.pieces = [(dict(src), np.asarray(idx, np.int64)) for src, idx in pieces]
    self._names = tuple(self.pieces[0][0])
    self._made: Dict[str, np.ndarray] = {}

  @property
  def num_records(self) -> int:
    return sum(idx.shape[0] for _, idx in self.pieces)

  def feature_shape(self, name: str) -> Tuple[int, ...]:
    """The shape ``self[name]`` has, without gathering it."""
    return (self.num_records,) + tuple(np.shape(self.pieces[0][0][name])[1:])

  def __getitem__(self, name: str) -> np.ndarray:
    got = self._made.get(name)
    if got is None:
      parts = [np.take(src[name], idx, axis=0) for src, idx in self.pieces]
      got = self._made[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return got

  def __contains__(self, name: object) -> bool:  # Mapping's would gather the feature to find out
    return name in self.pieces[0][0]

  def __iter__(self) -> Iterator[str]:
    return iter(self._names)

  def __len__(self) -> int:
    return len(self._names)

  def with_aliases(self, aliases: Mapping[str, str]) -> "Gathered":
    """The same records with each alias reading its source feature's arrays (still not gathered)."""
    out = Gathered([({**src, **{a: src[s] for a, s in aliases.items()}}, idx) for src, idx in self.pieces])
    out._made = {**self._made, **{a: self._made[s] for a, s in aliases.items() if s in self._made}}
    return out

  @staticmethod
  def concat(parts: Sequence["Gathered"]) -> "Gathered":
    """The records of ``parts`` end to end (a batch that spans windows), still not gathered."""
    return Gathered([p for g in parts for p in g.pieces])
