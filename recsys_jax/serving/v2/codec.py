"""The Open Inference Protocol's model, whatever carries it: tensors in, records to the front, scores out.

The model takes one input tensor per request feature (``Scorer.fields()``: name -> kind), every
tensor's first dimension the batch; row ``i`` of every tensor together is record ``i`` of a
``/v1`` request, and that record is what gets scored, through ``Front.score`` (the micro-batcher),
so the two protocols refuse and score alike. A kind's datatype (the one metadata declares; the
others it takes):

- ``float`` (dense values): ``FP32`` ``[-1]``; also ``FP64``, or ``BYTES`` where the data's
  format takes numbers as text (CSV/Parquet dense columns; ``""``: missing).
- ``int``: ``INT64`` ``[-1]`` (Criteo's counts), ``UINT64`` for synthetic data's ids (hashed
  into [0, 2**64)); any integer datatype, or ``BYTES`` where the format takes decimal text
  (Criteo: ``""`` is a missing count).
- ``string`` (categorical values): ``BYTES`` ``[-1]`` (UTF-8; ``""``: the empty field); integer
  datatypes where the format writes ints in decimal (Avazu, CSV/Parquet).
- ``list`` (multi-hot): ``[-1, max_len]``, a row's values then padding: ``UINT64`` ids padded
  with 2**64 - 1 (synthetic data; a signed datatype pads with negative values, an unsigned one
  with its largest), ``BYTES`` tokens padded with ``""`` (CSV/Parquet bags; a ``[-1]``
  ``BYTES`` tensor holds each bag as the file does, joined by its separator).

A scalar feature also takes a ``[-1, 1]`` shape. The one output is ``score``, ``FP32`` ``[-1]``:
the click probabilities, bit for bit those ``/v1`` answers. The model's version is the step of
the checkpoint the answer's scorer was loaded from; the answer's ``parameters`` carry the
server's own ``version`` name and its ``row_version`` and ``dense_version`` (the trainer steps of
the rows and of the dense parameters that scored it: ``/v1``'s fields of those names).

A bad request raises ``FrontError`` whose ``field`` is the tensor and ``record`` the row;
``describe`` words it for either transport.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import struct
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from recsys_jax.serving.batcher import Prediction, checkpoint_step
from recsys_jax.serving.front import Front, FrontError

SERVER_NAME = "recsys_jax"
PLATFORM = "recsys_jax"
OUTPUT = "score"
EXTENSIONS = ("binary_tensor_data", "parameters")  # HTTP's binary tensors; request and response parameters

NUMPY = {
  "BOOL": "|b1",
  "INT8": "<i1",
  "INT16": "<i2",
  "INT32": "<i4",
  "INT64": "<i8",
  "UINT8": "|u1",
  "UINT16": "<u2",
  "UINT32": "<u4",
  "UINT64": "<u8",
  "FP32": "<f4",
  "FP64": "<f8",
}
INTS = ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")
# kind -> (declared datatype, accepted datatypes)
KINDS = {
  "float": ("FP32", ("FP32", "FP64", "BYTES")),
  "int": ("INT64", (*INTS, "BYTES")),
  "string": ("BYTES", ("BYTES", *INTS)),
  "list": ("BYTES", ("BYTES", *INTS)),
}
_ANY = ("BYTES", *INTS, "FP32", "FP64")
_LENGTH = struct.Struct("<I")  # a BYTES element's length, before it


@dataclasses.dataclass
class Tensor:
  """An input tensor as received: its values flat, row-major (``str`` for ``BYTES``)."""

  name: str
  datatype: str
  shape: Tuple[int, ...]
  values: Sequence[Any]


def describe(e: FrontError) -> str:
  """``FrontError``'s words with the place named as this protocol names it: the tensor, the record."""
  where = ([f"input {e.field!r}"] if e.field is not None else []) + (
    [f"record {e.record}"] if e.record is not None else []
  )
  return f"{', '.join(where)}: {e.reason}" if where else e.reason


def _bad(message: str, tensor: Optional[str] = None, record: Optional[int] = None) -> FrontError:
  return FrontError("bad_request", message, tensor, record)


def _size(shape: Sequence[int]) -> int:
  return math.prod(shape) if shape else 1


