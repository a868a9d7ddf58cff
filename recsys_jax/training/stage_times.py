"""Where the host's time goes: wall and CPU seconds per stage of the training pipeline.

The pipeline records them itself (``recsys_jax.training.host.HostPipeline``, the reader's
stream, the prefetcher), and every train record of metrics.jsonl carries them as milliseconds per
step since the last record (``host_<stage>_ms`` and ``host_<stage>_cpu_ms``), so a benchmark
(``experiments/bench_feed.py``) or a person reading TensorBoard sees the same figures without
wrapping anything. Stages run on different threads and overlap, so their sum exceeds the wall
time of a step; a record holds what ran since the last one (the host works a few steps ahead of
the loop), divided by the steps trained in that interval. CPU is the thread CPU clock of the thread
doing the stage (``thread_time``: ``time.thread_time``'s clock, read without the interpreter lock).

- ``read``: drawing the reader's next batch (with host workers: the feeder thread cutting files,
  gathering the batch's records and waiting for parses; without, the parsing too);
- ``parse``: the format's parse of a chunk, or its read from the preprocessed cache (synthetic
  data: generating a batch), wherever it runs;
- ``prepare`` (dedup), ``resolve`` (the hot split and the PS's finding and creating of the cold
  rows, and the copy of the batch's arrays to the devices, before the staleness gate:
  ``HostPipeline.resolve``), ``lookup`` (the PS read of the cold rows), ``place`` (the rows' copy
  to the devices): the host workers' and the prefetcher's work on a training batch (at k = 0 the
  lookup and the place run on the training loop's thread: ``Prefetcher``'s ``lookup_on_get``);
- ``read_ahead``: handing a later step's ids to the PS's read-ahead (``config.ps.read_ahead``; the
  reads themselves run on the PS's reader thread; 0 without a tier);
- ``wait``: the training loop waiting for its next batch (the time a device sits idle, with the
  lookup and place at k = 0);
- ``get``: the pusher (at k = 0 the training loop) waiting for the step's row gradients and
  copying them to the host;
- ``push``: the PS update with them.

``rows_per_step`` and ``bucket_rows_per_step`` count the cold rows a training batch looks up
(distinct rows, and with their bucket's padding: what goes to the device).
``place_row_bytes_per_step`` and ``place_batch_bytes_per_step`` are the bytes a training batch's
placement copies host -> device: its rows (each group's bucket, and with hot rows the 4-byte hot
slots) and the rest (dense features, labels, the inverse indices and weights), counted by
``HostPipeline.place`` from the arrays it hands to ``device_put`` (one process's share);
``place_copies_per_step`` the host-to-device copies that makes (2 with one process: the step's
inputs packed in two buffers, ``training/packing.py``; one per array otherwise).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Callable, Dict, Iterator


def _unlocked_thread_time() -> Callable[[], float]:
  """``time.thread_time``, read with the interpreter lock released (``clock_gettime`` through
  ctypes, which drops the lock around the call), where the C library has it; else
  ``time.thread_time``. The clock is a system call: a thread holding the lock through it
  can be descheduled there and keep the lock while it waits for a core (on 2 cores bench_feed's
  lock time fell 14% with the stage timers' CPU reads gone, 5 paired runs of 5)."""

  class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]

  try:
    clock_gettime = ctypes.CDLL(None, use_errno=True).clock_gettime
  except (OSError, AttributeError):
    return time.thread_time
  clock_gettime.argtypes = [ctypes.c_int, ctypes.POINTER(_Timespec)]
  clock_gettime.restype = ctypes.c_int
  clock = getattr(time, "CLOCK_THREAD_CPUTIME_ID", 3)

  def thread_time() -> float:
    ts = _Timespec()
    if clock_gettime(clock, ctypes.byref(ts)) != 0:
      return time.thread_time()
    return ts.sec + 1e-9 * ts.nsec

  return thread_time


thread_time = _unlocked_thread_time()

STAGES = ("read", "parse", "prepare", "read_ahead", "resolve", "lookup", "place", "wait", "get", "push")
COUNTS = ("rows", "bucket_rows", "place_row_bytes", "place_batch_bytes", "place_copies")


class StageTimes:
  """Wall and thread-CPU seconds per stage and counts, summed since the last ``take`` (thread-safe)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._wall: Dict[str, float] = {}
    self._cpu: Dict[str, float] = {}
    self._counts: Dict[str, float] = {}

  def add(self, stage: str, wall_s: float, cpu_s: float) -> None:
    with self._lock:
      self._wall[stage] = self._wall.get(stage, 0.0) + wall_s
      self._cpu[stage] = self._cpu.get(stage, 0.0) + cpu_s

  def time(self, stage: str) -> "_Timer":
    """Times the block as ``stage`` (also when it raises): ``with times.time("lookup"): ...``.
    A plain object, not a generator's context: it is entered several times a batch on threads
    that hold the interpreter lock while they do it."""
    return _Timer(self, stage)

  def timed_iter(self, stage: str, it) -> Iterator:
    """``it``'s items, each ``next`` timed as ``stage``."""
    it = iter(it)
    while True:
      w, c = time.perf_counter(), thread_time()
      try:
        item = next(it)
      except StopIteration:
        return
      self.add(stage, time.perf_counter() - w, thread_time() - c)
      yield item

  def count(self, name: str, n: float) -> None:
    with self._lock:
      self._counts[name] = self._counts.get(name, 0.0) + n

  def take(self, steps: int) -> Dict[str, float]:
    """The metrics since the last ``take``, per step over ``steps`` steps, and starts again.

    Every stage and count is in the result (0.0 when nothing was recorded: e.g. ``parse`` of a
    source that parses nothing), so every train record has the same keys.
    """
    with self._lock:
      wall, cpu, counts = self._wall, self._cpu, self._counts
      self._wall, self._cpu, self._counts = {}, {}, {}
    per = 1.0 / max(1, steps)
    out = {}
    for s in STAGES:
      out[f"host_{s}_ms"] = 1e3 * wall.get(s, 0.0) * per
      out[f"host_{s}_cpu_ms"] = 1e3 * cpu.get(s, 0.0) * per
    for k in COUNTS:
      out[f"{k}_per_step"] = counts.get(k, 0.0) * per
    return out


class _Timer:
  """``StageTimes.time``'s context: wall and thread-CPU time of the block, added on exit."""

  __slots__ = ("_times", "_stage", "_w", "_c")

  def __init__(self, times: StageTimes, stage: str):
    self._times, self._stage = times, stage

  def __enter__(self) -> None:
    self._w, self._c = time.perf_counter(), thread_time()

  def __exit__(self, *exc) -> None:
    self._times.add(self._stage, time.perf_counter() - self._w, thread_time() - self._c)
