"""Online vs frozen on a stream whose click rates drift: progressive AUC over the stream.

    python experiments/online_drift.py [--steps=900] [--freeze_at=300] [--log_every=30] [--nocontrol] [--out=PATH]

The synthetic teacher drifts (``config.data.drift_records``): each id's effect turns toward an
independent one, a quarter turn every ``--drift_records`` records (by default over the whole
stream), so which ids click changes while the click rate does not. Two models see the same records
in the same order, scored by progressive validation (each batch scored before it is trained on;
one point per ``--log_every`` steps, over that interval's records): online trains on every batch;
frozen is the same run's checkpoint at ``--freeze_at``, then scored on the rest with no update
(``config.device_step = 'score'``). With ``--control`` (the default) the same pair runs on the
fixed teacher: there the online lead is what more training alone buys. The oracle's progressive
AUC (the teacher's own probabilities) is the ceiling. Each run ends with an offline evaluation on a
time-ordered split (``config.data.eval_at_record``: records of the teacher at the stream's end).

Prints each run's mean progressive AUC after the freeze and the margin, and, last, one JSON line;
writes ``<out>.json`` and a plot of the curves to ``<out>.png``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
from absl import app, flags, logging
from harness import jobs, outputs
from ml_collections import config_flags

from recsys_jax import metrics, train
from recsys_jax.data import synthetic

_CONFIG = config_flags.DEFINE_config_file("config", "configs/dlrm.py", "The job's ml_collections config file.")
_STEPS = flags.DEFINE_integer("steps", 900, "Steps of the whole stream.")
_FREEZE = flags.DEFINE_integer("freeze_at", 300, "The step after which the frozen model stops training.")
_BATCH = flags.DEFINE_integer("batch_size", 2048, "Records per step.")
_LOG = flags.DEFINE_integer("log_every", 30, "Steps per progressive point (the window is that many steps' records).")
_DRIFT = flags.DEFINE_integer("drift_records", 0, "Records per quarter turn of the teacher (0: the whole stream).")
_CONTROL = flags.DEFINE_bool("control", True, "Also run both models on the same data without drift.")
_EVAL = flags.DEFINE_integer("eval_samples", 32768, "Records of the time-ordered eval split (at the stream's end).")
_OUT = flags.DEFINE_string("out", outputs.default("online_drift"), "Output path without extension.")


def _config(drift_records: int):
  fields = {"batch_size": _BATCH.value, "log_every": _LOG.value, "data.drift_records": drift_records}
  fields["progressive.window"] = _LOG.value * _BATCH.value  # each point: the last interval's records
  fields["data.eval_at_record"] = _STEPS.value * _BATCH.value  # the offline eval: what follows the stream
  fields.update(eval_samples=_EVAL.value, eval_batch_size=min(_CONFIG.value.eval_batch_size, _EVAL.value))
  return jobs.job_config(_CONFIG.value, **fields)


def _curve(workdir: str, after: int = 0) -> list:
  """The progressive points of a workdir's runs, past step ``after``: (step, AUC, logloss)."""
  recs = [r for r in train.read_metrics(workdir, "progressive") if "source" not in r and r["step"] > after]
  return [(r["step"], r["auc"], r["logloss"]) for r in recs]


def _oracle(c, steps) -> list:
  """The teacher's own progressive AUC over the same intervals (its probabilities of the same records)."""
  data = synthetic.build({k: v for k, v in c.data.items() if k in synthetic.FIELDS})
  out = []
  for end in steps:
    batches = [data.batch(synthetic.TRAIN, i, c.batch_size) for i in range(end - c.log_every, end)]
    y = np.concatenate([b["label"] for b in batches])
    out.append(metrics.auc(y, np.concatenate([b["prob"] for b in batches])))
  return out


