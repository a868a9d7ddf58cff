"""A small client of the model server, over HTTP or gRPC (the tests and ``bench_serve`` use it); ``/v1``,
and the Open Inference Protocol's inference (``v2_request``, ``infer``).

    c = HttpClient("127.0.0.1", 8501)  # or GrpcClient("127.0.0.1:8500")
    fields = c.model()["fields"]       # what a record holds: the training data's schema, e.g. dense_00 .. cat_25
    c.predict(records)                 # -> {"version": "step-300", "dense_version": 300, "row_version": 300, "scores": [...]}

From a shell: ``python -m recsys_jax.predict --http=127.0.0.1:8501 --records=records.jsonl``.

Both raise ``ServeError`` (``status``: the HTTP status or gRPC code name; ``field``, ``record``:
where the server says the request is wrong). One client is one connection: use one per thread.
"""

from __future__ import annotations

import http.client
import json
import ssl
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import grpc
import numpy as np

from recsys_jax.serving.grpc_service import SERVICE


def v2_request(records: Sequence[Mapping[str, Any]], inputs: Sequence[Mapping[str, Any]], model: str) -> Dict[str, Any]:
  """The Open Inference Protocol's inference request of ``records`` (``/v1``'s), one tensor per input as
  the model's metadata declares them (``GET /v2/models/<name>``'s ``inputs``; a ``[-1, width]`` input's
  rows padded to the widest), in three forms: ``json`` (the body with JSON tensors), ``binary`` (the
  body with binary tensors, scores asked back binary; its JSON header is ``binary_head`` bytes long) and
  ``grpc`` (the serialized ``ModelInferRequest``)."""
  from recsys_jax.serving.v2 import codec
  from recsys_jax.serving.v2 import grpc_predict_v2_pb2 as pb

  tensors, raws = [], []
  for t in inputs:
    values = [r[t["name"]] for r in records]
    shape = [len(values)]
    if len(t["shape"]) == 2:
      rows = [v if isinstance(v, list) else [v] for v in values]
      shape.append(max(len(v) for v in rows))
      pad = {"BYTES": "", "UINT64": (1 << 64) - 1}.get(t["datatype"], -1)
      values = [x for v in rows for x in v + [pad] * (shape[1] - len(v))]
    if t["datatype"] == "BYTES":
      values = [str(v) for v in values]
      raws.append(b"".join(len(v).to_bytes(4, "little") + v for v in (x.encode("utf-8") for x in values)))
    else:
      raws.append(np.asarray(values, codec.NUMPY[t["datatype"]]).tobytes())
    tensors.append({"name": t["name"], "datatype": t["datatype"], "shape": shape, "data": values})
  binary = [
    {"name": t["name"], "datatype": t["datatype"], "shape": t["shape"], "parameters": {"binary_data_size": len(r)}}
    for t, r in zip(tensors, raws)
  ]
  head = json.dumps({"inputs": binary, "parameters": {"binary_data_output": True}}).encode("utf-8")
  wire = [
    pb.ModelInferRequest.InferInputTensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in tensors
  ]
  return {
    "json": json.dumps({"inputs": tensors}).encode("utf-8"),
    "binary": head + b"".join(raws),
    "binary_head": len(head),
    "grpc": pb.ModelInferRequest(model_name=model, inputs=wire, raw_input_contents=raws).SerializeToString(),
  }


class ServeError(Exception):
  """The server refused or failed a request."""

  def __init__(self, status: Any, message: str, field: Optional[str] = None, record: Optional[int] = None):
    super().__init__(f"{status}: {message}")
    self.status, self.message, self.field, self.record = status, message, field, record


