"""What a run writes for people: the progress bar, metrics.jsonl, TensorBoard event files,
the evaluations during training and summary.json (written by process 0 only)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import queue
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import numpy as np
from absl import logging
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.proto.summary_pb2 import Summary
from tqdm import tqdm

from recsys_jax import workdir as workdir_lib
from recsys_jax import write_waits
from recsys_jax.checkpoint_files import WriteError, named
from recsys_jax.online.progressive import ProgressiveValidation, window_of


def say(msg: str) -> None:
  """A message for the person running the job (stderr, above the progress bar)."""
  tqdm.write(msg, file=sys.stderr)
  logging.info(msg)


class TrainStats:
  """Loss and timing recorded by the pusher thread, read by the training loop; and the training
  loop's calls of the train step that compiled, whose time the throughput leaves out."""

  def __init__(self):
    self.lock = threading.Lock()
    self.loss_sum, self.loss_n = 0.0, 0
    self.first_applied: Optional[Tuple[int, float]] = None
    self.last_applied: Optional[Tuple[int, float]] = None
    self.compiles: List[Tuple[int, float, float]] = []  # (step, start, end) of a train step call that compiled

  def record(self, step: int, loss: float, now: Optional[float] = None) -> None:
    """Step ``step``'s push is applied (``now``: when, ``time.perf_counter()`` unless given)."""
    now = time.perf_counter() if now is None else now
    with self.lock:
      self.loss_sum += loss
      self.loss_n += 1
      if self.first_applied is None:
        self.first_applied = (step, now)
      self.last_applied = (step, now)

  def take_mean_loss(self) -> float:
    with self.lock:
      mean = self.loss_sum / self.loss_n if self.loss_n else float("nan")
      self.loss_sum, self.loss_n = 0.0, 0
      return mean

  def compiled(self, step: int, start: float, end: float) -> None:
    """The train step's call for ``step`` ran from ``start`` to ``end`` and traced (so compiled)."""
    with self.lock:
      self.compiles.append((step, start, end))

  def throughput(self, batch_size: int) -> Tuple[Optional[float], int, float]:
    """(samples/s, later compiles, their seconds): the steps after the first applied one, over the
    time from its push's application to the last's, less the time of the compiles in between.

    The first step compiles before its push is applied, so it is outside the interval; a later
    compile (a re-chosen hot set or a new batch shape changes the step's shapes) blocks the loop
    for seconds inside it, which would make a short run's figure a fraction of the steady rate.
    Its step still counts (its execution, after the compile, is in the interval). None when the
    run applied fewer than two steps (JSON null, not NaN).
    """
    with self.lock:
      first, last, compiles = self.first_applied, self.last_applied, list(self.compiles)
    if not (first and last and last[0] > first[0]):
      return None, 0, 0.0
    (f, t_f), (n, t_n) = first, last
    later = [(max(a, t_f), min(b, t_n)) for s, a, b in compiles if f < s <= n]
    secs = sum(max(0.0, b - a) for a, b in later)
    return (n - f) * batch_size / (t_n - t_f - secs), len(later), secs


MetricsCallback = Callable[[int, str, Dict[str, Any]], None]
"""``on_metrics(step, kind, values)``: called with every record written to metrics.jsonl (kind
"train": loss, samples/s, the interval's seconds, staleness, hot rows, host time per stage; "eval": AUC, logloss; "ps": rows, memory, hit rate;
"progressive": AUC, logloss, calibration of the last ``config.progressive.window`` training events, each scored before
it was trained on, with ``source`` set in the records of one source's own window),
e.g. to draw live plots in a notebook. An exception it raises stops the run like any other error
(the last checkpoint is kept)."""


def read_metrics(workdir: str, kind: Optional[str] = None) -> List[Dict[str, Any]]:
  """The records of ``<workdir>/metrics.jsonl`` (``kind``: only "train", "eval" or "ps" ones), in order.

  A run writes one record per log interval and evaluation, so this reads a run that is going on
  as well as a finished one (a line still being written at the end is left out).
  """
  path = os.path.join(workdir, workdir_lib.METRICS)
  out = []
  with open(path) as f:
    for i, line in enumerate(f, 1):
      try:
        rec = json.loads(line)
      except json.JSONDecodeError:
        if line.endswith("\n"):
          raise ValueError(f"{path}:{i}: not a JSON record: {line[:80]!r}") from None
        break  # the last line, half written
      if kind is None or rec.get("kind") == kind:
        out.append(rec)
  return out


