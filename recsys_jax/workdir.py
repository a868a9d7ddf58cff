"""The layout of a run's directory (its workdir): the one place its names are spelled.

A trainer writes, and ``serve`` and ``build_job`` read::

  <workdir>/config.json                  the run's config (training/run_config.py)
  <workdir>/checkpoints/<step>/          orbax: state/ (dense), meta/metadata (JSON: PS chain, reader...)
  <workdir>/checkpoint_parts/<step>/     files a checkpoint holds beside orbax (the hot set), written first
  <workdir>/checkpoints_damaged/         checkpoints that failed to read back, set aside, never deleted
  <workdir>/ps_snapshots/<name>/         PS snapshots; a checkpoint's meta names its chain of them
  <workdir>/metrics.jsonl, summary.json  the run's records and its last word
  <workdir>/trainer_p<i>.log             process i's tracebacks (the console gets one line)
  <workdir>/data_cache/                  the parsed-data cache, unless config.data.cache_dir says otherwise
  <workdir>/serving_held/<host>-<pid>/   what the versions a model server holds keep from rotation
  <workdir>/publish/                     rows and dense parameters published between checkpoints
                                         (config.publish_dir; async_ps/snapshot/published.py)
"""

from __future__ import annotations

import os

CHECKPOINTS = "checkpoints"
CHECKPOINT_PARTS = "checkpoint_parts"
CHECKPOINTS_DAMAGED = "checkpoints_damaged"
PS_SNAPSHOTS = "ps_snapshots"
META_FILE = os.path.join("meta", "metadata")  # orbax writes the item "meta" there
CONFIG = "config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
DATA_CACHE = "data_cache"
SERVING_HELD = "serving_held"


def checkpoints(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), CHECKPOINTS)


def checkpoint(workdir: str, step: int) -> str:
  return os.path.join(checkpoints(workdir), str(step))


def checkpoint_meta(workdir: str, step: int) -> str:
  return os.path.join(checkpoint(workdir, step), META_FILE)


def checkpoints_damaged(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), CHECKPOINTS_DAMAGED)


def all_checkpoint_parts(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), CHECKPOINT_PARTS)


def checkpoint_parts(workdir: str, step: int) -> str:
  return os.path.join(all_checkpoint_parts(workdir), str(step))


def ps_snapshots(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), PS_SNAPSHOTS)


def trainer_log(workdir: str, process_id: int) -> str:
  return os.path.join(os.path.abspath(workdir), f"trainer_p{process_id}.log")
