"""How long this process holds the interpreter lock: py-spy's ``--gil`` sampling, attached to itself.

Between :meth:`GilSampler.start` and :meth:`GilSampler.stop`, ``py-spy record --gil --nonblocking``
samples this process ``rate`` times a second and keeps a stack only when some thread holds the GIL.
So ``samples / rate`` estimates the seconds the lock was held over the window, and ``gil_fraction``
= that / the window's wall time. A thread running compiled code that released the lock (numba
``nogil`` kernels, numpy's loops over large arrays, XLA) is not sampled: the lock-held time is what
no number of cores can run in parallel, so ``1 / gil_fraction`` bounds how much more work more
cores could do. ``top`` counts the samples per innermost frame (and per thread name).

py-spy needs to read this process's memory: root, or ptrace allowed (``/proc/sys/kernel/yama/ptrace_scope``
0, or ``CAP_SYS_PTRACE`` in a container); :meth:`start` raises with py-spy's own message when it
cannot attach, never a silent zero.
"""

from __future__ import annotations

import collections
import concurrent.futures
import gc
import os
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple


def thread_cpu() -> Dict[str, float]:
  """CPU seconds (user + system) so far of this process's live threads, by name without its number
  (``host-worker_3`` counts as ``host-worker``; threads Python did not start count as ``native``)."""
  names = {t.native_id: t.name for t in threading.enumerate()}
  tick = os.sysconf("SC_CLK_TCK")
  out: Dict[str, float] = collections.defaultdict(float)
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # ended meanwhile
      continue
    name = names.get(int(tid), "native")
    base = name.rstrip("0123456789").rstrip("_-") or name
    out[base] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
  return dict(out)


def minor_faults() -> int:
  """This process's minor page faults so far: first touches of pages the kernel maps and zeroes, what
  every fresh large numpy array costs."""
  with open("/proc/self/stat") as f:
    return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt, field 10


class GcTimer:
  """Seconds spent in the cyclic garbage collector, and collections, per generation, while entered.
  A collection holds the interpreter lock throughout, so a lock figure must tell it apart."""

  def __init__(self):
    self.seconds = [0.0, 0.0, 0.0]
    self.count = [0, 0, 0]
    self._t0 = 0.0

  def _callback(self, phase: str, info: Dict[str, Any]) -> None:
    if phase == "start":
      self._t0 = time.perf_counter()
    else:
      self.seconds[info["generation"]] += time.perf_counter() - self._t0
      self.count[info["generation"]] += 1

  def __enter__(self) -> "GcTimer":
    gc.callbacks.append(self._callback)
    return self

  def __exit__(self, *exc) -> None:
    gc.callbacks.remove(self._callback)


class GilSamplerError(RuntimeError):
  """py-spy is missing or could not attach to this process."""


