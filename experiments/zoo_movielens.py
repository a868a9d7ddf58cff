"""Every model of the zoo on MovieLens, and DIN with and without the history sequence.

    python experiments/zoo_movielens.py [--models=din,din_no_history] [--steps=N] [--path=DIR] [--out=FILE]

Each run is ``configs/<model>.py`` (``configs/movielens.py`` for DLRM) trained from scratch in a
temporary workdir by ``train.train_and_evaluate``, as ``python -m recsys_jax.main`` would, beside a
count baseline that learns nothing. Prints a markdown table (eval AUC, logloss, samples/s, wall
time) and, last, one JSON line; writes every run's figures to ``--out``.
"""

from __future__ import annotations

import json
import tempfile
import time

import numpy as np
from absl import app, flags, logging
from harness import outputs, stats

from configs import dcn_v2, deepfm, din, movielens, wide_deep
from recsys_jax import metrics, train
from recsys_jax.data import base
from recsys_jax.data.get import find_movielens
from recsys_jax.data.movielens import MovieLensFormat

RUNS = {"dlrm": movielens.get_config, "dcn_v2": dcn_v2.get_config, "deepfm": deepfm.get_config}
RUNS.update(wide_deep=wide_deep.get_config, din=din.get_config, din_no_history=din.get_config)
_MODELS = flags.DEFINE_list("models", list(RUNS), f"Runs to do, from {list(RUNS)}.")
_PATH = flags.DEFINE_string("path", None, "MovieLens directory (default: the configs' data.path).")
_STEPS = flags.DEFINE_integer("steps", None, "Override num_steps (default: the configs').")
_OUT = flags.DEFINE_string("out", outputs.default("zoo_movielens.json"), "Where to write the results.")


def run(name: str) -> dict:
  c = RUNS[name]()
  if name == "din_no_history":
    c.model.kwargs.use_history = False
  if _PATH.value:
    c.data.path = _PATH.value
  if _STEPS.value:
    c.num_steps = _STEPS.value
  c.progress_bar = False
  with tempfile.TemporaryDirectory() as workdir:
    t0 = time.perf_counter()
    s = train.train_and_evaluate(c, workdir)
    wall = time.perf_counter() - t0
  return {
    "run": name,
    "model": c.model.name,
    "auc": s["auc"],
    "logloss": s["logloss"],
    "calibration": s["calibration"],
    "samples_per_sec": s["samples_per_sec"],
    "steps": c.num_steps,
    "batch_size": c.batch_size,
    "eval_samples": s["eval_samples"],
    "wall_s": wall,
  }


def count_baseline() -> dict:
  """No learning, the bar a model must clear: logit = logit(user rate) + logit(movie rate) - logit(global
  rate), click rates of the train split shrunk toward the global one (5 and 20 pseudo-counts)."""
  c = movielens.get_config()
  if _PATH.value:
    c.data.path = _PATH.value
  d = c.data
  fmt = MovieLensFormat(find_movielens(d.path), max_history=d.max_history, eval_fraction=d.eval_fraction, split=d.split)
  tr, ev = base.read_all(fmt, "train"), base.read_all(fmt, "eval")
  y, g = tr["label"].astype(np.float64), float(tr["label"].mean())

  def rate(key, prior):
    ids, inv = np.unique(tr["sparse"][key][:, 0], return_inverse=True)
    r = (np.bincount(inv, y) + prior * g) / (np.bincount(inv) + prior)
    pos = np.clip(np.searchsorted(ids, ev["sparse"][key][:, 0]), 0, len(ids) - 1)
    return np.where(ids[pos] == ev["sparse"][key][:, 0], r[pos], g)

  def logit(p):
    return np.log(p / (1 - p))

  z = logit(rate("user", 5)) + logit(rate("movie", 20)) - logit(g)
  p = 1 / (1 + np.exp(-z))
  yy = ev["label"]
  return {"run": "count_baseline", "model": "none", "auc": metrics.auc(yy, z), "logloss": metrics.logloss(yy, p)}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  unknown = set(_MODELS.value) - set(RUNS)
  if unknown:
    raise app.UsageError(f"unknown runs {sorted(unknown)}; choose from {list(RUNS)}")
  rows = [count_baseline()]
  for name in _MODELS.value:
    print(f"{name} ...", flush=True)
    rows.append(run(name))
  print("\n| run | eval AUC | eval logloss | samples/s | wall s |")
  print("| --- | --- | --- | --- | --- |")
  for r in rows:  # the count baseline has no samples/s or wall time
    sps, wall = stats.fmt(r.get("samples_per_sec"), ",.0f"), stats.fmt(r.get("wall_s"), ".0f")
    print(f"| {r['run']} | {r['auc']:.4f} | {r['logloss']:.4f} | {sps} | {wall} |")
  by = {r["run"]: r for r in rows}
  result = {"rows": rows}
  if "din" in by and "din_no_history" in by:
    result["din_history_auc_gain"] = by["din"]["auc"] - by["din_no_history"]["auc"]
    print(f"\nDIN: AUC {by['din']['auc']:.4f} with history, {by['din_no_history']['auc']:.4f} without")
  outputs.write_json(_OUT.value, result)
  print(json.dumps({r["run"]: {"auc": round(r["auc"], 4), "logloss": round(r["logloss"], 4)} for r in rows}))


if __name__ == "__main__":
  app.run(main)
