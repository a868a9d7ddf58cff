"""Persia's convergence claim: hybrid training (async embeddings, sync dense) matches sync.

    python experiments/persia_convergence.py [--full] [--staleness=0,1,4,16] [--async_k=4] [--hot_bytes=N] [--out=PATH]

Persia (Lian et al., KDD 2022) reports that hybrid training, embedding lookups and updates k
steps ahead of the synchronous dense step, stays within 0.1% AUC of synchronous training, while
an asynchronous dense part too costs 0.5 to 1%. This trains one model synchronously (k = 0),
hybrid (``config.staleness`` = each k), hybrid with the hot rows on the device at each k (the
config's ``hot_rows_bytes``, or ``--hot_bytes``; the others set it to 0) and fully asynchronous
(``--async_k`` for embeddings and ``config.dense_staleness``), on synthetic data (``configs/dlrm.py``,
600 steps, ``--full`` 2000; its oracle AUC is the ceiling) and MovieLens (``configs/movielens.py``),
and records eval AUC against samples seen and training wall time, with the hot rows' hit rate,
rows held and host -> device rows a step.

Prints a table and, last, one JSON line (per data set and run: AUC, its difference to sync,
samples/s, hot figures); writes ``<out>.json`` and a plot of the curves to ``<out>.png``.
"""

from __future__ import annotations

import json
import tempfile

from absl import app, flags, logging
from harness import jobs, outputs

from configs import dlrm, movielens, tiny
from recsys_jax import train

_FULL = flags.DEFINE_bool("full", False, "Synthetic data at the main job's 2000 steps.")
_STALENESS = flags.DEFINE_list("staleness", ["0", "1", "4", "16"], "k values; 0 is synchronous.")
_ASYNC = flags.DEFINE_integer("async_k", 4, "Staleness of the fully asynchronous run (0: skip it).")
_HOT = flags.DEFINE_integer("hot_bytes", -1, "Hot-row budget of the hybrid + hot runs (-1: the config's; 0: none).")
_OUT = flags.DEFINE_string("out", outputs.default("persia_convergence"), "Output path without extension.")
_SMOKE = flags.DEFINE_bool("smoke", False, "A tiny run (the test suite's): configs/tiny.py's sizes, 8 steps, k = 0, 2.")


def _datasets():
  syn = dlrm.get_config()
  syn.num_steps = 2000 if _FULL.value else 600
  syn.eval_every = 200 if _FULL.value else 100
  syn.eval_samples = 65536 if _FULL.value else 32768
  syn.checkpoint_every = 0
  ml = movielens.get_config()
  ml.eval_every = 35
  if _SMOKE.value:  # every kind of run, on a few small steps (MovieLens runs in zoo_movielens.py's smoke)
    syn.num_steps, syn.eval_every, syn.batch_size = 8, 4, 256
    # configs/tiny.py's 8 small tables and MLP, not dlrm.py's 26: compiling the steps is most of the run
    small = tiny.get_config()
    syn.data.vocab_sizes, syn.embeddings.dim = small.data.vocab_sizes, small.embeddings.dim
    syn.model.kwargs = small.model.kwargs
    syn.eval_samples = syn.eval_batch_size = 1024
    syn.hot_warmup_steps, syn.hot_every = 2, 4
    return {"synthetic": syn}
  return {"synthetic": syn, "movielens": ml}


def run(config, k: int, dense_k: int = 0, hot_bytes: int = 0) -> dict:
  c = config.copy_and_resolve_references()  # hot_rows_bytes set always: the config's default turns hot rows on
  c.update({"staleness": k, "dense_staleness": dense_k, "hot_rows_bytes": hot_bytes, "progress_bar": False})
  with tempfile.TemporaryDirectory() as workdir:
    s = train.train_and_evaluate(c, workdir)
  curve = [{"samples": e["samples"], "train_s": e["train_s"], "auc": e["auc"]} for e in s["evals"]]
  curve.append({"samples": s["steps"] * s["batch_size"], "train_s": s["train_s"], "auc": s["auc"]})
  return {
    "k": k,
    "dense_k": dense_k,
    "auc": s["auc"],
    "logloss": s["logloss"],
    "oracle_auc": s.get("oracle_auc"),
    "samples_per_sec": s["samples_per_sec"],
    "hot_bytes": hot_bytes,
    "hot": s["hot"],  # None without hot rows; else hit rate, rows held, per-step traffic, choices
    "curve": curve,
  }


def _mode(r: dict) -> str:
  if r["dense_k"]:
    return f"fully async k={r['k']}"
  if r["hot_bytes"]:
    return f"hybrid k={r['k']} + hot {r['hot_bytes'] / 2**20:g} MiB"
  return "sync (k=0)" if r["k"] == 0 else f"hybrid k={r['k']}"


def _key(r: dict) -> str:
  """Key prefix of a run in the JSON line, e.g. ``k4``, ``k4_hot``, ``async4``."""
  return f"{'async' if r['dense_k'] else 'k'}{r['k']}{'_hot' if r['hot_bytes'] else ''}"


_COLOURS = ["C0", "C1", "C2", "C4", "C5", "C6", "C7", "C8", "C9"]  # C3 is the fully async run's


