"""The Open Inference Protocol over gRPC: KServe's ``inference.GRPCInferenceService``, on the gRPC port.

The messages are those of KServe's ``grpc_predict_v2.proto`` (``grpc_predict_v2_pb2``, generated:
``generate.sh``); the methods ``ServerLive``, ``ServerReady``, ``ModelReady``, ``ServerMetadata``,
``ModelMetadata`` and ``ModelInfer`` answer what ``rest.py`` answers over HTTP (``codec``). An
input's values come from its typed ``contents`` or from ``raw_input_contents`` (what tritonclient
sends); the scores go back as ``raw_output_contents`` (little-endian FP32, which tritonclient
reads), the answer's ``parameters`` carrying ``version`` (a string) and ``row_version`` and
``dense_version`` (int64).

Errors: INVALID_ARGUMENT (a bad tensor or request, naming the tensor and the record, as HTTP
400/413), NOT_FOUND (no such model or version), UNAUTHENTICATED (a token is set and the call lacks
``authorization: Bearer <token>`` metadata), UNAVAILABLE (overloaded), INTERNAL (the model failed).
"""

from __future__ import annotations

from typing import Any, Callable, List

import grpc
import numpy as np
from absl import logging

from recsys_jax.serving.front import Front, FrontError, authorization
from recsys_jax.serving.v2 import codec
from recsys_jax.serving.v2 import grpc_predict_v2_pb2 as pb

SERVICE = "inference.GRPCInferenceService"

# datatype -> the InferTensorContents field that carries it
_CONTENTS = {
  "BOOL": "bool_contents",
  "INT8": "int_contents",
  "INT16": "int_contents",
  "INT32": "int_contents",
  "INT64": "int64_contents",
  "UINT8": "uint_contents",
  "UINT16": "uint_contents",
  "UINT32": "uint_contents",
  "UINT64": "uint64_contents",
  "FP32": "fp32_contents",
  "FP64": "fp64_contents",
  "BYTES": "bytes_contents",
}


def _tensors(request: Any) -> List[codec.Tensor]:
  raw = list(request.raw_input_contents)
  if raw and len(raw) != len(request.inputs):
    raise FrontError("bad_request", f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs (one each)")
  out = []
  for i, t in enumerate(request.inputs):
    shape = tuple(int(d) for d in t.shape)
    if raw:
      values = codec.values_from_raw(t.name, t.datatype, shape, raw[i])
    elif t.datatype in _CONTENTS:
      values = list(getattr(t.contents, _CONTENTS[t.datatype]))
      if t.datatype == "BYTES":
        values = [codec.text(b, t.name, j) for j, b in enumerate(values)]
      elif t.datatype == "FP32":
        values = np.asarray(values, np.float32).tolist()
    else:
      raise FrontError("bad_request", f"unknown datatype {t.datatype!r}", t.name)
    out.append(codec.Tensor(t.name, t.datatype, shape, values))
  return out


def _param(value: Any) -> Any:
  if isinstance(value, str):
    return pb.InferParameter(string_param=value)
  return pb.InferParameter(int64_param=int(value))


def handler(front: Front) -> grpc.GenericRpcHandler:
  """The service's methods over ``front``."""
  p = codec.Protocol(front)

  def metadata(request: Any) -> Any:
    m = p.model_metadata(request.name, request.version)
    tensors = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
      name=m["name"],
      versions=m["versions"],
      platform=m["platform"],
      inputs=[tensors(**t) for t in m["inputs"]],
      outputs=[tensors(**t) for t in m["outputs"]],
    )

  def ready(request: Any) -> Any:
    try:
      p.check_model(request.name, request.version)
    except FrontError:
      return pb.ModelReadyResponse(ready=False)
    return pb.ModelReadyResponse(ready=True)

  def infer(request: Any) -> Any:
    answer = p.infer(request.model_name, request.model_version, _tensors(request), [o.name for o in request.outputs])
    n = len(answer.scores)
    return pb.ModelInferResponse(
      model_name=p.model_name,
      model_version=codec.model_version(answer),
      id=request.id,
      parameters={k: _param(v) for k, v in codec.parameters(answer).items()},
      outputs=[pb.ModelInferResponse.InferOutputTensor(name=codec.OUTPUT, datatype="FP32", shape=[n])],
      raw_output_contents=[np.asarray(answer.scores, "<f4").tobytes()],
    )

  def wrap(fn: Callable[[Any], Any], request_type: Any, response_type: Any) -> grpc.RpcMethodHandler:
    def behavior(request: Any, context: grpc.ServicerContext) -> Any:
      try:
        front.authenticate(authorization(context.invocation_metadata()))
        return fn(request)
      except FrontError as e:
        code = grpc.StatusCode.NOT_FOUND if e.kind == "not_found" else grpc.StatusCode[e.grpc_code]
        context.abort(code, codec.describe(e))
      except Exception as e:  # noqa: BLE001 - a bug here: say so, keep serving
        logging.warning("v2 gRPC %s failed: %s: %s", fn.__name__, type(e).__name__, e)
        context.abort(grpc.StatusCode.INTERNAL, f"the server failed: {type(e).__name__}: {e}")
      raise AssertionError("context.abort raises")  # never reached

    return grpc.unary_unary_rpc_method_handler(
      behavior, request_deserializer=request_type.FromString, response_serializer=response_type.SerializeToString
    )

  server = p.server_metadata()
  methods = {
    "ServerLive": wrap(lambda _: pb.ServerLiveResponse(live=True), pb.ServerLiveRequest, pb.ServerLiveResponse),
    "ServerReady": wrap(lambda _: pb.ServerReadyResponse(ready=True), pb.ServerReadyRequest, pb.ServerReadyResponse),
    "ModelReady": wrap(ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
    "ServerMetadata": wrap(
      lambda _: pb.ServerMetadataResponse(**server), pb.ServerMetadataRequest, pb.ServerMetadataResponse
    ),
    "ModelMetadata": wrap(metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse),
    "ModelInfer": wrap(infer, pb.ModelInferRequest, pb.ModelInferResponse),
  }
  return grpc.method_handlers_generic_handler(SERVICE, methods)