def values_from_raw(t_name: str, datatype: str, shape: Sequence[int], raw: bytes) -> List[Any]:
  """A tensor's flat values from its raw bytes (the HTTP binary extension, gRPC ``raw_input_contents``):
  little-endian fixed-size elements, or for ``BYTES`` each element as a 4-byte little-endian length
  and that many bytes (UTF-8)."""
  if datatype == "BYTES":
    parts: List[bytes] = []
    at, n, length = 0, len(raw), _LENGTH.unpack_from
    while at + 4 <= n:
      k = length(raw, at)[0]
      parts.append(raw[at + 4 : at + 4 + k])
      at += 4 + k
    if at > n:
      raise _bad(f"BYTES element {len(parts) - 1} of {k} bytes runs past the tensor's {n} bytes", t_name)
    if at < n:
      raise _bad(f"BYTES data ends inside an element's 4-byte length (element {len(parts)})", t_name)
    try:
      return [b.decode("utf-8") for b in parts]
    except UnicodeDecodeError:
      return [text(b, t_name, i) for i, b in enumerate(parts)]  # names the element
  if datatype not in NUMPY:
    raise _bad(f"unknown datatype {datatype!r}", t_name)
  item = np.dtype(NUMPY[datatype]).itemsize
  if len(raw) != _size(shape) * item:
    raise _bad(f"{len(raw)} bytes of {datatype} data, but shape {list(shape)} needs {_size(shape) * item}", t_name)
  return np.frombuffer(raw, NUMPY[datatype]).tolist()


def text(b: bytes, t_name: str, element: int) -> str:
  """A ``BYTES`` element as the string it holds (UTF-8)."""
  try:
    return b.decode("utf-8")
  except UnicodeDecodeError:
    raise _bad(f"BYTES element {element} is not UTF-8", t_name) from None


def values_from_json(t_name: str, datatype: str, data: Any) -> List[Any]:
  """A tensor's flat values from the JSON form's ``data`` (flat or nested row-major), checked for type."""
  flat: List[Any] = []
  stack = [data]
  if isinstance(data, list) and list not in set(map(type, data)):
    flat, stack = data, []  # flat already (the usual form)
  while stack:  # depth-first, left to right: row-major order
    x = stack.pop()
    if isinstance(x, list):
      stack.extend(reversed(x))
    else:
      flat.append(x)
  # The usual case checked at once; else element by element, naming the first bad one.
  want: Set[type] = (
    {str} if datatype == "BYTES" else {bool} if datatype == "BOOL" else {int} if datatype in INTS else {int, float}
  )
  checked = set(map(type, flat)) <= want
  if datatype == "BYTES":
    for i, v in enumerate(() if checked else flat):
      if not isinstance(v, str):
        raise _bad(f"BYTES data holds strings, element {i} is {type(v).__name__} {v!r:.40}", t_name)
    return flat
  if datatype not in NUMPY:
    raise _bad(f"unknown datatype {datatype!r}", t_name)
  want_int = datatype in INTS or datatype == "BOOL"
  for i, v in enumerate(() if checked else flat):
    ok = isinstance(v, bool) if datatype == "BOOL" else not isinstance(v, bool) and isinstance(v, (int, float))
    if not ok or (want_int and datatype != "BOOL" and not isinstance(v, int)):
      raise _bad(f"{datatype} data holds {'integers' if want_int else 'numbers'}, element {i} is {v!r:.40}", t_name)
  try:
    with np.errstate(over="ignore"):  # a float past FP32's range becomes inf, which the model refuses by name
      return np.asarray(flat, NUMPY[datatype]).tolist()  # FP32: each value as the float32 it is
  except OverflowError:
    raise _bad(f"a value is out of {datatype}'s range", t_name) from None


