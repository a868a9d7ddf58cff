"""The gRPC side of a PS shard server: ``ShardServer`` decodes and checks requests, ``serve`` starts one.

The RPCs (messages in ``wire``'s format, method paths ``/recsys_jax.async_ps.PSShard/<name>``)
call ``service.ShardService``, which holds the tables and the steps in flight:

- ``Configure``: table specs, seed, num_workers, staleness, this server's place among the
  servers and its disk tier (a kvstore spec or none); later calls must agree with the first.
  Every other RPC but ``Health`` is refused (FAILED_PRECONDITION) until then.
- ``Lookup``, ``Push``, ``Snapshot``, ``Restore``: see ``service``.
- ``ExportRows``, ``ImportRows``: rows with their optimizer slots, out and back (below).
- ``ReadAhead``: ``ids/<table>`` (distinct uint64) and a ``step`` in; the server hands them to
  its tables' reader threads, which bring that step's tier rows into RAM (``service``), and
  answers at once with ``{'staged': the ids handed over}``, without waiting for the reads.
- ``Stats``, ``Health``.

Bad requests are answered with INVALID_ARGUMENT (malformed, unknown table, ids that are not
uint64, wrong shape, non-finite gradients, a step outside [0, 2**62)), FAILED_PRECONDITION (out
of order, not configured, mismatched configuration), OUT_OF_RANGE (a step too far ahead),
UNAUTHENTICATED (a token is set and no ``authorization: Bearer <token>`` metadata) or
RESOURCE_EXHAUSTED (a request over ``max_message_mb``, enforced by gRPC; a lookup whose answer
would be, refused before any work; no room in ``max_inflight_mb`` within the deadline, see
``budget``); the server keeps serving. ``Configure`` answers with the server's
``max_message_bytes``, so that ``RemotePS`` sends larger calls in chunks under it.
Waits for pushes end with CANCELLED, DEADLINE_EXCEEDED or UNAVAILABLE (see ``service``);
``serve`` keeps two RPC threads out of them, for pushes and Health. The PS trusts its callers
to name snapshot directories: ``snapshot_root`` keeps them under one directory.

Rows with their optimizer slots (``ShardService`` does the work):

- ``ExportRows``: ``ids/<table>`` (distinct uint64) and an optional ``step`` in; ``weights/<table>``
  and ``slot_<name>/<table>`` of every slot of the table's optimizer out.
- ``ImportRows``: ``ids/<table>``, ``weights/<table>`` and every ``slot_<name>/<table>`` in, all
  finite; ``{'rows': {table: count}}`` out. It is read once its bytes have room in the budget,
  as a push is.

Rows and slots travel as float32 whatever the client's ``wire_dtype``: optimizer state must not
be rounded on its way to the accelerator and back. A request with an unknown table, arrays of
the wrong shape or dtype, repeated ids, or other slots than the table's optimizer keeps is
refused with INVALID_ARGUMENT before anything changes; an export whose answer would pass the
message limit with RESOURCE_EXHAUSTED, before any work.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hmac
import os
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import grpc
import numpy as np
from absl import logging

from recsys_jax.async_ps import wire
from recsys_jax.async_ps.server.budget import ByteBudget, WaitSlots
from recsys_jax.async_ps.server.service import MAX_WAIT_S, STEP_WINDOW, Grads, ServiceError, ShardService
from recsys_jax.async_ps.server.staging import MAX_CHUNKS
from recsys_jax.async_ps.store.ids import check_distinct
from recsys_jax.async_ps.store.ps import ParameterServer

_F32 = wire.DTYPES["float32"]

_RESERVED_META = ("format", "parts", "incremental", "all_chunks")  # keys of snapshot.save's own manifest
_C = grpc.StatusCode
_MAX_STEP = 2**62  # steps go into int64 arrays (a row's last step), with room for arithmetic
_FREE_THREADS = 2  # RPC threads no wait for pushes may take: one for pushes, one for Health
# RPCs whose large requests are read only once their bytes have room in the budget: what each sends.
_READ_WHEN_ROOM = {"Push": "push", "ImportRows": "import of rows"}


def _json_number(v: Any) -> Any:
  if isinstance(v, (bool, np.bool_)):
    return bool(v)
  if isinstance(v, (int, np.integer)):
    return int(v)
  return float(v)


class ShardServer:
  """The RPC handlers of one PS server, over a ``ShardService``.

  Args:
    shard_index, num_shards: this server's place among the servers, if fixed at launch
      (else taken from the first Configure). Restore keeps the ids routed to it.
    local_shards: shards of the in-process PS (threads working one request in parallel).
    token: if set, every call must carry ``authorization: Bearer <token>`` metadata.
    snapshot_root: if set, Snapshot and Restore only touch directories under it.
    max_message_bytes: the server's message limit, told to clients (None: not told); a lookup
      whose answer would pass it is refused before any work.
    max_inflight_bytes: the ``ByteBudget`` of requests and answers in flight (None: none).
    **limits: ``max_wait_s``, ``step_window``, ``max_waiters``, ``read_ahead_rows`` of
      ``ShardService`` (the waits for memory count against ``max_waiters`` too).
  """

  def __init__(
    self,
    shard_index: Optional[int] = None,
    num_shards: Optional[int] = None,
    local_shards: int = 1,
    token: Optional[str] = None,
    snapshot_root: Optional[str] = None,
    max_message_bytes: Optional[int] = None,
    max_inflight_bytes: Optional[int] = None,
    **limits: Any,
  ):
    slots = WaitSlots(limits.pop("max_waiters", None))
    self.service = ShardService(shard_index, num_shards, local_shards, slots=slots, **limits)
    self._limit = max_message_bytes
    wait = limits.get("max_wait_s", MAX_WAIT_S)
    self.budget = None if max_inflight_bytes is None else ByteBudget(max_inflight_bytes, slots, wait)
    self._token = None if token is None else f"Bearer {token}".encode("utf-8")
    self._root = None if not snapshot_root else os.path.realpath(snapshot_root)
    self._counts: "collections.Counter[str]" = collections.Counter()  # refused calls by (method, status)
    self._counts_lock = threading.Lock()

  @property
  def ps(self) -> Optional[ParameterServer]:
    """The in-process PS (None until the first Configure)."""
    return self.service.ps

  # -- plumbing ------------------------------------------------------------------------
  def handler(self) -> grpc.GenericRpcHandler:
    """The generic handler serving every RPC of ``wire.METHODS`` (raw bytes in and out).

    Returns:
      A handler to pass to ``grpc.Server.add_generic_rpc_handlers``.
    """
    methods = {}
    for m in wire.METHODS:
      # A push (or an import of rows) is read only once its bytes have room in the budget: a stream
      # handler receives the message when it asks for it (HTTP/2 flow control holds the sender
      # meanwhile), and a client's unary call is the same on the wire. Lookups (and exports) are
      # read at once and take their room after their wait for pushes, so that they never hold
      # room the pushes need.
      make = grpc.stream_unary_rpc_method_handler if m in _READ_WHEN_ROOM else grpc.unary_unary_rpc_method_handler
      methods[m] = make(self._wrap(m, getattr(self, f"_rpc_{m.lower()}")))
    return grpc.method_handlers_generic_handler(wire.SERVICE, methods)

  def _wrap(self, method: str, fn: Callable[[wire.Message, grpc.ServicerContext], bytes]):
    def behavior(request: Any, context: grpc.ServicerContext) -> bytes:
      try:
        self._authenticate(context)
        if method not in ("Configure", "Health") and self.service.ps is None:
          raise ServiceError("FAILED_PRECONDITION", "the server is not configured yet: call Configure first")
        if method in _READ_WHEN_ROOM:
          request = self._receive(request, context, _READ_WHEN_ROOM[method])
        return fn(wire.decode(request), context)
      except ServiceError as e:
        code, text = _C[e.code], e.message
      except wire.WireError as e:
        code, text = _C.INVALID_ARGUMENT, str(e)
      except Exception as e:  # noqa: BLE001 - a bug or a library error must not end the server
        logging.exception("%s failed", method)
        code, text = _C.INTERNAL, f"{type(e).__name__}: {e}"
      with self._counts_lock:
        self._counts[f"{method}:{code.name}"] += 1
      if code not in (_C.DEADLINE_EXCEEDED, _C.CANCELLED):
        logging.warning("%s refused: %s: %s", method, code.name, text)
      return context.abort(code, f"{method}: {text}")  # it raises, ending the call with this status

    return behavior

  def _receive(self, requests: Iterator[bytes], context: grpc.ServicerContext, what: str = "push") -> bytes:
    """Reads a push (or an import: ``what``) once the bytes its client declared (``wire.SIZE_KEY``)
    have room in the budget; an undeclared one takes its room once read, one that declared too
    little the rest at once."""
    declared = None
    for key, value in context.invocation_metadata() or ():
      if key == wire.SIZE_KEY:
        try:
          declared = int(value)
        except ValueError:
          raise wire.WireError(f"metadata {wire.SIZE_KEY} must be a byte count, got {value!r}") from None
    if declared is not None and declared < 0:
      raise wire.WireError(f"metadata {wire.SIZE_KEY} must be a byte count, got {declared}")
    if declared is not None and self._limit is not None and declared > self._limit:
      raise ServiceError(
        "RESOURCE_EXHAUSTED",
        f"a {what} of {declared} bytes is over the server's --max_message_mb={self._limit / 2**20:g}: send it in "
        "chunks (RemotePS does, under the limit Configure reports)",
      )
    if declared is not None:
      self._admit(context, declared, f"a {what} of {declared} bytes")
    try:
      request = next(requests, None)
    except Exception:  # noqa: BLE001 - gRPC ends the stream with its own error when the caller goes away
      request = None
    if request is None and not context.is_active():  # gRPC has answered already (e.g. over the limit)
      raise ServiceError("CANCELLED", f"the call ended before its {what} was read (over the limit, or the caller left)")
    if request is None:
      raise wire.WireError("the call carried no message")
    more = len(request) - (declared or 0)
    if more > 0:
      self._admit(context, more, f"a {what} of {len(request)} bytes", wait=declared is None)
    return request

  def _authenticate(self, context: grpc.ServicerContext) -> None:
    if self._token is None:
      return
    got = b""
    for key, value in context.invocation_metadata() or ():
      if key == "authorization":
        got = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    if not hmac.compare_digest(got, self._token):
      raise ServiceError("UNAUTHENTICATED", "missing or wrong token (send metadata 'authorization: Bearer <token>')")

  def _check_path(self, directory: Any, what: str) -> str:
    if not isinstance(directory, str) or not directory:
      raise wire.WireError(f"{what} must be a non-empty path, got {directory!r}")
    real = os.path.realpath(directory)
    if self._root is not None and os.path.commonpath([real, self._root]) != self._root:
      raise ServiceError("PERMISSION_DENIED", f"{what} {directory!r} is outside --snapshot_root={self._root}")
    return real

  # -- request validation --------------------------------------------------------------
  def _tier(self, spec: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Configure's tier (a tensorstore kvstore spec, or None); a ``file`` one must lie under
    ``snapshot_root``, as snapshots do: the client names where this server writes."""
    if spec is None:
      return None
    if not isinstance(spec.get("driver"), str) or not spec["driver"]:
      raise wire.WireError(f"field 'tier' must be a tensorstore kvstore spec with a 'driver', got {spec!r}")
    if spec["driver"] == "file":
      spec = {**spec, "path": self._check_path(spec.get("path"), "the tier path")}
    return spec

  @staticmethod
  def _step(fields: Dict[str, Any]) -> Optional[int]:
    step = wire.get_field(fields, "step", int, None, optional=True)
    if step is not None and step < 0:
      raise wire.WireError(f"step {step} is negative: steps count from 0")
    if step is not None and step >= _MAX_STEP:
      raise wire.WireError(f"step {step} is outside [0, 2**62)")
    return step

  def _arrays_by_table(self, msg: wire.Message, kinds: Sequence[str]) -> Dict[str, Dict[str, np.ndarray]]:
    out: Dict[str, Dict[str, np.ndarray]] = {}
    ps = self.service.ps
    assert ps is not None  # _wrap refuses every call but Configure and Health until the server is configured
    for name, arr in msg.arrays.items():
      kind, table = wire.split_name(name)
      if kind not in kinds:
        raise wire.WireError(f"unexpected array {name!r}: this RPC takes {list(kinds)} per table")
      if table not in ps.specs:
        raise wire.WireError(f"unknown table {table!r}; this server holds {sorted(ps.specs)}")
      out.setdefault(table, {})[kind] = arr
    return out

  @staticmethod
  def _check_ids(table: str, ids: np.ndarray) -> np.ndarray:
    if ids.dtype != wire.DTYPES["uint64"] or ids.ndim != 1:
      raise wire.WireError(f"table {table!r}: ids must be 1-D uint64, got {ids.dtype} of shape {list(ids.shape)}")
    check_distinct(ids, table, wire.WireError)
    return ids

  def _check_grads(self, table: str, ids: np.ndarray, grads: np.ndarray) -> np.ndarray:
    ps = self.service.ps
    assert ps is not None  # configured (see _arrays_by_table)
    dim = ps.specs[table].dim
    if grads.dtype.name not in wire.FLOAT_DTYPES:
      raise wire.WireError(f"table {table!r}: grads must be one of {sorted(wire.FLOAT_DTYPES)}, got {grads.dtype}")
    if grads.shape != (ids.shape[0], dim):
      raise wire.WireError(
        f"table {table!r}: grads of shape {list(grads.shape)} do not match [n={ids.shape[0]} ids, dim={dim}]"
      )
    g = wire.from_wire(grads)
    wire.check_finite(table, "grads", g)
    return g

  # -- RPCs ----------------------------------------------------------------------------
  def _rpc_configure(self, msg: wire.Message, context) -> bytes:
    f = msg.fields
    raw = wire.get_field(f, "tables", list)
    specs = [wire.spec_from_json(d) for d in raw]
    if not specs:
      raise wire.WireError("field 'tables' is empty")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
      raise wire.WireError(f"table names must be distinct, got {names}")
    cfg = {
      "seed": wire.get_field(f, "seed", int, 0),
      "num_workers": wire.get_field(f, "num_workers", int, 1),
      "staleness": wire.get_field(f, "staleness", int, 0),
      "shard_index": wire.get_field(f, "shard_index", int),
      "num_shards": wire.get_field(f, "num_shards", int),
    }
    if cfg["num_workers"] < 1 or cfg["staleness"] < 0 or cfg["num_shards"] < 1:
      raise wire.WireError(f"need num_workers >= 1, staleness >= 0, num_shards >= 1; got {cfg}")
    if not 0 <= cfg["shard_index"] < cfg["num_shards"]:
      raise wire.WireError(f"shard_index {cfg['shard_index']} is not in [0, {cfg['num_shards']})")
    cfg["tier"] = self._tier(wire.get_field(f, "tier", dict, None, optional=True))
    return wire.encode({**self.service.configure(specs, cfg), "max_message_bytes": self._limit})

  def _rpc_lookup(self, msg: wire.Message, context) -> bytes:
    f = msg.fields
    step = self._step(f)
    create = wire.get_field(f, "create", bool, True)
    wire_dtype = wire.check_wire_dtype(wire.get_field(f, "wire_dtype", str, "float32"))
    ids = {}
    for t, arrs in self._arrays_by_table(msg, ("ids",)).items():
      ids[t] = self._check_ids(t, arrs["ids"])
    size = wire.DTYPES[wire_dtype].itemsize
    ps = self.service.ps
    assert ps is not None  # configured (see _arrays_by_table)
    answer = sum(v.shape[0] * ps.specs[t].dim * size for t, v in ids.items())
    answer += wire.header_bound({}, [f"rows/{t}" for t in ids])
    n = sum(v.shape[0] for v in ids.values())
    admit = self._room_for_answer(context, msg, answer, f"a lookup of {n} ids", "look up fewer ids per call")
    rows = self.service.lookup(ids, create, step, context.time_remaining, context.is_active, admit)
    return wire.encode({}, {f"rows/{t}": wire.to_wire(r, wire_dtype) for t, r in rows.items()})

  def _rpc_readahead(self, msg: wire.Message, context) -> bytes:
    step = self._step(msg.fields)
    if step is None:
      raise wire.WireError("a read-ahead needs the step of the lookup it reads for")
    ids = {t: self._check_ids(t, arrs["ids"]) for t, arrs in self._arrays_by_table(msg, ("ids",)).items()}
    n = sum(v.shape[0] for v in ids.values())
    self._admit(context, wire.payload_bytes(msg), f"a read-ahead of {n} ids")
    return wire.encode({"staged": int(self.service.read_ahead(ids, step))})

  def _room_for_answer(self, context, msg: wire.Message, answer: int, what: str, advice: str) -> Callable[[], None]:
    """Refuses, before any work, a call whose answer of ``answer`` bytes would pass the message limit
    (it would only fail in gRPC); returns what takes the call's bytes from the budget (``_admit``)."""
    if self._limit is not None and answer > self._limit:
      raise ServiceError(
        "RESOURCE_EXHAUSTED",
        f"the answer to {what} would take {answer / 2**20:.1f} MiB, over the server's "
        f"--max_message_mb={self._limit / 2**20:g}: {advice} (RemotePS splits its calls by it)",
      )
    return functools.partial(self._admit, context, wire.payload_bytes(msg) + answer, what)

  def _admit(self, context, cost: int, what: str, wait: bool = True) -> None:
    """Takes ``cost`` bytes of the budget (``wait``: once they have room), until the call ends."""
    if self.budget is None:
      return
    if wait:
      release = self.budget.acquire(cost, context.time_remaining, context.is_active, what)
    else:
      release = self.budget.take(cost)
    if not context.add_callback(release):  # the call has ended already
      release()
      raise ServiceError("CANCELLED", f"{what}: the caller went away")

  def _rpc_push(self, msg: wire.Message, context) -> bytes:
    f = msg.fields
    nw = self.service.config["num_workers"]
    worker = wire.get_field(f, "worker", int)
    step = self._step(f)
    request_id = wire.get_field(f, "request_id", str)
    if not 0 <= worker < nw:
      raise wire.WireError(f"worker {worker} is not in [0, num_workers={nw})")
    if not 0 < len(request_id) <= 256:
      raise wire.WireError("request_id must have 1 to 256 characters")
    if step is None and nw > 1:
      raise wire.WireError(f"a push needs a step when num_workers={nw} (steps are summed over workers)")
    chunks = wire.get_field(f, "chunks", int, 1)
    chunk = wire.get_field(f, "chunk", int, 0)
    if not (1 <= chunks <= MAX_CHUNKS and 0 <= chunk < chunks):
      raise wire.WireError(f"chunk {chunk} of {chunks}: need 0 <= chunk < chunks <= {MAX_CHUNKS}")
    grads: Grads = {}
    for t, arrs in self._arrays_by_table(msg, ("ids", "grads")).items():
      if set(arrs) != {"ids", "grads"}:
        raise wire.WireError(f"table {t!r}: a push needs both ids/{t} and grads/{t}")
      ids = self._check_ids(t, arrs["ids"])
      grads[t] = (ids, self._check_grads(t, ids, arrs["grads"]))
    return wire.encode(self.service.push(worker, step, request_id, grads, chunk, chunks))

  def _rpc_snapshot(self, msg: wire.Message, context) -> bytes:
    f = msg.fields
    directory = self._check_path(wire.get_field(f, "directory", str), "directory")
    incremental = wire.get_field(f, "incremental", bool, False)
    step = self._step(f)
    meta = wire.get_field(f, "meta", dict, {})
    if any(k in meta for k in _RESERVED_META):
      raise wire.WireError(f"meta may not set {[k for k in _RESERVED_META if k in meta]} (the snapshot manifest's own)")
    rows = self.service.snapshot(directory, incremental, step, meta, context.time_remaining, context.is_active)
    return wire.encode({"rows": {t: int(n) for t, n in rows.items()}, "directory": directory})

  def _rpc_restore(self, msg: wire.Message, context) -> bytes:
    f = msg.fields
    chain = wire.get_field(f, "chain", list)
    step = self._step(f)
    if not chain or not all(isinstance(link, list) and link for link in chain):
      raise wire.WireError("field 'chain' must be a non-empty list of non-empty lists of directories")
    links = [[self._check_path(d, "snapshot directory") for d in link] for link in chain]
    return wire.encode(self.service.restore(links, step))

  def _rpc_stats(self, msg: wire.Message, context) -> bytes:
    ps = self.service.ps
    assert ps is not None  # configured (see _arrays_by_table)
    tables = {t: {k: _json_number(v) for k, v in s.items()} for t, s in ps.stats().items()}
    return wire.encode({"tables": tables, "server": self._state()})

  def _rpc_health(self, msg: wire.Message, context) -> bytes:
    return wire.encode({"ok": self.service.broken is None, "configured": self.service.ps is not None, **self._state()})

  def _state(self) -> Dict[str, Any]:
    with self._counts_lock:
      refused = dict(self._counts)
    inflight = None if self.budget is None else self.budget.used
    return {**self.service.state(), "refused": refused, "inflight_bytes": inflight}

  # Rows with their optimizer slots: the ExportRows and ImportRows handlers.
  def _rpc_exportrows(self, msg: wire.Message, context) -> bytes:
    step = self._step(msg.fields)
    ps = self.service.ps
    assert ps is not None  # configured (see _arrays_by_table)
    specs = ps.specs
    ids = {t: self._check_ids(t, arrs["ids"]) for t, arrs in self._arrays_by_table(msg, ("ids",)).items()}
    kinds = {t: wire.row_arrays(specs[t]) for t in ids}
    answer = sum(v.shape[0] * sum(kinds[t].values()) * _F32.itemsize for t, v in ids.items())
    answer += wire.header_bound({}, [f"{k}/{t}" for t in ids for k in kinds[t]])
    n = sum(v.shape[0] for v in ids.values())
    admit = self._room_for_answer(context, msg, answer, f"an export of {n} rows", "export fewer rows per call")
    got = self.service.export_rows(ids, step, context.time_remaining, context.is_active, admit)
    arrays = {}
    for t, (w, slots) in got.items():
      arrays[f"weights/{t}"] = w
      arrays.update({f"slot_{k}/{t}": v for k, v in slots.items()})
    return wire.encode({}, arrays)

  def _rpc_importrows(self, msg: wire.Message, context) -> bytes:
    ps = self.service.ps
    assert ps is not None  # configured (see _arrays_by_table)
    every = sorted({"ids", *(k for s in ps.specs.values() for k in wire.row_arrays(s))})
    rows = {}
    for t, arrs in self._arrays_by_table(msg, every).items():
      want = {"ids", *wire.row_arrays(ps.specs[t])}
      if set(arrs) != want:
        raise wire.WireError(
          f"table {t!r}: an import of its rows needs exactly {sorted(want)} (its {ps.specs[t].optimizer} "
          f"optimizer's slots), got {sorted(arrs)}"
        )
      ids = self._check_ids(t, arrs.pop("ids"))
      for k, a in arrs.items():
        if a.dtype != _F32:
          raise wire.WireError(
            f"table {t!r}: {k} must be float32 (rows and optimizer slots travel unrounded), got {a.dtype}"
          )
        if a.ndim != 2 or a.shape[0] != ids.shape[0]:
          raise wire.WireError(
            f"table {t!r}: {k} of shape {list(a.shape)} does not match [n={ids.shape[0]} ids, width]"
          )
        wire.check_finite(t, k, a)
      rows[t] = (ids, arrs.pop("weights"), {k[len("slot_") :]: a for k, a in arrs.items()})
    try:  # the widths; the same checks as an in-process import, before anything changes
      checked = ps.check_import(rows)
    except ValueError as e:
      raise wire.WireError(str(e)) from None
    return wire.encode(self.service.import_rows(checked))


