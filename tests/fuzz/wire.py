"""Fuzz target 'wire': ``async_ps.wire.decode`` and the PS server's request checks behind it.

An input is a short sequence of 1 to 3 requests sent to a fresh, configured ``rpc.ShardServer``
(two tables; no gRPC: its handlers are called with a stand-in context, as gRPC would call them).
Each request is drawn as one of: random bytes; the magic and a random length before random
bytes; a well-formed request of a real RPC (Lookup, Push, Configure, Snapshot, Restore, Stats,
Health, ReadAhead) with plausible and implausible field values; such a request with bits flipped, cut
short, extended, or its JSON header changed at one place (a value replaced by a huge, negative,
wrong-typed or unknown one) and re-framed, with the true header length or a lying one.

Correct: ``decode`` returns a message whose arrays are views inside the bytes (never an
allocation a length asked for) or raises ``WireError`` with a message; the server answers
every request with a response or a status other than INTERNAL (INTERNAL means an exception
the handlers did not expect). The worker runs under a 4 GiB address-space limit, so a lying
length that allocates fails as a crash instead of eating the host.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from typing import Any, Dict, List

import numpy as np
from hypothesis import strategies as st

from .harness import Crash, Target, clear_error

TABLES = (
  {"name": "user", "dim": 4, "optimizer": "adagrad", "optimizer_kwargs": [["learning_rate", 0.1]]},
  {"name": "item", "dim": 8, "optimizer": "adam", "optimizer_kwargs": [["learning_rate", 0.01]], "capacity": 64},
)
CONFIG = {"seed": 3, "num_workers": 2, "staleness": 1, "shard_index": 0, "num_shards": 1}

_HUGE = st.sampled_from([2**31, 2**32 + 1, 2**53 + 1, 2**62, 2**63, 2**64 + 7, -(2**63), -1, 10**30])
_JSON_SCALAR = st.one_of(
  st.none(),
  st.booleans(),
  st.integers(-5, 70),
  _HUGE,
  st.floats(allow_nan=True, allow_infinity=True),
  st.text(max_size=12),
  st.sampled_from(["uint64", "float32", "bfloat16", "float16", "int64", "object", "ids/user", "grads/item"]),
)
JSON_VALUE = st.recursive(
  _JSON_SCALAR,
  lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
  max_leaves=12,
)
_DTYPES = st.sampled_from(["uint64", "float32", "float16", "bfloat16"])


@st.composite
def _array(draw, kinds=("ids", "grads", "rows")):
  kind = draw(st.sampled_from(list(kinds)))
  table = draw(st.sampled_from(["user", "item", "nope", "user/x", ""]))
  if kind == "ids":
    dtype = draw(st.sampled_from(["uint64", "uint64", "uint64", "float32"]))
    shape = [draw(st.integers(0, 9))] if draw(st.booleans()) else draw(st.lists(st.integers(0, 4), max_size=3))
  else:
    dtype = draw(_DTYPES)
    shape = draw(st.lists(st.integers(0, 9), min_size=0, max_size=3))
  n = int(np.prod(shape)) if shape else 1
  itemsize = {"uint64": 8, "float32": 4, "float16": 2, "bfloat16": 2}[dtype]
  raw = draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
  if kind == "ids" and draw(st.booleans()):  # distinct small ids: the common, valid case
    raw = np.arange(n, dtype="<u8").tobytes() if dtype == "uint64" else raw
  return {"name": f"{kind}/{table}", "dtype": dtype, "shape": shape, "raw": raw}


def _value(draw, valid):
  return draw(st.one_of(st.just(valid), JSON_VALUE)) if draw(st.booleans()) else valid


@st.composite
def _request(draw):
  """A request of a real RPC: (method, fields, arrays)."""
  method = draw(
    st.sampled_from(
      ["Lookup", "Lookup", "Push", "Push", "Configure", "Snapshot", "Restore", "Stats", "Health", "ReadAhead"]
    )
  )
  fields: Dict[str, Any] = {}
  arrays: List[Dict[str, Any]] = []
  if method == "Lookup":
    fields = {"step": _value(draw, draw(st.integers(-3, 40))), "create": _value(draw, True)}
    if draw(st.booleans()):
      fields["wire_dtype"] = _value(draw, draw(st.sampled_from(["float32", "bfloat16", "float16"])))
    arrays = draw(st.lists(_array(("ids",)), max_size=3))
  elif method == "ReadAhead":
    fields = {"step": _value(draw, draw(st.integers(-3, 40)))}
    arrays = draw(st.lists(_array(("ids",)), max_size=3))
  elif method == "Push":
    fields = {"worker": _value(draw, draw(st.integers(0, 2))), "step": _value(draw, draw(st.integers(-1, 40)))}
    fields["request_id"] = _value(draw, draw(st.text(min_size=0, max_size=8)))
    arrays = draw(st.lists(_array(("ids", "grads")), max_size=4))
  elif method == "Configure":
    tables = [dict(t) for t in TABLES]
    if draw(st.booleans()):
      t = draw(st.sampled_from(tables))
      key = draw(st.sampled_from(sorted(t) + ["capacity", "dim", "storage_dtype", "admit_after", "bogus"]))
      t[key] = draw(JSON_VALUE)
    fields = dict(CONFIG, tables=_value(draw, tables))
    if draw(st.booleans()):
      key = draw(st.sampled_from(sorted(CONFIG)))
      fields[key] = draw(JSON_VALUE)
  elif method == "Snapshot":
    fields = {"directory": _value(draw, "ROOT/" + draw(st.text("abc/.", min_size=1, max_size=8)))}
    fields.update(incremental=_value(draw, False), step=_value(draw, draw(st.integers(0, 5))))
    fields["meta"] = _value(draw, draw(st.dictionaries(st.text(max_size=8), JSON_VALUE, max_size=3)))
  elif method == "Restore":
    links = draw(
      st.lists(st.lists(st.text("abc/.", min_size=1, max_size=8).map(lambda s: "ROOT/" + s), max_size=2), max_size=2)
    )
    fields = {"chain": _value(draw, links), "step": _value(draw, draw(st.integers(0, 5)))}
  return method, fields, arrays


def encode_request(fields: Dict[str, Any], arrays: List[Dict[str, Any]], header_edit=None, lie: int = 0) -> bytes:
  """Frames a request as ``wire.encode`` does, from raw array bytes; ``header_edit`` changes the
  header dict before it is written and ``lie`` is added to the header length in the prefix."""
  entries, buffers, offset = [], [], 0
  for a in arrays:
    entries.append({"name": a["name"], "dtype": a["dtype"], "shape": a["shape"], "offset": offset})
    raw = a["raw"] + b"\0" * (-len(a["raw"]) % 8)
    buffers.append(raw)
    offset += len(raw)
  header = {"v": 1, "fields": fields, "payload_bytes": offset, "arrays": entries}
  if header_edit is not None:
    header = header_edit(header)
  text = json.dumps(header, separators=(",", ":")).encode("utf-8", "surrogatepass")
  text += b" " * (-(8 + len(text)) % 8)
  return b"RPS1" + struct.pack("<I", (len(text) + lie) % 2**32) + text + b"".join(buffers)


@st.composite
def _header_edit(draw):
  """(path into the header, new value): one place of the header replaced."""
  where = draw(
    st.sampled_from(
      [
        "v",
        "fields",
        "payload_bytes",
        "arrays",
        "arrays.name",
        "arrays.dtype",
        "arrays.shape",
        "arrays.offset",
        "arrays.extra",
        "arrays.shape.0",
        "fields.step",
        "root",
      ]
    )
  )
  return [where, draw(JSON_VALUE)]


def _apply_edit(edit):
  where, value = edit

  def f(h):
    if where == "root":
      return value
    head, _, rest = where.partition(".")
    if not rest:
      h[head] = value
      return h
    if head == "fields":
      h["fields"][rest] = value
      return h
    for e in h["arrays"][:1]:
      key, _, idx = rest.partition(".")
      if idx and isinstance(e.get(key), list) and e[key]:
        e[key][0] = value
      else:
        e[key] = value
    return h

  return f


@st.composite
def message(draw):
  """One request's bytes, with the method it is sent to (a dict: JSON-able)."""
  kind = draw(
    st.sampled_from(["random", "prefix", "valid", "flip", "truncate", "extend", "header", "header", "lie", "digits"])
  )
  method, fields, arrays = draw(_request())
  if kind == "random":
    return {"method": method, "kind": kind, "data": draw(st.binary(max_size=300))}
  if kind == "prefix":
    hlen = draw(st.one_of(st.integers(0, 64), _HUGE.map(lambda x: x % 2**32)))
    return {"method": method, "kind": kind, "data": b"RPS1" + struct.pack("<I", hlen) + draw(st.binary(max_size=200))}
  case = {"method": method, "kind": kind, "fields": fields, "arrays": arrays}
  if kind == "flip":
    case["flips"] = draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=8))
  elif kind == "truncate":
    case["keep"] = draw(st.integers(0, 10**6))
  elif kind == "extend":
    case["tail"] = draw(st.binary(min_size=1, max_size=40))
  elif kind == "header":
    case["edit"] = draw(_header_edit())
  elif kind == "lie":
    case["lie"] = draw(st.one_of(st.integers(-64, 64), _HUGE))
  elif kind == "digits":  # a number of more digits than Python's int() takes from a string
    case["edit"] = [
      draw(st.sampled_from(["payload_bytes", "arrays.offset", "arrays.shape.0", "fields.step"])),
      "DIGITS",
    ]
  return case


