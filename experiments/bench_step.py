"""The main job's jitted train step alone: the formulation before issue 14's change against the current one.

    python experiments/bench_step.py [--batch_size=8192] [--bottom=16] [--top=16] [--repeats=15]
        [--config=configs/dlrm.py]

Run from the repository root. Builds the job of ``--config`` (default ``configs/dlrm.py``:
Criteo's shape, 13 dense and 26 categorical fields, rows of dim 16) with bottom and top MLPs of
width ``--bottom`` / ``--top`` (16: ``bench_feed.py``'s tiny step; 0 keeps the config's), takes
one synthetic batch through the host half (dedup, PS lookup, placement) and times the jitted
train step on it, blocking on each, in four variants alternated round-robin in one process so
that they see the same machine load:

- ``old``: DLRM's dot interaction by autodiff of ``einsum(t, t)[:, i, j]`` and the pooled
  features split off by slicing ``p[:, k]`` (the code before the change);
- ``old_interaction``, ``old_split``: one of the two old;
- ``new``: the current code (``models.dlrm.dot_interaction``'s hand-written gradient,
  ``jnp.unstack``).

Every variant starts from the same state and batch; the script checks that their row gradients,
loss and updated parameters agree with ``old``'s to float32 round-off (and prints the largest
differences). Prints one JSON line per variant: median ``step_ms`` over ``--repeats`` rounds,
``vs_old`` (its median / old's), ``load_avg`` before and after.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from recsys_jax.embeddings import pooling
from recsys_jax.models import dlrm
from recsys_jax.training import job as job_lib

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = config_flags.DEFINE_config_file("config", os.path.join(_ROOT, "configs", "dlrm.py"), "The job's config.")
_BATCH = flags.DEFINE_integer("batch_size", 8192, "Batch size.")
_BOTTOM = flags.DEFINE_integer("bottom", 16, "Width of the one bottom MLP layer (0: the config's MLPs).")
_TOP = flags.DEFINE_integer("top", 16, "Width of the one top MLP hidden layer (0: the config's MLPs).")
_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed rounds (each runs every variant once).")


def old_dot_interaction(t):
  """The interaction before the change: autodiff of the pair selection (a scatter-add backward)."""
  i, j = jnp.triu_indices(t.shape[1], k=1)
  return jnp.einsum("bfd,bgd->bfg", t, t)[:, i, j]


def old_embed_features(rows, inverse, weights, features):
  """embed_features before the change, for one-hot pooled features only (the benchmark's)."""
  assert all(kind == "pooled" for _, kind, _ in features)
  p = pooling.pool(rows, inverse, weights)
  return {name: p[:, k] for k, (name, _, _) in enumerate(features)}, {}


def main(_):
  logging.set_verbosity(logging.WARNING)
  c = _CONFIG.value
  c.batch_size, c.host_workers = _BATCH.value, 0
  c.hot_rows_bytes = 0  # the step's dense and pooling code is what is compared: every row from the PS
  if _BOTTOM.value:
    c.model.kwargs.bottom = (_BOTTOM.value,)
  if _TOP.value:
    c.model.kwargs.top = (_TOP.value,)
  job = job_lib.build_job(c, tempfile.mkdtemp(prefix="bench_step_"))
  host = job.host
  batches = iter(host.reader.train())
  next(batches)  # the second batch: the PS already holds some of its rows, as in a run
  batch, position = next(batches)
  _, rows, placed = host.place(host.lookup(host.prepare(1, batch, position), create=True))

  new_interaction, new_embed = dlrm.dot_interaction, pooling.embed_features
  variants = {
    "old": (old_dot_interaction, old_embed_features),
    "old_interaction": (old_dot_interaction, new_embed),
    "old_split": (new_interaction, old_embed_features),
    "new": (new_interaction, new_embed),
  }
  steps, outs, states = {}, {}, {}
  for name, (interaction, embed) in variants.items():
    dlrm.dot_interaction, pooling.embed_features = interaction, embed  # read while tracing
    fresh = job_lib.build_job(c, tempfile.mkdtemp(prefix="bench_step_"))  # its own jit, traced now
    states[name], _, g, m = fresh.train_step(
      fresh.state, fresh.hot.tables, rows, placed
    )  # the same seed: the same initial state
    outs[name] = jax.tree.map(np.asarray, (states[name].params, g, m))
    fresh.ps.close()
    steps[name] = fresh.train_step
  dlrm.dot_interaction, pooling.embed_features = new_interaction, new_embed

  ref = outs["old"]
  for name, out in outs.items():
    diff = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6))), out, ref)
    worst = max(jax.tree.leaves(diff))
    print(f"{name}: largest relative difference from old {worst:.2e} (params, row grads, loss)")
    assert worst < 1e-4, (name, diff)

  load0 = os.getloadavg()[0]
  times = {k: [] for k in steps}
  for r in range(_REPEATS.value + 2):
    for name, step in steps.items():
      t0 = time.perf_counter()
      states[name], _, g, _ = step(states[name], {}, rows, placed)
      jax.block_until_ready((states[name], g))
      if r >= 2:
        times[name].append(time.perf_counter() - t0)
  base = np.median(times["old"])
  for name, ts in times.items():
    med = float(np.median(ts))
    print(
      json.dumps(
        {
          "variant": name,
          "step_ms": round(1e3 * med, 2),
          "vs_old": round(med / base, 3),
          "runs_ms": [round(1e3 * t, 1) for t in ts],
          "batch": c.batch_size,
          "bottom": list(c.model.kwargs.bottom),
          "top": list(c.model.kwargs.top),
          "load_avg": [load0, os.getloadavg()[0]],
        }
      )
    )
  job.ps.close()


if __name__ == "__main__":
  app.run(main)