def serve(
  host: str = "127.0.0.1",
  port: int = 0,
  *,
  shard_index: Optional[int] = None,
  num_shards: Optional[int] = None,
  local_shards: int = 1,
  token: Optional[str] = None,
  tls_cert: Optional[bytes] = None,
  tls_key: Optional[bytes] = None,
  max_message_mb: int = 256,
  max_inflight_mb: float = 1024,
  threads: int = 32,
  snapshot_root: Optional[str] = None,
  max_wait_s: float = MAX_WAIT_S,
  step_window: int = STEP_WINDOW,
  read_ahead_rows: int = 0,
) -> Tuple[grpc.Server, int, ShardServer]:
  """Starts a shard server (in this process) and returns (grpc server, bound port, handlers).

  Args:
    host, port: where to listen (port 0: a free one).
    shard_index, num_shards, local_shards, token, snapshot_root: see ``ShardServer``.
    tls_cert, tls_key: PEM bytes; both or neither (then plaintext).
    max_message_mb: the largest request and response, in MiB (larger: RESOURCE_EXHAUSTED).
    max_inflight_mb: bytes of requests and answers the calls in flight may hold, MiB
      (``budget.ByteBudget``; 0: no bound).
    threads: RPCs served at once (lookups waiting for pushes hold one each; at most threads - 2
      may wait, the rest are refused with UNAVAILABLE, so pushes and Health always find one).
    max_wait_s, step_window, read_ahead_rows: see ``ShardService``.

  Returns:
    The started server (stop it with ``.stop(grace)``), the port it listens on, the handlers.

  Raises:
    RuntimeError: the address cannot be bound.
  """
  waiters = max(1, threads - _FREE_THREADS)
  limits = {"max_wait_s": max_wait_s, "step_window": step_window, "max_waiters": waiters}
  limits["read_ahead_rows"] = read_ahead_rows
  limit = int(max_message_mb * (1 << 20))
  if limit < 1 or max_inflight_mb < 0:
    raise ValueError(f"need --max_message_mb > 0 and --max_inflight_mb >= 0, got {max_message_mb}, {max_inflight_mb}")
  inflight = int(max_inflight_mb * (1 << 20)) or None
  service = ShardServer(shard_index, num_shards, local_shards, token, snapshot_root, limit, inflight, **limits)
  server, bound = listen(service.handler(), host, port, threads, limit, tls_cert, tls_key, "ps-rpc")
  return server, bound, service