def _style(r: dict, ks: list) -> dict:
  """Line style: one colour per k (sync black), dashed with hot rows, dotted for fully async."""
  if r["dense_k"]:
    return {"color": "C3", "ls": ":"}
  colour = "black" if r["k"] == 0 else _COLOURS[[k for k in ks if k].index(r["k"]) % len(_COLOURS)]
  return {"color": colour, "ls": "--" if r["hot_bytes"] else "-"}


def plot(results: dict, ks: list, path: str) -> None:
  plt = jobs.pyplot()
  fig, axes = plt.subplots(len(results), 2, figsize=(12, 4.5 * len(results)), squeeze=False)
  for row, (name, runs) in enumerate(results.items()):
    for r in runs:
      style = {**_style(r, ks), "marker": "o", "ms": 3, "label": _mode(r)}
      aucs = [p["auc"] for p in r["curve"]]
      axes[row][0].plot([p["samples"] / 1e6 for p in r["curve"]], aucs, **style)
      axes[row][1].plot([p["train_s"] for p in r["curve"]], aucs, **style)
    if runs[0]["oracle_auc"]:
      for ax in axes[row]:
        ax.axhline(runs[0]["oracle_auc"], color="gray", ls="-.", lw=0.8, label="oracle")
    axes[row][0].set(title=f"{name}: eval AUC vs samples", xlabel="samples seen (M)", ylabel="eval AUC")
    axes[row][1].set(title=f"{name}: eval AUC vs training time", xlabel="training wall time (s)", ylabel="eval AUC")
    axes[row][0].legend(fontsize=7)
  jobs.save_plot(fig, path)


# The hot rows' figures in the JSON line, and their rounding (None: to an integer).
HOT_FIGURES = {"hot_hit_rate": 4, "hot_rows_held": None, "cold_rows_per_step": 1, "h2d_row_bytes_per_step": None}


def _row(name: str, r: dict, sync: dict) -> tuple:
  """One run's table row and its JSON-line entries (AUC, delta to sync, samples/s, hot figures)."""
  d = r["auc"] - sync["auc"]
  r["vs_sync"], r["vs_sync_pct"] = d, 100 * d / sync["auc"]
  h = r["hot"]
  hot_cols = (
    f"{h['hot_hit_rate']:.3f} | {h['hot_rows_held']:,.0f} | {h['cold_rows_per_step']:,.0f} | "
    f"{h['h2d_row_bytes_per_step'] / 2**10:,.1f}"
    if h
    else "| | |"
  )
  text = (
    f"| {name} | {_mode(r)} | {r['auc']:.4f} | {d:+.4f} ({r['vs_sync_pct']:+.2f}%) | "
    f"{r['samples_per_sec']:,.0f} | {hot_cols} |"
  )
  key = f"{name}_{_key(r)}"
  line = {
    f"{key}_auc": round(r["auc"], 4),
    f"{key}_vs_sync": round(d, 4),
    f"{key}_vs_sync_pct": round(r["vs_sync_pct"], 3),
    f"{key}_samples_per_sec": round(r["samples_per_sec"]),
  }
  line.update({f"{key}_{k}": round(h[k], digits) for k, digits in HOT_FIGURES.items()} if h else {})
  return text, line


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if _SMOKE.value:
    for name, value in (("staleness", ["0", "2"]), ("async_k", 0)):  # sync, hybrid and hybrid + hot
      if not flags.FLAGS[name].present:
        flags.FLAGS[name].value = value
  ks = [int(k) for k in _STALENESS.value]
  if 0 not in ks:
    raise app.UsageError("--staleness must include 0: the synchronous run is the reference")
  if _HOT.value < -1:
    raise app.UsageError(f"--hot_bytes={_HOT.value}: -1 (the config's budget), 0 (no hot runs) or bytes")
  results = {}
  for name, config in _datasets().items():
    hot_bytes = int(config.hot_rows_bytes) if _HOT.value == -1 else _HOT.value
    results[name] = []
    for k in ks:
      print(f"{name}, {'sync' if k == 0 else 'hybrid'} k={k} ...", flush=True)
      results[name].append(run(config, k))
    for k in [k for k in ks if k] if hot_bytes else []:
      print(f"{name}, hybrid k={k} + hot {hot_bytes / 2**20:g} MiB ...", flush=True)
      results[name].append(run(config, k, hot_bytes=hot_bytes))
    if _ASYNC.value:
      print(f"{name}, fully async k={_ASYNC.value} ...", flush=True)
      results[name].append(run(config, _ASYNC.value, _ASYNC.value))
  print(
    "\n| data | mode | eval AUC | vs sync | samples/s | hot hit rate | hot rows held | cold rows/step | h2d KiB/step |"
  )
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  line = {}
  for name, runs in results.items():
    sync = next(r for r in runs if r["k"] == 0 and not r["dense_k"] and not r["hot_bytes"])
    for r in runs:
      text, entries = _row(name, r, sync)
      print(text)
      line.update(entries)
  outputs.write_json(_OUT.value + ".json", {"full": _FULL.value, "results": results})
  plot(results, ks, _OUT.value + ".png")
  print(json.dumps(line))


if __name__ == "__main__":
  app.run(main)
