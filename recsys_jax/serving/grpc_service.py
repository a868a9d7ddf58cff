"""The gRPC side of the model server (for services), with generic handlers and no generated code.

(The same port also serves the Open Inference Protocol's ``inference.GRPCInferenceService``:
``serving/v2/rpc.py``, whose messages are KServe's, generated.)

Methods of ``/recsys_jax.serving.Predictor/``: ``Predict``, ``Model``, ``Health``. The messages
are the HTTP side's JSON bodies as UTF-8 bytes (``Model`` and ``Health`` take an empty message):
the records are raw feature values of mixed types in the training data's schema, which a
protobuf would need a schema per dataset (or a ``Struct``, which is JSON anyway) to carry; JSON
keeps one parser and one set of checks and error words for both sides, and any gRPC client can
send it without our ``.proto``. Its cost is measured by ``experiments/bench_serve.py``.

Errors: INVALID_ARGUMENT (a bad request, as HTTP 400/413: the details say which record and
field, also in trailing metadata ``error-field`` and ``error-record``), UNAUTHENTICATED (a
token is set and the call lacks ``authorization: Bearer <token>`` metadata), UNAVAILABLE
(overloaded), INTERNAL (the model failed), RESOURCE_EXHAUSTED (a message over the limit, from
gRPC itself).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, Tuple

import grpc

from recsys_jax.async_ps.server import rpc
from recsys_jax.serving.front import Front, FrontError, authorization
from recsys_jax.serving.v2 import rpc as v2_rpc

SERVICE = "recsys_jax.serving.Predictor"
METHODS = ("Predict", "Model", "Health")


def _handler(front: Front) -> grpc.GenericRpcHandler:
  def wrap(fn: Callable[[bytes], Any]):
    def behavior(request: bytes, context: grpc.ServicerContext) -> bytes:
      try:
        front.authenticate(authorization(context.invocation_metadata()))
        return json.dumps(fn(request)).encode("utf-8")
      except FrontError as e:
        meta = []
        if e.field is not None:
          meta.append(("error-field", str(e.field)))
        if e.record is not None:
          meta.append(("error-record", str(e.record)))
        if meta:
          context.set_trailing_metadata(tuple(meta))
        context.abort(grpc.StatusCode[e.grpc_code], e.message)
        raise AssertionError("context.abort raises") from e  # never reached

    return grpc.unary_unary_rpc_method_handler(behavior)

  methods = {
    "Predict": wrap(front.predict),
    "Model": wrap(lambda _: front.model()),
    "Health": wrap(lambda _: front.health()),
  }
  return grpc.method_handlers_generic_handler(SERVICE, methods)


def serve_grpc(
  front: Front,
  host: str,
  port: int,
  threads: int = 32,
  max_message_bytes: int = 16 << 20,
  tls_cert: Optional[bytes] = None,
  tls_key: Optional[bytes] = None,
) -> Tuple[grpc.Server, int]:
  """Starts the gRPC server.

  Args:
    front: the request handling.
    host, port: where to listen (port 0: a free one).
    threads: calls served at once (each waits for its batch to be scored).
    max_message_bytes: larger requests are refused by gRPC (RESOURCE_EXHAUSTED).
    tls_cert, tls_key: PEM bytes; both or neither (then plaintext).

  Returns:
    The started server (stop it with ``.stop(grace)``) and its port.

  Raises:
    RuntimeError: the address cannot be bound.
  """
  both = _Services(_handler(front), v2_rpc.handler(front))
  return rpc.listen(both, host, port, threads, max_message_bytes, tls_cert, tls_key, "serve-rpc", " (gRPC)")


class _Services(grpc.GenericRpcHandler):
  """Several services' handlers as the one ``rpc.listen`` takes: the first that knows a method serves it."""

  def __init__(self, *handlers: grpc.GenericRpcHandler):
    self.handlers = handlers

  def service(self, handler_call_details: Any) -> Optional[grpc.RpcMethodHandler]:
    for h in self.handlers:
      found = h.service(handler_call_details)
      if found is not None:
        return found
    return None