def listen(handler, host: str, port: int, threads: int, limit: int, tls_cert, tls_key, thread_prefix: str, what=""):
  """A started gRPC server of the generic ``handler`` on host:port, and the port it got.

  ``threads`` calls are served at once and messages are limited to ``limit`` bytes both ways
  (larger: RESOURCE_EXHAUSTED); with both PEMs (bytes) it speaks TLS. A second server on a port in
  use fails rather than sharing it: RuntimeError naming the address (and ``what`` listens there).
  """
  if (tls_cert is None) != (tls_key is None):
    raise ValueError("TLS needs both a certificate and a key")
  server = grpc.server(
    concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=thread_prefix),
    options=[
      ("grpc.max_receive_message_length", limit),
      ("grpc.max_send_message_length", limit),
      ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
    ],
  )
  server.add_generic_rpc_handlers((handler,))
  address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
  try:
    if tls_cert is not None:
      bound = server.add_secure_port(address, grpc.ssl_server_credentials([(tls_key, tls_cert)]))
    else:
      bound = server.add_insecure_port(address)
  except RuntimeError as e:
    raise RuntimeError(f"cannot listen on {address}{what}: {e}") from None
  if not bound:
    raise RuntimeError(f"cannot listen on {address}{what}")
  server.start()
  return server, bound