# TensorBoard's event file: tensorboardX's ``SummaryWriter`` writes its events on a thread that
# dies with the first write that fails (a full disk), silently; its queue of events then fills and
# the next ``add_summary`` waits forever on it, SIGTERM or not. ``EventFile`` raises a failed write
# to the next caller, holds a caller on a disk that takes no writes only until the run is told to
# stop, and its thread never blocks the process's exit.
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
    try:
      with write_waits.writing(f"TensorBoard events {logdir}"):
        os.makedirs(logdir, exist_ok=True)
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
    with write_waits.waiting_for(self._thread, f"TensorBoard events {self.path}"):
      self._thread.join(timeout=None if not self._dropping else 2 * _POLL_S)
    if not self._thread.is_alive() and self._error is None:
      try:
        with write_waits.writing(f"TensorBoard events {self.path}"):
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
            f"TensorBoard: {self.path} takes no writes; its events from step {step} on are dropped, the stop goes on"
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


class Writers:
  """metrics.jsonl and TensorBoard event files in the workdir (written by process 0 only), and
  the caller's ``on_metrics`` callback (called on process 0 with the same records).

  A record that cannot be written (a full disk) raises ``WriteError`` naming the file; ``stop``
  (set by SIGTERM): TensorBoard events that would wait for a disk that takes no writes are dropped.
  """

  def __init__(
    self, workdir: str, on_metrics: Optional[MetricsCallback] = None, stop: Optional[threading.Event] = None
  ):
    self.enabled = jax.process_index() == 0
    self.on_metrics = on_metrics
    self._closed = False
    self._lock = threading.RLock()
    if self.enabled:
      self.jsonl_path = os.path.join(os.path.abspath(workdir), workdir_lib.METRICS)
      try:
        with write_waits.writing(f"metrics {self.jsonl_path}"):
          self.jsonl = open(self.jsonl_path, "a")
      except OSError as e:
        raise WriteError.of("metrics", self.jsonl_path, e) from e
      self.tb = EventFile(os.path.join(os.path.abspath(workdir), "tensorboard"), stop)

  def write(self, step: int, kind: str, values: Dict[str, Any], tb_prefix: Optional[str] = None) -> None:
    """One record; its finite numbers also go to TensorBoard as ``<tb_prefix or kind>/<name>``.
    Thread-safe (the progressive reports are written by their own thread): records are whole,
    in the order they are written, in the file, to ``on_metrics`` and to TensorBoard."""
    if not self.enabled:
      return
    # The lock too: a progressive report that holds it may be the write that hangs.
    with write_waits.writing(f"metrics {self.jsonl_path}"), self._lock:
      if self._closed:
        raise ValueError(f"metrics writers closed: the {kind!r} record of step {step} came after the run's end")
      try:
        self.jsonl.write(json.dumps({"step": step, "kind": kind, **values}) + "\n")
        self.jsonl.flush()
      except OSError as e:
        raise WriteError.of("metrics", self.jsonl_path, named(e, self.jsonl_path)) from e
      if self.on_metrics is not None:
        self.on_metrics(step, kind, dict(values))
      self._scalars(step, {f"{tb_prefix or kind}/{k}": v for k, v in values.items()})

  def _scalars(self, step: int, values: Dict[str, Any]) -> None:
    """The finite numbers of ``values`` (tag -> value) as one TensorBoard event: one event per
    scalar (``add_scalar``) cost the loop 23 ms for the 312 PS scalars of a Criteo-shaped record
    (under the GIL, which every host thread needs), one event with all of them 1 ms."""
    tb_values = [
      Summary.Value(tag=tag, simple_value=float(v))
      for tag, v in values.items()
      if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)
    ]
    if tb_values:
      self.tb.add(Summary(value=tb_values), step)

  def write_ps(self, step: int, stats: Dict[str, Dict[str, float]]) -> None:
    """PS metrics: totals in metrics.jsonl, per table in TensorBoard (ps/<table>/<metric>)."""
    if not self.enabled:
      return
    keys: Tuple[str, ...] = ("rows", "tier_rows", "bytes", "evictions", "expirations", "admitted", "rejected")
    keys += ("dropped_grads",)
    # The disk tier's: rows read back (by lookups and read-aheads), rows read ahead, lookups
    # that found rows a read-ahead pinned, ids not read ahead (over the budget, or too late), the
    # seconds lookups spent on tier reads and evictions spent (all since the start), read-aheads
    # queued now, rows pinned for later steps now, rows not yet written.
    tier_keys: Tuple[str, ...] = ("tier_reads", "read_ahead_rows", "read_ahead_hits", "read_ahead_skipped")
    tier_keys += ("read_ahead_late",)
    tier_keys += ("tier_wait_s", "evict_s", "reads_in_flight", "read_ahead_pinned", "write_behind_rows")
    keys += tier_keys if any(t.get("tier_rows", 0) or t.get("tier_reads", 0) for t in stats.values()) else ()
    total = {k: sum(t.get(k, 0) for t in stats.values()) for k in keys}
    lookups = sum(t["lookups"] for t in stats.values())
    total["hit_rate"] = sum(t["hits"] for t in stats.values()) / lookups if lookups else float("nan")
    if "read_ahead_rows" in keys:  # what the RAM cache held without the read-ahead's help
      ahead = sum(t.get("read_ahead_rows", 0) for t in stats.values())
      total["cache_hit_rate"] = (sum(t["hits"] for t in stats.values()) - ahead) / lookups if lookups else float("nan")
    total["lookup_ms"] = sum(t["lookup_ms"] for t in stats.values())
    total["apply_ms"] = sum(t["apply_ms"] for t in stats.values())
    self.write(step, "ps", total)
    per_table = keys + ("hit_rate", "cache_hit_rate", "lookup_ms", "apply_ms")
    with self._lock:
      self._scalars(step, {f"ps/{name}/{k}": t[k] for name, t in stats.items() for k in per_table if k in t})

  def close(self) -> None:
    """Closes the files (once; again is a no-op).

    Raises:
      WriteError: naming the file, if what was written could not all reach it (a full disk).
    """
    if not self.enabled or self._closed:
      return
    with write_waits.writing(f"metrics {self.jsonl_path}"), self._lock:
      self._closed = True
      try:
        self.jsonl.close()
      except OSError as e:
        raise WriteError.of("metrics", self.jsonl_path, named(e, self.jsonl_path)) from e
      finally:
        self.tb.close()


