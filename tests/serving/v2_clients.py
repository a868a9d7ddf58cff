"""tritonclient (NVIDIA Triton's client, which this project did not write) pointed at our model server.

``tensors`` builds a request's input tensors from ``/v1`` records and the model's metadata, as a
client that reads ``GET /v2/models/<name>`` would; ``clients`` opens one HTTP and one gRPC client.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

__all__ = ["InferenceServerException", "clients", "column", "tensors", "thttp", "tgrpc"]


def clients(s, tls_ca=None) -> Dict[str, Any]:
  """``{"http": ..., "grpc": ...}`` tritonclient clients of a running ``Serving``."""
  if tls_ca is None:
    return {
      "http": thttp.InferenceServerClient(f"127.0.0.1:{s.http_port}"),
      "grpc": tgrpc.InferenceServerClient(f"127.0.0.1:{s.grpc_port}"),
    }
  return {
    "http": thttp.InferenceServerClient(f"localhost:{s.http_port}", ssl=True, ssl_options={"ca_certs": str(tls_ca)}),
    "grpc": tgrpc.InferenceServerClient(f"localhost:{s.grpc_port}", ssl=True, root_certificates=str(tls_ca)),
  }


def column(values: Sequence[Any], datatype: str, shape: Sequence[int]) -> np.ndarray:
  """One tensor's array from the records' values of one feature (a list per record for a
  ``[-1, width]`` feature, padded to the widest with ``""``, -1 or 2**64 - 1 for UINT64)."""
  if len(shape) == 2:
    rows = [v if isinstance(v, list) else [v] for v in values]
    width = max(len(r) for r in rows)
    pad = {"BYTES": "", "UINT64": (1 << 64) - 1}.get(datatype, -1)
    values = [r + [pad] * (width - len(r)) for r in rows]
  if datatype == "BYTES":
    return np.array([[str(x).encode() for x in v] if isinstance(v, list) else str(v).encode() for v in values], object)
  return np.array(values, {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "UINT64": np.uint64}[datatype])


def tensors(
  mod, records: Sequence[Mapping[str, Any]], inputs: List[Dict[str, Any]], binary: bool = True, **datatypes: str
) -> list:
  """``mod.InferInput``s holding ``records`` as ``inputs`` (the model metadata's) declare them, or
  as ``datatypes`` (feature -> datatype) says for some."""
  out = []
  for meta in inputs:
    name, datatype = meta["name"], datatypes.get(meta["name"], meta["datatype"])
    arr = column([r[name] for r in records], datatype, [int(d) for d in meta["shape"]])
    x = mod.InferInput(name, list(arr.shape), datatype)
    if mod is thttp:
      x.set_data_from_numpy(arr, binary_data=binary)
    else:
      x.set_data_from_numpy(arr)
    out.append(x)
  return out


def metadata_inputs(c, name: str) -> List[Dict[str, Any]]:
  """The model's inputs as plain dicts, from either client."""
  m = (
    c.get_model_metadata(name, as_json=True)
    if isinstance(c, tgrpc.InferenceServerClient)
    else c.get_model_metadata(name)
  )
  return [{"name": t["name"], "datatype": t["datatype"], "shape": [int(d) for d in t["shape"]]} for t in m["inputs"]]
