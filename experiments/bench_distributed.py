"""Throughput with remote PS servers and several trainers on loopback, against the in-process PS.

    python experiments/bench_distributed.py                    # about 5 minutes on 2 cores
    python experiments/bench_distributed.py --steps=600 --config=configs/dlrm.py

Every setting is one ``python -m recsys_jax.launch`` run (servers and trainers as separate
processes, one CPU device per trainer) of the same config and steps, in a fresh workdir:
the in-process PS (``--num_ps=0``), then {1, 2} trainers x {1, 2} PS servers. Throughput is
the run's own samples/s (global batch, after the first step), read from its summary.json.
On one 2-core machine the processes compete for the cores, so this measures the overhead of
the remote path (serialisation, loopback gRPC, the per-step barrier of the servers), not the
scaling several hosts would give. Prints a table and, last, one JSON line; writes ``--out``
(default runs/experiments/bench_distributed.json; the committed one is in experiments/results/).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags
from harness import outputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = flags.DEFINE_string("config", "configs/dlrm.py", "The config every run uses.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps per run.")
_OUT = flags.DEFINE_string("out", outputs.default("bench_distributed.json"), "Where to write the results.")
_SMOKE = flags.DEFINE_bool(
  "smoke",
  False,
  "A tiny run that checks the script works (the test suite's): configs/tiny.py, 3 steps, 1 trainer x 1 server.",
)
SETTINGS = ((1, 0), (1, 1), (1, 2), (2, 1), (2, 2))  # (trainers, PS servers); 0 servers: in-process
SMOKE_SETTINGS = ((1, 1),)  # the remote path; persia_throughput's smoke runs the in-process one


def smoke_flags() -> None:
  """With --smoke: the tiny config and 3 steps, unless given on the command line."""
  if _SMOKE.value:
    for name, value in (("config", "configs/tiny.py"), ("steps", 3)):
      if not flags.FLAGS[name].present:
        flags.FLAGS[name].value = value


def run(workers: int, servers: int, workdir: str, extra=()) -> dict:
  """One launcher run; ``extra``: more ``--config.*`` overrides. Returns its figures."""
  argv = [
    sys.executable,
    "-m",
    "recsys_jax.launch",
    f"--config={_CONFIG.value}",
    f"--num_ps={servers}",
    f"--num_workers={workers}",
    f"--workdir={workdir}",
    f"--config.num_steps={_STEPS.value}",
    "--config.progress_bar=False",
    f"--config.eval_samples={4096 if _SMOKE.value else 16384}",
    *extra,
  ]
  t0 = time.perf_counter()
  out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
  wall = time.perf_counter() - t0
  if out.returncode != 0:
    raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
  s = json.load(open(os.path.join(workdir, "summary.json")))
  return {
    "staleness": s["staleness"],
    "trainers": workers,
    "ps_servers": servers,
    "samples_per_sec": s["samples_per_sec"],
    "auc": s["auc"],
    "steps": s["steps"],
    "batch_size": s["batch_size"],
    "wall_s": wall,
  }


def main(argv):
  del argv
  smoke_flags()
  rows = []
  for workers, servers in SMOKE_SETTINGS if _SMOKE.value else SETTINGS:
    with tempfile.TemporaryDirectory() as d:
      print(f"{workers} trainer(s), {servers or 'in-process'} PS ...", flush=True)
      rows.append(run(workers, servers, os.path.join(d, "run")))
  base = rows[0]["samples_per_sec"]
  print(f"\n{_CONFIG.value}, {_STEPS.value} steps, {os.cpu_count()} CPU cores, loopback")
  print(f"{'trainers':>8} {'PS':>12} {'samples/s':>10} {'vs in-process':>14} {'AUC':>7}")
  for r in rows:
    ps = "in-process" if r["ps_servers"] == 0 else f"{r['ps_servers']} server(s)"
    print(
      f"{r['trainers']:>8} {ps:>12} {r['samples_per_sec']:>10,.0f} {r['samples_per_sec'] / base:>14.2f} {r['auc']:>7.4f}"
    )
  result = {"config": _CONFIG.value, "steps": _STEPS.value, "cpu_count": os.cpu_count(), "rows": rows}
  outputs.write_json(_OUT.value, result)
  print(
    json.dumps(
      {f"{r['trainers']}x{r['ps_servers']}": round(r["samples_per_sec"]) for r in rows}
      | ({"in_process_samples_per_sec": round(base)} if rows[0]["ps_servers"] == 0 else {})
    )
  )


if __name__ == "__main__":
  app.run(main)
