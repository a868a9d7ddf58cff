"""The bytes on the wire between ``RemotePS`` clients and PS shard servers, and their routing.

No protobuf or codegen: every request and response of every RPC is one message of this form
(all integers little-endian)::

  b"RPS1"                     4 bytes, magic
  header length H             uint32
  header                      H bytes of UTF-8 JSON, padded with spaces to a multiple of 8
  payload                     the raw array buffers, each at an 8-byte aligned offset

The header is ``{"v": 1, "fields": {...}, "payload_bytes": P, "arrays": [{"name", "dtype",
"shape", "offset"}, ...]}``: ``fields`` holds the RPC's scalars and JSON values, each array's
``offset`` counts from the start of the payload, and ``P`` is the payload's exact length.
Arrays are C-ordered with a dtype from an allow-list (uint64 ids; float32, bfloat16 or float16
rows and gradients). Nothing is unpickled or evaluated: ``decode`` checks the magic, the
JSON, every dtype, that each shape matches its byte length, and that buffers neither overrun
the payload nor overlap; any violation is a ``WireError`` (the server answers
INVALID_ARGUMENT). Array names are ``<kind>/<table>`` (``ids/user``, ``grads/user``,
``rows/user``; ``weights/user`` and ``slot_<name>/user``, rows with their optimizer slots,
always float32); a table name may itself contain ``/``.

Routing is ``hashing.server_of``: client, servers and snapshot restores must agree on it.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

from recsys_jax.async_ps.store.rows import slot_widths
from recsys_jax.embeddings.specs import TableSpec

MAGIC = b"RPS1"
VERSION = 1
SERVICE = "recsys_jax.async_ps.PSShard"
METHODS = (
  "Configure",
  "Lookup",
  "Push",
  "Snapshot",
  "Restore",
  "Stats",
  "Health",
  "ExportRows",
  "ImportRows",
  "ReadAhead",
)
MAX_HEADER_BYTES = 16 << 20
SIZE_KEY = "rps-request-bytes"
"""gRPC metadata: the request's length in bytes, so a server can make room before reading it."""
_PREFIX = struct.Struct("<4sI")
_ALIGN = 8

