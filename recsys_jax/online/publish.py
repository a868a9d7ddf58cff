"""Publishing fresh rows and dense parameters for the model server, between checkpoints.

Every ``config.publish_every_s`` seconds the training loop hands the publisher one cut, taken as a
checkpoint takes its own (``recsys_jax.training.run_checkpoints.RunCheckpoints.save``): the
lookups of later steps are held (``StalenessGate.hold``), the pushes of every step up to the cut
are applied (``Pusher.flush``). The rows of every id touched since the previous publish (the ids
each step pushed, and the hot rows each step trained on the device, by their slots) are then read: the cold ones
from the PS without changing it (``lookup_many(create=False)``: an id whose row was dropped reads
what the trainer's evaluation reads for it), the hot ones from the device tables, rounded to their
table's storage dtype as a write-back into the PS would round them (the PS is not written: a
write-back imports every hot row with its slots, most of a publish's cost). Then the lookups go
on; the rows are written to disk by a background thread. Every ``config.publish_dense_every_s``
seconds the cut also carries the dense parameters. The files and their index are
``recsys_jax.async_ps.snapshot.published``.

The set of ids touched is the publisher's own, apart from the PS's change tracking, which
belongs to the checkpoints' incremental snapshots (a publish changes nothing they write).

Limits: one trainer process (the ids a step pushes are this process's own); a row dropped by a
bounded table (expiry, eviction without a tier) that was not touched since the previous publish
reaches the server with the next checkpoint, not with a delta.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Union

import jax
import numpy as np
from absl import logging

from recsys_jax import write_waits
from recsys_jax.async_ps.protocol import RowStore
from recsys_jax.async_ps.snapshot import published
from recsys_jax.checkpoint_files import WriteError

PUBLISH = "publish"  # under the workdir unless config.publish_dir is set


@dataclasses.dataclass(frozen=True)
class _Cut:
  """A cut for the writing thread: its rows' delta (None: a cut published again, for its dense
  parameters only) and its dense parameters' leaves (None: not this time)."""

  step: int
  arrays: Optional[Dict[str, Any]]
  leaves: Optional[List[np.ndarray]]
  times: Dict[str, float]


@dataclasses.dataclass(frozen=True)
class _Prune:
  """For the writing thread: the deltas at or before ``covered_step`` may go (a checkpoint covers them)."""

  covered_step: int


def publish_dir(config, workdir: str) -> str:
  """Where ``config``'s run publishes: ``config.publish_dir``, or ``<workdir>/publish``; relative
  paths are under the workdir."""
  d = str(config.publish_dir or "")
  return os.path.abspath(os.path.join(workdir, d or PUBLISH))


