"""Throughput with remote PS servers and several trainers on loopback, against the in-process PS.

    python experiments/bench_distributed.py [--config=configs/dlrm.py] [--steps=300] [--out=FILE]

Every setting is one ``python -m recsys_jax.launch`` run (servers and trainers as separate processes,
one CPU device per trainer) of the same config and steps, in a fresh workdir: the in-process PS
(``--num_ps=0``), then {1, 2} trainers x {1, 2} PS servers. Throughput is the run's own samples/s
(global batch, after the first step), from its summary.json. Where the processes share the machine's
cores, this measures the cost of the remote path (serialisation, loopback gRPC, the servers' per-step
barrier), not the scaling several hosts would give. Prints a table and, last, one JSON line; writes
``--out`` (default runs/experiments/bench_distributed.json; the committed one is in experiments/results/).
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import app, flags
from harness import outputs, processes

_CONFIG = flags.DEFINE_string("config", "configs/dlrm.py", "The config every run uses.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps per run.")
_OUT = flags.DEFINE_string("out", outputs.default("bench_distributed.json"), "Where to write the results.")
_SMOKE = flags.DEFINE_bool(
  "smoke", False, "A tiny run (the test suite's): configs/tiny.py, 3 steps, 1 trainer x 1 server."
)
SETTINGS = ((1, 0), (1, 1), (1, 2), (2, 1), (2, 2))  # (trainers, PS servers); 0 servers: in-process


def main(argv):
  del argv
  config, steps = ("configs/tiny.py", 3) if _SMOKE.value else (_CONFIG.value, _STEPS.value)
  sets = [f"num_steps={steps}", f"eval_samples={4096 if _SMOKE.value else 16384}"]
  rows = []
  for workers, servers in ((1, 1),) if _SMOKE.value else SETTINGS:
    with tempfile.TemporaryDirectory() as d:
      print(f"{workers} trainer(s), {servers or 'in-process'} PS ...", flush=True)
      rows.append(processes.launch(config, workers, servers, os.path.join(d, "run"), sets))
  base = rows[0]["samples_per_sec"]
  print(f"\n{config}, {steps} steps, {os.cpu_count()} CPU cores, loopback")
  print(f"{'trainers':>8} {'PS':>12} {'samples/s':>10} {'vs in-process':>14} {'AUC':>7}")
  for r in rows:
    ps = "in-process" if r["ps_servers"] == 0 else f"{r['ps_servers']} server(s)"
    print(
      f"{r['trainers']:>8} {ps:>12} {r['samples_per_sec']:>10,.0f} {r['samples_per_sec'] / base:>14.2f} {r['auc']:>7.4f}"
    )
  outputs.write_json(_OUT.value, {"config": config, "steps": steps, "cpu_count": os.cpu_count(), "rows": rows})
  print(
    json.dumps(
      {f"{r['trainers']}x{r['ps_servers']}": round(r["samples_per_sec"]) for r in rows}
      | ({"in_process_samples_per_sec": round(base)} if rows[0]["ps_servers"] == 0 else {})
    )
  )


if __name__ == "__main__":
  app.run(main)
