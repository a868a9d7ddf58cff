"""What bounds a PS server's memory and threads under load: ``ByteBudget`` and ``WaitSlots``.

``ByteBudget`` counts the bytes of the requests and answers in flight (``--max_inflight_mb``):
a call is admitted once its bytes fit, in arrival order, and holds them until gRPC has sent its
answer; one call larger than the whole budget runs alone. A call waits for room within its
deadline and ``max_wait_s``, then is refused with RESOURCE_EXHAUSTED naming the budget.

``WaitSlots`` counts the calls that wait (for pushes, or for room in the budget) against one
limit, so that some RPC threads always stay free for pushes and Health.

Neither imports gRPC: a refusal is a ``ServiceError``, as in ``service``.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Callable, List, Optional

from recsys_jax.async_ps.server.errors import ServiceError

_MIB = 1 << 20
POLL_S = 0.1  # how often a waiting call checks that its caller is still there
WAIT_MARGIN_S = 0.05  # answer a little before the client's deadline, so it sees why

TimeLeft = Callable[[], Optional[float]]  # seconds until the caller's deadline (None: no deadline)
Active = Callable[[], bool]  # False once the caller cancelled or its deadline passed


class WaitSlots:
  """How many calls wait at once, and the most that may (None: any number). Thread-safe."""

  def __init__(self, limit: Optional[int] = None):
    if limit is not None and limit < 1:
      raise ValueError(f"max_waiters must be >= 1, got {limit}")
    self.limit = limit
    self.count = 0
    self._lock = threading.Lock()

  def enter(self) -> bool:
    """Takes a slot; False (and nothing taken) when all are taken."""
    with self._lock:
      if self.limit is not None and self.count >= self.limit:
        return False
      self.count += 1
      return True

  def leave(self) -> None:
    with self._lock:
      self.count -= 1


class ByteBudget:
  """Bytes of calls in flight, at most ``limit`` (bar one call larger than it, alone).

  Args:
    limit: the budget, bytes.
    slots: counts the calls waiting for room (shared with the waits for pushes).
    max_wait_s: the longest a call waits for room, whatever its deadline.
  """

  def __init__(self, limit: int, slots: WaitSlots, max_wait_s: float):
    if limit < 1:
      raise ValueError(f"--max_inflight_mb must be positive, got {limit / _MIB:g}")
    self.limit, self._slots, self._max_wait_s = int(limit), slots, float(max_wait_s)
    self.used = 0
    self._cond = threading.Condition()
    self._queue: "collections.deque[int]" = collections.deque()  # tickets of the waiting calls, oldest first
    self._tickets = itertools.count()

  def _fits(self, n: int) -> bool:
    return self.used == 0 or self.used + n <= self.limit

  def acquire(self, n: int, time_left: TimeLeft, active: Active, what: str) -> Callable[[], None]:
    """Waits until ``n`` bytes fit (after the calls that came first), then takes them.

    Returns:
      The function that gives them back (call it once the answer is sent; more calls do nothing).

    Raises:
      ServiceError: RESOURCE_EXHAUSTED when no room came within the deadline or ``max_wait_s``,
        or too many calls wait already; CANCELLED when the caller went away.
    """
    with self._cond:
      if self._queue or not self._fits(n):
        self._wait(n, time_left, active, what)
    return self.take(n)

  def take(self, n: int) -> Callable[[], None]:
    """Takes ``n`` bytes at once, room or not (a call's bytes beyond those it was admitted with).

    Returns:
      The function that gives them back (more calls do nothing).
    """
    with self._cond:
      self.used += n
    done: List[bool] = []

    def release() -> None:
      with self._cond:
        if not done:
          done.append(True)
          self.used -= n
          self._cond.notify_all()

    return release

  def _wait(self, n: int, time_left: TimeLeft, active: Active, what: str) -> None:
    """Waits, holding ``_cond``, until this call is the oldest waiting and ``n`` bytes fit."""
    mib = f"{n / _MIB:.1f} MiB"
    if not self._slots.enter():
      raise ServiceError(
        "RESOURCE_EXHAUSTED",
        f"{what} needs {mib} of the server's --max_inflight_mb={self.limit / _MIB:g}, which holds "
        f"{self.used / _MIB:.1f} MiB, and {self._slots.count} calls already wait (start it with more --threads)",
      )
    ticket = next(self._tickets)
    self._queue.append(ticket)
    left = time_left()
    limit = self._max_wait_s if left is None else min(self._max_wait_s, left - WAIT_MARGIN_S)
    start = time.monotonic()
    try:
      while not (self._queue[0] == ticket and self._fits(n)):
        waited = time.monotonic() - start
        if not active():
          raise ServiceError("CANCELLED", f"{what}: the caller went away after {waited:.1f} s of waiting for memory")
        if waited >= limit:
          bound = f"the server's --max_wait_s={self._max_wait_s:g}" if limit == self._max_wait_s else "its deadline"
          raise ServiceError(
            "RESOURCE_EXHAUSTED",
            f"{what} needs {mib} of the server's --max_inflight_mb={self.limit / _MIB:g}, but other calls held "
            f"{self.used / _MIB:.1f} MiB for {waited:.1f} s ({bound}); send smaller requests (ps.max_request_mb) "
            "or start the server with a larger --max_inflight_mb",
          )
        # Polled, like the waits for pushes: a cancelled caller must be noticed without a wake-up.
        self._cond.wait(min(POLL_S, limit - waited))
    finally:
      self._queue.remove(ticket)
      self._slots.leave()
      self._cond.notify_all()  # the next in line may fit now
