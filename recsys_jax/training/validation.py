"""Config values checked before anything is built, and the dense optimizer they name.

``validate_config`` raises one ValueError naming the first field with a wrong value
(``config.<field> = <value>: <what is allowed>``), so a typo fails before any compile.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections import abc
from typing import Any, Callable, Dict, Tuple

import ml_collections
import optax

from recsys_jax import models
from recsys_jax.data import readers

# The type of every field of configs/default.py that something reads (ml_collections lets None
# and bools through its own type check). A field absent from a config is not checked.
_INTS = (
  "seed num_steps batch_size staleness dense_staleness prefetch_depth log_every checkpoint_every max_checkpoints "
  "checkpoint_full_every eval_every eval_samples eval_batch_size micro_steps data.seed data.chunk_records "
  "data.shuffle_window data.max_history data.max_genres data.num_dense data.num_pairs data.teacher_dim embeddings.dim "
  "embeddings.capacity embeddings.expire_after embeddings.admit_after ps.num_shards ps.threads mesh.replica mesh.fsdp "
  "ps.read_ahead ps.read_ahead_rows "
  "hot_rows_bytes hot_warmup_steps hot_every hot_min_count hot_count_every progressive.window data.drift_records data.eval_at_record"
).split()
# Sizes of arrays, or indices into them, that the jitted step holds as int32.
_INT32 = "batch_size eval_batch_size micro_steps data.chunk_records embeddings.dim data.num_dense".split()
_FLOATS = (
  "optimizer.learning_rate embeddings.learning_rate embeddings.initial_accumulator_value embeddings.init_scale "
  "embeddings.clip embeddings.admit_probability ps.timeout_s ps.snapshot_timeout_s data.eval_fraction data.zipf_alpha "
  "data.bias data.dense_scale data.id_scale data.pair_scale data.stream_poll_s data.stream_idle_exit_s "
  "publish_every_s publish_dense_every_s"
).split()
_BOOLS = "progress_bar final_checkpoint place_pinned_host data.shuffle".split()
_MAX_DENSE_STALENESS = 1024
_STRS = (
  "device_step data.name data.stream_dir data.on_bad_record data.label data.dense_transform data.delimiter data.path data.split "
  "embeddings.optimizer embeddings.initializer embeddings.combiner embeddings.storage_dtype embeddings.eviction "
  "publish_dir ps.tier ps.kind ps.addresses ps.token_file ps.tls_ca ps.wire_dtype model.name optimizer.name optimizer.state_memory"
).split()
_SEQUENCES = "data.train_files data.eval_files data.dense data.categorical data.multi_hot data.sequence".split()


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _check_types(config, need) -> None:
  """Each field is of its type before any value is compared (None > 0 is a TypeError)."""
  present = lambda f: _has(config, f)  # noqa: E731
  for f in filter(present, _INTS):
    v = _get(config, f)
    need(_is_int(v), f, "must be an integer")
    need(-(2**63) <= v < 2**63, f, "must fit in int64")
  for f in filter(present, _INT32):
    need(_get(config, f) < 2**31, f, "must be below 2**31 (device arrays index it with int32)")
  for f in filter(present, _FLOATS):
    v = _get(config, f)
    need((_is_int(v) or isinstance(v, float)) and math.isfinite(v), f, "must be a finite number")
  if _has(config, "data.label_threshold"):
    v = config.data.label_threshold
    need(
      v is None or ((_is_int(v) or isinstance(v, float)) and math.isfinite(v)),
      "data.label_threshold",
      "must be None or a finite number",
    )
  for f in filter(present, _BOOLS):
    need(isinstance(_get(config, f), bool), f, "must be True or False")
  for f in filter(present, _STRS):
    need(isinstance(_get(config, f), str), f, "must be a string")
  for f in filter(present, _SEQUENCES):
    need(isinstance(_get(config, f), (str, tuple, list)), f, "must be a tuple")
  if _has(config, "data.vocab_sizes"):
    v = config.data.vocab_sizes
    need(
      isinstance(v, (tuple, list)) and len(v) > 0 and all(_is_int(x) and 0 < x < 2**63 for x in v),
      "data.vocab_sizes",
      "must be a non-empty tuple of positive integers",
    )


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first config field with a wrong value."""

  def need(ok: bool, field: str, msg: str) -> None:
    if not ok:
      raise ValueError(f"config.{field} = {_get(config, field)!r}: {msg}")

  _check_types(config, need)
  need(config.seed >= 0 and config.data.seed >= 0, "seed" if config.seed < 0 else "data.seed", "must be >= 0")
  need(config.num_steps >= -1, "num_steps", "must be >= 0, or -1 (until stopped)")
  if _has(config, "data.stream_poll_s"):
    need(config.data.stream_poll_s > 0, "data.stream_poll_s", "must be > 0 (seconds between listings)")
    need(config.data.stream_idle_exit_s >= 0, "data.stream_idle_exit_s", "must be >= 0 (0: wait for files forever)")
  need(config.batch_size > 0, "batch_size", "must be positive")
  need(config.staleness >= 0, "staleness", "must be >= 0 (0 = synchronous)")
  need(config.dense_staleness >= 0, "dense_staleness", "must be >= 0 (0 = synchronous dense part)")
  need(
    config.dense_staleness <= _MAX_DENSE_STALENESS,
    "dense_staleness",
    f"must be <= {_MAX_DENSE_STALENESS}: the step keeps that many dense gradients on the device",
  )
  if _has(config, "data.num_dense"):
    need(config.data.num_dense >= 0, "data.num_dense", "must be >= 0 (the dense features a record has)")
  rules = config.mesh.rules
  need(
    isinstance(rules, (tuple, list))
    and all(
      isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str) and r[1] in ("fsdp", None) for r in rules
    ),
    "mesh.rules",
    "pairs (logical axis, 'fsdp' or None): dense parameters are sharded inside a group and replicated across",
  )
  need(config.micro_steps >= 1, "micro_steps", "must be >= 1 (1 = no gradient accumulation)")
  need(config.prefetch_depth >= 1, "prefetch_depth", "must be >= 1")
  need(
    isinstance(config.host_workers, int) and config.host_workers >= -1,
    "host_workers",
    "must be an integer >= -1 (-1: one per core; 0: read and dedup on the prefetcher thread)",
  )
  if _has(config, "hot_rows_bytes"):
    need(config.hot_rows_bytes >= 0, "hot_rows_bytes", "must be >= 0 (0: no hot rows on the device)")
    need(config.hot_warmup_steps >= 0, "hot_warmup_steps", "must be >= 0")
    need(config.hot_every >= 0, "hot_every", "must be >= 0 (0: choose the hot set once, after the warm-up)")
    need(config.hot_min_count >= 1, "hot_min_count", "must be >= 1")
    if "hot_count_every" in config:
      need(config.hot_count_every >= 1, "hot_count_every", "must be >= 1 (1: count every step's ids)")
    per_table = config.hot_rows_per_table
    need(
      isinstance(per_table, (dict, ml_collections.ConfigDict))
      and all(_is_int(v) and v >= 0 for v in dict(per_table).values()),
      "hot_rows_per_table",
      "must map table names to row counts >= 0 (0: never hot)",
    )
  need(config.log_every > 0, "log_every", "must be positive")
  need(config.checkpoint_every >= 0, "checkpoint_every", "must be >= 0 (0 = only at the end)")
  if _has(config, "publish_every_s"):
    need(config.publish_every_s >= 0, "publish_every_s", "must be >= 0 (seconds; 0 = no row deltas for serving)")
    need(config.publish_dense_every_s >= 0, "publish_dense_every_s", "must be >= 0 (seconds; 0 = never)")
    need(
      config.publish_every_s == 0 or config.checkpoint_every > 0,
      "publish_every_s",
      "needs config.checkpoint_every > 0: the deltas on disk are pruned once checkpoints cover them",
    )
  need(config.eval_every >= 0, "eval_every", "must be >= 0 (0 = only at the end)")
  need(config.eval_batch_size > 0, "eval_batch_size", "must be positive")
  if config.data.name == "synthetic":
    need(config.eval_samples >= config.eval_batch_size, "eval_samples", "must be >= eval_batch_size")
  if _has(config, "device_step"):
    need(
      config.device_step in ("model", "none", "score"),
      "device_step",
      "choose 'model', 'none' (no training: zero row gradients) or 'score' (score each batch, update nothing)",
    )
  if _has(config, "progressive.window"):
    need(config.progressive.window >= 0, "progressive.window", "must be >= 0 (events; 0 = off)")
  for f in ("data.drift_records", "data.eval_at_record"):
    if _has(config, f):
      need(_get(config, f) >= 0, f, "must be >= 0 (records; 0 = none)")
  known = models.names()
  need(config.model.name in known, "model.name", f"unknown model; choose one of {known}")
  _check_model_kwargs(config)
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
  if "threads" in config.ps:
    need(config.ps.threads == -1 or config.ps.threads >= 1, "ps.threads", "must be >= 1, or -1 for the core count")
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
  if "read_ahead" in config.ps:
    need(config.ps.read_ahead >= 0, "ps.read_ahead", "must be >= 0 (steps; 0 = off)")
    need(config.ps.read_ahead_rows >= 0, "ps.read_ahead_rows", "must be >= 0 (0: half the capacity)")