class GilSampler:
  """py-spy ``--gil`` attached to this process between ``start`` and ``stop``, ``rate`` samples a second.
  ``raw_out``: also keep py-spy's raw stacks there, for a flame graph; ``native``: sample native frames
  too (slower); ``gil_only=False``: every running thread's samples, a CPU profile (``gil_s`` then counts
  every thread)."""

  def __init__(self, rate: int = 500, raw_out: Optional[str] = None, native: bool = False, gil_only: bool = True):
    self.rate, self.raw_out, self.native, self.gil_only = int(rate), raw_out, native, gil_only
    self._proc: Optional[subprocess.Popen] = None
    self._tmp: Optional[str] = None
    self._t0 = self._cpu0 = 0.0
    self._output: List[str] = []

  def start(self, attach_timeout_s: float = 20.0) -> "GilSampler":
    """Attaches py-spy; returns once it samples (py-spy announces it)."""
    # a venv's python run without activating it has py-spy beside it, not on PATH
    exe = shutil.which("py-spy", path=sysconfig.get_path("scripts")) or shutil.which("py-spy")
    if exe is None:
      raise GilSamplerError("py-spy is not installed (pip install -r requirements.txt): no interpreter-lock figure")
    fd, self._tmp = tempfile.mkstemp(prefix="gil_", suffix=".txt")
    os.close(fd)
    # --native needs the process paused while it is read; the lock figure samples without pausing it.
    cmd = [exe, "record", "--pid", str(os.getpid()), "--threads"] + ([] if self.native else ["--nonblocking"])
    cmd += ["--gil"] if self.gil_only else []
    cmd += ["--rate", str(self.rate), "--format", "raw", "--output", self._tmp] + (["--native"] if self.native else [])
    # py-spy announces itself on stdout, errors on stderr: one pipe for both
    self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = threading.Event()

    def read_output():
      for line in self._proc.stdout:
        self._output.append(line.rstrip())
        if "Sampling process" in line:
          started.set()

    threading.Thread(target=read_output, name="gil-sampler-output", daemon=True).start()
    deadline = time.monotonic() + attach_timeout_s
    while not started.wait(0.05):
      if self._proc.poll() is not None or time.monotonic() > deadline:
        self._proc.kill()
        self._proc.wait()
        raise GilSamplerError(f"py-spy could not attach to pid {os.getpid()}: {' / '.join(self._output[-3:])}")
    self._t0, self._cpu0, self._threads0 = time.perf_counter(), time.process_time(), thread_cpu()
    self._faults0 = minor_faults()
    self._gc = GcTimer().__enter__()
    return self

  def stop(self, top: int = 12) -> Dict[str, Any]:
    """Stops sampling; the window's figures: ``gil_s`` (samples / rate), ``wall_s``, ``gil_fraction``,
    ``cpu_s`` (every thread), ``top`` / ``top_threads`` (the frames and threads that held the lock most,
    as ``[name, share of the samples]``), ``thread_cpu_s``, ``minor_faults``, ``gc_s`` and ``gc_count``."""
    if self._proc is None:
      raise GilSamplerError("stop() before start()")
    wall, cpu = time.perf_counter() - self._t0, time.process_time() - self._cpu0
    thread_cpus = {k: v - self._threads0.get(k, 0.0) for k, v in thread_cpu().items()}
    faults = minor_faults() - self._faults0
    self._gc.__exit__()
    self._proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    try:
      self._proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      raise GilSamplerError("py-spy did not stop within 60 s of SIGINT") from None
    frames: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    samples = 0
    with open(self._tmp) as f:
      text = f.read()
    if self.raw_out:
      os.makedirs(os.path.dirname(os.path.abspath(self.raw_out)), exist_ok=True)
      shutil.copyfile(self._tmp, self.raw_out)
    os.unlink(self._tmp)
    for line in text.splitlines():
      stack, _, count = line.rpartition(" ")
      if not stack or not count.isdigit():
        continue
      n = int(count)
      samples += n
      parts = stack.split(";")
      threads[parts[0]] += n
      frames[parts[-1]] += n
    if samples == 0 and wall > 1.0 and not text.strip() and self._proc.returncode not in (0, -signal.SIGINT, 130):
      raise GilSamplerError(f"py-spy exited {self._proc.returncode}: {' / '.join(self._output[-3:])}")
    gil_s = samples / self.rate
    share = lambda c: [[k, round(v / max(1, samples), 4)] for k, v in c.most_common(top)]  # noqa: E731
    return {
      "gil_s": gil_s,
      "wall_s": wall,
      "gil_fraction": gil_s / wall if wall > 0 else float("nan"),
      "cpu_s": cpu,
      "samples": samples,
      "rate": self.rate,
      "top": share(frames),
      "top_threads": share(threads),
      "minor_faults": faults,
      "gc_s": self._gc.seconds,
      "gc_count": self._gc.count,
      "thread_cpu_s": {k: round(v, 3) for k, v in sorted(thread_cpus.items(), key=lambda kv: -kv[1]) if v > 0},
    }


def sampled(run: Callable[..., Any], first: int, last: int, sampler: Optional[GilSampler]) -> Tuple[Any, Any]:
  """``run(on_metrics=...)`` (a run of the main job: ``functools.partial(train.train_and_evaluate, c, workdir)``)
  with ``sampler`` running from its train record of step ``first`` to that of step ``last``, started and stopped
  on a thread of its own so that the loop writing the records is not held up while py-spy attaches or stops.
  Returns (what ``run`` returned, the sampler's figures: None without a sampler); raises what sampling raised."""
  pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gil-window")
  started: List[concurrent.futures.Future] = []
  stopped: List[concurrent.futures.Future] = []

  def stop() -> None:
    if started and not stopped:
      stopped.append(pool.submit(sampler.stop))

  def on_metrics(step: int, kind: str, values: Dict[str, Any]) -> None:
    if kind == "train" and sampler is not None:
      if step == first and not started:
        started.append(pool.submit(sampler.start))
      elif step == last:
        stop()

  try:
    out = run(on_metrics=on_metrics)
  finally:
    stop()  # the run ended (or failed: its own error is the one raised) before its last record
    pool.shutdown(wait=True)
  if sampler is None:
    return out, None
  if not started:
    raise RuntimeError(f"the interpreter lock was not sampled: no train record at step {first}")
  started[0].result()  # raises what starting raised
  return out, stopped[0].result()