class Progress:
  """The training loop's reporting: bar, loss and throughput every ``log_every`` steps,
  evaluations during training (timed apart from training), and the summary at the end.

  Args:
    workdir: where metrics.jsonl, tensorboard/ and summary.json go.
    config: the run's config.
    start: the first step this run trains (after a resume, the checkpoint's).
    t_start: when the run started (``time.perf_counter()``).
    on_metrics: called with every record written to metrics.jsonl (e.g. a notebook's live plot).
    stop: set when the run is told to stop (``Writers``).
  """

  def __init__(
    self,
    workdir: str,
    config,
    start: int,
    t_start: float,
    on_metrics: Optional[MetricsCallback] = None,
    stop: Optional[threading.Event] = None,
  ):
    self.workdir, self.config, self.t_start = workdir, config, t_start
    self.writers = Writers(workdir, on_metrics, stop)
    self.stats = TrainStats()
    self.bar = tqdm(
      total=config.num_steps if config.num_steps >= 0 else None,  # -1: until stopped
      initial=start,
      unit="step",
      desc="train",
      disable=not config.progress_bar,
      dynamic_ncols=True,
      mininterval=1.0,
    )
    self.log_t, self.log_step = time.perf_counter(), start
    self.evals: List[Dict[str, Any]] = []
    self.eval_s = 0.0  # time spent in evaluations during training
    window = window_of(config)
    # Process 0 writes the records, and every process's step returns the whole batch's scores.
    self.progressive = ProgressiveValidation(window) if window and self.writers.enabled else None
    self.last_progressive: Optional[Dict[str, Any]] = None
    self._reporter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="progressive")
    self._reports: List[concurrent.futures.Future] = []
    self._stream_file: Optional[str] = None  # the stream file the last batch trained ended in

  def record_step(
    self, step: int, loss: float, metrics: Dict[str, Any], source: Optional[str] = None, now: Optional[float] = None
  ) -> None:
    """The pusher's record of an applied step: its loss, and with progressive validation on, the
    scores the step's forward pass gave its batch (``metrics["logits"]``, before the update) with
    its labels; ``source`` names where the batch came from (a stream's file), or None; ``now``:
    when its push was applied (``time.perf_counter()``; None: now)."""
    self.stats.record(step, loss, now)
    if self.progressive is not None and "logits" in metrics:
      self.progressive.add(_host(metrics["logits"]), _host(metrics["label"]), source)

  def advance(self, step: int, position: Any) -> None:
    """Step ``step``, whose batch ends at ``position``, is trained: the bar moves on, and on a stream
    the first batch that ends in a file says so on the console (a line per file, bar or not)."""
    self.bar.update(1)
    name = position.get("file") if isinstance(position, dict) else None
    if name is None or name == self._stream_file:
      return
    self._stream_file = name
    say(f"stream: training {name} (step {step}, {len(position.get('done', ()))} file(s) read before it)")

  def log_due(self, done: int) -> bool:
    return done % self.config.log_every == 0 or done == self.config.num_steps

  def log_train(self, done: int, pre, ps, hot=None, times=None) -> None:
    """Writes the mean loss and samples/s since the last log, the staleness seen, the host's time
    per stage (``times``: the pipeline's ``StageTimes``, ms per step since the last log) and the PS's metrics."""
    now = time.perf_counter()
    sps = (done - self.log_step) * self.config.batch_size / (now - self.log_t)
    loss = self.stats.take_mean_loss()
    staleness = {"staleness_mean": pre.stale_sum / max(1, pre.stale_n), "staleness_max": pre.stale_max}
    hot_metrics = hot.metrics() if hot is not None and hot.enabled else {}
    stages = times.take(done - self.log_step) if times is not None else {}
    record = {"loss": loss, "samples_per_sec": sps, "train_s": now - self.log_t, **staleness, **hot_metrics, **stages}
    self.writers.write(done, "train", record)
    self.writers.write_ps(done, ps.stats())
    if self.progressive is not None:
      self.log_progressive(done)
    self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{sps:,.0f}", refresh=False)
    self.log_t, self.log_step = now, done

  def log_progressive(self, done: int) -> None:
    """The progressive metrics over the window, then per source, computed and written on the
    reporter thread: the loop only copies what they cover (``ProgressiveValidation.take``), so a
    report (a sort of a million keys) never holds a step back (at k = 0 the next step waits for the
    loop). ``report_ms``: what computing them took the reporter. ``flush_reports`` waits for them."""
    assert self.progressive is not None, "progressive validation is off"
    taken = self.progressive.take()

    def report() -> None:
      t = time.perf_counter()
      rec, sources = taken.metrics()
      rec["report_ms"] = 1e3 * (time.perf_counter() - t)
      self.writers.write(done, "progressive", rec)
      for name, r in sources.items():
        self.writers.write(done, "progressive", {"source": name, **r}, tb_prefix=f"progressive/{name}")
      self.last_progressive = rec

    self._reports.append(self._reporter.submit(report))

  def flush_reports(self) -> None:
    """Waits until every progressive report asked for is written; raises the first that failed."""
    pending, self._reports = self._reports, []
    if not pending:
      return
    with write_waits.writing(f"metrics {self.writers.jsonl_path} (progressive reports)"):
      for f in pending:
        f.result()

  def log_eval(self, done: int, evaluate: Callable[[], Dict[str, float]]) -> None:
    """Runs an evaluation during training and records it against the training time so far."""
    t_eval = time.perf_counter()
    ev = evaluate()
    self.writers.write(done, "eval", ev)
    # Training time so far, without the evaluations: the x axis of AUC against wall time.
    train_s = t_eval - self.t_start - self.eval_s
    self.evals.append({"step": done, "samples": done * self.config.batch_size, "train_s": train_s, **ev})
    self.eval_s += time.perf_counter() - t_eval

  def finish(
    self,
    ev: Dict[str, float],
    job,
    start: int,
    resumed: bool,
    ps_stats,
    train_end: float,
    hot=None,
    done: Optional[int] = None,
  ) -> Dict[str, Any]:
    """Writes the final evaluation and summary.json; returns the summary (on every process).
    ``done``: the step training reached (default: ``num_steps``, or ``start`` if past it)."""
    config, B = self.config, self.config.batch_size
    step = max(config.num_steps, start) if done is None else done  # a workdir past num_steps is evaluated where it is
    self.flush_reports()
    self._reporter.shutdown()
    self.writers.write(step, "eval", ev)
    self.writers.close()
    sps, recompiles, recompile_s = self.stats.throughput(B)
    summary = {
      **ev,
      "auc_gap": ev["oracle_auc"] - ev["auc"] if "oracle_auc" in ev else None,
      "data": config.data.name,
      "model": config.model.name,
      "bad_records_skipped": job.reader.bad.count,
      "bad_record_examples": job.reader.bad.examples,
      "samples_per_sec": sps,  # after the first step, less the time of the later compiles
      "recompiles": recompiles,  # train step compiles after the first step's, left out of samples_per_sec
      "recompile_s": recompile_s,
      "steps": step,
      "steps_this_run": max(0, step - start),
      "resumed_from": start if resumed else None,
      "batch_size": B,
      "staleness": config.staleness,
      "wall_s": time.perf_counter() - self.t_start,
      "train_wall_s": train_end - self.t_start,
      "train_s": train_end - self.t_start - self.eval_s,  # without the evaluations during training
      "ps_rows": int(sum(s["rows"] for s in ps_stats.values())),
      "ps_bytes": int(sum(s["bytes"] for s in ps_stats.values())),
      "ps_tier_rows": int(sum(s["tier_rows"] for s in ps_stats.values())),
      "ps_tier_wait_s": float(sum(s.get("tier_wait_s", 0.0) for s in ps_stats.values())),
      "ps_read_ahead_rows": int(sum(s.get("read_ahead_rows", 0) for s in ps_stats.values())),
      "ps_read_ahead_hits": int(sum(s.get("read_ahead_hits", 0) for s in ps_stats.values())),
      "ps_tier_reads": int(sum(s.get("tier_reads", 0) for s in ps_stats.values())),
      "train_step_traces": job.traces.get("train", 0),
      "eval_step_traces": job.traces.get("eval", 0),
      "devices": jax.device_count(),
      "mesh": dict(job.mesh.shape),
      "micro_steps": config.micro_steps,
      "evals": self.evals,
      "progressive": self.last_progressive,  # the last report over the window (None: off)
      "hot": {**hot.metrics(), "choices": hot.choices} if hot is not None and hot.enabled else None,
    }
    if self.writers.enabled:  # every process returns the summary; process 0 writes it
      path = os.path.join(os.path.abspath(self.workdir), workdir_lib.SUMMARY)
      try:
        with write_waits.writing(f"summary {path}"), open(path, "w") as f:
          json.dump(summary, f, indent=2)
      except OSError as e:
        raise WriteError.of("summary", path, named(e, path)) from e
    return summary