class Protocol:
  """What both transports of the Open Inference Protocol ask of the server: metadata and inference."""

  def __init__(self, front: Front):
    self.front = front
    self.model_name = front.model_name

  def server_metadata(self) -> Dict[str, Any]:
    try:
      version = importlib.metadata.version("recsys_jax")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
      version = "0"
    return {"name": SERVER_NAME, "version": version, "extensions": list(EXTENSIONS)}

  def version(self) -> str:
    """The model version served now: its checkpoint's step."""
    sc = self.front.holder.current()
    step = checkpoint_step(sc)
    return str(step) if step is not None else str(sc.version)

  def check_model(self, name: str, version: str = "") -> None:
    """``FrontError("not_found")`` unless ``name`` (and ``version``, when given) is what is served."""
    if name != self.model_name:
      raise FrontError("not_found", f"no model {name!r}: this server serves {self.model_name!r}")
    served = self.version()
    if version and version != served:
      raise FrontError(
        "not_found", f"version {version!r} of {name!r} is not served; version {served} is (send no version for it)"
      )

  def inputs(self) -> List[Dict[str, Any]]:
    """``[{"name", "datatype", "shape"}]``, one per feature (module docstring)."""
    sc = self.front.holder.current()
    declared = _declared(sc)
    out = []
    for name, kind in sc.fields().items():
      datatype, shape = declared.get(name) or (KINDS.get(kind, ("BYTES",))[0], [-1, -1] if kind == "list" else [-1])
      out.append({"name": name, "datatype": datatype, "shape": shape})
    return out

  def model_metadata(self, name: str, version: str = "") -> Dict[str, Any]:
    self.check_model(name, version)
    return {
      "name": self.model_name,
      "versions": [self.version()],
      "platform": PLATFORM,
      "inputs": self.inputs(),
      "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1]}],
    }

  def infer(self, name: str, version: str, tensors: Sequence[Tensor], outputs: Sequence[str] = ()) -> Prediction:
    """Scores the records the tensors hold; ``FrontError`` naming the tensor (and record) if they are bad."""
    self.check_model(name, version)
    for o in outputs:
      if o != OUTPUT:
        raise _bad(f"no output {o!r}; this model's one output is {OUTPUT!r}")
    return self.front.score(self.records(tensors))

  def records(self, tensors: Sequence[Tensor]) -> List[Dict[str, Any]]:
    """The ``/v1`` records that row ``i`` of the tensors make (module docstring)."""
    fields = self.front.holder.current().fields()
    given: Dict[str, Tensor] = {}
    for t in tensors:
      if t.name not in fields:
        raise _bad(f"no such input; this model reads one tensor per feature: {sorted(fields)}", t.name)
      if t.name in given:
        raise _bad("given twice", t.name)
      given[t.name] = t
    for f in fields:
      if f not in given:
        raise _bad("missing: this model reads one tensor per feature (GET /v2/models/<name> lists them)", f)
    n = None
    columns = {}
    declared = {i["name"]: i["datatype"] for i in self.inputs()}
    for t in tensors:
      kind = fields[t.name]
      accepted = KINDS.get(kind, ("BYTES", _ANY))[1]
      if t.datatype not in accepted:
        also = ", ".join(a for a in accepted if a != declared[t.name])
        raise _bad(f"datatype {t.datatype}; this {kind} feature is {declared[t.name]} (or {also})", t.name)
      shape = tuple(t.shape)
      if (
        len(shape) not in (1, 2) or any(d < 0 for d in shape) or (kind != "list" and len(shape) == 2 and shape[1] != 1)
      ):
        want = "[batch, width]" if kind == "list" else "[batch] (or [batch, 1])"
        raise _bad(f"shape {list(shape)}; a {kind} feature's is {want}", t.name)
      if n is None:
        n = shape[0]
      elif shape[0] != n:
        raise _bad(f"a batch of {shape[0]} rows, but the tensors before it hold {n}", t.name)
      if len(t.values) != _size(shape):
        raise _bad(f"{len(t.values)} values for shape {list(shape)}", t.name)
      if kind == "list" and len(shape) == 2:
        w = shape[1]
        pad = _padding(t.datatype)
        columns[t.name] = [[v for v in t.values[i * w : (i + 1) * w] if not pad(v)] for i in range(n)]
      elif kind == "list" and t.datatype != "BYTES":  # one id a row
        columns[t.name] = [[v] for v in t.values]
      else:
        columns[t.name] = list(t.values)
    if not n:
      raise _bad("the tensors hold no rows: send at least one record")
    if n > self.front.batcher.max_batch:
      raise FrontError(
        "too_large", f"{n} records in one request, over the server's --max_batch={self.front.batcher.max_batch}"
      )
    names = list(columns)
    return [dict(zip(names, row)) for row in zip(*(columns[k] for k in names))]


def _padding(datatype: str) -> Callable[[Any], bool]:
  """Whether a value of a ``[-1, width]`` tensor pads its row: ``""``, a negative value, or an
  unsigned datatype's largest."""
  if datatype == "BYTES":
    return lambda v: v == ""
  if datatype.startswith("UINT"):
    top = int(np.iinfo(NUMPY[datatype]).max)
    return lambda v: v == top
  return lambda v: v < 0


def _declared(scorer: Any) -> Dict[str, Tuple[str, List[int]]]:
  """Feature -> (datatype, shape) where the data's format says more than the kind: synthetic ids are
  UINT64, and a multi-hot feature's width is its max_len (from the scorer's encoder, if it has one)."""
  enc = getattr(scorer, "encoder", None)
  if enc is None:
    return {}
  out = {b.column: ("BYTES", [-1, int(b.max_len)]) for b in getattr(getattr(enc, "fmt", None), "bags", ())}
  if getattr(enc, "name", None) == "synthetic":
    for f in enc.schema.features:
      out[f.name] = ("UINT64", [-1, int(f.max_len)] if f.max_len > 1 else [-1])
  return out


def parameters(p: Prediction) -> Dict[str, Any]:
  """An answer's response parameters: the server's version name and the steps of its rows and dense parameters."""
  out: Dict[str, Any] = {"version": p.version}
  if p.row_version is not None:
    out["row_version"] = int(p.row_version)
  if p.dense_version is not None:
    out["dense_version"] = int(p.dense_version)
  return out


def model_version(p: Prediction) -> str:
  return str(p.step) if p.step is not None else str(p.version)
