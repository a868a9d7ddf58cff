"""Every model of the zoo on MovieLens, and DIN with and without the history sequence.

    python experiments/zoo_movielens.py                 # all runs, about 5 minutes on 2 cores
    python experiments/zoo_movielens.py --models=din,din_no_history

Each run is ``configs/<model>.py`` (``configs/movielens.py`` for DLRM) trained from scratch in
a temporary workdir with ``train.train_and_evaluate``, exactly as ``python -m recsys_jax.main
--config=configs/<model>.py`` would. Prints a markdown table (eval AUC, logloss, samples/s,
wall time), writes ``runs/experiments/zoo_movielens.json`` (``--out=experiments/results/zoo_movielens.json``
updates the committed one) and, last, one JSON line.
"""

from __future__ import annotations

import json
import tempfile
import time

import numpy as np
from absl import app, flags, logging
from harness import outputs

from configs import dcn_v2, deepfm, din, movielens, wide_deep
from recsys_jax import metrics, train
from recsys_jax.data import base
from recsys_jax.data.get import find_movielens
from recsys_jax.data.movielens import MovieLensFormat

RUNS = {
  "dlrm": movielens.get_config,
  "dcn_v2": dcn_v2.get_config,
  "deepfm": deepfm.get_config,
  "wide_deep": wide_deep.get_config,
  "din": din.get_config,
  "din_no_history": din.get_config,
}
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
  """No learning: smoothed click rates of the user and of the movie in the train split.

  logit = logit(user rate) + logit(movie rate) - logit(global rate), each rate shrunk toward
  the global one (5 and 20 pseudo-counts): the bar a model must clear.
  """
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
  for r in rows:
    if "wall_s" not in r:
      print(f"| {r['run']} | {r['auc']:.4f} | {r['logloss']:.4f} | - | - |")
      continue
    print(f"| {r['run']} | {r['auc']:.4f} | {r['logloss']:.4f} | {r['samples_per_sec']:,.0f} | {r['wall_s']:.0f} |")
  by = {r["run"]: r for r in rows}
  result = {"rows": rows}
  if "din" in by and "din_no_history" in by:
    result["din_history_auc_gain"] = by["din"]["auc"] - by["din_no_history"]["auc"]
    print(f"\nDIN: AUC {by['din']['auc']:.4f} with history, {by['din_no_history']['auc']:.4f} without")
  outputs.write_json(_OUT.value, result)
  print(json.dumps({r["run"]: {"auc": round(r["auc"], 4), "logloss": round(r["logloss"], 4)} for r in rows}))


if __name__ == "__main__":
  app.run(main)
