"""Training and evaluation through the host parameter server: the loop.

One step of data flows one way:
  reader -> dedup per table -> PS lookup (k steps ahead, prefetcher thread)
  -> device_put -> jitted train_step (dense update + row gradients) -> pusher thread -> PS.

``train_and_evaluate(config, workdir)`` is the whole job; ``main.py`` only parses flags. The
parts it is assembled from live in :mod:`recsys_jax.training` (one module each); the names
below are re-exported so ``from recsys_jax import train; train.build_job(...)`` keeps working.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Dict, Optional

import ml_collections

from recsys_jax.async_ps.factory import parse_kvstore
from recsys_jax.parallel import distributed
from recsys_jax.training import run_config
from recsys_jax.training.evaluation import evaluate
from recsys_jax.training.host import HostPipeline, NonFiniteLossError, Prepared
from recsys_jax.training.job import Job, build_job, build_ps
from recsys_jax.training.pipeline import Aborted, Pusher, StalenessGate
from recsys_jax.training.publish import Publisher
from recsys_jax.training.run_checkpoints import RunCheckpoints
from recsys_jax.training.specs import build_specs
from recsys_jax.training.steps import AsyncDenseState, make_eval_step, make_train_step
from recsys_jax.training.validation import dense_optimizer, validate_config
from recsys_jax.training.writers import MetricsCallback, Progress, format_summary, read_metrics, say

__all__ = [
  "AsyncDenseState",
  "HostPipeline",
  "Job",
  "NonFiniteLossError",
  "Prepared",
  "build_job",
  "build_ps",
  "build_specs",
  "dense_optimizer",
  "evaluate",
  "format_summary",
  "make_eval_step",
  "make_train_step",
  "parse_kvstore",
  "read_metrics",
  "train_and_evaluate",
  "validate_config",
]


def _due(every: int, done: int, last: int) -> bool:
  """Whether an every-N-steps action falls on step ``done`` (the last step has its own)."""
  return bool(every) and done % every == 0 and done != last


def _last_cut(config, ckpts: RunCheckpoints, state, ps, pusher: Pusher, hot_rows, publisher: Publisher) -> None:
  """After the last step: its checkpoint, or with ``config.final_checkpoint`` False none, but every
  push applied and the hot rows back in the PS, which the final evaluation reads; the last rows and
  dense parameters published for serving."""
  if config.get("final_checkpoint", True):
    ckpts.save(config.num_steps, state, ps, pusher, hot_rows)
  else:
    pusher.flush(config.num_steps - 1)
    hot_rows[0].write_back(hot_rows[1], ps)
  publisher.publish(config.num_steps, state, hot_rows[1], pusher, dense=True)
  publisher.close()


def _resume(config, workdir: str, job: Job):
  """The run's checkpoints and its start: ``(ckpts, dense state, first step, reader position, hot
  tables, publisher)``, from the newest intact checkpoint (a config its checkpoints do not fit is
  named) or fresh; the publisher of rows for serving (``config.publish_every_s``) starts there."""
  ckpts = RunCheckpoints(workdir, config)
  state, start, position = ckpts.restore_latest(job.state, job.ps)
  run_config.record(workdir, config, say)  # once restored: it names the config (a scorer rebuilds the model)
  if start >= config.num_steps and ckpts.latest is not None:
    say(
      f"{ckpts.latest_dir()} is at step {start}, at or past num_steps={config.num_steps}: no step to train, the "
      "checkpoint is evaluated as it is (a new --workdir trains from the start; a larger --config.num_steps goes on)"
    )
  hot_state = job.hot.resume(start, ckpts.latest_part(job.hot.state_name()), job.ps, job.hot_state)
  publisher = Publisher(config, workdir, job.ps, job.hot, start)
  ckpts.after_save = publisher.checkpointed  # deltas two checkpoints cover are pruned
  return ckpts, state, start, position, hot_state, publisher


def _train_step(job: Job, progress: Progress, t: int, state, hot_state, rows, batch):
  """The jitted step of step ``t``; a call that compiled is timed apart (the throughput leaves it out)."""
  traced, t_call = job.traces.get("train", 0), time.perf_counter()
  out = job.train_step(state, hot_state, rows, batch)
  if job.traces.get("train", 0) > traced:
    progress.stats.compiled(t, t_call, time.perf_counter())
  return out


def train_and_evaluate(
  config: ml_collections.ConfigDict, workdir: str, on_metrics: Optional[MetricsCallback] = None
) -> Dict[str, Any]:
  """Trains (resuming from ``workdir`` if it holds a checkpoint), evaluates, writes a summary.

  Args:
    config: a config like ``configs/default.py``.
    workdir: where checkpoints, metrics.jsonl, TensorBoard events and summary.json go.
    on_metrics: called with every metrics.jsonl record as it is written (``writers.MetricsCallback``).

  Returns the summary dict (also written to ``<workdir>/summary.json``). Raises NonFiniteLossError
  if the loss becomes NaN or infinite (the last checkpoint is kept), ValueError for a bad config value.
  """
  t_start = time.perf_counter()
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  job = build_job(config, workdir, restore=False)  # restored below, where a resume checks the data position
  host, ps, n = job.host, job.ps, config.num_steps
  ckpts, state, start, position, hot_state, publisher = _resume(config, workdir, job)
  hot = job.hot
  gate = StalenessGate(last_applied=start - 1)
  pre = host.train_prefetcher(start, config, gate, position)
  progress = Progress(workdir, config, start, t_start, on_metrics)
  pusher = Pusher(lambda t, payload: progress.stats.record(t, host.push_step(t, payload)), gate)
  try:
    for t in range(start, n):
      hot_state = hot.before_step(t, hot_state, ps, pusher)  # re-chooses the hot rows at a boundary
      try:
        _, (p, rows, batch) = pre.get()
        ckpts.positions[t] = p.position
      except Aborted:
        pusher.check()  # the pusher's error (e.g. a NaN loss) is the one to report
        raise
      state, hot_state, g_rows, m = _train_step(job, progress, t, state, hot_state, rows, batch)
      done = t + 1
      save = _due(config.checkpoint_every, done, n)
      if save:
        gate.hold(done)  # the checkpoint's cut: no lookup of step `done` before its PS snapshot
      publisher.step(p, done, gate, save)  # records the ids pushed; holds the lookups if it publishes
      pusher.push(t, (p.groups, g_rows, m))
      publisher.cut(done, state, hot_state, pusher)  # if due: this cut's rows for serving, then the lookups go on
      progress.bar.update(1)
      if progress.log_due(done):
        pusher.flush(t)
        progress.log_train(done, pre, ps, hot, host.times)
      if _due(config.eval_every, done, n):
        pusher.flush(t)
        hot.write_back(hot_state, ps)  # evaluation reads the PS: the hot rows' current values go there
        distributed.barrier(f"eval at {done}")  # every trainer's pushes are in: the PS is one cut
        progress.log_eval(done, functools.partial(evaluate, state, job.eval_step, host, config))
      if save:
        try:
          ckpts.save(done, state, ps, pusher, (hot, hot_state))
        finally:
          gate.release()
    if n > start:
      _last_cut(config, ckpts, state, ps, pusher, (hot, hot_state), publisher)
  except NonFiniteLossError as e:
    raise NonFiniteLossError(f"{e}; the run stopped. Last good checkpoint: {ckpts.last_good()} (left intact)") from None
  except ConnectionError as e:
    # A PS server is lost: wake a prefetcher waiting for pushes that will not come and end the
    # other calls in flight, so that the threads below stop at once.
    gate.abort(e)
    ps.close()
    raise
  finally:
    progress.bar.close()
    publisher.close(quiet=True)
    hot.close()
    pre.close()
    pusher.close()
    ckpts.close()
  train_end = time.perf_counter()

  distributed.barrier("final eval")
  ev = evaluate(state, job.eval_step, host, config)
  ps_stats = ps.stats()
  ps.close()
  return progress.finish(ev, job, start, ckpts.latest is not None, ps_stats, train_end, hot)