def build(case: Dict[str, Any], root: str) -> bytes:
  """The bytes of one drawn request (``ROOT`` in paths becomes the server's snapshot root)."""
  if "data" in case:
    return case["data"]
  fields = json.loads(json.dumps(case["fields"]).replace("ROOT/", root + "/"))
  arrays = case["arrays"]
  edit = case.get("edit")
  header_edit = None
  if edit is not None:
    header_edit = _apply_edit(edit)
  data = encode_request(fields, arrays, header_edit, case.get("lie", 0))
  if edit is not None and edit[1] == "DIGITS":
    data = data.replace(b'"DIGITS"', b"9" * 5000)
    text_len = struct.unpack_from("<I", data, 4)[0] + 5000 - len(b'"DIGITS"')
    data = data[:4] + struct.pack("<I", text_len) + data[8:]
  if case["kind"] == "flip":
    b = bytearray(data)
    for f in case["flips"]:
      if b:
        b[(f // 8) % len(b)] ^= 1 << (f % 8)
    data = bytes(b)
  elif case["kind"] == "truncate":
    data = data[: case["keep"] % (len(data) + 1)]
  elif case["kind"] == "extend":
    data += case["tail"]
  return data


class _Aborted(Exception):
  pass


class _Context:
  """What the handlers use of a ``grpc.ServicerContext``."""

  def __init__(self):
    self.code = self.details = None

  def invocation_metadata(self):
    return ()

  def time_remaining(self):
    return 0.3  # waits for pushes end quickly

  def is_active(self):
    return True

  def abort(self, code, details):
    self.code, self.details = code, details
    raise _Aborted()


class WireTarget(Target):
  name = "wire"
  deadline_s = 10.0
  memory_limit_gib = 4.0

  def setup(self, workdir: str) -> None:
    from recsys_jax.async_ps import wire  # noqa: F401 - compiled kernels warm up here
    from recsys_jax.async_ps.server import rpc  # noqa: F401 - compiled kernels warm up here

    self.workdir = workdir
    os.makedirs(workdir, exist_ok=True)
    self._server(tempfile.mkdtemp(dir=workdir), True)  # numba compiles the PS kernels once

  def _server(self, root: str, configure: bool):
    from recsys_jax.async_ps import wire
    from recsys_jax.async_ps.server import rpc

    server = rpc.ShardServer(snapshot_root=root, max_wait_s=1.0)
    handler = {m: server._wrap(m, getattr(server, f"_rpc_{m.lower()}")) for m in wire.METHODS}
    if configure:
      handler["Configure"](wire.encode(dict(CONFIG, tables=list(TABLES))), _Context())
    return handler

  def strategy(self):
    return st.lists(message(), min_size=1, max_size=3)

  def run(self, case) -> str:
    from recsys_jax.async_ps import wire

    root = tempfile.mkdtemp(dir=self.workdir)
    try:
      # A sequence that starts with Configure goes to a server not configured yet.
      handler = self._server(root, case[0]["method"] != "Configure")
      outcome = "accepted"
      for req in case:
        data = build(req, root)
        try:
          msg = wire.decode(data)
        except Exception as e:  # noqa: BLE001 - classified below
          clear_error(e, [wire.WireError], [], "decode")
          if not str(e):
            raise Crash("decode: WireError without a message") from None
          outcome = "clear"
          msg = None
        if msg is not None:
          for name, arr in msg.arrays.items():
            if arr.nbytes > len(data) or (arr.size and arr.base is None):
              raise Crash(f"decode: array {name!r} of {arr.nbytes} bytes is not a view of the {len(data)}-byte message")
        ctx = _Context()
        try:
          handler[req["method"]](data, ctx)
        except _Aborted:
          if ctx.code.name == "INTERNAL":
            raise Crash(f"{req['method']}: answered INTERNAL (an unexpected exception): {ctx.details[:300]}") from None
          if not ctx.details.startswith(req["method"] + ": ") or len(ctx.details) <= len(req["method"]) + 2:
            raise Crash(f"{req['method']}: status without a message: {ctx.details!r}") from None
          outcome = "clear"
      return outcome
    finally:
      shutil.rmtree(root, ignore_errors=True)
