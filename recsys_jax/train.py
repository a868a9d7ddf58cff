"""Training and evaluation through the host parameter server: the loop.

One step of data flows one way:
  reader -> dedup per table -> PS lookup (k steps ahead, prefetcher thread)
  -> device_put -> jitted train_step (dense update + row gradients) -> pusher thread -> PS.

``train_and_evaluate(config, workdir)`` is the whole job; ``main.py`` only parses flags. The
parts it is assembled from live in ``recsys_jax.training`` (one module each); the names
below are re-exported so ``from recsys_jax import train; train.build_job(...)`` keeps working.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import queue
import threading
import time
from typing import Any, Dict, Optional

import ml_collections

from recsys_jax.async_ps.factory import parse_kvstore
from recsys_jax.checkpoint_files import WriteError
from recsys_jax.online.publish import Publisher
from recsys_jax.parallel import distributed
from recsys_jax.training import run_config
from recsys_jax.training.evaluation import evaluate
from recsys_jax.training.host import DataError, EndOfData, HostPipeline, NonFiniteLossError, Prepared, Push, last_step
from recsys_jax.training.job import Job, build_job, build_ps
from recsys_jax.training.pipeline import Aborted, Pusher, StalenessGate
from recsys_jax.training.run_checkpoints import RunCheckpoints
from recsys_jax.training.specs import build_specs
from recsys_jax.training.steps import AsyncDenseState, make_eval_step, make_train_step
from recsys_jax.training.validation import dense_optimizer, validate_config
from recsys_jax.training.writers import MetricsCallback, Progress, format_summary, read_metrics, say

# The public entry points first: the API reference lists the names in this order.
__all__ = [
  "train_and_evaluate",
  "build_job",
  "evaluate",
  "validate_config",
  "read_metrics",
  "format_summary",
  "Job",
  "build_ps",
  "build_specs",
  "parse_kvstore",
  "dense_optimizer",
  "make_train_step",
  "make_eval_step",
  "AsyncDenseState",
  "NonFiniteLossError",
  "HostPipeline",
  "Prepared",
]


def _settle_heap() -> None:
  """Keeps the cyclic garbage collector off the heap of long-lived objects a trainer holds (jax's
  and flax's: traced functions, compiled executables, the model, the configs): every host thread
  allocates small objects every step, so CPython runs a full collection over that whole heap every
  so often, on whichever thread crossed the threshold, holding the GIL (90-150 ms here, once or
  twice a run, every host thread waiting; ``experiments/bench_feed.py`` reports ``gc_ms_per_step``).
  Collects once, then freezes what is alive (``gc.freeze``): later collections look at objects made
  after it only. Reference counting frees frozen objects as before; only a cycle of them that
  becomes garbage is never collected, and the objects alive when a loop starts are the run's own."""
  gc.collect()
  gc.freeze()


def _due(every: int, done: int, last: int) -> bool:
  """Whether an every-N-steps action falls on step ``done`` (the last step has its own)."""
  return bool(every) and done % every == 0 and done != last


@dataclasses.dataclass
class _Run:
  """The parts of one run around its loop, built once it resumes (``train_and_evaluate``): what the
  helpers that end it take, instead of ten parameters each."""

  config: ml_collections.ConfigDict
  job: Job
  ckpts: RunCheckpoints
  publisher: Publisher
  gate: StalenessGate
  pre: Any
  """The training prefetcher (``HostPipeline.train_prefetcher``)."""
  progress: Progress
  pusher: Pusher
  start: int
  """The step the run started at (its checkpoint's, 0 for a fresh run)."""


def _last_cut(run: _Run, done: int, state, data_error=None) -> None:
  """After the last step (``done`` steps in all; none if ``done`` is ``start``): its checkpoint, or with
  ``config.final_checkpoint`` False none, but every push applied and the hot rows back in the PS,
  which the final evaluation reads; the last rows and dense parameters published for serving. Then
  raises ``data_error`` (a ``DataError``) if there is one."""
  ckpts, ps, pusher, hot, publisher = run.ckpts, run.job.ps, run.pusher, run.job.hot, run.publisher
  if done > run.start and run.config.final_checkpoint and ckpts.last_saved != done:
    ckpts.save(done, state, ps, pusher, hot)
  elif done > run.start:
    pusher.flush(done - 1)
    hot.write_back(ps)
  if done > run.start:
    publisher.publish(done, state, pusher, dense=True)
  publisher.close()
  if data_error is not None:
    saved = f"checkpoint at step {done}: {ckpts.last_good()}" if done > run.start else "nothing trained this run"
    msg = f"{data_error.error} (training stopped before step {done}; {saved})"
    try:
      error = type(data_error.error)(msg)
    except TypeError:  # an error type that takes other arguments
      error = ValueError(msg)
    raise error from data_error.error


def _next_batch(pre, gate: StalenessGate, pusher: Pusher, t: int, stop: Optional[threading.Event]):
  """``(step t's placed batch, None)``, or ``(None, why)`` if the run is to end after step t - 1:
  ``why`` is the reader's error (``DataError``: the steps before are saved first), or None when the
  data ended or a stop was requested (``stop`` set) before any lookup or resolve of step t (the
  lookups from t on are then held, so the PS holds nothing of step t; a step already looked up or
  resolved is trained first: ``StalenessGate.stop_before``).
  Waits as long as the data does."""
  while True:
    if stop is not None and stop.is_set() and gate.stop_before(t):
      say(f"stop requested: stopping at step {t} (its checkpoint follows)")
      return None, None
    try:
      return pre.get(timeout=None if stop is None else 0.25)[1], None
    except queue.Empty:
      continue
    except EndOfData:
      say(f"the training data ended: stopping at step {t} (its checkpoint follows)")
      return None, None
    except DataError as e:
      return None, e
    except Aborted:
      pusher.check()  # the pusher's error (e.g. a NaN loss) is the one to report
      raise


def _hold_for_cut(gate: StalenessGate, done: int, save: bool, stop: Optional[threading.Event]) -> bool:
  """Before step ``done - 1``'s push: holds the lookups of step ``done`` on if a checkpoint is due
  there (``save``) or a stop was requested (returned: the run then ends at ``done``)."""
  stopping = stop is not None and stop.is_set()
  if save or stopping:
    gate.hold(done)  # the checkpoint's cut: no lookup of step `done` before its PS snapshot
  if stopping:
    say(f"stop requested: stopping at step {done} (its checkpoint follows)")
  return stopping


def _wind_down(run: _Run) -> None:
  """Ends the loop's helpers, however the loop ended (its ``finally``), in this order."""
  run.progress.bar.close()
  run.publisher.close(quiet=True)
  run.job.hot.close()
  run.gate.abort(Aborted("training ended"))  # a prefetcher held at the last step stops waiting
  run.pre.close()
  run.pusher.close()
  run.ckpts.close()


def _resume(config, workdir: str, job: Job):
  """The run's checkpoints and its start: ``(ckpts, dense state, first step, reader position, hot
  tables, publisher)``, from the newest intact checkpoint (a config its checkpoints do not fit is
  named) or fresh; the publisher of rows for serving (``config.publish_every_s``) starts there."""
  run_config.verify(workdir)  # a damaged config file stops the run before any checkpoint is touched
  ckpts = RunCheckpoints(workdir, config)
  state, start, position = ckpts.restore_latest(job.state, job.ps)
  run_config.record(workdir, config, say)  # once restored: it names the config (a scorer rebuilds the model)
  if 0 <= config.num_steps <= start and ckpts.latest is not None:
    say(
      f"{ckpts.latest_dir()} is at step {start}, at or past num_steps={config.num_steps}: no step to train, the "
      "checkpoint is evaluated as it is (a new --workdir trains from the start; a larger --config.num_steps goes on)"
    )
  job.hot.resume(start, ckpts.latest_part(job.hot.state_name()), job.ps)
  publisher = Publisher(config, workdir, job.ps, job.hot, start)
  ckpts.after_save = publisher.checkpointed  # deltas two checkpoints cover are pruned
  return ckpts, state, start, position, publisher


def _around_the_loop(config, job: Job, gate: StalenessGate, start: int, position, progress: Progress):
  """The prefetcher and the pusher of a run from step ``start`` (the reader at ``position``). At
  k = 0 the loop pushes each step and looks the next one up itself: nothing could overlap them, and
  threads between them would only add wake-ups to the time the device waits (``training/pipeline.py``)."""
  inline = config.staleness == 0
  pre = job.host.train_prefetcher(start, config, gate, position, lookup_on_get=inline)

  def record(t: int, push: Push, m: Dict[str, Any], at: float) -> None:
    # the step's metrics as push_step copied them to the host, with its row gradients
    progress.record_step(t, float(m["loss"]), m, push.source, at)

  return pre, Pusher(job.host.push_step, gate, inline=inline, record=record)


def _train_step(job: Job, progress: Progress, t: int, state, rows, batch):
  """The jitted step of step ``t`` (the hot rows' device tables go in and come back updated);
  a call that compiled is timed apart (the throughput leaves it out)."""
  traced, t_call = job.traces.get("train", 0), time.perf_counter()
  state, job.hot.tables, g_rows, m = job.train_step(state, job.hot.tables, rows, batch)
  if job.traces.get("train", 0) > traced:
    progress.stats.compiled(t, t_call, time.perf_counter())
  return state, g_rows, m


def _naming_last_good(e: Exception, ckpts: RunCheckpoints) -> Exception:
  """The error that ends a run (a NaN loss, a file it could not write) with its last good checkpoint."""
  if isinstance(e, NonFiniteLossError):
    return NonFiniteLossError(f"{e}; the run stopped. Last good checkpoint: {ckpts.last_good()} (left intact)")
  # metrics, TensorBoard events, a publish, the summary: said as a checkpoint that failed is
  return WriteError(f"{e}; last good checkpoint: {ckpts.last_good()} (left as it was)")


def _finish(run: _Run, ev: Dict[str, Any], ps_stats, train_end: float, done: int) -> Dict[str, Any]:
  """The final evaluation's record and summary.json (``Progress.finish``); returns the summary."""
  try:
    return run.progress.finish(
      ev, run.job, run.start, run.ckpts.latest is not None, ps_stats, train_end, run.job.hot, done=done
    )
  except WriteError as e:
    raise _naming_last_good(e, run.ckpts) from e


def train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: str,
  on_metrics: Optional[MetricsCallback] = None,
  stop: Optional[threading.Event] = None,
) -> Dict[str, Any]:
  """Trains (resuming from ``workdir`` if it holds a checkpoint), evaluates, writes a summary. ``on_metrics``
  gets every metrics.jsonl record as it is written (``writers.MetricsCallback``). Training ends after ``num_steps``
  (-1: never), when the data ends (a stream gone idle) or once ``stop`` is set (``main.py``: on SIGTERM).

  Returns the summary dict (also written to ``<workdir>/summary.json``). Raises NonFiniteLossError
  if the loss becomes NaN or infinite (the last checkpoint is kept), ValueError for a bad config value
  or bad data (with a checkpoint of the steps before its batch).
  """
  t_start = time.perf_counter()
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  job = build_job(config, workdir, restore=False)  # restored below, where a resume checks the data position
  host, ps, hot, n = job.host, job.ps, job.hot, config.num_steps
  ckpts, state, start, position, publisher = _resume(config, workdir, job)
  gate = StalenessGate(last_applied=start - 1)
  progress = Progress(workdir, config, start, t_start, on_metrics, stop)
  pre, pusher = _around_the_loop(config, job, gate, start, position, progress)
  run = _Run(config, job, ckpts, publisher, gate, pre, progress, pusher, start)
  done, data_error = start, None
  _settle_heap()
  try:
    for t in range(start, last_step(n)):
      hot.before_step(t, ps, pusher)  # re-chooses the hot rows at a boundary
      placed, data_error = _next_batch(pre, gate, pusher, t, stop)
      if placed is None:
        break
      p, rows, batch = placed
      ckpts.positions[t] = p.position
      state, g_rows, m = _train_step(job, progress, t, state, rows, batch)
      if t == start:
        _settle_heap()  # and what compiling the step made
      done = t + 1
      save = _due(config.checkpoint_every, done, n)
      stopping = _hold_for_cut(gate, done, save, stop)
      publisher.step(p, done, gate, save or stopping)  # records the ids pushed; holds the lookups if it publishes
      gate.decide(done)  # step done's ids may now be resolved ahead, unless held
      pusher.push(t, Push.of(p, g_rows, m, scoring=config.device_step == "score"))
      publisher.cut(done, state, pusher)  # if due: this cut's rows for serving, then the lookups go on
      progress.advance(t, p.position)  # the bar, and on a stream a line per file
      if progress.log_due(done):
        pusher.flush(t)
        progress.log_train(done, pre, ps, hot, host.times)
      if _due(config.eval_every, done, n):
        pusher.flush(t)
        hot.write_back(ps)  # evaluation reads the PS: the hot rows' current values go there
        distributed.barrier(f"eval at {done}")  # every trainer's pushes are in: the PS is one cut
        progress.log_eval(done, functools.partial(evaluate, state, job.eval_step, host, config))
      if save:
        try:
          ckpts.save(done, state, ps, pusher, hot)
        finally:
          gate.release()  # a stop's hold too: its cut is this checkpoint
      if stopping:
        break
    _last_cut(run, done, state, data_error)
  except (NonFiniteLossError, WriteError) as e:
    raise _naming_last_good(e, ckpts) from (None if isinstance(e, NonFiniteLossError) else e)
  except ConnectionError as e:
    # A PS server is lost: wake a prefetcher waiting for pushes that will not come and end the
    # other calls in flight, so that the threads below stop at once.
    gate.abort(e)
    ps.close()
    raise
  finally:
    _wind_down(run)
  train_end = time.perf_counter()

  distributed.barrier("final eval")
  ev = evaluate(state, job.eval_step, host, config)
  ps_stats = ps.stats()
  ps.close()
  return _finish(run, ev, ps_stats, train_end, done)
