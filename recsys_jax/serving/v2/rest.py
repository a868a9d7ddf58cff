"""The Open Inference Protocol over HTTP (KServe v2's REST form), beside ``/v1`` on the same port.

- ``GET /v2/health/live``, ``GET /v2/health/ready``: 200 when serving (the server listens only
  once a version is loaded).
- ``GET /v2``: ``{"name", "version", "extensions"}``.
- ``GET /v2/models/{name}[/versions/{v}]``: the model's metadata (``codec``); ``.../ready``: 200.
- ``POST /v2/models/{name}[/versions/{v}]/infer``: ``{"id"?, "parameters"?, "inputs": [{"name",
  "datatype", "shape", "data"}], "outputs"?: [{"name": "score", "parameters"?: {"binary_data"}}]}``
  -> ``{"model_name", "model_version", "id"?, "parameters": {"version", "row_version",
  "dense_version"}, "outputs": [{"name": "score", "datatype": "FP32", "shape": [n], "data"}]}``.

The binary tensor extension is served both ways: an input with ``parameters.binary_data_size``
takes its data from the bytes after the JSON (``Inference-Header-Content-Length`` says where the
JSON ends), and ``binary_data`` on an output (or ``binary_data_output`` on the request) puts the
scores after the JSON the same way; tritonclient does both by default. Compressed bodies
(``Content-Encoding``) are not taken. Errors are ``{"error": text}`` naming the tensor and the
record: 400 (a bad tensor or request), 404 (no such model or version), 413 (more rows than
``--max_batch``); authentication, 405, 411 and body limits are those of ``/v1`` (``serving/http.py``).
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any, Dict, List, Optional, Protocol, Tuple

import numpy as np
from absl import logging

from recsys_jax.serving.front import Front, FrontError
from recsys_jax.serving.v2 import codec

_MODEL = r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?"
_ROUTES = (
  (re.compile(r"/v2/?"), "GET", "server"),
  (re.compile(r"/v2/health/live"), "GET", "live"),
  (re.compile(r"/v2/health/ready"), "GET", "ready"),
  (re.compile(_MODEL), "GET", "model"),
  (re.compile(_MODEL + "/ready"), "GET", "model_ready"),
  (re.compile(_MODEL + "/infer"), "POST", "infer"),
)
HEADER_LENGTH = "Inference-Header-Content-Length"
Reply = Tuple[int, Dict[str, str], bytes]


class Headers(Protocol):
  def get(self, name: str, default: None = None) -> Optional[str]: ...


def _match(path: str) -> Optional[Tuple[str, str, Dict[str, str]]]:
  for pattern, method, what in _ROUTES:
    m = pattern.fullmatch(path)
    if m:
      return method, what, {k: urllib.parse.unquote(v) for k, v in m.groupdict().items() if v is not None}
  return None


def method(path: str) -> Optional[str]:
  """The method ``path`` takes, or None if it is no path of the protocol."""
  m = _match(path)
  return m[0] if m else None


def _json(status: int, body: Any) -> Reply:
  return status, {"Content-Type": "application/json"}, json.dumps(body).encode("utf-8")


def _no_constant(name: str) -> Any:
  raise ValueError(f"{name} is not JSON (send finite numbers)")


class Routes:
  """The protocol's HTTP routes over a ``Front``."""

  def __init__(self, front: Front):
    self.protocol = codec.Protocol(front)

  def handle(self, method: str, path: str, headers: Headers, body: bytes) -> Reply:
    """The reply (status, headers, body) to an authenticated request whose ``method(path)`` is ``method``."""
    m = _match(path)
    assert m is not None and m[0] == method, (method, path)
    _, what, args = m
    p = self.protocol
    try:
      if what == "server":
        return _json(200, p.server_metadata())
      if what in ("live", "ready"):
        return 200, {}, b""
      if what == "model":
        return _json(200, p.model_metadata(args["name"], args.get("version", "")))
      if what == "model_ready":
        p.check_model(args["name"], args.get("version", ""))
        return 200, {}, b""
      return self._infer(args["name"], args.get("version", ""), headers, body)
    except FrontError as e:
      return _json(e.http_status, {"error": codec.describe(e)})
    except Exception as e:  # noqa: BLE001 - a bug here: say so, keep serving
      logging.warning("v2 %s %s failed: %s: %s", method, path, type(e).__name__, e)
      return _json(500, {"error": f"the server failed: {type(e).__name__}: {e}"})

  def _infer(self, name: str, version: str, headers: Headers, body: bytes) -> Reply:
    encoding = headers.get("Content-Encoding")
    if encoding not in (None, "identity"):
      raise FrontError("bad_request", f"Content-Encoding {encoding!r} is not taken: send the body uncompressed")
    length = headers.get(HEADER_LENGTH)
    if length is None:
      head, tail = body, b""
    else:
      if not length.isdigit() or int(length) > len(body):
        raise FrontError(
          "bad_request", f"{HEADER_LENGTH} {length!r} is not a length within the body's {len(body)} bytes"
        )
      head, tail = body[: int(length)], body[int(length) :]
    try:
      req = json.loads(head, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
      raise FrontError("bad_request", f"malformed JSON: {e}") from None
    except RecursionError:
      raise FrontError("bad_request", "malformed JSON: nested too deeply") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
      raise FrontError("bad_request", 'the body must be a JSON object {"inputs": [...]}')
    tensors = _tensors(req["inputs"], tail)
    binary, outputs = _requested(req)
    answer = self.protocol.infer(name, version, tensors, list(outputs))
    scores = np.asarray(answer.scores, np.float32)
    out: Dict[str, Any] = {"name": codec.OUTPUT, "datatype": "FP32", "shape": [len(scores)]}
    raw = b""
    if outputs.get(codec.OUTPUT, binary):
      raw = scores.astype("<f4").tobytes()
      out["parameters"] = {"binary_data_size": len(raw)}
    else:
      out["data"] = answer.scores
    res: Dict[str, Any] = {"model_name": self.protocol.model_name, "model_version": codec.model_version(answer)}
    if isinstance(req.get("id"), str) and req["id"]:
      res["id"] = req["id"]
    res.update(parameters=codec.parameters(answer), outputs=[out])
    text = json.dumps(res).encode("utf-8")
    if not raw:
      return 200, {"Content-Type": "application/json"}, text
    return 200, {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(text))}, text + raw


