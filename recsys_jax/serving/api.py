"""What the serving front (HTTP, gRPC, micro-batching, hot reload) needs of a loaded model.

A ``Scorer`` is one model version, immutable once built: the front swaps whole scorers between
batches, so a batch is scored by exactly one version and every response names it.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Protocol, Sequence

import numpy as np


class RequestError(ValueError):
  """A request the model cannot score: names the record (its index in the request) and the field.

  The front answers it with HTTP 400 / gRPC INVALID_ARGUMENT and keeps serving.
  """

  def __init__(self, message: str, field: Optional[str] = None, record: Optional[int] = None):
    where = []
    if record is not None:
      where.append(f"record {record}")
    if field is not None:
      where.append(f"field {field!r}")
    super().__init__(f"{', '.join(where)}: {message}" if where else message)
    self.field, self.record, self.reason = field, record, message


class SnapshotGone(RuntimeError):
  """The files a loaded version reads are gone: the trainer deleted a PS snapshot that only older
  checkpoints needed. A newer checkpoint exists then; the front loads it and scores the batch again."""


class Scorer(Protocol):
  """One loaded model version (dense parameters + the tables it reads)."""

  version: str
  """Names the checkpoint step and PS snapshot the scores come from, e.g. ``"step-200"``."""

  def fields(self) -> Dict[str, str]:
    """Request field name -> what it holds (e.g. ``"float"``, ``"string"``, ``"int"``, ``"list"``)."""
    ...

  def encode(self, records: Sequence[Mapping[str, Any]]) -> Any:
    """Checks and encodes raw records (the training data's schema) exactly as the reader would.

    Raises ``RequestError`` naming the first bad record and field. Cheap next to ``predict``:
    the front calls it per request, before micro-batching, so one bad request fails alone.
    """
    ...

  def concat(self, encoded: Sequence[Any]) -> Any:
    """Several ``encode`` results as one batch, in order."""
    ...

  def predict(self, encoded: Any) -> np.ndarray:
    """Click probabilities, float32 [number of records], in the records' order.

    ``encoded``: what ``encode`` returned, or the raw records themselves (a list of dicts, any
    number: they are encoded here, and a bad one raises ``RequestError`` as ``encode`` does).
    """
    ...
