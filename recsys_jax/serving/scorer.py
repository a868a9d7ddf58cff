"""A scorer from a training workdir: its config, the newest intact checkpoint, its PS snapshot chain.

``load_scorer(workdir)`` rebuilds what the run was built from (``<workdir>/config.json``:
reader schema, table and feature specs, the model), restores the dense parameters of a
checkpoint through orbax (checked against their CRC32s, ``Checkpointer.read_dense``), and
serves the tables from the checkpoint's PS snapshot chain on demand
(``recsys_jax.serving.rows.snapshot_rows.SnapshotRows``), from files the version holds for as
long as it lives (``recsys_jax.serving.rows.held``: hard links under ``<workdir>/serving_held``,
so the trainer's rotation deleting the chain changes nothing it reads). The forward is the training eval step
(``recsys_jax.training.steps.make_eval_step``), jitted, so scores cannot drift from the
trainer's evaluation. Nothing the trainer wrote is changed, moved or deleted.

``newest_step(workdir)`` is cheap (a directory listing and a few small JSON files): the front
polls it to reload.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import jax
from absl import logging

from recsys_jax import checkpoint as checkpoint_lib
from recsys_jax import workdir as workdir_lib
from recsys_jax.async_ps.snapshot import chain as snapshot_chain
from recsys_jax.serving.batching import BatchScorer, LoadedCheckpoint
from recsys_jax.serving.encode import Encoder
from recsys_jax.serving.rows import held as held_lib
from recsys_jax.serving.rows.snapshot_rows import SnapshotRows, table_info
from recsys_jax.training import run_config

DEFAULT_CACHE_BYTES = 64 << 20


def _step_dirs(workdir: str) -> List[int]:
  d = workdir_lib.checkpoints(workdir)
  names = os.listdir(d) if os.path.isdir(d) else []
  return sorted((int(n) for n in names if n.isdigit()), reverse=True)


def read_meta(workdir: str, step: int) -> Dict[str, Any]:
  """Checkpoint ``step``'s meta, checked as the trainer checks it, and its PS chain checked complete.

  Raises:
    CheckpointError: naming the checkpoint, if it is incomplete or damaged.
  """
  path = workdir_lib.checkpoint(workdir, step)
  try:
    with open(workdir_lib.checkpoint_meta(workdir, step)) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise checkpoint_lib.CheckpointError(f"checkpoint {path}: meta cannot be read ({type(e).__name__}: {e})") from e
  if not isinstance(meta, dict) or not isinstance(meta.get("ps_chain"), list) or not meta["ps_chain"]:
    raise checkpoint_lib.CheckpointError(f"checkpoint {path}: meta is damaged (no PS snapshot chain)")
  if "meta_crc32" in meta and meta["meta_crc32"] != checkpoint_lib.meta_checksum(meta):
    raise checkpoint_lib.CheckpointError(f"checkpoint {path} is damaged: its meta does not match its checksum")
  if not os.path.isdir(os.path.join(path, "state")):
    raise checkpoint_lib.CheckpointError(f"checkpoint {path}: its dense state is missing")
  try:
    snapshot_chain.check_links(snapshot_chain.snapshot_parts(chain_paths(workdir, meta)))
  except (OSError, ValueError) as e:
    raise checkpoint_lib.CheckpointError(f"checkpoint {path}: its PS snapshot chain is incomplete ({e})") from e
  return meta


def chain_paths(workdir: str, meta: Dict[str, Any]) -> List[str]:
  return [os.path.join(workdir_lib.ps_snapshots(workdir), n) for n in meta["ps_chain"]]


def complete_steps(workdir: str) -> List[int]:
  """The checkpoints of ``workdir`` that are complete (a committed orbax step whose meta reads back
  and matches its CRC32, with every snapshot of its PS chain there), newest first.

  The dense arrays' CRC32s are checked by ``load_scorer``, which falls back to an older step
  if they fail (with ``step=None``); the server's reload skips such a step (``step_signature``).
  """
  out = []
  for step in _step_dirs(workdir):
    try:
      read_meta(workdir, step)
    except checkpoint_lib.CheckpointError:
      continue
    out.append(step)
  return out


def newest_step(workdir: str) -> Optional[int]:
  """The newest complete checkpoint of ``workdir`` (``complete_steps``), or None."""
  for step in _step_dirs(workdir):
    try:
      read_meta(workdir, step)
    except checkpoint_lib.CheckpointError:
      continue
    return step
  return None


def step_signature(workdir: str, step: int) -> Tuple[Tuple[str, int, int], ...]:
  """What changes when checkpoint ``step``'s files change (each file's path, size and mtime): a
  step that failed to load is tried again only then."""
  top = workdir_lib.checkpoint(workdir, step)
  out = []
  for d, _, files in os.walk(top):
    for f in files:
      st = os.stat(os.path.join(d, f))
      out.append((os.path.relpath(os.path.join(d, f), top), st.st_size, st.st_mtime_ns))
  return tuple(sorted(out))


class _Model:
  """What the config builds: schema, specs, model, eval step, and a dense state template."""

  def __init__(self, config):
    from recsys_jax import models
    from recsys_jax.parallel import mesh as mesh_lib
    from recsys_jax.training.specs import build_specs
    from recsys_jax.training.steps import group_features, init_state, make_eval_step

    self.config = config
    # The schema from the format alone: the training files need not be here any more.
    self.encoder = Encoder(run_config.to_dict(config.data))
    self.schema = self.encoder.schema
    model_cls = models.get(config.model.name)
    self.tables, self.features, self.aliases = build_specs(
      config, self.schema, getattr(model_cls, "linear_terms", False)
    )
    self.model = model_cls(**config.model.kwargs)
    by_name = {t.name: t for t in self.tables}
    mesh = mesh_lib.make_mesh(1, 1, jax.devices()[:1])
    cfg = config.copy_and_resolve_references()
    with cfg.unlocked():
      cfg.optimizer.state_memory = "device"  # the template's placement only; the values come from the checkpoint
    with jax.transfer_guard("allow"):
      self.template, _, _ = init_state(cfg, self.model, self.schema, self.features, by_name, mesh)
    self.group_features = group_features(self.features, by_name)
    self.traces: Dict[str, int] = {}
    self.eval_step = make_eval_step(self.model, self.group_features, self.traces)
    self.step_fn = jax.jit(self.eval_step)


_BUILT: Dict[str, Any] = {}  # workdir -> ((config as JSON, max_batch), _Model): the newest load's, for the next
_BUILT_LOCK = threading.Lock()


def _built(workdir: str, config, max_batch: int) -> "_Model":
  """The model ``config`` builds, the one the last load of ``workdir`` built if the config is the
  same: a reload then compiles nothing (the forward takes the parameters as an argument; building
  and compiling per version took most of a 4-9 s reload beside a running trainer)."""
  key = (config.to_json_best_effort(sort_keys=True), max_batch)  # max_batch: its traces count its shapes
  with _BUILT_LOCK:
    got = _BUILT.get(workdir)
    if got is not None and got[0] == key:
      return got[1]
  built = _Model(config)
  with _BUILT_LOCK:
    _BUILT[workdir] = (key, built)
  return built


def load_scorer(
  workdir: str,
  step: Optional[int] = None,
  cache_rows: Optional[int] = None,
  cache_bytes: Optional[int] = None,
  max_batch: int = 512,
  verify: bool = True,
) -> BatchScorer:
  """The scorer of checkpoint ``step`` of ``workdir`` (None: the newest intact one).

  Args:
    workdir: a training run's directory (with ``config.json``, ``checkpoints/``, ``ps_snapshots/``).
    step: a checkpoint step; None picks the newest one that is complete and reads back intact.
    cache_rows: rows of the tables held in RAM over all tables (instead of ``cache_bytes``).
    cache_bytes: RAM for cached rows (default 64 MiB); the index adds 16 bytes per id.
    max_batch: records scored at once (a power of two; batch buckets 1, 2, 4, ... max_batch).
    verify: check every snapshot array's CRC32 at load (one pass over the chain, one part in RAM).

  Returns:
    A ``recsys_jax.serving.batching.BatchScorer`` (``version`` ``"step-<step>"``) whose
    ``checkpoint`` (``recsys_jax.serving.batching.LoadedCheckpoint``) says what it was loaded
    from, and ``traces`` its forward compilations so far.

  Raises:
    FileNotFoundError: the workdir has no config or no checkpoint.
    CheckpointError: the requested checkpoint (or, with step None, every one) is damaged.
  """
  t0 = time.perf_counter()
  workdir = os.path.abspath(workdir)
  config = run_config.load(workdir)
  if step is None:
    steps = _step_dirs(workdir)
    if not steps:
      raise FileNotFoundError(f"{workdir} holds no checkpoint (checkpoints/<step>)")
  else:
    steps = [int(step)]
  built = _built(workdir, config, max_batch)
  if cache_bytes is None:
    width = max(t.dim for t in built.tables) * 4
    cache_bytes = DEFAULT_CACHE_BYTES if cache_rows is None else int(cache_rows) * width
  tables = {t.name: table_info(t) for t in built.tables}
  errors = []
  for s in steps:
    held = None
    try:
      names = read_meta(workdir, s)["ps_chain"]
      # Everything the version reads (its checkpoint and PS chain) is held (hard-linked) first
      # and read from there: a rotation after this point cannot touch it, one before fails here.
      # Its parts (the hot set) too: the checkpoint is read whole, and one missing a part is damaged.
      parts = workdir_lib.checkpoint_parts(workdir, s)
      held = held_lib.hold(
        [(workdir_lib.checkpoint(workdir, s), os.path.join(workdir_lib.CHECKPOINTS, str(s)))]
        + ([(parts, os.path.join(workdir_lib.CHECKPOINT_PARTS, str(s)))] if os.path.isdir(parts) else [])
        + [
          (p, os.path.join(workdir_lib.PS_SNAPSHOTS, os.path.basename(p)))
          for p in chain_paths(workdir, {"ps_chain": names})
        ],
        held_lib.hold_root(workdir),
        f"step-{s}",
      )
      snap = SnapshotRows(
        chain_paths(held, read_meta(held, s)), tables, int(config.seed), cache_bytes, verify=verify, owns=held
      )
      ckpt = checkpoint_lib.Checkpointer(held)
      try:
        state, _ = ckpt.read_dense(s, built.template)
      finally:
        ckpt.close()
    except (checkpoint_lib.CheckpointError, OSError, ValueError) as e:
      if held is not None:
        shutil.rmtree(held, ignore_errors=True)
      if not isinstance(e, checkpoint_lib.CheckpointError):
        e = checkpoint_lib.CheckpointError(f"checkpoint {s} of {workdir}: its PS snapshot chain: {e}")
      if step is not None:
        raise e from None
      logging.warning("serving: skipping checkpoint %d: %s", s, e)
      errors.append(str(e))
      continue
    break
  else:
    raise checkpoint_lib.CheckpointError(f"no checkpoint in {workdir} is intact: " + "; ".join(errors))
  params = jax.device_get(state.params)
  step_fn = built.step_fn

  def forward(rows, batch):
    return step_fn(params, rows, batch)["logits"]

  chain = tuple(chain_paths(workdir, {"ps_chain": names}))
  loaded = LoadedCheckpoint(
    workdir=workdir,
    step=s,
    chain=chain,
    params=params,
    config=config,
    schema=built.schema,
    table_specs=tuple(built.tables),
    model=built.model,
    eval_step=built.eval_step,
    step_fn=step_fn,
    encoder_data=run_config.to_dict(config.data),
    load_s=time.perf_counter() - t0,
  )
  scorer = BatchScorer(
    f"step-{s}",
    built.encoder,
    built.features,
    {t.name: t.dim for t in built.tables},
    built.aliases,
    snap,
    forward,
    max_batch,
    checkpoint=loaded,
    params=params,
    chain=chain,
    traces=built.traces,
  )
  scorer.dense_version = scorer.row_version = s
  return scorer