def _host(x) -> np.ndarray:
  """A step output on the host (an explicit copy, as the step loop's transfer guard asks): with
  several processes, this process's copy of a replicated array."""
  if not getattr(x, "is_fully_addressable", True):
    x = x.addressable_data(0)
  return np.asarray(jax.device_get(x))


def _throughput(s: Dict[str, Any]) -> str:
  sps = s.get("samples_per_sec")
  if sps is not None and sps == sps:  # not NaN
    k = s.get("recompiles", 0)
    if not k:
      return f"{sps:,.0f} samples/s (after the first step, which compiled)"
    return (
      f"{sps:,.0f} samples/s (after the first step, less {s['recompile_s']:.1f} s of {k} later "
      f"compile{'s' if k > 1 else ''} of the train step)"
    )
  if not s.get("steps_this_run"):
    return "no steps run (the workdir's checkpoint is at the last step; a new workdir trains again)"
  return "not measured (it is timed after the first step, which compiles; this run made one)"


def format_summary(s: Dict[str, Any]) -> str:
  """A few readable lines for the end of a run."""
  lines = [
    f"eval AUC      {s['auc']:.4f}"
    + (f"   (oracle {s['oracle_auc']:.4f}, gap {s['auc_gap']:.4f})" if s.get("oracle_auc") else ""),
    f"eval logloss  {s['logloss']:.4f}" + (f"   (oracle {s['oracle_logloss']:.4f})" if s.get("oracle_logloss") else ""),
    f"calibration   {s['calibration']:.3f}",
    f"steps         {s['steps']} ({s['steps_this_run']} this run, batch {s['batch_size']}, staleness k={s['staleness']})",
    f"throughput    {_throughput(s)}",
    *(
      [
        f"hot rows      {s['hot']['hot_rows_held']:,.0f} on the device, hit rate {s['hot']['hot_hit_rate']:.3f}, "
        f"{s['hot']['h2d_row_bytes_per_step'] / 2**10:,.1f} KiB of rows host -> device a step"
      ]
      if s.get("hot")
      else []
    ),
    f"wall time     {s['wall_s']:.1f} s",
    f"PS            {s['ps_rows']:,} rows, {s['ps_bytes'] / 2**20:.1f} MiB",
    f"model, data   {s.get('model')}, {s.get('data')} ({s['eval_samples']:,} eval records)",
  ]
  if s.get("bad_records_skipped"):
    examples = s.get("bad_record_examples") or []
    # A resumed run's count starts at its checkpoint's; the examples are those this run met.
    said = f", e.g. {examples[0]}" if examples else " (counted by the run before the resume; its log names them)"
    lines.append(f"bad records   {s['bad_records_skipped']:,} skipped{said}")
  return "\n".join(lines)
