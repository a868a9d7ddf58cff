"""One step's pushes summed over the workers, the same whatever order they arrived in: ``sum_pushes``.

A PS server (``service``) buffers each worker's row gradients of a step and, once every
worker has pushed it, applies this sum in one ``apply_many``; the chunks of a push that came in
several are summed as if each were a worker (their ids are distinct: ``repeated_id`` checks).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

Grads = Dict[str, Tuple[np.ndarray, np.ndarray]]
"""{table: (distinct uint64 ids, float32 gradients [n, dim])}."""


def sum_pushes(pushes: Mapping[Any, Grads], dims: Mapping[str, int]) -> Grads:
  """Sums the pushes of one step: {worker: {table: (ids, grads)}} -> {table: (ids, grads)}.

  The ids of a table are the union of the workers' ids; each id's gradient is added up in
  worker-index order (starting from 0.0), so the sum does not depend on arrival order.

  Args:
    pushes: each worker's distinct ids and float32 gradients per table.
    dims: row width per table.

  Returns:
    Distinct ids (sorted where several workers sent the table) and summed float32 gradients.
  """
  workers = sorted(pushes)
  if len(workers) == 1:
    return dict(pushes[workers[0]])
  tables: List[str] = []
  for w in workers:
    tables.extend(t for t in pushes[w] if t not in tables)
  out = {}
  for t in tables:
    parts = [pushes[w][t] for w in workers if t in pushes[w]]
    if len(parts) == 1:
      out[t] = parts[0]
      continue
    uniq, inv = np.unique(np.concatenate([i for i, _ in parts]), return_inverse=True)
    total = np.zeros((uniq.shape[0], dims[t]), np.float32)
    pos = 0
    for i, g in parts:
      total[inv[pos : pos + i.shape[0]]] += g  # ids are distinct within a worker's push
      pos += i.shape[0]
    out[t] = (uniq, total)
  return out


def repeated_id(parts: Sequence[Grads]) -> Optional[Tuple[str, int]]:
  """(table, id) of an id that is in two chunks of one push (each chunk was checked alone), or None."""
  tables = {t for p in parts for t in p}
  for t in sorted(tables):
    ids = [p[t][0] for p in parts if t in p]
    if len(ids) < 2:
      continue
    s = np.sort(np.concatenate(ids))
    rep = s[1:][s[1:] == s[:-1]]
    if rep.shape[0]:
      return t, int(rep[0])
  return None
