"""What progressive validation costs the main job: samples/s with it on and off, in one process.

    python experiments/bench_progressive.py                       # configs/dlrm.py, 300 steps a run, 3 runs each
    python experiments/bench_progressive.py --windows=0,100000,1000000 --steps=500

Each run is ``train.train_and_evaluate`` on the config (``--config.FIELD=VALUE`` overrides a field)
in a fresh workdir, ``--steps`` steps with no checkpoint and a one-batch final evaluation; the
figure is the job's own ``samples_per_sec`` (every step after the first, later compiles left out).
The windows (``config.progressive.window``; 0 = off, the step then returns no logits) are run in
turn, ``--repeats`` rounds, the order reversed every other round, so that the drift of a shared
machine falls on all of them; each window's figure is the median of its runs, and the ratio to
window 0 is the cost. On a shared machine that ratio moves by more than the cost (runs of one
window differ by 30% under load), so each run also gives the cost as the jobs time it themselves:
``time_share``, the time of the progressive reports (``report_ms``: every ``log_every`` steps, on
the reporter thread since the loop hands them over; CPU taken from the cores the step runs on,
no longer on its path) and of adding each batch's events (``add_ms``, on the pusher thread, which a
step waits for at k = 0) over the run's training time: an upper bound of the share of samples/s
they take.

Prints one line per run and, last, one JSON line: per window the median samples/s, its ratio to
off, the median report time and the median ``time_share``.
"""

from __future__ import annotations

import json
import statistics
import tempfile

from absl import app, flags, logging
from harness import outputs
from ml_collections import config_flags

from recsys_jax import train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/dlrm.py", "The main job's ml_collections config file.")
_STEPS = flags.DEFINE_integer("steps", 300, "Steps of each run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs of each window.")
_WINDOWS = flags.DEFINE_list("windows", ["0", "1000000"], "config.progressive.window values; 0 (off) is the baseline.")
_JSON = flags.DEFINE_string("json_out", outputs.default("bench_progressive.json"), "Where the results go.")


def run(window: int) -> dict:
  c = _CONFIG.value.copy_and_resolve_references()
  c.num_steps, c.progressive.window = _STEPS.value, window
  c.checkpoint_every, c.eval_every, c.final_checkpoint, c.progress_bar = 0, 0, False, False
  c.eval_samples = c.eval_batch_size = min(c.eval_batch_size, 4096)
  with tempfile.TemporaryDirectory() as workdir:
    s = train.train_and_evaluate(c, workdir)
    prog = [r for r in train.read_metrics(workdir, "progressive") if "source" not in r]
    train_s = sum(r["train_s"] for r in train.read_metrics(workdir, "train"))
  reports = [r["report_ms"] for r in prog]
  # The training loop's and the pusher's time in progressive validation, over the run's training time.
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
      med = statistics.median(out["report_ms"]) if out["report_ms"] else 0.0
      print(
        f"round {r} window {w:>9,}: {out['samples_per_sec']:,.0f} samples/s, report {med:.1f} ms, "
        f"{100 * out['time_share']:.2f}% of the training time in progressive validation",
        flush=True,
      )
  base = statistics.median(x["samples_per_sec"] for x in runs if x["window"] == 0)
  line = {"steps": _STEPS.value, "repeats": _REPEATS.value, "batch_size": _CONFIG.value.batch_size}
  line["log_every"] = _CONFIG.value.log_every
  for w in windows:
    sps = statistics.median(x["samples_per_sec"] for x in runs if x["window"] == w)
    line[f"samples_per_sec_{w}"] = round(sps)
    line[f"ratio_{w}"] = round(sps / base, 4)
    ms = [m for x in runs if x["window"] == w for m in x["report_ms"]]
    line[f"report_ms_{w}"] = round(statistics.median(ms), 2) if ms else 0.0
    line[f"time_share_{w}"] = round(statistics.median(x["time_share"] for x in runs if x["window"] == w), 5)
  outputs.write_json(_JSON.value, {"summary": line, "runs": runs})
  print(json.dumps(line))


if __name__ == "__main__":
  app.run(main)
