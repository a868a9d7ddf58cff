"""What the HTTP and gRPC sides share: reading a predict request, the token, and the errors.

A predict request is the JSON object ``{"records": [{field: value, ...}, ...]}`` (raw feature
values in the training data's schema, ``Scorer.fields()``); the answer is
``{"version": "...", "dense_version": step, "row_version": step, "scores": [p, ...]}``, one click
probability per record in order, all from the version named: its dense parameters are those after
training step ``dense_version`` and its rows those after step ``row_version`` (they differ when
the server applies the trainer's row deltas between checkpoints: ``serving/fresh.py``). Both sides carry the same JSON (over gRPC as the message bytes), so both
refuse the same requests with the same words. An error is ``{"error": text, "field": name or
null, "record": index or null}``; ``FrontError.kind`` picks the HTTP status and gRPC code.
"""

from __future__ import annotations

import concurrent.futures
import hmac
import json
from typing import Any, Dict, Optional, Union

from absl import logging

from recsys_jax.serving.api import RequestError, SnapshotGone
from recsys_jax.serving.batcher import Batcher, Overloaded, Prediction
from recsys_jax.serving.reload import ModelHolder

# kind -> (HTTP status, gRPC status code name)
KINDS = {
  "bad_request": (400, "INVALID_ARGUMENT"),
  "too_large": (413, "INVALID_ARGUMENT"),
  "unauthenticated": (401, "UNAUTHENTICATED"),
  "not_found": (404, "UNIMPLEMENTED"),
  "unavailable": (503, "UNAVAILABLE"),
  "internal": (500, "INTERNAL"),
}


class FrontError(Exception):
  """A request answered with an error; ``field`` and ``record`` say where, when it is one place."""

  def __init__(self, kind: str, message: str, field: Optional[str] = None, record: Optional[int] = None):
    text = str(RequestError(message, field, record))  # "record 1, field 'c2': ..." as the model's errors say
    super().__init__(text)
    self.kind, self.message, self.field, self.record = kind, text, field, record
    self.reason = message  # the words without the place

  @property
  def http_status(self) -> int:
    return KINDS[self.kind][0]

  @property
  def grpc_code(self) -> str:
    return KINDS[self.kind][1]

  def body(self) -> Dict[str, Any]:
    return {"error": self.message, "field": self.field, "record": self.record}


def _no_constant(name: str) -> Any:
  raise ValueError(f"{name} is not JSON (send finite numbers)")


def parse_request(body: Union[bytes, str], max_records: int) -> list:
  """The records of a predict request's body, checked for shape (the model checks the values).

  Raises:
    FrontError: malformed JSON, not ``{"records": [...]}``, an unknown key, no records, more than
      ``max_records`` (``too_large``), or a record that is not an object.
  """
  try:
    req = json.loads(body, parse_constant=_no_constant)
  except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
    raise FrontError("bad_request", f"malformed JSON: {e}") from None
  except RecursionError:  # arrays or objects nested past Python's recursion limit (~1000 deep)
    raise FrontError("bad_request", "malformed JSON: nested too deeply (a predict request is 3 levels deep)") from None
  if not isinstance(req, dict):
    raise FrontError("bad_request", f'the body must be a JSON object {{"records": [...]}}, got {type(req).__name__}')
  for key in req:
    if key != "records":
      raise FrontError("bad_request", f"unknown key {key!r} (a predict request holds only 'records')", field=key)
  records = req.get("records")
  if not isinstance(records, list):
    what = "missing" if "records" not in req else f"a {type(records).__name__}, not a list of objects"
    raise FrontError("bad_request", f"'records' is {what}", field="records")
  if not records:
    raise FrontError("bad_request", "'records' is empty: send at least one record", field="records")
  if len(records) > max_records:
    raise FrontError(
      "too_large", f"{len(records)} records in one request, over the server's --max_batch={max_records}", "records"
    )
  for i, r in enumerate(records):
    if not isinstance(r, dict):
      raise FrontError("bad_request", f"a record must be a JSON object, got {type(r).__name__}", "records", i)
  return records


