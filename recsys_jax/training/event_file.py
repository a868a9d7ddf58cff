"""A TensorBoard event file written by a thread of its own, whose failures reach the caller.

tensorboardX's ``SummaryWriter`` writes its events on a thread that dies with the first write that
fails (a full disk), silently; its queue of events then fills and the next ``add_summary`` waits
forever on it, SIGTERM or not. Here a failed write is raised by the next ``add`` (and by
``close``), a writer thread that takes no events (a disk that hangs) holds a caller only until the
run is told to stop, and the thread never blocks the process's exit.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from typing import Optional

from absl import logging
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary

from recsys_jax.checkpoint_files import WriteError, named

_CLOSE = object()
_POLL_S = 0.25


class EventFile:
  """``<logdir>/events.out.tfevents.*``, written in the background.

  Args:
    logdir: the directory (made if missing).
    stop: once set (SIGTERM), an event that would wait for room in the queue is dropped instead
      (one line says so): a run told to stop does not wait on a disk that takes no writes.
    flush_s: seconds between flushes (with fsync) of the file; the first event is flushed at once.
    max_queue: events waiting to be written before ``add`` waits.
  """

  def __init__(self, logdir: str, stop: Optional[threading.Event] = None, flush_s: float = 120.0, max_queue: int = 64):
    os.makedirs(logdir, exist_ok=True)
    try:
      self._writer = EventsWriter(os.path.join(logdir, "events"))
    except OSError as e:
      raise WriteError.of("TensorBoard events", logdir, e) from e
    self.path: str = getattr(self._writer, "_file_name", logdir)
    self._stop, self._flush_s = stop, flush_s
    self._queue: "queue.Queue[object]" = queue.Queue(max_queue)
    self._error: Optional[BaseException] = None
    self._dropping = False  # told to stop while the queue was full: events are dropped
    self._thread = threading.Thread(target=self._loop, name="tensorboard", daemon=True)
    self._thread.start()

  def add(self, summary: Summary, step: int) -> None:
    """Queues ``summary`` as the event of ``step``.

    Raises:
      WriteError: naming the file, if a write of an earlier event failed.
    """
    self._raise()
    if self._dropping:
      return
    self._put(Event(wall_time=time.time(), step=int(step), summary=summary), step)

  def close(self) -> None:
    """Writes what is queued, flushes and closes the file (waits no longer than ``add`` would).

    Raises:
      WriteError: naming the file, if a write failed.
    """
    if self._thread.is_alive() and not self._dropping:
      self._put(_CLOSE, None)
    self._thread.join(timeout=None if not self._dropping else 2 * _POLL_S)
    if not self._thread.is_alive() and self._error is None:
      try:
        self._writer.close()
      except OSError as e:
        self._error = named(e, self.path)
    self._raise()

  def _put(self, item: object, step: Optional[int]) -> None:
    while True:
      try:
        self._queue.put(item, timeout=_POLL_S)
        return
      except queue.Full:
        self._raise()
        if self._stop is not None and self._stop.is_set():
          self._dropping = True
          msg = (
            f"TensorBoard: {self.path} takes no writes (its queue has been full since before the stop); "
            f"its events from step {step} on are dropped, the stop goes on"
          )
          print(msg, file=sys.stderr)
          logging.warning(msg)
          return

  def _raise(self) -> None:
    if self._error is not None:
      raise WriteError.of("TensorBoard events", self.path, self._error) from self._error

  def _loop(self) -> None:
    next_flush, pending = 0.0, False
    while True:
      try:
        item = self._queue.get(timeout=max(1e-3, next_flush - time.monotonic()))
      except queue.Empty:
        item = None
      if item is _CLOSE:
        return
      if self._error is not None:
        continue  # raised to the caller; what comes after is not written (the queue never fills)
      try:
        if item is not None:
          self._writer.write_event(item)
          pending = True
        if time.monotonic() >= next_flush:
          if pending:
            self._writer.flush()
            pending = False
          next_flush = time.monotonic() + self._flush_s
      except OSError as e:
        self._error = named(e, self.path)
      except Exception as e:  # noqa: BLE001 - raised to the caller by the next add
        self._error = e