def _accepts(annotation) -> Tuple[Callable[[Any], bool], str]:
  """What a value of a model argument annotated ``annotation`` must be, and its description: widths
  and counts are int32 on the device, a sequence of integers holds widths (positive)."""
  origin, args = typing.get_origin(annotation), typing.get_args(annotation)
  if annotation is bool:
    return (lambda v: isinstance(v, bool)), "True or False"
  if annotation is int:
    return (lambda v: _is_int(v) and 0 <= v < 2**31), "an integer >= 0"
  if annotation is float:
    return (lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v)), "a finite number"
  if annotation is str:
    return (lambda v: isinstance(v, str)), "a string"
  if origin is typing.Union and type(None) in args and len(args) == 2:
    inner, what = _accepts(next(a for a in args if a is not type(None)))
    return (lambda v: v is None or inner(v)), f"None or {what}"
  if origin in (abc.Sequence, tuple, list) and args and args[0] in (int, str) and set(args) <= {args[0], ...}:
    if args[0] is int:
      return (lambda v: isinstance(v, (tuple, list)) and all(_is_int(x) and 0 < x < 2**31 for x in v)), (
        "a tuple of positive integers"
      )
    return (lambda v: isinstance(v, (tuple, list)) and all(isinstance(x, str) for x in v)), "a tuple of strings"
  shown = annotation.__name__ if isinstance(annotation, type) else annotation
  return (lambda v: False), f"of type {shown}, which a config cannot give"


