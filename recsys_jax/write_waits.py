"""What the run's threads wait on while a file is written: for the watchdog that ends a run whose
disk hangs after SIGTERM (``recsys_jax.main``).

A write that fails raises, and the run ends with one line naming the file (``WriteError``,
``CheckpointError``). A write that hangs (a file server gone, a disk that answers no I/O) never
returns, and the thread in it cannot be interrupted: a stop that waits for it waits forever,
whether the training loop makes the write itself (a checkpoint's files, metrics.jsonl, the
summary) or waits for a thread that makes it (the publisher's queue and join, the TensorBoard
writer's join, a progressive report). So each such write or wait is entered here while it lasts
(``writing``, ``waiting_for``), named as a write error names its file (``<what> <path>``). After
SIGTERM the watchdog asks ``stuck`` whether the main thread's innermost one has made no progress
(no write inside it ended) for longer than its limit, and if so ends the process itself
(``os._exit``): the threads stuck in the kernel stay there. Nothing a resume reads is damaged:
checkpoints, their parts and published files are written under temporary names and renamed whole
(a checkpoint not committed is no checkpoint); metrics.jsonl and the log are appended to.

The limit bounds one write, not the stop: a healthy write that takes longer after SIGTERM (orbax's
write of a large dense state, a large PS snapshot) is cut short as well, and its checkpoint is not
made; ``--stop_write_timeout_s`` is to be above the longest such write (and below the time a
supervisor gives a stop before SIGKILL, which prints nothing).

Nothing here touches a file: the watchdog must not hang on the disk that hung the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple


@dataclasses.dataclass
class _Wait:
  what: str
  since: float
  """When it began, or when the last write inside it ended (``time.monotonic()``): its last progress."""
  on: Optional[threading.Thread]  # the thread whose write this waits for (None: its own)


_lock = threading.Lock()
_waits: Dict[int, List[_Wait]] = {}  # thread ident -> its waits, the innermost last
_last_good: List[Callable[[], str]] = [lambda: "none"]


@contextlib.contextmanager
def writing(what: str) -> Iterator[None]:
  """This thread writes ``what`` (``"<what> <path>"``, as a write error names it) while the block runs."""
  with _entered(_Wait(what, time.monotonic(), None)):
    yield


@contextlib.contextmanager
def waiting_for(thread: threading.Thread, what: str) -> Iterator[None]:
  """This thread waits for ``thread``, which writes ``what``, while the block runs (the write
  ``thread`` has entered itself, if any, names it more exactly, and its progress is this wait's)."""
  with _entered(_Wait(what, time.monotonic(), thread)):
    yield


@contextlib.contextmanager
def _entered(wait: _Wait) -> Iterator[None]:
  ident = threading.get_ident()
  with _lock:
    _waits.setdefault(ident, []).append(wait)
  try:
    yield
  finally:
    with _lock:
      stack = _waits[ident]
      stack.remove(wait)
      if stack:
        stack[-1].since = time.monotonic()  # a write inside it ended: progress
      else:
        del _waits[ident]


def _innermost(thread: Optional[threading.Thread]) -> Optional[_Wait]:
  with _lock:
    stack = _waits.get(thread.ident) if thread is not None and thread.ident is not None else None
    return stack[-1] if stack else None


def _resolved(wait: _Wait) -> Tuple[str, float]:
  """What ``wait`` waits on and its last progress, through the threads it waits for."""
  what, since = wait.what, wait.since
  for _ in range(4):  # a chain of threads waiting for one another, never a long one
    theirs = _innermost(wait.on)
    if theirs is None:
      break
    wait = theirs
    what, since = wait.what, max(since, wait.since)
  return what, since


def stuck(thread: threading.Thread, since: float, limit_s: float) -> Optional[Tuple[str, float]]:
  """``(what, seconds)`` if ``thread``'s innermost write or wait has made no progress for
  ``limit_s`` seconds or more, counted from ``since`` (``time.monotonic()``: SIGTERM's) if that
  is later; else None."""
  wait = _innermost(thread)
  if wait is None:
    return None
  what, progress = _resolved(wait)
  waited = time.monotonic() - max(progress, since)
  return (what, waited) if waited >= limit_s else None


def note_last_good(last_good: Callable[[], str]) -> None:
  """Where the run's last good checkpoint is, for the line that ends a hung run (a callable: it
  changes with each save; it must not touch a file)."""
  _last_good[0] = last_good


def last_good() -> str:
  return _last_good[0]()