class Publisher:
  """Publishes a run's rows and dense parameters (see the module docstring).

  Args:
    config: ``publish_every_s`` (0: off), ``publish_dense_every_s``, ``publish_dir``.
    workdir: the run's directory.
    ps: the run's PS (read with ``lookup_many(create=False)``).
    hot: the run's ``HotRows`` (or None).
    start: the step the run starts at (the checkpoint it resumed from, 0 for a fresh one): the
      first delta continues from there, and deltas of an earlier run past it are dropped.
    clock: seconds, monotonic (tests pass their own).
  """

  def __init__(self, config, workdir: str, ps: Optional[RowStore], hot=None, start: int = 0, clock=time.monotonic):
    self.every_s = float(config.publish_every_s or 0.0)
    self.dense_every_s = float(config.publish_dense_every_s or 0.0)
    self.enabled = self.every_s > 0
    self.ps, self.hot, self._clock = ps, hot, clock
    self.directory = publish_dir(config, workdir)
    self.published = 0  # deltas published by this process
    self.seconds = 0.0  # the training loop's time spent in cuts
    self.times: Dict[str, float] = {"flush": 0.0, "hot": 0.0, "read": 0.0, "dense": 0.0}
    self._due: Optional[tuple] = None  # (step, the gate to release or None) of the cut ``cut`` publishes
    self._touched: Dict[str, List[np.ndarray]] = {}
    self._hot_seen: Dict[str, Any] = {}  # table -> (hot ids, their slots) of the choice in force
    self._hot_slots: Dict[int, List[np.ndarray]] = {}  # row width -> the hot slots each step trained
    self._error: Optional[BaseException] = None
    if not self.enabled:
      return
    if jax.process_count() > 1:
      raise ValueError(
        "config.publish_every_s > 0 needs one trainer process: each process pushes its own ids, and the "
        "publisher sees only this one's"
      )
    stale = published.stale_temporaries(self.directory)
    if stale:  # a run that died mid-write (a full disk, a kill)
      published.remove(stale)
      logging.warning("publish: removed %d temporary file(s) an earlier run left: %s", len(stale), ", ".join(stale))
      print(f"publish: removed {len(stale)} temporary file(s) an earlier run left in {self.directory}", file=sys.stderr)
    try:
      os.makedirs(self.directory, exist_ok=True)
    except OSError as e:
      raise WriteError.of("publish", self.directory, e) from e
    index = published.read_index(self.directory) or published.empty_index()
    # Deltas past the checkpoint this run resumed from are of steps it trains again: a server must not
    # apply them to the new rows. Their seq numbers are not reused.
    gone = [os.path.join(self.directory, published.ROWS, d["name"]) for d in index["deltas"] if d["step"] > start]
    gone += [os.path.join(self.directory, published.DENSE, d["name"]) for d in index["dense"] if d["step"] > start]
    index["deltas"] = [d for d in index["deltas"] if d["step"] <= start]
    index["dense"] = [d for d in index["dense"] if d["step"] <= start]
    try:
      with self._writing(published.INDEX):
        published.write_index(self.directory, index)
    except OSError as e:
      raise WriteError.of("publish", self.directory, e) from e
    published.remove(gone)
    self._index = index
    self._parent: Optional[int] = None
    self._parent_step = int(start)
    now = clock()
    self._next, self._next_dense = now + self.every_s, now
    self._last_step: Optional[int] = None
    self._last_dense: Optional[int] = None
    self._first_update: Optional[float] = None
    self._queue: "queue.Queue[Union[_Cut, _Prune, None]]" = queue.Queue(maxsize=2)
    self._thread = threading.Thread(target=self._write_loop, name="publisher", daemon=True)
    self._thread.start()

  # -- the training loop's side ---------------------------------------------------------
  def step(self, prepared, step: int, gate, save: bool = False) -> bool:
    """Records the ids a step pushes (``prepared.groups``, deduplicated) and the hot rows it trains
    on the device (``prepared.hot_idx``: their slots), before its push; if the cut after it (``step`` steps done) is to be published (its time has come, or
    ``save``: a checkpoint's cut, so that the deltas reach past each checkpoint at once), holds the
    lookups of ``step`` on (``gate.hold``; a checkpoint holds them itself) until ``cut``.

    Returns:
      Whether ``cut`` publishes this step's cut."""
    self._due = None
    if not self.enabled:
      return False
    if self._first_update is None:
      self._first_update = time.time()  # the oldest change the next delta carries (its push follows)
    for g in prepared.groups.values():
      for name, ids, _ in g.tables:
        if ids.shape[0]:
          self._touched.setdefault(name, []).append(ids)
    if self.hot is not None and self.hot.enabled:
      now = {t: self.hot.set.hot(t) for ts in self.hot.groups.values() for t in ts}
      if any(self._hot_seen.get(t, (None,))[0] is not now[t][0] for t in now):
        # A new choice: the slots recorded so far name rows of the old one (a row that left the
        # device went back into the PS with what it learnt there, and is read from the PS).
        self._hot_touched()
        self._hot_seen = now
      for d, idx in (prepared.hot_idx or {}).items():
        self._hot_slots.setdefault(int(d), []).append(idx)
    if not (save or self._clock() >= self._next):
      return False
    if not save:
      gate.hold(step)
    self._due = (step, None if save else gate)
    return True

  def cut(self, step: int, state, pusher) -> None:
    """Publishes the cut after ``step`` steps if ``step`` said so (after the step's push), then
    releases the lookups it held."""
    if self._due is not None and self._due[0] == step:
      gate, self._due = self._due[1], None
      self.publish(step, state, pusher, gate)

  def publish(self, step: int, state, pusher, gate=None, dense: Optional[bool] = None) -> None:
    """Publishes the cut after ``step`` steps: lookups of step ``step`` on must be held until the
    rows are read; then ``gate`` (if given) is released.

    ``dense``: carry the dense parameters (None: if their time has come)."""
    if not self.enabled:
      return
    try:
      self._publish(step, state, pusher, dense)
    finally:
      if gate is not None:
        gate.release()

  def _publish(self, step: int, state, pusher, dense: Optional[bool]) -> None:
    self.check()
    now = self._clock()
    dense = bool(dense or (dense is None and now >= self._next_dense and self.dense_every_s > 0))
    if step == self._last_step and (not dense or self._last_dense == step):
      return  # this cut is published already (the last step's, by time and again at the end)
    t0 = time.perf_counter()
    pusher.flush(step - 1)
    t1 = time.perf_counter()
    self._hot_touched()
    wanted = {t: np.unique(np.concatenate(v)) for t, v in self._touched.items()}
    self._touched = {}
    # A hot row's value is the device's (the PS holds an older one): read there, not written back.
    hot = self.hot.current_rows(wanted) if self.hot is not None else {}
    t2 = time.perf_counter()
    for t, (ids, _) in hot.items():
      wanted[t] = wanted[t][~np.isin(wanted[t], ids)]
    wanted = {t: ids for t, ids in wanted.items() if ids.shape[0]}
    assert self.ps is not None, "a publishing run has a PS"
    rows = self.ps.lookup_many(wanted, create=False) if wanted else {}
    arrays = {t: {"ids": wanted[t], "weights": rows[t]} for t in wanted}
    for t, (ids, w) in hot.items():
      if t in arrays:
        ids, w = np.concatenate([arrays[t]["ids"], ids]), np.concatenate([arrays[t]["weights"], w])
      arrays[t] = {"ids": ids, "weights": w}
    t3 = time.perf_counter()
    leaves = None
    if dense and self._last_dense != step:
      leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]
      self._next_dense, self._last_dense = now + self.dense_every_s, step
    self.times["flush"] += t1 - t0
    self.times["hot"] += t2 - t1
    self.times["read"] += t3 - t2
    self.times["dense"] += time.perf_counter() - t3
    self._next = now + self.every_s
    # A cut published again (for its dense parameters) has no row to add: no delta.
    delta = None if step == self._last_step else arrays
    self._last_step = step
    times = {"first_update": self._first_update or time.time(), "cut": time.time()}
    self._first_update = None
    with self._waiting():  # the queue is full while the writing thread is behind
      self._queue.put(_Cut(int(step), delta, leaves, times))
    self.seconds += time.perf_counter() - t0

  def _hot_touched(self) -> None:
    """The hot rows the steps since the last call trained (their slots, in the choice in force then)
    among the ids touched."""
    for dim, idx in self._hot_slots.items():
      slots = np.unique(np.concatenate(idx))
      for t in self.hot.groups.get(dim, ()):
        ids, at = self._hot_seen.get(t, (None, None))
        if ids is not None and ids.shape[0]:
          self._touched.setdefault(t, []).append(ids[np.isin(at, slots)])
    self._hot_slots = {}

  def checkpointed(self, covered_step: Optional[int]) -> None:
    """A checkpoint was saved: the deltas at or before ``covered_step`` may go (the older of the
    two newest checkpoints: a server that polls keeps its line, one far behind starts again)."""
    if self.enabled and covered_step is not None:
      with self._waiting():
        self._queue.put(_Prune(int(covered_step)))

  def check(self) -> None:
    """Re-raises the writing thread's failure (a full disk): a ``WriteError`` naming the publish
    directory and the file that could not be written."""
    if self._error is not None:
      raise WriteError.of("publish", self.directory, self._error) from self._error

  def close(self, quiet: bool = False) -> None:
    """Waits for what was handed over to be written; ``quiet``: a failure is not raised (the run
    is failing for another reason, which is the one to report)."""
    if not self.enabled or not self._thread.is_alive():
      return
    with self._waiting():
      self._queue.put(None)
      self._thread.join()
    if not quiet:
      self.check()

  def _waiting(self):
    """The training loop waits for the writing thread (``write_waits``: a write of it that hangs is named)."""
    return write_waits.waiting_for(self._thread, f"publish {self.directory}")

  def _writing(self, *name: str):
    """A write of ``<directory>/<name>`` (``write_waits``); no name: of the directory (files deleted)."""
    return write_waits.writing(f"publish {os.path.join(self.directory, *name)}")

  # -- the writing thread -----------------------------------------------------------------
  def _write_loop(self) -> None:
    while True:
      item = self._queue.get()
      if item is None:
        return
      if self._error is not None:
        continue  # reported by check(); what comes after a failure is not written
      try:
        with self._writing():
          self._write(item)
      except Exception as e:  # noqa: BLE001 - re-raised in the training loop by check()
        logging.exception("publishing to %s failed", self.directory)
        self._error = e

  def _write(self, item: Union[_Cut, _Prune]) -> None:
    if isinstance(item, _Prune):
      gone = published.prune(self.directory, self._index, item.covered_step)
      with self._writing(published.INDEX):
        published.write_index(self.directory, self._index)
      published.remove(gone)
      return
    step, arrays, leaves, times = item.step, item.arrays, item.leaves, item.times
    index = self._index
    if arrays is not None:
      seq = int(index["next_seq"])
      with self._writing(published.ROWS, published.delta_name(seq, step)):
        entry = published.write_delta(self.directory, seq, step, self._parent, self._parent_step, arrays, times)
      index["deltas"].append(entry)
      index["next_seq"] = seq + 1
    gone = []
    if leaves is not None:
      with self._writing(published.DENSE, published.dense_name(step)):
        index["dense"].append(published.write_dense(self.directory, step, leaves))
      gone = published.prune(self.directory, index, None)
    with self._writing(published.INDEX):
      published.write_index(self.directory, index)
    published.remove(gone)
    if arrays is not None:
      self._parent, self._parent_step = seq, step
      self.published += 1
