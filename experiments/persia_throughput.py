"""Persia's throughput claims measured here: samples/s by mode, trainers and PS servers.

    python experiments/persia_throughput.py [--config=configs/dlrm.py] [--steps=300] [--full]

Persia reports that hybrid training is faster than synchronous training (lookups and pushes overlap
the dense step) and that throughput scales with trainers and PS servers. Every setting is one
``python -m recsys_jax.launch`` run of ``--config``: synchronous (k = 0) and hybrid (k = 4) with the
in-process PS, then 1 and 2 trainers x 1 and 2 PS servers over loopback. Where the processes share
the machine's cores, scaling cannot show, only the cost of the remote path and the gain of
overlapping. Writes ``runs/experiments/persia_throughput.json`` and ``.png``
(``--throughput_out=experiments/results/persia_throughput`` updates the committed ones); prints a
table and, last, one JSON line.
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import app, flags
from harness import jobs, outputs, processes

_CONFIG = flags.DEFINE_string("config", "configs/dlrm.py", "The config every run uses.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps per run.")
_OUT_T = flags.DEFINE_string(
  "throughput_out", outputs.default("persia_throughput"), "Output path without extension (.json, .png)."
)
_FULL = flags.DEFINE_bool("full", False, "The main job's length: 2000 steps per setting (about 40 minutes).")
_SMOKE = flags.DEFINE_bool(
  "smoke", False, "A tiny run (the test suite's): configs/tiny.py, 3 steps, in-process k=0, 4."
)
SETTINGS = [(k, w, s) for k in (0, 4) for (w, s) in ((1, 0), (1, 1), (2, 1), (2, 2))]  # (k, trainers, servers)


def main(argv):
  del argv
  config, steps = ("configs/tiny.py", 3) if _SMOKE.value else (_CONFIG.value, 2000 if _FULL.value else _STEPS.value)
  sets = [f"num_steps={steps}", f"eval_samples={4096 if _SMOKE.value else 16384}"]
  settings = [(0, 1, 0), (4, 1, 0)] if _SMOKE.value else SETTINGS  # bench_distributed's smoke runs the remote path
  rows = []
  for k, workers, servers in settings:
    with tempfile.TemporaryDirectory() as d:
      print(f"k={k}, {workers} trainer(s), {servers or 'in-process'} PS ...", flush=True)
      rows.append(processes.launch(config, workers, servers, os.path.join(d, "run"), sets + [f"staleness={k}"]))
  print(f"\n{config}, {steps} steps, {os.cpu_count()} cores, loopback")
  print("| mode | trainers | PS | samples/s | vs sync in-process |")
  print("| --- | --- | --- | --- | --- |")
  base = rows[0]["samples_per_sec"]
  for r in rows:
    mode = "sync (k=0)" if r["staleness"] == 0 else f"hybrid (k={r['staleness']})"
    ps = "in-process" if r["ps_servers"] == 0 else str(r["ps_servers"])
    print(f"| {mode} | {r['trainers']} | {ps} | {r['samples_per_sec']:,.0f} | {r['samples_per_sec'] / base:.2f} |")
  plt = jobs.pyplot()
  labels = ["in-process" if s == 0 else f"{w} tr x {s} PS" for k, w, s in settings if k == 0]
  fig, ax = plt.subplots(figsize=(8, 4))
  for j, k in enumerate((0, 4)):
    ys = [r["samples_per_sec"] for r in rows if r["staleness"] == k]
    ax.bar([i + 0.4 * j for i in range(len(ys))], ys, width=0.4, label="sync (k=0)" if k == 0 else f"hybrid (k={k})")
  ax.set_xticks([i + 0.2 for i in range(len(labels))], labels)
  ax.set(ylabel="samples/s", title=f"{config} on {os.cpu_count()} CPU cores, loopback")
  ax.legend()
  jobs.save_plot(fig, _OUT_T.value + ".png")
  outputs.write_json(_OUT_T.value + ".json", {"config": config, "steps": steps, "rows": rows})
  print(json.dumps({f"k{r['staleness']}_{r['trainers']}x{r['ps_servers']}": round(r["samples_per_sec"]) for r in rows}))


if __name__ == "__main__":
  app.run(main)