def run_pair(drift_records: int, root: str) -> dict:
  """Online and frozen on one data setting: their progressive curves and offline evaluations."""
  c = _config(drift_records)
  online, frozen = os.path.join(root, "online"), os.path.join(root, "frozen")
  c.num_steps = _FREEZE.value
  first = train.train_and_evaluate(c, online)
  shutil.copytree(online, frozen)  # the frozen model: this run's checkpoint at --freeze_at
  c.num_steps, c.final_checkpoint = _STEPS.value, False
  on = train.train_and_evaluate(c, online)
  c.device_step = "score"
  fr = train.train_and_evaluate(c, frozen)
  curve_on, curve_fr = _curve(online), _curve(frozen, after=_FREEZE.value)
  fr_auc = {s: a for s, a, _ in curve_fr}
  both = [(s, a) for s, a, _ in curve_on if s in fr_auc]
  margins = [a - fr_auc[s] for s, a in both]
  oracle = _oracle(c, [s for s, _ in both])
  return {
    "drift_records": drift_records,
    "online": [{"step": s, "auc": a, "logloss": ll} for s, a, ll in curve_on],
    "frozen": [{"step": s, "auc": a, "logloss": ll} for s, a, ll in curve_fr],
    "oracle": [{"step": s, "auc": a} for (s, _), a in zip(both, oracle)],
    "online_mean_auc": float(np.mean([a for _, a in both])),
    "frozen_mean_auc": float(np.mean(list(fr_auc.values()))),
    "oracle_mean_auc": float(np.mean(oracle)),
    "margin_mean": float(np.mean(margins)),
    "margin_last": margins[-1],
    "online_ahead_share": float(np.mean([m > 0 for m in margins])),
    "offline_eval_auc": {"online": on["auc"], "frozen": fr["auc"], "frozen_at_freeze": first["auc"]},
    "offline_oracle_auc": on.get("oracle_auc"),
    "online_samples_per_sec": on["samples_per_sec"],
  }


def plot(results: dict, path: str) -> None:
  plt = jobs.pyplot()
  fig, ax = plt.subplots(figsize=(9, 5))
  B = _BATCH.value
  for name, r in results.items():
    ls = "-" if name == "drift" else "--"
    for key, colour in (("online", "C0"), ("frozen", "C3"), ("oracle", "gray")):
      x, y = [p["step"] * B / 1e6 for p in r[key]], [p["auc"] for p in r[key]]
      ax.plot(x, y, ls=ls, color=colour, label=f"{key} ({name})", lw=1.3)
  ax.axvline(_FREEZE.value * B / 1e6, color="k", lw=0.8, ls=":", label="frozen from here")
  ax.set(
    xlabel="records of the stream (M)",
    ylabel=f"progressive AUC (last {_LOG.value * B:,} records)",
    title="Online vs frozen on a drifting teacher (solid) and a fixed one (dashed)",
  )
  ax.legend(fontsize=8)
  jobs.save_plot(fig, path)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if not 0 < _FREEZE.value < _STEPS.value or _STEPS.value - _FREEZE.value < _LOG.value:
    raise app.UsageError(
      f"--freeze_at={_FREEZE.value} must be in (0, --steps={_STEPS.value}) with at least --log_every steps after it"
    )
  drift = _DRIFT.value or _STEPS.value * _BATCH.value
  settings = {"drift": drift, **({"no_drift": 0} if _CONTROL.value else {})}
  results = {}
  with tempfile.TemporaryDirectory() as root:
    for name, d in settings.items():
      print(f"{name} (drift_records={d}): online to step {_STEPS.value}, frozen from {_FREEZE.value} ...", flush=True)
      results[name] = run_pair(d, os.path.join(root, name))
  print("\n| data | online, mean AUC | frozen | oracle | margin (mean, last) | online ahead | offline on/frozen |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  line = {"steps": _STEPS.value, "freeze_at": _FREEZE.value, "batch_size": _BATCH.value, "drift_records": drift}
  for name, r in results.items():
    ev = r["offline_eval_auc"]
    print(
      f"| {name} | {r['online_mean_auc']:.4f} | {r['frozen_mean_auc']:.4f} | {r['oracle_mean_auc']:.4f} | "
      f"{r['margin_mean']:+.4f}, {r['margin_last']:+.4f} | {r['online_ahead_share']:.0%} | "
      f"{ev['online']:.4f} / {ev['frozen']:.4f} |"
    )
    for k in ("online_mean_auc", "frozen_mean_auc", "oracle_mean_auc", "margin_mean", "margin_last"):
      line[f"{name}_{k}"] = round(r[k], 4)
  if "no_drift" in results:
    line["drift_share_of_margin"] = round(results["drift"]["margin_mean"] - results["no_drift"]["margin_mean"], 4)
  outputs.write_json(_OUT.value + ".json", {"flags": line, "results": results})
  plot(results, _OUT.value + ".png")
  print(json.dumps(line))


if __name__ == "__main__":
  app.run(main)
