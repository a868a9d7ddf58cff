"""Online vs frozen on a stream whose click rates drift: progressive AUC over the stream (issue 29).

    python experiments/online_drift.py                 # about 4 minutes on 2 shared cores
    python experiments/online_drift.py --steps=1200 --freeze_at=300
    python experiments/online_drift.py --out=experiments/results/online_drift   # the committed results

The synthetic teacher drifts (``config.data.drift_records``, ``recsys_jax/data/synthetic.py``): each
id's effect and interaction vector turn toward independent ones, a quarter turn every
``drift_records`` records, so which ids click changes while the click rate does not. By default the
quarter turn takes the whole stream: the teacher of the last record is independent of the first's,
and the frozen model, which learned from records before ``--freeze_at``, scores the last records
with id effects that have turned by 60 to 90 degrees (default flags; correlation 0.5 to 0) from the ones it learned.

Two models see the same records in the same order, scored by progressive validation (each batch
scored before it is trained on, ``config.progressive``; one point per ``--log_every`` steps, over
that interval's events):

- online: trains on every batch of the stream, ``--steps`` steps;
- frozen: the same run up to ``--freeze_at`` (its checkpoint, copied), then scored on the rest
  of the stream with no update (``config.device_step = 'score'``: the training step's forward
  pass, nothing changed).

The same pair runs on the same data without drift (``--control``, on by default): there the online
model's lead is what more training alone buys, so the drift's share of the margin is the difference.
The oracle's progressive AUC (the teacher's own probabilities, over the same intervals) is the ceiling.
Each run also ends with an offline evaluation on a time-ordered split: eval records drawn from the
teacher as it stands at the end of the stream (``config.data.eval_at_record``).

Prints each run's mean progressive AUC after the freeze, the margin, and, last, one JSON line; writes
``<out>.json`` and ``<out>.png`` (default ``runs/experiments/online_drift``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
from absl import app, flags, logging
from harness import outputs
from ml_collections import config_flags

from recsys_jax import metrics, train
from recsys_jax.data import synthetic

_CONFIG = config_flags.DEFINE_config_file("config", "configs/dlrm.py", "The job's ml_collections config file.")
_STEPS = flags.DEFINE_integer("steps", 900, "Steps of the whole stream.")
_FREEZE = flags.DEFINE_integer("freeze_at", 300, "The step after which the frozen model stops training.")
_BATCH = flags.DEFINE_integer("batch_size", 2048, "Records per step.")
_LOG = flags.DEFINE_integer("log_every", 30, "Steps per progressive point (the window is that many steps' records).")
_DRIFT = flags.DEFINE_integer(
  "drift_records", 0, "Records per quarter turn of the teacher (0: the whole stream, steps x batch_size)."
)
_CONTROL = flags.DEFINE_bool("control", True, "Also run both models on the same data without drift.")
_EVAL = flags.DEFINE_integer("eval_samples", 32768, "Records of the time-ordered eval split (at the stream's end).")
_OUT = flags.DEFINE_string("out", outputs.default("online_drift"), "Output path without extension.")


def _config(drift_records: int):
  c = _CONFIG.value.copy_and_resolve_references()
  c.batch_size, c.log_every = _BATCH.value, _LOG.value
  c.progressive.window = _LOG.value * _BATCH.value  # each point: the last interval's records
  c.data.drift_records = drift_records
  c.data.eval_at_record = _STEPS.value * _BATCH.value  # the offline eval: what follows the stream
  c.eval_samples = _EVAL.value
  c.eval_batch_size = min(c.eval_batch_size, _EVAL.value)
  c.checkpoint_every, c.eval_every, c.progress_bar = 0, 0, False
  return c


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
  after = {s for s, _, _ in curve_fr}
  both = [(s, a) for s, a, _ in curve_on if s in after]
  fr_auc = dict((s, a) for s, a, _ in curve_fr)
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
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(9, 5))
  B = _BATCH.value
  for name, r in results.items():
    ls = "-" if name == "drift" else "--"
    for key, colour in (("online", "C0"), ("frozen", "C3"), ("oracle", "gray")):
      pts = r[key]
      label = f"{key} ({name})"
      ax.plot([p["step"] * B / 1e6 for p in pts], [p["auc"] for p in pts], ls=ls, color=colour, label=label, lw=1.3)
  ax.axvline(_FREEZE.value * B / 1e6, color="k", lw=0.8, ls=":", label="frozen from here")
  ax.set(
    xlabel="records of the stream (M)",
    ylabel=f"progressive AUC (last {_LOG.value * B:,} records)",
    title="Online vs frozen on a drifting teacher (solid) and a fixed one (dashed)",
  )
  ax.legend(fontsize=8)
  fig.tight_layout()
  outputs.save_figure(fig, path, dpi=110)


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
  print(
    "\n| data | online mean AUC | frozen mean AUC | oracle | margin (mean, last) | online ahead | offline eval on/frozen |"
  )
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
