"""What progressive validation costs the main job: samples/s with it on and off, in one process.

    python experiments/bench_progressive.py [--steps=300] [--repeats=3] [--windows=0,1000000] [--json_out=FILE]

Each run is ``train.train_and_evaluate`` on the config (``--config.FIELD=VALUE`` overrides a field)
in a fresh workdir, ``--steps`` steps, no checkpoint, a one-batch final evaluation; its figure is
the job's own ``samples_per_sec``. The windows (``config.progressive.window``; 0: off) run in turn,
``--repeats`` rounds, every other round reversed; a window's figure is the median of its runs, and
its ratio to window 0 the cost. As that ratio moves with the load by more than the cost, each run
also gives ``time_share``: the jobs' own time in progressive validation (``report_ms``, every
``log_every`` steps on the reporter thread, and ``add_ms``, each batch's events on the pusher
thread) over the training time, an upper bound of the share of samples/s it takes.

Prints one line per run and, last, one JSON line: per window the median samples/s
(``samples_per_sec_<w>``), ``ratio_<w>``, the median ``report_ms_<w>`` and ``time_share_<w>``.
"""

from __future__ import annotations

import json
import tempfile

from absl import app, flags, logging
from harness import jobs, outputs, stats
from ml_collections import config_flags

from recsys_jax import train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/dlrm.py", "The main job's ml_collections config file.")
_STEPS = flags.DEFINE_integer("steps", 300, "Steps of each run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs of each window.")
_WINDOWS = flags.DEFINE_list("windows", ["0", "1000000"], "config.progressive.window values; 0 (off) is the baseline.")
_JSON = flags.DEFINE_string("json_out", outputs.default("bench_progressive.json"), "Where the results go.")


def run(window: int) -> dict:
  eval_samples = min(_CONFIG.value.eval_batch_size, 4096)
  fields = {"num_steps": _STEPS.value, "progressive.window": window, "final_checkpoint": False}
  c = jobs.job_config(_CONFIG.value, eval_samples=eval_samples, eval_batch_size=eval_samples, **fields)
  with tempfile.TemporaryDirectory() as workdir:
    s = train.train_and_evaluate(c, workdir)
    prog = [r for r in train.read_metrics(workdir, "progressive") if "source" not in r]
    train_s = sum(r["train_s"] for r in train.read_metrics(workdir, "train"))
  reports = [r["report_ms"] for r in prog]
  # The reporter's and the pusher's time in progressive validation, over the run's training time.
  share = (sum(reports) + sum(r["add_ms"] for r in prog)) / (1e3 * train_s)
  return {"window": window, "samples_per_sec": s["samples_per_sec"], "report_ms": reports, "time_share": share}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  windows = [int(w) for w in _WINDOWS.value]
  if 0 not in windows:
    raise app.UsageError("--windows must include 0: the run without progressive validation is the baseline")
  runs = []
  for r in range(_REPEATS.value):
    for w in windows if r % 2 == 0 else windows[::-1]:
      out = run(w)
      runs.append(out)
      med = stats.fmt(stats.median(out["report_ms"]), ".1f")
      print(
        f"round {r} window {w:>9,}: {out['samples_per_sec']:,.0f} samples/s, report {med} ms, "
        f"{100 * out['time_share']:.2f}% of the training time in progressive validation",
        flush=True,
      )
  base = stats.median(x["samples_per_sec"] for x in runs if x["window"] == 0)
  line = {"steps": _STEPS.value, "repeats": _REPEATS.value, "batch_size": _CONFIG.value.batch_size}
  line["log_every"] = _CONFIG.value.log_every
  for w in windows:
    sps = stats.median(x["samples_per_sec"] for x in runs if x["window"] == w)
    line[f"samples_per_sec_{w}"] = round(sps)
    line[f"ratio_{w}"] = round(sps / base, 4)
    ms = [m for x in runs if x["window"] == w for m in x["report_ms"]]
    line[f"report_ms_{w}"] = round(stats.median(ms), 2) if ms else 0.0  # window 0: no reports
    line[f"time_share_{w}"] = round(stats.median(x["time_share"] for x in runs if x["window"] == w), 5)
  outputs.write_json(_JSON.value, {"summary": line, "runs": runs})
  print(json.dumps(line))


if __name__ == "__main__":
  app.run(main)