def _check_model_kwargs(config) -> None:
  """Every ``config.model.kwargs`` entry is an argument of the model (one of its dataclass fields),
  of that field's type; a required argument is given."""
  takes = models.arguments(config.model.name)
  kwargs = dict(config.model.kwargs)
  for k, v in kwargs.items():
    if k not in takes:
      raise ValueError(
        f"config.model.kwargs.{k}: model {config.model.name!r} takes no such argument; it takes {sorted(takes)}"
      )
    ok, what = _accepts(takes[k].type)
    if not ok(v):
      shown = v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v  # one line, not its YAML
      raise ValueError(f"config.model.kwargs.{k} = {shown!r}: must be {what}")
  for k, arg in takes.items():
    if arg.default is dataclasses.MISSING and k not in kwargs:
      raise ValueError(f"config.model.kwargs.{k}: model {config.model.name!r} needs it (it has no default)")


def _get(config, dotted: str):
  for part in dotted.split("."):
    config = config[part]
  return config


def _has(config, dotted: str) -> bool:
  for part in dotted.split("."):
    if not hasattr(config, "keys") or part not in config:
      return False
    config = config[part]
  return True


_DENSE_OPTIMIZERS: Dict[str, Callable[[float], optax.GradientTransformation]] = {
  "adam": optax.adam,
  "adagrad": optax.adagrad,
  "sgd": optax.sgd,
}


def dense_optimizer(config) -> optax.GradientTransformation:
  """The optax optimizer of the dense parameters named by ``config.optimizer``."""
  return _DENSE_OPTIMIZERS[config.optimizer.name](config.optimizer.learning_rate)
