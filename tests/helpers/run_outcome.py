"""What a training run leaves behind, read back for comparisons: summary, losses, dense weights, PS rows."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from recsys_jax.async_ps.snapshot import directory as snapshot


def checkpoint_contents(c, workdir, step):
  """(dense parameters, every PS row sorted by id) of the checkpoint after ``step``, restored into a
  fresh job built from ``c`` (its own PS; ``c`` may differ from the run's, e.g. in its hot budget)."""
  import jax

  from recsys_jax import checkpoint as checkpoint_lib
  from recsys_jax import train

  job = train.build_job(c, os.path.join(workdir, f"probe_{step}"))
  ckpt = checkpoint_lib.Checkpointer(workdir)
  state, _ = ckpt.restore(step, job.state, job.ps)
  ckpt.close()
  params = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(state.params)[0]}
  rows = {}
  for t, part in job.ps.snapshot().items():
    order = np.argsort(part["ids"])
    rows[t] = {k: v[order] for k, v in part.items()}
  job.ps.close()
  return params, rows


def outcome(c, workdir):
  """What a run leaves: its summary, logged losses, final dense parameters and every PS row."""
  from recsys_jax import train

  log = os.path.join(workdir, "metrics.jsonl")
  before = os.path.getsize(log) if os.path.exists(log) else 0
  s = train.train_and_evaluate(c, workdir)
  with open(log) as f:
    f.seek(before)  # what this run logged
    losses = [(r["step"], r["loss"]) for r in map(json.loads, f) if r["kind"] == "train"]
  params, rows = checkpoint_contents(c, workdir, c.num_steps)
  keep = ("auc", "logloss", "eval_samples", "bad_records_skipped", "bad_record_examples", "ps_rows")
  return {k: s[k] for k in keep}, losses, params, rows


def preempted_copy(src, dst, step):
  """A copy of a finished run's workdir as a run preempted just after its checkpoint at ``step``."""
  shutil.copytree(src, dst)
  for name in os.listdir(os.path.join(dst, "checkpoints")):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(os.path.join(dst, "checkpoints", name))
  for name in os.listdir(os.path.join(dst, "ps_snapshots")):
    if int(name.split("-")[0]) > step:
      shutil.rmtree(os.path.join(dst, "ps_snapshots", name))


def snapshot_rows(workdir, step=None):
  """Every table's rows at the last checkpoint (or at ``step``), folded from its PS snapshot
  chain (the last full snapshot and the incremental ones after it), sorted by id."""
  names = sorted(os.listdir(os.path.join(workdir, "ps_snapshots")))
  if step is not None:
    names = [n for n in names if int(n.split("-")[0]) <= step]
  last_full = max(i for i, n in enumerate(names) if n.endswith("-full"))
  tables = {}
  for name in names[last_full:]:
    for table, arrays in snapshot.read(os.path.join(workdir, "ps_snapshots", name)).items():
      rows = tables.setdefault(table, {})
      for i in arrays.get("deleted", []):
        rows.pop(int(i), None)
      for j, i in enumerate(arrays["ids"]):
        rows[int(i)] = {k: v[j] for k, v in arrays.items() if k not in ("ids", "deleted")}
  out = {}
  for table, rows in tables.items():
    ids = np.array(sorted(rows), np.uint64)
    keys = sorted({k for r in rows.values() for k in r})
    out[table] = {"ids": ids, **{k: np.stack([rows[int(i)][k] for i in ids]) for k in keys}}
  return out