class HttpClient:
  """Predict over HTTP/JSON on one keep-alive connection.

  Args:
    host, port: the server's HTTP side.
    token: sent as ``Authorization: Bearer <token>``.
    timeout: seconds per request.
    tls_ca: path of a CA bundle: speak HTTPS, checking the server against it.
  """

  def __init__(self, host: str, port: int, token: Optional[str] = None, timeout: float = 60.0, tls_ca=None):
    self._conn: http.client.HTTPConnection
    if tls_ca is not None:
      ctx = ssl.create_default_context(cafile=tls_ca)
      self._conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ctx)
    else:
      self._conn = http.client.HTTPConnection(host, port, timeout=timeout)
    self._headers = {"Content-Type": "application/json"}
    if token is not None:
      self._headers["Authorization"] = f"Bearer {token}"

  def send(
    self, method: str, path: str, body: Optional[bytes] = None, headers: Optional[Mapping[str, str]] = None
  ) -> Tuple[http.client.HTTPResponse, bytes]:
    """Sends ``body`` (bytes, as is) with ``headers`` besides the client's own: the response and its body."""
    try:
      self._conn.request(method, path, body=body, headers={**self._headers, **(headers or {})})
      resp = self._conn.getresponse()
      data = resp.read()
    except (http.client.HTTPException, OSError):
      self._conn.close()  # the next request opens a new connection
      raise
    if resp.getheader("Connection", "").lower() == "close":
      self._conn.close()
    return resp, data

  def request(self, method: str, path: str, body: Optional[bytes] = None) -> Dict[str, Any]:
    """Sends ``body`` (bytes, as is) and returns the JSON answer; ``ServeError`` on a non-200."""
    resp, data = self.send(method, path, body)
    try:
      answer = json.loads(data)
    except ValueError:
      raise ServeError(resp.status, f"not JSON: {data[:200]!r}") from None
    if resp.status != 200:
      raise ServeError(resp.status, answer.get("error", ""), answer.get("field"), answer.get("record"))
    return answer

  def infer(self, model: str, body: bytes, binary_head: Optional[int] = None) -> Tuple[Dict[str, Any], np.ndarray]:
    """Sends an Open Inference Protocol request's ``body`` (``v2_request``; with binary tensors, its JSON
    header ``binary_head`` bytes long) to ``model``: the answer's JSON and its scores."""
    head = None if binary_head is None else {"Inference-Header-Content-Length": str(binary_head)}
    resp, data = self.send("POST", f"/v2/models/{model}/infer", body, head)
    if resp.status != 200:
      raise ServeError(resp.status, data[:300].decode("utf-8", "replace"))
    n = int(resp.getheader("Inference-Header-Content-Length") or len(data))
    answer = json.loads(data[:n])
    return answer, np.frombuffer(data[n:], "<f4") if n < len(data) else np.asarray(answer["outputs"][0]["data"])

  def predict(self, records: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """``{"version", "scores"}`` of ``records``."""
    return self.request("POST", "/v1/predict", json.dumps({"records": list(records)}).encode("utf-8"))

  def model(self) -> Dict[str, Any]:
    return self.request("GET", "/v1/model")

  def health(self) -> Dict[str, Any]:
    return self.request("GET", "/v1/health")

  def close(self) -> None:
    self._conn.close()


class GrpcClient:
  """Predict over gRPC (JSON messages, see ``grpc_service``).

  Args:
    target: ``host:port`` of the server's gRPC side.
    token: sent as ``authorization: Bearer <token>`` metadata.
    timeout: seconds per call.
    tls_ca: PEM bytes of a CA: speak TLS, checking the server against it.
  """

  def __init__(self, target: str, token: Optional[str] = None, timeout: float = 60.0, tls_ca: Optional[bytes] = None):
    if tls_ca is not None:
      self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=tls_ca))
    else:
      self._channel = grpc.insecure_channel(target)
    self._meta = () if token is None else (("authorization", f"Bearer {token}"),)
    self._timeout = timeout
    self._calls = {m: self._channel.unary_unary(f"/{SERVICE}/{m}") for m in ("Predict", "Model", "Health")}
    self._infer = self._channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

  def call(self, method: str, body: bytes = b"") -> Dict[str, Any]:
    """Sends ``body`` (bytes, as is) to ``method``; ``ServeError`` with the status code name on an error."""
    try:
      return json.loads(self._calls[method](body, timeout=self._timeout, metadata=self._meta))
    except grpc.RpcError as e:
      trailing = dict(e.trailing_metadata() or ())
      record = trailing.get("error-record")
      raise ServeError(
        e.code().name, e.details() or "", trailing.get("error-field"), None if record is None else int(record)
      ) from None

  def infer(self, body: bytes) -> Tuple[Any, np.ndarray]:
    """Sends a serialized ``ModelInferRequest`` (``v2_request``): the ``ModelInferResponse`` and its scores."""
    from recsys_jax.serving.v2 import grpc_predict_v2_pb2 as pb

    try:
      answer = pb.ModelInferResponse.FromString(self._infer(body, timeout=self._timeout, metadata=self._meta))
    except grpc.RpcError as e:
      raise ServeError(e.code().name, e.details() or "") from None
    return answer, np.frombuffer(answer.raw_output_contents[0], "<f4")

  def predict(self, records: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    return self.call("Predict", json.dumps({"records": list(records)}).encode("utf-8"))

  def model(self) -> Dict[str, Any]:
    return self.call("Model")

  def health(self) -> Dict[str, Any]:
    return self.call("Health")

  def close(self) -> None:
    self._channel.close()
