"""A stream a trainer follows (CSV files arriving in ``config.data.stream_dir``), written a few files ahead
of its steps, with events in it (a new id, a known id's label turned over) whose arrival in a model
server's scores a prober times."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

HEADER = "label,d1,c1,c2,item\n"
KNOWN = 200  # ids the base files teach with label 0; the flip events turn their labels over
EVENT_RECORDS = 4  # records of one event (one id)
# configs/tiny.py on these files (with data.eval_files and data.stream_dir); a writer paces itself on log_every
SETS = ["log_every=5", "eval_samples=256", "eval_batch_size=256", "data.name=csv", "data.stream_poll_s=0.02"]
SETS += ["data.dense=('d1',)", "data.categorical=('c1','c2','item')", "data.chunk_records=512"]


def traffic(rng: np.random.Generator, n: int) -> List[str]:
  """``n`` CSV lines of ordinary traffic: Zipf users and items, a label the item and c2 predict."""
  u, v, it = rng.zipf(1.3, n) % 1000, rng.integers(0, 30, n), rng.zipf(1.2, n) % 20000
  logit = (it % 5 - 2) * 0.6 + (v > 15) - 0.5
  y = rng.random(n) < 1 / (1 + np.exp(-logit))
  d = rng.poisson(3, n)
  return [f"{int(a)},{b},u{c},v{e},i{f}" for a, b, c, e, f in zip(y, d, u, v, it)]


def records(lines: List[str]) -> List[Dict[str, Any]]:
  """The request records of CSV lines (their label left out)."""
  out = []
  for line in lines:
    _, d1, c1, c2, item = line.split(",")
    out.append({"d1": float(d1), "c1": c1, "c2": c2, "item": item})
  return out


def put(stream: str, name: str, lines: List[str]) -> float:
  """Writes a stream file under a name the reader ignores, renames it into place; the time it counts."""
  tmp = os.path.join(stream, f".{name}.inprogress")
  with open(tmp, "w") as f:
    f.write(HEADER + "\n".join(lines) + "\n")
  os.rename(tmp, os.path.join(stream, name))
  return time.time()


def base_files(stream: str, batch_size: int, rng: np.random.Generator, files: int = 4) -> int:
  """Writes the base files (the known ids with label 0, ten records each, and traffic) into ``stream``;
  their records, whole batches (a run on them ends at a file's end)."""
  lines = [f"0,3,u{j % 7},v{j % 11},k{j}" for j in range(KNOWN) for _ in range(10)]
  n = -(-len(lines) // batch_size) * batch_size * 2
  lines += traffic(rng, n - len(lines))
  lines = [lines[i] for i in rng.permutation(len(lines))]
  for k in range(files):
    put(stream, f"{k:08d}.csv", lines[k * n // files : (k + 1) * n // files])
    time.sleep(0.01)  # distinct mtimes: the arrival order is the names' order
  return n


def probe_record(item: str) -> Dict[str, Any]:
  return {"d1": 3.0, "c1": "never-trained", "c2": "never-trained", "item": item}  # only ``item`` can move its score


class Prober:
  """Asks the server every ``every_s`` for a record of each pending event's id and records, in seconds
  from the event's file counting, ``rows_at``: the first answer scored with rows at or past the step that
  trains the event (an answer names its rows' step), and ``moved_at``: the first whose score differs
  from the score before the file was written. New dense parameters before the rows re-take that score
  (``rebased``); after them, or after ``timeout_s``, the event is no longer followed."""

  def __init__(self, port: int, every_s: float, timeout_s: float = 60.0):
    from recsys_jax.serving.client import HttpClient

    self.base_client, self.client = HttpClient("127.0.0.1", port, 30), HttpClient("127.0.0.1", port, 30)
    self.every_s, self.timeout_s = every_s, timeout_s
    self.pending: List[Dict[str, Any]] = []
    self.done: List[Dict[str, Any]] = []
    self.failures: List[str] = []
    self.flips: Dict[int, int] = {}
    self.rebased = 0
    self.lock = threading.Lock()
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._loop, daemon=True)

  def prepare(self, n: int):
    """The ``n``-th event (in turn a new id with label 1, a known id's label turned over) and its lines."""
    if n % 2 == 0:
      kind, item, label = "new", f"n{n}", 1
    else:
      j = (n // 2) % KNOWN
      self.flips[j] = self.flips.get(j, 0) + 1
      kind, item, label = "flip", f"k{j}", self.flips[j] % 2  # label 0 -> 1 -> 0 ...
    a = self.base_client.predict([probe_record(item)])
    ev = {"kind": kind, "item": item, "score": a["scores"][0], "dense": a["dense_version"]}
    return ev, [f"{label},3,u1,v1,{item}"] * EVENT_RECORDS

  def register(self, ev: Dict[str, Any], t: float, step: int) -> None:
    """``t``: when its file counted; ``step``: the step that trains its last record."""
    ev["t"], ev["step"] = t, step
    with self.lock:
      self.pending.append(ev)

  def _loop(self) -> None:
    while not self.stop.wait(self.every_s):
      with self.lock:
        pending = list(self.pending)
      if not pending:
        continue
      try:
        a = self.client.predict([probe_record(e["item"]) for e in pending])
      except Exception as e:  # noqa: BLE001 - counted and shown
        self.failures.append(f"{type(e).__name__}: {e}")
        continue
      now, rv, dense = time.time(), a["row_version"], a["dense_version"]
      for e, score in zip(pending, a["scores"]):
        lag = now - e["t"]
        if "rows_at" not in e and rv is not None and rv >= e["step"]:
          e["rows_at"], e["with_dense"] = lag, dense != e["dense"]
        elif dense != e["dense"] and "rows_at" in e:  # the score may move with the dense parameters now
          e["settled"] = True
          continue
        elif dense != e["dense"]:
          e["score"], e["dense"] = score, dense
          self.rebased += 1
        if abs(score - e["score"]) > 1e-6:
          e["moved_at"], e["settled"] = lag, True
        elif lag > self.timeout_s:
          e["settled"] = True
      with self.lock:
        self.done += [e for e in pending if "settled" in e]
        self.pending = [e for e in self.pending if "settled" not in e]

  def close(self) -> List[Dict[str, Any]]:
    """Stops probing; every event, followed to its end or not."""
    self.stop.set()
    if self.thread.is_alive():
      self.thread.join()
    self.client.close()
    self.base_client.close()
    return self.done + self.pending


class Writer:
  """A thread writing files of ``file_records`` traffic records into ``stream`` (named from ``seq`` on,
  after ``written`` records), at most ``ahead`` records ahead of ``trained()``, the records the trainer
  trained (the trainer's batch: ``batch_size``). While ``events`` is set, every ``every_s`` a file starts
  with the records of ``prober``'s next event. ``halt`` ends it."""

  def __init__(
    self,
    stream: str,
    seq: int,
    written: int,
    trained: Callable[[], int],
    rng: np.random.Generator,
    batch_size: int,
    file_records: int,
    ahead: int,
    prober: Optional[Prober] = None,
    every_s: float = 0.5,
  ):
    self.stream, self.seq, self.written, self.trained = stream, seq, written, trained
    self.rng, self.batch_size, self.file_records, self.ahead = rng, batch_size, file_records, ahead
    self.prober, self.every_s = prober, every_s
    self.events = threading.Event()
    self.halt = threading.Event()
    self.in_flight = threading.Lock()
    threading.Thread(target=self._loop, daemon=True).start()

  def _loop(self) -> None:
    next_event, n = 0.0, 0
    while not self.halt.is_set():
      if self.written - self.trained() >= self.ahead:
        time.sleep(0.005)
        continue
      lines, ev = traffic(self.rng, self.file_records), None
      with self.in_flight:  # an event the writer began is registered before the run looks for pending ones
        if self.prober is not None and self.events.is_set() and time.time() >= next_event:
          try:
            ev, head = self.prober.prepare(n)
            lines = head + lines
          except Exception as e:  # noqa: BLE001 - counted and shown
            self.prober.failures.append(f"{type(e).__name__}: {e}")
          n, next_event = n + 1, time.time() + self.every_s
        t = put(self.stream, f"{self.seq:08d}.csv", lines)
        if ev is not None:  # its records are the stream's records written ... written + EVENT_RECORDS - 1
          self.prober.register(ev, t, (self.written + EVENT_RECORDS - 1) // self.batch_size + 1)
      self.seq += 1
      self.written += len(lines)

  def end_events(self) -> None:
    """No more events; returns once an event begun is registered."""
    self.events.clear()
    with self.in_flight:
      pass