DTYPES: Dict[str, np.dtype] = {
  "uint64": np.dtype("<u8"),
  "float32": np.dtype("<f4"),
  "float16": np.dtype("<f2"),
  "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
"""The only dtypes a message may carry, by the name the header uses."""

WIRE_DTYPES = ("float32", "bfloat16", "float16")
"""Dtypes rows and gradients may travel in (converted from and back to float32 at the ends)."""

FLOAT_DTYPES = frozenset(WIRE_DTYPES)


class WireError(ValueError):
  """A message (or a field of one) that does not follow the format; the server answers INVALID_ARGUMENT."""


@dataclasses.dataclass
class Message:
  """A decoded message: JSON ``fields`` and named arrays (read-only views of the message bytes)."""

  fields: Dict[str, Any]
  arrays: Dict[str, np.ndarray]


def path(method: str) -> str:
  """The gRPC method path of an RPC.

  Args:
    method: one of ``METHODS``.

  Returns:
    E.g. ``/recsys_jax.async_ps.PSShard/Lookup``.
  """
  return f"/{SERVICE}/{method}"


def _pad(n: int) -> int:
  return -n % _ALIGN


def encode(fields: Optional[Mapping[str, Any]] = None, arrays: Optional[Mapping[str, np.ndarray]] = None) -> bytes:
  """Builds one message.

  Args:
    fields: JSON-serialisable values (the RPC's scalars, lists and dicts).
    arrays: named arrays; each must already have a dtype of ``DTYPES`` (converted here to
      little-endian C order if it is not).

  Returns:
    The message bytes.

  Raises:
    WireError: an array with a dtype outside the allow-list.
  """
  names = {v: k for k, v in DTYPES.items()}
  entries: List[Dict[str, Any]] = []
  buffers: List[Any] = []  # bytes and uint8 arrays (numpy's stubs make ndarray a Buffer only on Python 3.12+)
  offset = 0
  for name, arr in (arrays or {}).items():
    arr = np.asarray(arr)
    dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
    if dt not in names:
      raise WireError(f"array {name!r}: dtype {arr.dtype} cannot be sent (allowed: {sorted(DTYPES)})")
    arr = np.ascontiguousarray(arr, dtype=dt)
    nbytes = arr.nbytes
    entries.append({"name": name, "dtype": names[dt], "shape": list(arr.shape), "offset": offset})
    if nbytes:
      buffers.append(arr.reshape(-1).view(np.uint8))  # bytes.join takes any buffer: no extra copy
    pad = _pad(nbytes)
    if pad:
      buffers.append(b"\0" * pad)
    offset += nbytes + pad
  header = json.dumps(
    {"v": VERSION, "fields": dict(fields or {}), "payload_bytes": offset, "arrays": entries}, separators=(",", ":")
  ).encode("utf-8")
  # The payload starts 8-byte aligned, so decoded arrays are aligned too.
  header += b" " * _pad(_PREFIX.size + len(header))
  return b"".join([_PREFIX.pack(MAGIC, len(header)), header, *buffers])


def header_bound(fields: Mapping[str, Any], names: Sequence[str]) -> int:
  """An upper bound of the bytes besides the payload in a message of these fields and arrays.

  Args:
    fields: the message's fields (numbers in them as large as they will be).
    names: the names of its arrays (of at most 2 dimensions).

  Returns:
    Bytes of the prefix and the padded header, whatever the arrays' shapes and offsets.
  """
  big = 10**19  # wider than any shape, offset or length of a message
  entries = [{"name": n, "dtype": "bfloat16", "shape": [big, big], "offset": big} for n in names]
  header = {"v": VERSION, "fields": dict(fields), "payload_bytes": big, "arrays": entries}
  return _PREFIX.size + len(json.dumps(header, separators=(",", ":")).encode("utf-8")) + _ALIGN


def _int(value: Any, what: str) -> int:
  if isinstance(value, bool) or not isinstance(value, int):
    raise WireError(f"{what} must be an integer, got {value!r}")
  return value


def decode(data: bytes) -> Message:
  """Parses and checks one message (see the module docstring for the format).

  Args:
    data: the message bytes as received.

  Returns:
    The message; its arrays are read-only views of ``data``.

  Raises:
    WireError: naming what is wrong (magic, header, an array's dtype, shape, offset or size).
  """
  view = memoryview(data)
  if view.nbytes < _PREFIX.size:
    raise WireError(f"message of {view.nbytes} bytes is shorter than the {_PREFIX.size}-byte prefix")
  magic, hlen = _PREFIX.unpack_from(view, 0)
  if magic != MAGIC:
    raise WireError(f"not a recsys_jax PS message (magic {bytes(magic)!r}, expected {MAGIC!r})")
  if hlen > MAX_HEADER_BYTES:
    raise WireError(f"header length {hlen} exceeds the limit of {MAX_HEADER_BYTES} bytes")
  start = _PREFIX.size + hlen
  if start > view.nbytes:
    raise WireError(
      f"header claims {hlen} bytes but the message has only {view.nbytes - _PREFIX.size} after the prefix"
    )
  try:
    header = json.loads(bytes(view[_PREFIX.size : start]).decode("utf-8"))
  # ValueError covers UnicodeDecodeError, JSONDecodeError and an integer of more digits than
  # int() converts (4300 by default), which json raises as a plain ValueError.
  except (ValueError, RecursionError) as err:
    raise WireError(f"header is not valid UTF-8 JSON ({err})") from None
  if not isinstance(header, dict):
    raise WireError("header must be a JSON object")
  if header.get("v") != VERSION:
    raise WireError(f"unsupported message version {header.get('v')!r} (this end speaks {VERSION})")
  fields, entries = header.get("fields"), header.get("arrays")
  if not isinstance(fields, dict):
    raise WireError("header field 'fields' must be a JSON object")
  if not isinstance(entries, list):
    raise WireError("header field 'arrays' must be a JSON list")
  payload = view.nbytes - start
  declared = _int(header.get("payload_bytes"), "header field 'payload_bytes'")
  if declared != payload:
    raise WireError(f"header declares {declared} payload bytes but the message carries {payload}")
  arrays: Dict[str, np.ndarray] = {}
  spans = []
  for i, e in enumerate(entries):
    if not isinstance(e, dict) or set(e) != {"name", "dtype", "shape", "offset"}:
      raise WireError(f"array entry {i} must be an object with exactly name, dtype, shape, offset")
    name = e["name"]
    if not isinstance(name, str) or not name:
      raise WireError(f"array entry {i}: name must be a non-empty string")
    if name in arrays:
      raise WireError(f"array {name!r} appears twice")
    if not isinstance(e["dtype"], str) or e["dtype"] not in DTYPES:  # a list or dict is not hashable
      raise WireError(f"array {name!r}: dtype {e['dtype']!r} is not allowed (allowed: {sorted(DTYPES)})")
    dt = DTYPES[e["dtype"]]
    shape = e["shape"]
    if not isinstance(shape, list) or len(shape) > 4:
      raise WireError(f"array {name!r}: shape must be a list of at most 4 dimensions, got {shape!r}")
    dims = [_int(d, f"array {name!r}: shape entry") for d in shape]
    if any(d < 0 for d in dims):
      raise WireError(f"array {name!r}: negative dimension in shape {dims}")
    count = 1
    for d in dims:
      count *= d
    nbytes = count * dt.itemsize
    offset = _int(e["offset"], f"array {name!r}: offset")
    if offset < 0 or offset % _ALIGN:
      raise WireError(f"array {name!r}: offset {offset} must be a non-negative multiple of {_ALIGN}")
    if offset + nbytes > payload:
      raise WireError(f"array {name!r}: {nbytes} bytes at offset {offset} overrun the {payload}-byte payload")
    if nbytes:
      spans.append((offset, offset + nbytes, name))
    arrays[name] = np.frombuffer(view, dt, count, start + offset).reshape(dims)
  spans.sort()
  for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
    if begin < end:
      raise WireError(f"arrays {a!r} and {b!r} overlap in the payload")
  return Message(fields, arrays)


def row_arrays(spec: TableSpec) -> Dict[str, int]:
  """The arrays rows of a table travel as with their optimizer slots (float32), by kind:
  ``weights`` and ``slot_<name>`` of each slot -> width."""
  return {"weights": spec.dim, **{f"slot_{k}": w for k, w in slot_widths(spec).items()}}


def payload_bytes(msg: Message) -> int:
  """The bytes of a message's arrays."""
  return sum(a.nbytes for a in msg.arrays.values())


def check_finite(table: str, what: str, x: np.ndarray, block: int = 1 << 20) -> None:
  """Refuses non-finite values (checked ``block`` values at a time: no mask of the full size).

  Raises:
    WireError: naming the table, ``what`` and the first bad row and column.
  """
  x = x.reshape(x.shape[0], -1)
  rows = max(1, block // max(x.shape[1], 1))
  for a in range(0, x.shape[0], rows):
    if not np.isfinite(x[a : a + rows]).all():
      bad = np.argwhere(~np.isfinite(x[a : a + rows]))[0]
      raise WireError(f"table {table!r}: {what} are not finite (e.g. row {a + bad[0]}, column {bad[1]})")


def split_name(name: str) -> Tuple[str, str]:
  """Splits an array name at its first ``/``.

  Args:
    name: e.g. ``'grads/user'``.

  Returns:
    (kind, table), e.g. ``('grads', 'user')``.

  Raises:
    WireError: a name without a ``<kind>/`` prefix or without a table.
  """
  kind, sep, table = name.partition("/")
  if not sep or not kind or not table:
    raise WireError(f"array name {name!r} must be '<kind>/<table>'")
  return kind, table


def to_wire(x: np.ndarray, wire_dtype: str) -> np.ndarray:
  """Converts float32 rows or gradients to the travelling dtype (rounding to nearest even).

  Args:
    x: float32 values.
    wire_dtype: one of ``WIRE_DTYPES``.

  Returns:
    ``x`` itself for float32, else a converted copy.
  """
  return np.asarray(x, np.float32).astype(DTYPES[check_wire_dtype(wire_dtype)], copy=False)


def from_wire(x: np.ndarray) -> np.ndarray:
  """Converts received rows or gradients of any allowed float dtype to float32 (exactly).

  Args:
    x: float32, bfloat16 or float16 values.

  Returns:
    float32 values (``x`` itself if it is float32 already).
  """
  return np.asarray(x).astype(np.float32, copy=False)


def check_wire_dtype(wire_dtype: Any) -> str:
  """Checks a wire dtype name.

  Args:
    wire_dtype: the name to check.

  Returns:
    ``wire_dtype``, if it is one of ``WIRE_DTYPES``.

  Raises:
    WireError: otherwise.
  """
  if wire_dtype not in WIRE_DTYPES:
    raise WireError(f"wire_dtype {wire_dtype!r} must be one of {WIRE_DTYPES}")
  return wire_dtype


# -- fields ------------------------------------------------------------------------------
_MISSING = object()


def get_field(fields: Mapping[str, Any], name: str, kind: type, default: Any = _MISSING, optional: bool = False) -> Any:
  """A typed field of a message.

  Args:
    fields: the message's fields.
    name: the field.
    kind: its type: int, float, bool, str, list or dict (an int is accepted for float; bool
      is never taken for int).
    default: returned when the field is absent (absent and no default: an error).
    optional: JSON null is allowed (returned as None).

  Returns:
    The value.

  Raises:
    WireError: naming the field, when it is missing or of the wrong type.
  """
  if name not in fields:
    if default is _MISSING:
      raise WireError(f"field {name!r} is missing")
    return default
  v = fields[name]
  if v is None and optional:
    return None
  ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
  if kind is float and isinstance(v, int) and not isinstance(v, bool):
    ok, v = True, float(v)
  if not ok:
    raise WireError(f"field {name!r} must be {kind.__name__}{' or null' if optional else ''}, got {v!r}")
  return v


def spec_to_json(spec: TableSpec) -> Dict[str, Any]:
  """A TableSpec as a JSON object of its fields.

  Args:
    spec: the spec.

  Returns:
    {field: value}, ``optimizer_kwargs`` as a list of [name, value] pairs.
  """
  d = dataclasses.asdict(spec)
  d["optimizer_kwargs"] = [list(kv) for kv in spec.optimizer_kwargs]
  return d


def spec_from_json(d: Any) -> TableSpec:
  """The inverse of ``spec_to_json``.

  Args:
    d: a decoded JSON object.

  Returns:
    The TableSpec (its own checks applied).

  Raises:
    WireError: unknown or missing fields, or values the TableSpec refuses.
  """
  if not isinstance(d, dict):
    raise WireError(f"a table spec must be a JSON object, got {type(d).__name__}")
  known = {f.name for f in dataclasses.fields(TableSpec)}
  unknown = set(d) - known
  if unknown:
    raise WireError(f"table spec {d.get('name')!r} has unknown fields {sorted(unknown)}")
  d = dict(d)
  kw = d.get("optimizer_kwargs", [])
  if not isinstance(kw, list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in kw):
    raise WireError(f"table spec {d.get('name')!r}: optimizer_kwargs must be a list of [name, value] pairs")
  d["optimizer_kwargs"] = tuple(tuple(p) for p in kw)
  try:
    return TableSpec(**d)
  except (TypeError, ValueError) as e:
    raise WireError(f"table spec {d.get('name')!r}: {e}") from None


def spec_differences(a: TableSpec, b: TableSpec) -> Sequence[str]:
  """Names of the fields in which two specs differ.

  Args:
    a, b: the specs.

  Returns:
    Field names, in declaration order (empty if equal).
  """
  return [f.name for f in dataclasses.fields(TableSpec) if getattr(a, f.name) != getattr(b, f.name)]
