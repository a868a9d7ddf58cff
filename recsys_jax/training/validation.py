"""Config values checked before anything is built, and the dense optimizer they name.

``validate_config`` raises one ValueError naming the first field with a wrong value
(``config.<field> = <value>: <what is allowed>``), so a typo fails before any compile.
"""

from __future__ import annotations

from typing import Callable, Dict

import ml_collections
import optax

from recsys_jax.data import readers
from recsys_jax.models import MODELS


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first config field with a wrong value."""

  def need(ok: bool, field: str, msg: str) -> None:
    if not ok:
      raise ValueError(f"config.{field} = {_get(config, field)!r}: {msg}")

  need(config.num_steps >= 0, "num_steps", "must be >= 0")
  need(config.batch_size > 0, "batch_size", "must be positive")
  need(config.staleness >= 0, "staleness", "must be >= 0 (0 = synchronous)")
  need(config.dense_staleness >= 0, "dense_staleness", "must be >= 0 (0 = synchronous dense part)")
  need(
    all(len(r) == 2 and r[1] in ("fsdp", None) for r in config.mesh.rules),
    "mesh.rules",
    "pairs (logical axis, 'fsdp' or None): dense parameters are sharded inside a group and replicated across",
  )
  need(config.micro_steps >= 1, "micro_steps", "must be >= 1 (1 = no gradient accumulation)")
  need(config.prefetch_depth >= 1, "prefetch_depth", "must be >= 1")
  need(config.log_every > 0, "log_every", "must be positive")
  need(config.checkpoint_every >= 0, "checkpoint_every", "must be >= 0 (0 = only at the end)")
  need(config.eval_every >= 0, "eval_every", "must be >= 0 (0 = only at the end)")
  need(config.eval_batch_size > 0, "eval_batch_size", "must be positive")
  if config.data.name == "synthetic":
    need(config.eval_samples >= config.eval_batch_size, "eval_samples", "must be >= eval_batch_size")
  need(config.model.name in MODELS, "model.name", f"unknown model; choose one of {sorted(MODELS)}")
  need(config.data.name in readers.NAMES, "data.name", f"unknown data source; choose one of {readers.NAMES}")
  need(config.data.on_bad_record in ("error", "skip"), "data.on_bad_record", "choose 'error' or 'skip'")
  need(config.eval_samples >= 0, "eval_samples", "must be >= 0 (0: all of the eval files)")
  need(config.optimizer.name in _DENSE_OPTIMIZERS, "optimizer.name", f"choose one of {sorted(_DENSE_OPTIMIZERS)}")
  need(config.optimizer.learning_rate > 0, "optimizer.learning_rate", "must be positive")
  need(
    config.optimizer.state_memory in ("device", "pinned_host"),
    "optimizer.state_memory",
    "choose 'device' or 'pinned_host' (dense optimizer state in host memory, streamed for the update)",
  )
  need(config.embeddings.learning_rate > 0, "embeddings.learning_rate", "must be positive")
  need(config.embeddings.clip >= 0, "embeddings.clip", "must be >= 0 (0 = no clipping)")
  need(config.ps.num_shards >= 1, "ps.num_shards", "must be >= 1")
  need(config.ps.kind in ("local", "remote"), "ps.kind", "choose 'local' or 'remote' (gRPC PS servers)")
  need(
    config.ps.wire_dtype in ("float32", "bfloat16", "float16"), "ps.wire_dtype", "choose float32, bfloat16 or float16"
  )
  need(config.ps.timeout_s > 0, "ps.timeout_s", "must be positive")
  need(config.ps.snapshot_timeout_s >= 0, "ps.snapshot_timeout_s", "must be >= 0 (0: 10 x ps.timeout_s)")
  need(0 <= config.ps.max_request_mb < 2**20, "ps.max_request_mb", "must be in [0, 2**20) (0: the servers' limit)")
  need(config.checkpoint_full_every >= 1, "checkpoint_full_every", "must be >= 1 (1 = every snapshot full)")
  if config.ps.tier:
    need(config.embeddings.capacity > 0, "ps.tier", "a disk tier needs a bounded table: set config.embeddings.capacity")


def _get(config, dotted: str):
  for part in dotted.split("."):
    config = config[part]
  return config


_DENSE_OPTIMIZERS: Dict[str, Callable[[float], optax.GradientTransformation]] = {
  "adam": optax.adam,
  "adagrad": optax.adagrad,
  "sgd": optax.sgd,
}


def dense_optimizer(config) -> optax.GradientTransformation:
  """The optax optimizer of the dense parameters named by ``config.optimizer``."""
  return _DENSE_OPTIMIZERS[config.optimizer.name](config.optimizer.learning_rate)
