"""A PS shard's service logic, independent of the RPC layer: ``ShardService``.

It holds the in-process ``ParameterServer`` of the rows routed to this server and the state of
the steps in flight (``rpc`` decodes and checks the requests and calls it):

- ``configure``: creates the tables on the first call; later calls must agree with the first.
- ``lookup``: rows of distinct ids. With a step t, first waits until the pushes of every
  step <= t - staleness - 1 are applied.
- ``read_ahead``: hands a later step's ids to the tables' reader threads, which bring that
  step's tier rows into RAM (``ParameterServer.read_ahead_many``); never waits, and moves no step.
- ``push``: a worker's row gradients of a step. A step is applied once every worker has
  pushed it (or moved past it): the gradients summed in worker order (``pushes.sum_pushes``),
  one ``apply_many``. A repeated (worker, request_id) is acknowledged, not applied again; a push
  in chunks is staged (``staging``) until its last chunk is in, then counts as that one push.
- ``snapshot`` / ``restore``: ``snapshot.save`` of the local PS after the pushes of the steps
  before ``step``; restore from the parts of any number of servers, keeping this server's ids.
- ``export_rows`` / ``import_rows`` : rows with their optimizer slots, out
  (after the pushes of the steps before ``step``) and back.

One client must not be able to jam the server: a wait ends when the caller cancels, before
its deadline, and after ``max_wait_s`` whatever the deadline; at most ``max_waiters`` calls
wait at once (the rest of the RPC threads stay free for pushes and Health; ``rpc``'s waits for
memory count too, through the shared ``slots``); a step more than staleness + ``step_window``
ahead of the applied one is refused (no trainer can be there, and it would move everyone's step).

A refusal is a ``ServiceError`` whose ``code`` names the status the server answers with, so
this module needs no gRPC.

Rows with their optimizer slots: the trainer moves its hottest rows, with their optimizer slots, to the accelerator and back, and
writes them back before a checkpoint. ``export_rows`` reads rows of distinct ids once the pushes
of the steps before ``step`` (if given) are applied, so that no gradient still on its way is
missing from what it reads; ``import_rows`` sets rows and their slots. Both run under the lock
that steps are applied under (``_apply_lock``), so neither sees nor changes a step's update half
applied, and a server whose restore failed refuses both.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from absl import logging

from recsys_jax.async_ps import wire
from recsys_jax.async_ps.server.budget import POLL_S, WAIT_MARGIN_S, Active, TimeLeft, WaitSlots
from recsys_jax.async_ps.server.errors import ServiceError as ServiceError
from recsys_jax.async_ps.server.pushes import Grads as Grads
from recsys_jax.async_ps.server.pushes import repeated_id, sum_pushes
from recsys_jax.async_ps.server.staging import Staging
from recsys_jax.async_ps.snapshot import chain as snapshot_chain
from recsys_jax.async_ps.snapshot import directory as snapshot
from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec

Rows = Dict[str, Tuple[np.ndarray, Dict[str, np.ndarray]]]

_SEEN_PER_WORKER = 4096  # request ids remembered per worker: far more than pushes in flight
# Steps buffered while waiting for the other workers. The staleness bound keeps a worker at
# most k + 1 steps ahead, so this only stops a misbehaving client from filling the memory.
_MAX_PENDING_STEPS = 1024
# Defaults of the server's --max_wait_s and --step_window. A wait only lasts until the slowest
# worker's push, and RemotePS's own deadline (ps.timeout_s, 30 s by default) ends it sooner.
MAX_WAIT_S = 300.0
STEP_WINDOW = 1000


def _no_deadline() -> Optional[float]:
  return None


def _always() -> bool:
  return True


def _own_tier(spec: Optional[Mapping[str, Any]], shard_index: int) -> Optional[Dict[str, Any]]:
  """This server's part of the client's tier: servers given one path must not share arrays
  (a ``DiskTier`` deletes what it finds under its path)."""
  if spec is None:
    return None
  path = str(spec.get("path", ""))
  return {**spec, "path": f"{path}{'/' if path and not path.endswith('/') else ''}server-{shard_index}"}


class ShardService:
  """One PS server's tables and step bookkeeping, over an in-process ``ParameterServer``.

  Thread-safe: the RPC layer calls it from many threads at once.

  Args:
    shard_index, num_shards: this server's place among the servers, if fixed at launch
      (else taken from the first configure). Restore keeps the ids routed to it.
    local_shards: shards of the in-process PS (threads working one request in parallel).
    max_wait_s: the longest a call waits for pushes, whatever its deadline.
    step_window: a step more than staleness + this ahead of the applied step is refused.
    max_waiters: calls that may wait for pushes at once (None: any number); more are refused.
    slots: instead of ``max_waiters``, the ``WaitSlots`` counting waits (shared with ``rpc``).
    read_ahead_rows: per table shard, the most rows read-aheads may hold pinned in RAM for later
      steps (0: half its capacity; ``ParameterServer``'s argument).
  """

  def __init__(
    self,
    shard_index: Optional[int] = None,
    num_shards: Optional[int] = None,
    local_shards: int = 1,
    *,
    max_wait_s: float = MAX_WAIT_S,
    step_window: int = STEP_WINDOW,
    max_waiters: Optional[int] = None,
    slots: Optional[WaitSlots] = None,
    read_ahead_rows: int = 0,
  ):
    if (shard_index is None) != (num_shards is None):
      raise ValueError("--shard_index and --num_shards go together")
    if shard_index is not None and num_shards is not None and not 0 <= shard_index < num_shards:
      raise ValueError(f"--shard_index={shard_index} must be in [0, --num_shards={num_shards})")
    if local_shards < 1:
      raise ValueError(f"--local_shards must be >= 1, got {local_shards}")
    if not max_wait_s > 0:
      raise ValueError(f"--max_wait_s must be positive, got {max_wait_s}")
    if step_window < 2:  # a trainer's lookup may be staleness + 2 steps ahead
      raise ValueError(f"--step_window must be >= 2, got {step_window}")
    if read_ahead_rows < 0:
      raise ValueError(f"--read_ahead_rows must be >= 0, got {read_ahead_rows}")
    self._read_ahead_rows = int(read_ahead_rows)
    self._max_wait_s, self._step_window = float(max_wait_s), int(step_window)
    self.slots = slots or WaitSlots(max_waiters)  # calls waiting
    self._fixed_place = None if num_shards is None else (shard_index, num_shards)
    self._local_shards = local_shards
    self._cond = threading.Condition()
    # Held while the PS changes in bulk (applying a step, a snapshot, a restore); taken after
    # _cond when both are needed, never the other way round.
    self._apply_lock = threading.Lock()
    self.ps: Optional[ParameterServer] = None
    self._config: Dict[str, Any] = {}
    self._applied: Optional[int] = None  # every step <= this is applied (None: no step seen yet)
    self._pending: Dict[int, Dict[int, List[Grads]]] = {}  # step -> worker -> gradients (its chunks)
    self._last: Dict[int, int] = {}  # worker -> the last step it pushed
    self._seen: Dict[int, "collections.OrderedDict[str, int]"] = {}  # worker -> request ids
    self._staging = Staging()  # pushes with chunks still missing
    self._broken: Optional[str] = None  # why the tables cannot be used (a failed restore)

  @property
  def config(self) -> Mapping[str, Any]:
    """seed, num_workers, staleness, shard_index, num_shards (empty until configured)."""
    return self._config

  @property
  def broken(self) -> Optional[str]:
    """Why the tables cannot be used (a failed restore), or None."""
    return self._broken

  def _check_step(self, step: int, what: str) -> None:
    """Refuses (holding ``_cond``) a step too far ahead of the applied one; changes nothing."""
    a, k = self._applied, self._config["staleness"]
    if a is not None and step > a + k + self._step_window:
      raise ServiceError(
        "OUT_OF_RANGE",
        f"{what}: step {step} is {step - a} steps ahead of the applied step {a}; this server takes steps "
        f"up to {a + k + self._step_window} (staleness {k} + --step_window {self._step_window})",
      )

  def _wait_applied(self, target: int, time_left: TimeLeft, active: Active, what: str) -> None:
    """Waits, holding ``_cond``, until every step <= ``target`` is applied.

    Ends with a refusal naming the steps when the caller went away, before its deadline, after
    ``max_wait_s``, or at once when ``max_waiters`` calls already wait.
    """

    def behind() -> bool:
      return self._applied is not None and self._applied < target and self._broken is None

    if behind():
      if not self.slots.enter():
        raise ServiceError(
          "UNAVAILABLE",
          f"{what} would wait for the pushes of steps <= {target} (steps <= {self._applied} are applied), but "
          f"{self.slots.count} calls already wait, the most this server lets wait so that pushes and Health keep "
          "a thread (start it with more --threads)",
        )
      left = time_left()
      limit = self._max_wait_s if left is None else min(self._max_wait_s, left - WAIT_MARGIN_S)
      start = time.monotonic()
      try:
        while behind():
          waited = time.monotonic() - start
          if not active():
            raise ServiceError(
              "CANCELLED",
              f"{what}: the caller went away after {waited:.1f} s of waiting for the pushes of steps <= {target}",
            )
          if waited >= limit:
            waiting = {s: sorted(p) for s, p in sorted(self._pending.items())[:4]}
            bound = f"the server's --max_wait_s={self._max_wait_s:g}" if limit == self._max_wait_s else "its deadline"
            raise ServiceError(
              "DEADLINE_EXCEEDED",
              f"{what} waited {waited:.1f} s ({bound}) for the pushes of steps <= {target}, but only steps <= "
              f"{self._applied} are applied (pending steps -> workers that pushed them: {waiting}; "
              f"num_workers={self._config['num_workers']})",
            )
          # Polled, not woken: gRPC runs cancellation callbacks on its serving thread, which must
          # never block on _cond.
          self._cond.wait(min(POLL_S, limit - waited))
      finally:
        self.slots.leave()
    if self._broken is not None:
      raise ServiceError("FAILED_PRECONDITION", self._broken)

  def configure(self, specs: Sequence[TableSpec], cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """Creates the tables on the first call; refuses a later call that does not agree with it.

    Args:
      specs: the table specs (distinct names).
      cfg: seed, num_workers, staleness, shard_index, num_shards (already range-checked), and
        optionally tier: the kvstore spec under which bounded tables spill (``server-<i>/`` of it).

    Returns:
      {'created': whether this call created the tables, 'applied_step': ..., 'pid': ...}.
    """
    names = [s.name for s in specs]
    place = (cfg["shard_index"], cfg["num_shards"])
    if self._fixed_place is not None and place != self._fixed_place:
      raise ServiceError(
        "FAILED_PRECONDITION",
        f"this server was started as shard {self._fixed_place[0]} of {self._fixed_place[1]}, "
        f"but the client addresses it as shard {place[0]} of {place[1]} (check the order of the addresses)",
      )
    with self._cond:
      created = self.ps is None
      if created:
        try:
          self.ps = ParameterServer(
            specs,
            num_shards=self._local_shards,
            seed=cfg["seed"],
            protect_steps=cfg["staleness"] + 1,
            tier=_own_tier(cfg.get("tier"), place[0]),
            read_ahead_rows=self._read_ahead_rows,
          )
        except (KeyError, TypeError, ValueError) as e:  # e.g. an unknown optimizer or its arguments
          raise ServiceError("INVALID_ARGUMENT", f"the tables cannot be created: {type(e).__name__}: {e}") from None
        self._config = dict(cfg)
        logging.info("configured: shard %d of %d, tables %s", place[0], place[1], names)
      else:
        assert self.ps is not None  # not created: configured before
        have = self.ps.specs
        if set(names) != set(have):
          raise ServiceError(
            "FAILED_PRECONDITION",
            f"tables {sorted(names)} differ from the configured {sorted(have)}",
          )
        for s in specs:
          diff = wire.spec_differences(have[s.name], s)
          if diff:
            k = diff[0]
            raise ServiceError(
              "FAILED_PRECONDITION",
              f"table {s.name!r}: field {k} is {getattr(have[s.name], k)!r} on this server, "
              f"{getattr(s, k)!r} in the request",
            )
        for k, v in cfg.items():
          if self._config.get(k) != v:
            raise ServiceError(
              "FAILED_PRECONDITION", f"{k} is {self._config.get(k)!r} on this server, {v!r} in the request"
            )
      return {"created": created, "applied_step": self._applied, "pid": os.getpid()}

  def lookup(
    self,
    ids: Mapping[str, np.ndarray],
    create: bool,
    step: Optional[int],
    time_left: TimeLeft = _no_deadline,
    active: Active = _always,
    admit: Optional[Callable[[], None]] = None,
  ) -> Dict[str, np.ndarray]:
    """Rows of distinct ids per table, after the staleness wait when ``step`` is given, then
    ``admit`` (which may wait for memory: a call waiting for pushes holds none)."""
    with self._cond:
      if step is not None:
        if self._applied is None:
          # The first step seen: no push of an earlier step can come any more.
          self._applied = step - 1
        what = f"the lookup of step {step}"
        self._check_step(step, what)
        self._wait_applied(step - self._config["staleness"] - 1, time_left, active, what)
      elif self._broken is not None:
        raise ServiceError("FAILED_PRECONDITION", self._broken)
    if admit is not None:
      admit()
    ps = self.ps
    assert ps is not None  # every call but Configure and Health comes after Configure (rpc refuses it before)
    return ps.lookup_many(ids, create, step)

  def read_ahead(self, ids: Mapping[str, np.ndarray], step: int) -> int:
    """Starts bringing into RAM the tier rows that the lookup of ``ids`` at ``step`` would read;
    returns at once (``ParameterServer.read_ahead_many`` hands the ids to reader threads).

    Neither waits for pushes nor moves the applied step (a read-ahead of step t + k says nothing
    of step t); a step too far ahead is refused as a lookup's is, since its rows would stay pinned
    until then. Like a lookup it runs beside applies, under the tables' own locks.

    Returns:
      The ids handed to the reader threads.
    """
    with self._cond:
      if self._broken is not None:
        raise ServiceError("FAILED_PRECONDITION", self._broken)
      self._check_step(step, f"the read-ahead of step {step}")
    ps = self.ps
    assert ps is not None  # configured (see lookup)
    return ps.read_ahead_many(ids, step)

  def _refuse_push(self, worker: int, step: Optional[int], request_id: str) -> bool:
    """Checks a push (holding ``_cond``) and refuses it if it cannot be taken; True: a repeat."""
    if self._broken is not None:
      raise ServiceError("FAILED_PRECONDITION", self._broken)
    if request_id in self._seen.get(worker, ()):
      return True
    if step is not None:
      if self._applied is None:
        self._applied = step - 1
      self._check_step(step, f"push of step {step} from worker {worker}")
      if step <= self._applied:
        raise ServiceError(
          "FAILED_PRECONDITION",
          f"push of step {step} from worker {worker}: steps <= {self._applied} are already applied",
        )
      if step not in self._pending and len(self._pending) >= _MAX_PENDING_STEPS:
        raise ServiceError(
          "RESOURCE_EXHAUSTED",
          f"push of step {step} from worker {worker}: {len(self._pending)} steps already wait for other workers",
        )
      last = self._last.get(worker)
      if last is not None and step <= last:
        raise ServiceError(
          "FAILED_PRECONDITION",
          f"push of step {step} from worker {worker} after its step {last}: steps must arrive in increasing order",
        )
    return False

  def push(
    self, worker: int, step: Optional[int], request_id: str, grads: Grads, chunk: int = 0, chunks: int = 1
  ) -> Dict[str, Any]:
    """Buffers a worker's gradients of a step; applies every step that all workers have pushed.

    A push in several chunks (``chunk`` of ``chunks``, one ``request_id``) is staged until its
    last chunk is in, then taken as one push; before that it changes nothing a lookup sees.

    Returns:
      {'duplicate': whether request_id (or this chunk of it) was seen before, 'applied_step': ...,
      'chunks_missing': chunks of the push not in yet (0 once it is taken)}.
    """
    nw = self._config["num_workers"]
    ready: List[Tuple[Optional[int], Dict[int, List[Grads]]]] = []
    parts: Optional[List[Grads]]
    parts, bad = [grads], None
    s: Optional[int]  # a step (None: a push without one)
    if chunks > 1:
      with self._cond:
        if self._refuse_push(worker, step, request_id):
          return {"duplicate": True, "applied_step": self._applied, "chunks_missing": 0}
        repeat, parts = self._staging.add(worker, request_id, step, chunk, chunks, grads)
        if parts is None:
          missing = self._staging.missing(worker, request_id)
          return {"duplicate": repeat, "applied_step": self._applied, "chunks_missing": missing}
      bad = repeated_id(parts)  # outside the lock: it sorts every id of the push
    with self._cond:
      if chunks > 1:
        what = f"push {request_id!r} of step {step} from worker {worker}"
        if not self._staging.finish(worker, request_id):
          raise ServiceError("FAILED_PRECONDITION", f"{what}: a Restore came in while its chunks arrived")
        if bad is not None:
          raise ServiceError(
            "INVALID_ARGUMENT", f"{what}: table {bad[0]!r}: id {bad[1]} is in two of its {chunks} chunks"
          )
      if self._refuse_push(worker, step, request_id):
        return {"duplicate": True, "applied_step": self._applied, "chunks_missing": 0}
      if step is not None:
        self._pending.setdefault(step, {})[worker] = parts
        self._last[worker] = step
      seen = self._seen.setdefault(worker, collections.OrderedDict())
      seen[request_id] = -1 if step is None else step
      while len(seen) > _SEEN_PER_WORKER:
        seen.popitem(last=False)
      if step is None:
        ready = [(None, {worker: parts})]
        horizon = None
      else:
        # Each worker pushes its steps in increasing order, so once every worker has pushed
        # step h or later, no push of a step <= h can come: those steps are complete.
        horizon = min(self._last.get(w, -(2**62)) for w in range(nw))
        for s in sorted(self._pending):
          if s > horizon:
            break
          ready.append((s, self._pending.pop(s)))
      if ready:
        self._apply_lock.acquire()  # in step order: taken before _cond is released
    if not ready:
      return {"duplicate": False, "applied_step": self._applied, "chunks_missing": 0}
    ps = self.ps
    assert ps is not None  # configured (see lookup)
    dims = {t: s.dim for t, s in ps.specs.items()}
    error = None
    try:
      for s, pushes in ready:
        try:
          if len(pushes) == 1:  # its chunks hold distinct ids: one by one they are one push, uncopied
            for part in next(iter(pushes.values())):
              ps.apply_many(part, s)
          else:  # each chunk as its own worker, in (worker, chunk) order: the sum of the workers
            ps.apply_many(sum_pushes({(w, k): p for w, parts in pushes.items() for k, p in enumerate(parts)}, dims), s)
        except (KeyError, ValueError) as e:
          # The step is consumed either way: the server must not wedge on one bad step.
          error = error or ServiceError("FAILED_PRECONDITION", f"applying step {s}: {e}")
    finally:
      self._apply_lock.release()
      with self._cond:
        if horizon is not None and self._applied is not None:  # None: a Restore came in between
          self._applied = max(self._applied, horizon)
        self._cond.notify_all()
    if error is not None:
      raise error
    return {"duplicate": False, "applied_step": self._applied, "chunks_missing": 0}

  def snapshot(
    self,
    directory: str,
    incremental: bool,
    step: Optional[int],
    meta: Mapping[str, Any],
    time_left: TimeLeft = _no_deadline,
    active: Active = _always,
  ) -> Dict[str, int]:
    """``snapshot.save`` of the tables into ``directory``, after the pushes of the steps < ``step``.

    Returns:
      Rows written per table.
    """
    with self._cond:
      self._wait_before(step, f"the snapshot at step {step}", time_left, active)
      self._apply_lock.acquire()
      applied = self._applied
    try:
      place = {"shard_index": self._config["shard_index"], "num_shards": self._config["num_shards"]}
      info = {**place, "step": step, "applied_step": applied, **meta}
      rows = snapshot.save(self.ps, directory, incremental, info)
    except FileExistsError as e:
      raise ServiceError("ALREADY_EXISTS", str(e)) from None
    finally:
      self._apply_lock.release()
    return rows

  def restore(self, links: Sequence[Sequence[str]], step: Optional[int]) -> Dict[str, Any]:
    """Replaces the tables by this server's ids of a snapshot chain (one full link, then
    incremental ones; each link the parts of any number of servers).

    A failure midway leaves the tables partial: every call is then refused until a restore
    succeeds. ``step``: the next step (every step before it counts as applied).

    Returns:
      {'rows': rows kept per table, 'applied_step': ...}.
    """
    try:
      snapshot_chain.check_links(links)
    except FileNotFoundError as e:
      raise ServiceError("NOT_FOUND", str(e)) from None
    except ValueError as e:
      raise ServiceError("FAILED_PRECONDITION", str(e)) from None
    place = (self._config["seed"], self._config["shard_index"], self._config["num_shards"])
    with self._cond:
      with self._apply_lock:
        try:
          rows = snapshot_chain.restore_server(self.ps, links, *place)
        except Exception as e:  # noqa: BLE001 - the tables are now partial: refuse to serve them
          self._broken = f"a Restore failed ({type(e).__name__}: {e}); the tables are partial: Restore again"
          self._cond.notify_all()
          raise ServiceError("FAILED_PRECONDITION", self._broken) from None
        self._broken = None
        self._applied = None if step is None else step - 1
        self._pending.clear()
        self._last.clear()
        self._seen.clear()
        self._staging.clear()
        self._cond.notify_all()
    return {"rows": rows, "applied_step": self._applied}

  def state(self) -> Dict[str, Any]:
    """This server's place, applied step, pending steps and why it is broken (if it is)."""
    with self._cond:
      return {
        "pid": os.getpid(),
        "shard_index": self._config.get("shard_index"),
        "num_shards": self._config.get("num_shards"),
        "applied_step": self._applied,
        "pending_steps": sorted(self._pending),
        "waiting_calls": self.slots.count,
        "staged_pushes": self._staging.describe(),
        "broken": self._broken,
      }

  # Rows with their optimizer slots, out and back.
  def _wait_before(self, step: Optional[int], what: str, time_left: TimeLeft, active: Active) -> None:
    """Holding ``_cond``: with a step, refuses one too far ahead and waits until every step before
    it is applied; refuses while the tables are broken (a failed restore)."""
    if step is not None:
      self._check_step(step, what)
      self._wait_applied(step - 1, time_left, active, what)
    elif self._broken is not None:
      raise ServiceError("FAILED_PRECONDITION", self._broken)

  def _refuse_broken(self) -> None:
    # Under _apply_lock: a Restore sets _broken holding it.
    if self._broken is not None:
      raise ServiceError("FAILED_PRECONDITION", self._broken)

  def export_rows(
    self,
    ids: Mapping[str, np.ndarray],
    step: Optional[int],
    time_left: TimeLeft,
    active: Active,
    admit: Optional[Callable[[], None]] = None,
  ) -> Rows:
    """Rows of distinct ids with their optimizer slots (``ParameterServer.export_rows_many``).

    With a step, first waits until the pushes of every step before it are applied (as a
    snapshot does), then ``admit`` (which may wait for memory: a call waiting for pushes holds
    none).

    Returns:
      {table: (float32 weights, {slot: float32 values})}.
    """
    with self._cond:
      self._wait_before(
        step, "an export of rows" if step is None else f"the export of rows at step {step}", time_left, active
      )
    if admit is not None:
      admit()
    with self._apply_lock:
      self._refuse_broken()
      ps = self.ps
      assert ps is not None  # configured (see lookup)
      return ps.export_rows_many(ids)

  def import_rows(self, rows: Mapping[str, Tuple[np.ndarray, np.ndarray, Mapping[str, np.ndarray]]]) -> Dict[str, Any]:
    """Sets rows and their optimizer slots (``ParameterServer.import_rows_many``; ``rows`` as
    ``ParameterServer.check_import`` returns them).

    Returns:
      {'rows': rows imported per table}.
    """
    with self._apply_lock:
      self._refuse_broken()
      ps = self.ps
      assert ps is not None  # configured (see lookup)
      ps.import_rows_many(rows, checked=True)
    return {"rows": {t: int(r[0].shape[0]) for t, r in rows.items()}}
