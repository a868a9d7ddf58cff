"""A PS server's pushes that arrive in chunks: ``Staging`` holds their chunks until all are in.

``RemotePS`` sends a push too large for one message as chunks ``0 .. chunks - 1`` of one
``request_id``. The server must count them as ONE push of that worker and step: nothing of it
may be applied, or move the step on, before its last chunk is in, and a chunk sent twice (a
retry) must not be applied twice. So ``service`` stages each chunk here and only hands the
whole push on to its step bookkeeping (the same path as a push in one message) when the last
one arrives; a repeated chunk is acknowledged and dropped. Not thread-safe: ``service``
calls it holding its lock.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from recsys_jax.async_ps.server.errors import ServiceError
from recsys_jax.async_ps.server.pushes import Grads

MAX_CHUNKS = 1 << 20
_MAX_OPEN_PER_WORKER = 4  # pushes a worker may have half sent at once (a trainer sends one at a time)


@dataclasses.dataclass
class _Push:
  step: Optional[int]
  chunks: int
  parts: Dict[int, Grads]


class Staging:
  """The chunks of each worker's pushes in progress, by (worker, request_id)."""

  def __init__(self):
    self._open: Dict[Tuple[int, str], _Push] = {}

  def add(
    self, worker: int, request_id: str, step: Optional[int], chunk: int, chunks: int, grads: Grads
  ) -> Tuple[bool, Optional[List[Grads]]]:
    """Stages one chunk.

    Returns:
      (whether the chunk was staged before, the push's chunks in order once all are in, else
      None). The push stays staged until ``finish``: a chunk sent again meanwhile is a repeat.

    Raises:
      ServiceError: INVALID_ARGUMENT when the chunk disagrees with the push's earlier chunks
        (step, number of chunks); RESOURCE_EXHAUSTED when the worker has too many pushes open.
    """
    key = (worker, request_id)
    push = self._open.get(key)
    what = f"chunk {chunk} of {chunks} of push {request_id!r} from worker {worker}"
    if push is None:
      mine = sum(1 for w, _ in self._open if w == worker)
      if mine >= _MAX_OPEN_PER_WORKER:
        raise ServiceError(
          "RESOURCE_EXHAUSTED",
          f"{what}: the worker already has {mine} pushes with chunks missing (e.g. "
          f"{self.describe(worker)[0]}); send their missing chunks first",
        )
      push = self._open[key] = _Push(step, chunks, {})
    elif (push.step, push.chunks) != (step, chunks):
      raise ServiceError(
        "INVALID_ARGUMENT",
        f"{what} says step {step} of {chunks} chunks; its earlier chunks said step {push.step} of {push.chunks}",
      )
    if chunk in push.parts:
      return True, None
    push.parts[chunk] = grads
    if len(push.parts) < chunks:
      return False, None
    return False, [push.parts[i] for i in range(chunks)]

  def missing(self, worker: int, request_id: str) -> int:
    """How many chunks of a staged push are not in yet."""
    push = self._open[(worker, request_id)]
    return push.chunks - len(push.parts)

  def finish(self, worker: int, request_id: str) -> bool:
    """Drops a push (complete, or refused); False when it was not staged (a Restore dropped it)."""
    return self._open.pop((worker, request_id), None) is not None

  def clear(self) -> None:
    """Drops every push in progress (a Restore: their steps are gone)."""
    self._open.clear()

  def describe(self, worker: Optional[int] = None) -> List[str]:
    """'request_id (worker w, step s): k of n chunks' for each push in progress (of ``worker``)."""
    return [
      f"{rid!r} (worker {w}, step {p.step}): {len(p.parts)} of {p.chunks} chunks"
      for (w, rid), p in sorted(self._open.items())
      if worker is None or w == worker
    ]
