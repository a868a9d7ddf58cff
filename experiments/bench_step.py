"""The main job's jitted train step alone: DLRM's current interaction and feature split against the
formulation they replaced.

    python experiments/bench_step.py [--batch_size=8192] [--bottom=16] [--top=16] [--repeats=15] [--config=configs/dlrm.py]

Builds the job of ``--config`` with bottom and top MLPs of width ``--bottom`` / ``--top`` (0 keeps
the config's), takes one synthetic batch through the host half and times the jitted train step
on it, blocking on each, in four variants alternated round-robin in one process: ``old`` (the
dot interaction by autodiff of ``einsum(t, t)[:, i, j]``, the pooled features split by slicing
``p[:, k]``), ``old_interaction`` and ``old_split`` (one of the two old), and ``new`` (the current
code: ``dlrm.dot_interaction``'s hand-written gradient, ``jnp.unstack``). Every variant starts from
the same state and batch; their gradients, loss and updated parameters must agree with ``old``'s
to float32 round-off. Prints one JSON line per variant: median ``step_ms`` over ``--repeats``
rounds, ``vs_old`` (its median over old's) and ``load_avg``.
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
from harness import outputs, stats
from ml_collections import config_flags

from recsys_jax.embeddings import pooling
from recsys_jax.models import dlrm
from recsys_jax.training import job as job_lib

_CONFIG = config_flags.DEFINE_config_file(
  "config", os.path.join(outputs.ROOT, "configs", "dlrm.py"), "The job's config."
)
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
  host, batches = job.host, iter(job.host.reader.train())
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
    # The same seed: the same initial state.
    states[name], _, g, m = fresh.train_step(fresh.state, fresh.hot.tables, rows, placed)
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
  base = stats.median(times["old"])
  for name, ts in times.items():
    med = stats.median(ts)
    line = {"variant": name, "step_ms": round(1e3 * med, 2), "vs_old": round(med / base, 3)}
    line.update(runs_ms=[round(1e3 * t, 1) for t in ts], batch=c.batch_size, bottom=list(c.model.kwargs.bottom))
    line.update(top=list(c.model.kwargs.top), load_avg=[load0, os.getloadavg()[0]])
    print(json.dumps(line))
  job.ps.close()


if __name__ == "__main__":
  app.run(main)