def _tensors(inputs: List[Any], tail: bytes) -> List[codec.Tensor]:
  """The input tensors of a request's ``inputs``, their binary data cut from ``tail`` in order."""
  out, at = [], 0
  for i, t in enumerate(inputs):
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
      raise FrontError("bad_request", f"inputs[{i}] must be an object with a name, a datatype, a shape and data")
    name, datatype, shape = t["name"], t.get("datatype"), t.get("shape")
    if not isinstance(datatype, str):
      raise FrontError("bad_request", "no datatype", name)
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
      raise FrontError("bad_request", f"shape {shape!r:.60} is not a list of integers", name)
    params = t.get("parameters") or {}
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    if size is not None:
      if not isinstance(size, int) or size < 0 or at + size > len(tail):
        raise FrontError(
          "bad_request", f"binary_data_size {size!r} runs past the {len(tail)} bytes after the JSON", name
        )
      values = codec.values_from_raw(name, datatype, shape, tail[at : at + size])
      at += size
    elif "data" in t:
      values = codec.values_from_json(name, datatype, t["data"])
    else:
      raise FrontError("bad_request", "no data (nor binary_data_size)", name)
    out.append(codec.Tensor(name, datatype, tuple(shape), values))
  if at != len(tail):
    raise FrontError("bad_request", f"{len(tail) - at} bytes after the JSON belong to no input's binary_data_size")
  return out


def _requested(req: Dict[str, Any]) -> Tuple[bool, Dict[str, bool]]:
  """(binary by default, requested output -> binary)."""
  params = req.get("parameters")
  params = params if isinstance(params, dict) else {}
  binary = bool(params.get("binary_data_output", False))
  outputs: Dict[str, bool] = {}
  for o in req.get("outputs") or ():
    if not isinstance(o, dict) or not isinstance(o.get("name"), str):
      raise FrontError("bad_request", 'each of "outputs" must be an object with a name')
    p = o.get("parameters")
    p = p if isinstance(p, dict) else {}
    outputs[o["name"]] = bool(p.get("binary_data", binary))
  return binary, outputs
