"""Builds everything a run is made of from its config: reader, specs, PS, mesh, model,
jitted steps and the initial dense state (``build_job``; nothing runs)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import jax
import ml_collections
from flax.training import train_state

from recsys_jax import models
from recsys_jax import workdir as workdir_lib
from recsys_jax.async_ps import factory
from recsys_jax.async_ps.protocol import RowStore
from recsys_jax.data import readers
from recsys_jax.embeddings.specs import FeatureSpec, TableSpec
from recsys_jax.online import progressive
from recsys_jax.parallel import mesh as mesh_lib
from recsys_jax.training import steps as steps_lib
from recsys_jax.training.feed import worker_count
from recsys_jax.training.host import HostPipeline
from recsys_jax.training.hot_rows import HotRows
from recsys_jax.training.run_checkpoints import RunCheckpoints
from recsys_jax.training.specs import build_specs
from recsys_jax.training.steps import init_state, make_eval_step, make_train_step, state_specs
from recsys_jax.training.writers import say


@dataclasses.dataclass
class Job:
  """Everything a run is made of, built from the config (``build_job``)."""

  reader: Any
  tables: List[TableSpec]
  features: List[FeatureSpec]
  mesh: jax.sharding.Mesh
  model: Any
  ps: RowStore
  host: HostPipeline
  train_step: Callable
  """jitted (state, hot, rows, batch) -> (state, hot, row grads, metrics); donates the state and hot."""
  eval_step: Callable
  """jitted (params, rows, batch) -> logits."""
  state: train_state.TrainState
  """The initial dense train state, replicated over the mesh."""
  traces: Dict[str, int]
  """How many times each step function has been traced."""
  hot: HotRows
  """The hot rows kept on the device, with their device tables (``hot.tables``; ``hot.enabled``
  False: ``config.hot_rows_bytes`` buys none)."""
  step: int = 0
  """The step the state and PS rows are at: 0 for a fresh job, else the checkpoint's restored by ``build_job``."""


def build_ps(config: ml_collections.ConfigDict, tables: Sequence[TableSpec], workdir: Optional[str] = None) -> RowStore:
  """The PS ``config.ps`` asks for, for this trainer process (``recsys_jax.async_ps.factory.build_ps``)."""
  return factory.build_ps(config, tables, workdir, process_index=jax.process_index(), process_count=jax.process_count())


def build_job(config: ml_collections.ConfigDict, workdir: Optional[str] = None, restore: bool = True) -> Job:
  """Builds reader, PS, model, mesh, jitted steps and the state (nothing runs).

  ``workdir`` anchors a relative ``config.ps.tier`` path and holds the data cache (``config.data.cache_dir``).
  If it holds a checkpoint (a trained run's workdir) and ``restore`` is True, the job is that run's: the
  newest intact checkpoint's dense state, PS rows and hot set are loaded (one line says which), so
  ``evaluate(job.state, job.eval_step, job.host, config)`` scores the trained model. ``restore=False``
  builds a fresh, untrained job whatever the workdir holds.

  Raises:
    ValueError: a checkpoint written with another batch size, data set or number of trainer processes.
    CheckpointError: the workdir has checkpoints and none of them can be read.
  """
  reader = readers.build_reader(config, jax.process_index(), jax.process_count(), workdir)
  model_cls = models.get(config.model.name)
  tables, features, aliases = build_specs(config, reader.schema, getattr(model_cls, "linear_terms", False))
  tables_by_name = {t.name: t for t in tables}
  n_dev = jax.device_count()
  for field, n in (("batch_size", n_dev * config.micro_steps), ("eval_batch_size", n_dev)):
    if config[field] % n:
      what = f"{n_dev} devices x {config.micro_steps} micro_steps" if field == "batch_size" else f"{n_dev} devices"
      raise ValueError(f"config.{field} = {config[field]} is not divisible by the {what}")
  mesh = mesh_lib.make_mesh(config.mesh.replica, config.mesh.fsdp)
  model = model_cls(**config.model.kwargs)
  ps = build_ps(config, tables, workdir)
  multi = jax.process_count() > 1
  # Several processes evaluate on their own devices, each its share of the eval set.
  eval_mesh = mesh_lib.make_mesh(-1, 1, jax.local_devices()) if multi else mesh
  workers = worker_count(config.host_workers)
  pinned = bool(config.place_pinned_host)
  host = HostPipeline(reader, ps, features, tables_by_name, mesh, aliases, eval_mesh, workers, pinned_host=pinned)
  group_features = steps_lib.group_features(features, tables_by_name)
  traces: Dict[str, int] = {}
  repl = mesh_lib.replicated(mesh)
  hot = HotRows(config, tables_by_name, features, mesh)
  host.hot = hot if hot.enabled else None
  with jax.transfer_guard("allow"):  # one-off setup; the step loop itself moves data explicitly
    state, state_shardings, on_device = init_state(config, model, reader.schema, features, tables_by_name, mesh)
    hot.init_state()
  rows_out = mesh_lib.data_sharding(mesh) if multi else repl
  train_step = jax.jit(
    make_train_step(
      model,
      group_features,
      traces,
      mesh,
      state_specs(state_shardings),
      config.micro_steps,
      on_device,
      rows_per_device=multi,
      hot_opts=hot.device_opts(),
      predictions=progressive.window_of(config) > 0,  # progressive validation scores each batch
      update=config.device_step != "score",
    ),
    donate_argnums=(0, 1),
    out_shardings=(state_shardings, repl, rows_out, repl),
  )
  if config.device_step == "none":  # the host pipeline alone (configs/default.py)
    train_step = jax.jit(
      steps_lib.no_train_step, donate_argnums=(0, 1), out_shardings=(state_shardings, repl, rows_out, repl)
    )
  eval_step = jax.jit(make_eval_step(model, group_features, traces), out_shardings=mesh_lib.replicated(eval_mesh))
  job = Job(reader, tables, features, mesh, model, ps, host, train_step, eval_step, state, traces, hot)
  ckpt_dir = None if workdir is None else workdir_lib.checkpoints(workdir)
  if restore and ckpt_dir is not None and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
    _restore(job, config, workdir)
  return job


def _restore(job: Job, config: ml_collections.ConfigDict, workdir: Optional[str]) -> None:
  """Loads the newest intact checkpoint of ``workdir`` into ``job`` (as a resumed run starts)."""
  assert workdir is not None
  ckpts = RunCheckpoints(workdir, config)
  try:
    state, start, _ = ckpts.restore_latest(job.state, job.ps, announce=False)
    if ckpts.latest is None:
      return
    job.state, job.step = state, start
    job.hot.resume(start, ckpts.latest_part(job.hot.state_name()), job.ps)
    say(
      f"build_job: restored {ckpts.latest_dir()} (step {start}): dense state and PS rows; restore=False for a fresh job"
    )
  finally:
    ckpts.close()