def authorization(metadata: Any) -> Optional[str]:
  """The ``authorization`` value of a gRPC call's metadata (``context.invocation_metadata()``), or None."""
  for key, value in metadata or ():
    if key == "authorization":
      return value
  return None


class Front:
  """The request handling both servers call: token, predict, model, health.

  Args:
    holder: the version served (``reload.ModelHolder``).
    batcher: the micro-batcher over ``holder.current``.
    token: if set, each request must carry ``authorization: Bearer <token>``.
    timeout_s: longest a request waits for its batch to be scored (then 503 / UNAVAILABLE).
    model_name: the model's name in the Open Inference Protocol (``serving/v2``).
  """

  def __init__(
    self,
    holder: ModelHolder,
    batcher: Batcher,
    token: Optional[str] = None,
    timeout_s: float = 30.0,
    model_name: str = "model",
  ):
    self.holder, self.batcher, self.timeout_s, self.model_name = holder, batcher, timeout_s, model_name
    self._token = None if token is None else f"Bearer {token}".encode("utf-8")

  def authenticate(self, header: Union[str, bytes, None]) -> None:
    """Raises ``FrontError("unauthenticated")`` unless the token is unset or ``header`` carries it."""
    if self._token is None:
      return
    got = header.encode("utf-8", "replace") if isinstance(header, str) else (header or b"")
    if not hmac.compare_digest(got, self._token):
      raise FrontError("unauthenticated", "missing or wrong token (send 'authorization: Bearer <token>')")

  def predict(self, body: Union[bytes, str]) -> Dict[str, Any]:
    """Scores a request's body; returns ``{"version", "scores"}`` or raises ``FrontError``."""
    answer = self.score(parse_request(body, self.batcher.max_batch))
    return {
      "version": answer.version,
      "dense_version": answer.dense_version,
      "row_version": answer.row_version,
      "scores": answer.scores,
    }

  def score(self, records: list) -> Prediction:
    """Scores records through the micro-batcher (every protocol's predict ends here): one version's
    answer, or ``FrontError`` (a bad record: ``bad_request`` naming it; overloaded; the model failed)."""
    try:
      return self.batcher.submit(records).result(self.timeout_s)
    except RequestError as e:
      raise FrontError("bad_request", e.reason, e.field, e.record) from None
    except (Overloaded, SnapshotGone) as e:  # SnapshotGone: no version that can read its rows; no score
      raise FrontError("unavailable", str(e)) from None
    except concurrent.futures.TimeoutError:
      raise FrontError("unavailable", f"not scored within {self.timeout_s:g} s; the server is overloaded") from None
    except Exception as e:  # noqa: BLE001 - the model failed on a good request: say so, keep serving
      logging.warning("predict failed: %s: %s", type(e).__name__, e)
      raise FrontError("internal", f"the model failed: {type(e).__name__}: {e}") from None

  def model(self) -> Dict[str, Any]:
    """The version served, the step, its request fields, and the reload counters."""
    scorer = self.holder.current()
    return {
      "version": scorer.version,
      "dense_version": getattr(scorer, "dense_version", None),
      "row_version": getattr(scorer, "row_version", None),
      "step": self.holder.step,
      "fields": scorer.fields(),
      "max_batch": self.batcher.max_batch,
      "loads": self.holder.loads,
      "failed_loads": self.holder.failures,
      "last_load_error": self.holder.last_error,
      "skipped": {str(k): v for k, v in sorted(self.holder.skipped.items())},
      "batching": {k: v for k, v in self.batcher.stats().items() if k != "batch_sizes"},
      **({"fresh": self.holder.model_info()} if hasattr(self.holder, "model_info") else {}),
    }

  def health(self) -> Dict[str, Any]:
    sc = self.holder.current()
    return {
      "status": "serving",
      "version": sc.version,
      "dense_version": getattr(sc, "dense_version", None),
      "row_version": getattr(sc, "row_version", None),
    }
