"""The host half of the main job, fed to a no-op (or tiny) device step: how many samples/s it can feed.

    python experiments/bench_feed.py [--sources=tsv,cache,synthetic] [--batch_sizes=2048,8192,65536]
        [--workers=1,2] [--step=noop] [--step=tiny] [--repeats=N] [--baseline=DIR] [--json_out=FILE]
        [--png_out=FILE] [--smoke]

Run from the repository root. Each setting (source x batch x workers x step) is one run of
``train.train_and_evaluate`` of ``configs/dlrm.py`` in a fresh process, set through the config's
public fields (``device_step = 'none'`` for ``noop``: only the host half runs; ``tiny``: MLPs of
width 16). ``feed_samples_per_s`` counts the steps after one pass over the records, as the run's
train records time them, beside the pipeline's stage records (``<stage>_ms``, ``<stage>_cpu_ms``),
the interpreter lock py-spy saw held (``gil_us_per_sample``, ``--gil``), the CPU by thread, and
``floor_ratio`` (samples/s over the bytes a batch must move at one thread's memcpy rate).
``--baseline=DIR`` runs DIR's code with one worker, interleaved (``vs_baseline``); ``--repeats=N``
reports the median of N interleaved runs. A failed setting prints one line naming it and its log;
the others still run and the script exits 1. Prints a table, then one JSON line per setting.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from absl import app, flags
from harness import jobs, outputs
from harness.data import criteo_text
from harness.gil import GilSampler, sampled  # py-spy --gil attached to this process
from harness.ps import Memcpy
from harness.stats import intervals, per_step

_SOURCES = flags.DEFINE_list("sources", ["tsv", "cache", "synthetic"], "Sources: tsv, cache, synthetic.")
_BATCHES = flags.DEFINE_list("batch_sizes", ["2048", "8192", "65536"], "Batch sizes.")
_WORKERS = flags.DEFINE_list("workers", None, "Host worker counts (default: 1 and the core count).")
_STEP = flags.DEFINE_multi_enum("step", ["noop"], ["noop", "tiny"], "Device steps (repeat the flag for both).")
_RECORDS = flags.DEFINE_integer("records", 400_000, "Records of the generated TSV files (one pass: the warm-up).")
_SAMPLES = flags.DEFINE_integer("samples", 2_000_000, "Samples per setting (at least --min_steps steps).")
_MIN_STEPS = flags.DEFINE_integer("min_steps", 12, "Steps per setting at least, warmup included.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 3, "Steps not timed.")
_DATA_DIR = flags.DEFINE_string("data_dir", outputs.default("bench_feed_data"), "Generated files and the cache.")
_BASELINE = flags.DEFINE_string("baseline", None, "A checkout to run with one worker for comparison.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON lines to this file.")
_PNG_OUT = flags.DEFINE_string("png_out", None, "Plot samples/s and stage times against the worker counts (PNG).")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Runs of each setting (the median is reported; of 2, the faster).")
_SETTING = flags.DEFINE_string("setting", None, "(internal) run one setting, given as JSON, in this process.")
_GIL = flags.DEFINE_bool("gil", True, "Sample the interpreter lock over the timed steps with py-spy.")
_GIL_RAW = flags.DEFINE_string("gil_raw_dir", None, "Also keep py-spy's raw stacks of each setting in this folder.")
_CPU_PROFILE = flags.DEFINE_bool("cpu_profile", False, "With --gil_raw_dir: every running thread's stacks there.")
_SMOKE = flags.DEFINE_bool("smoke", False, "A tiny sweep that checks the script runs (the test suite's; no figure).")

SMOKE = {
  "sources": ["cache"],
  "batch_sizes": ["1024"],
  "workers": ["1"],
  "records": 8192,
  "samples": 8192,
  "min_steps": 4,
}
FILE_RECORDS = 100_000
EVAL_RECORDS = 4096
STAGES = ("read", "parse", "prepare", "resolve", "lookup", "place", "get", "push", "wait")


def criteo_files(data_dir: str, records: int, seed: int = 0) -> Dict[str, Any]:
  """Criteo TSV files (``harness.data.criteo_text``) of ``records`` records in all, in files of
  FILE_RECORDS, and one of EVAL_RECORDS, written once and kept."""
  d = os.path.join(data_dir, f"criteo_{records}_{seed}")
  os.makedirs(d, exist_ok=True)
  files = [(f"day_{i}", min(FILE_RECORDS, records - a), i) for i, a in enumerate(range(0, records, FILE_RECORDS))]
  for name, n, i in files + [("eval", EVAL_RECORDS, 999)]:
    path = os.path.join(d, name)
    if not os.path.exists(path):
      with open(path + ".tmp", "wb") as f:
        f.write(criteo_text(n, np.random.default_rng([seed, i])))
      os.replace(path + ".tmp", path)
      outputs.wrote(path)
  train = [os.path.join(d, name) for name, _, _ in files]
  return {
    "train": train,
    "eval": os.path.join(d, "eval"),
    "bytes_per_record": sum(map(os.path.getsize, train)) / records,
  }


def run_setting(s: Dict[str, Any]) -> Dict[str, Any]:
  """Runs the main job for one setting in this process; returns its figures (module docstring)."""
  import jax
  from absl import logging

  # configs and recsys_jax of s["code_root"]: child() runs this process with PYTHONPATH set to it
  from configs import dlrm
  from recsys_jax import train
  from recsys_jax.data import readers
  from recsys_jax.training.pipeline import StalenessGate

  logging.set_verbosity(logging.WARNING)
  B, n, L = s["batch"], s["steps"], s["log_every"]
  c = dlrm.get_config()
  for field in ("device_step", "final_checkpoint"):
    if field not in c:
      raise ValueError(f"this checkout has no config.{field}: bench_feed measures through it")
  # Past the timed steps by more than the feed runs ahead of the loop, so that every stage thread
  # still runs when the window closes at step n (a thread that ended has no CPU time left to read).
  c.batch_size, c.num_steps = B, n + -(-(s["workers"] + 8) // L) * L
  c.checkpoint_every = c.eval_every = 0
  c.final_checkpoint = False
  c.log_every = L
  c.progress_bar = False
  c.eval_batch_size = c.eval_samples = EVAL_RECORDS
  c.host_workers = s["workers"]
  c.device_step = "none" if s["step"] == "noop" else "model"
  if s["step"] == "tiny":
    c.model.kwargs.bottom, c.model.kwargs.top = (16,), (16,)
  if s["source"] in ("tsv", "cache"):
    c.data.name = "criteo"
    c.data.train_files, c.data.eval_files = tuple(s["files"]["train"]), (s["files"]["eval"],)
    c.data.cache_dir = s["cache_dir"] if s["source"] == "cache" else "none"
  workdir = s["workdir"]
  if s["source"] == "cache":  # warm the cache: one pass over every file (quick once an earlier setting did it)
    for _, pos in readers.build_reader(c, workdir=workdir).train():
      if pos["epoch"] >= 1:  # every file read to its end: its manifest and every chunk written
        break
  load0 = os.getloadavg()[0]
  sampler = GilSampler(raw_out=s.get("gil_raw"), native=False, gil_only=not s.get("cpu_profile"))
  run = functools.partial(train.train_and_evaluate, c, workdir)
  _, gil = sampled(run, s["warmup"], n, sampler if s.get("gil") else None)
  recs = train.read_metrics(workdir, "train")
  timed = intervals(recs, s["warmup"], n)  # warmup and n are multiples of L: whole intervals
  steps_timed = sum(k for k, _ in timed)
  if steps_timed != n - s["warmup"]:
    raise RuntimeError(f"train records at {[r['step'] for r in recs]} cover {steps_timed} of {n - s['warmup']} steps")
  elapsed = sum(r["train_s"] for _, r in timed)
  first = intervals(recs, s["first_timed"], s["warmup"])  # the first pass, after the interval that compiled
  first_pass = sum(k for k, _ in first) * B / sum(r["train_s"] for _, r in first) if first else float("nan")
  mean = functools.partial(per_step, timed)  # NaN: the code records no such metric

  tables, features, _ = train.build_specs(c, readers.build_reader(c, workdir=workdir).schema)
  dim, F = min(t.dim for t in tables), len(features)
  rows, bucket = mean("rows_per_step"), mean("bucket_rows_per_step")
  col_bytes = 4 + 4 * c.data.num_dense + 8 * F
  source_bytes = {"tsv": (s["files"] or {}).get("bytes_per_record"), "cache": col_bytes, "synthetic": 0.0}[s["source"]]
  row = 4 * dim
  per_batch = {
    "parse": B * (source_bytes + col_bytes),  # source read, columns written
    "dedup": B * F * (8 + 4) + rows * 8,  # ids read, inverse and distinct ids written
    "lookup": 2 * rows * row,  # rows read from the PS, written to the step's buffer
    "place": 2 * (bucket * row + B * (F * 4 + 4 * c.data.num_dense + 4)),  # host -> device copy
    "get": 2 * bucket * row,  # row gradients device -> host
    "push": rows * row * (1 + 2 + 2),  # gradients read; rows and Adagrad accumulators read + written
  }
  floor_sps = B * s["memcpy_bytes_per_s"] / sum(per_batch.values())
  sps = steps_timed * B / elapsed
  out = {
    "feed_samples_per_s": sps,
    "source": s["source"],
    "batch": B,
    "workers": s["workers"],
    "cores": len(os.sched_getaffinity(0)),
    "step": s["step"],
    "first_pass_samples_per_s": first_pass,
    "distinct_rows_per_batch": rows,
    "floor_samples_per_s": floor_sps,
    "floor_ratio": sps / floor_sps,
    "loop_wait_fraction": mean("host_wait_ms") * steps_timed / 1e3 / elapsed,  # the loop waiting for its next batch
    "load_avg": [load0, os.getloadavg()[0]],
  }
  for stage in STAGES:
    out[f"{stage}_ms"] = mean(f"host_{stage}_ms")
    out[f"{stage}_cpu_ms"] = mean(f"host_{stage}_cpu_ms")
  out["cpu_us_per_sample"] = 1e3 * sum(out[f"{stage}_cpu_ms"] for stage in STAGES) / B
  out["gil_us_per_sample"] = out["process_cpu_us_per_sample"] = out["gil_fraction"] = None
  if gil is not None:
    per_sample = 1e6 / (gil["wall_s"] * sps)  # us per sample of each second of the window
    out["gil_us_per_sample"] = gil["gil_s"] * per_sample
    out["process_cpu_us_per_sample"] = gil["cpu_s"] * per_sample
    out["gil_fraction"] = gil["gil_fraction"]
    out["gil_window_s"] = gil["wall_s"]
    out["gil_top"], out["gil_top_threads"] = gil["top"], gil["top_threads"]
    out["thread_cpu_us_per_sample"] = {k: v * per_sample for k, v in gil["thread_cpu_s"].items()}
    out["minor_faults_per_step"] = gil["minor_faults"] * per_sample * B / 1e6
    out["gc_ms_per_step"] = 1e3 * sum(gil["gc_s"]) * per_sample * B / 1e6
    out["gc_full_collections"] = gil["gc_count"][2]
  if s["step"] == "tiny":  # the step alone on a batch of a fresh job: how long the device is busy
    fresh = train.build_job(c, os.path.join(workdir, "alone"), restore=False)
    pre = fresh.host.train_prefetcher(0, c, StalenessGate(last_applied=-1))
    try:
      _, (_, rows_in, batch) = pre.get()
    finally:
      pre.close()
    state, hot = fresh.state, fresh.hot.tables
    alone = []
    for _ in range(13):
      t0 = time.perf_counter()
      state, hot, g, _ = fresh.train_step(state, hot, rows_in, batch)
      jax.block_until_ready(g)
      alone.append(time.perf_counter() - t0)
    out["step_alone_ms"] = 1e3 * float(np.median(alone[3:]))
    out["device_idle_fraction"] = max(0.0, 1.0 - float(np.median(alone[3:])) * steps_timed / elapsed)
    fresh.ps.close()
  return out


def setting_name(s: Dict[str, Any]) -> str:
  return f"{s['label']} {s['source']} batch {s['batch']} workers {s['workers']} step {s['step']} (run {s['rep'] + 1})"


def child(setting: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], str]:
  """Runs one setting in a fresh process with the code of ``setting['code_root']``, in its own
  workdir, removed after; -> (its figures, '') or (None, why it failed, in one line)."""
  # The setting's checkout first; what the environment adds (packages installed with --target) after it.
  path = os.pathsep.join(p for p in (setting["code_root"], os.environ.get("PYTHONPATH", "")) if p)
  env = dict(os.environ, PYTHONPATH=path, MALLOC_ARENA_MAX="2")
  cmd = [sys.executable, os.path.abspath(__file__), f"--setting={json.dumps(setting)}"]
  try:
    p = subprocess.run(cmd, env=env, cwd=setting["code_root"], capture_output=True, text=True)
  finally:
    shutil.rmtree(setting["workdir"], ignore_errors=True)
  if p.returncode == 0:
    try:
      return json.loads(p.stdout.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
      why = "printed no JSON line"
  else:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    why = f"exit {p.returncode}: {lines[-1].strip() if lines else 'no output'}"
  log = setting["workdir"] + ".log"  # the whole output, for the traceback
  outputs.write_text(log, f"$ {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
  return None, f"{why} (output: {log})"


def print_table(results: List[Dict[str, Any]]) -> None:
  head = f"{'source':9}{'batch':>7}{'wk':>4}{'step':>5}{'code':>6}{'samples/s':>11}{'(runs, k)':>16}{'vs base':>8}"
  head += f"{'floor':>11}{'ratio':>7}{'idle':>6}{'cpu us':>8}{'gil us':>8}"
  print(head + "".join(f"{s:>9}" for s in STAGES) + "   (ms per batch; CPU ms in brackets below)")
  for r in results:
    spread = "-".join(f"{x / 1e3:.0f}" for x in (r["runs_samples_per_s"][0], r["runs_samples_per_s"][-1]))
    line = f"{r['source']:9}{r['batch']:>7}{r['workers']:>4}{r['step']:>5}{r['label']:>6}"
    line += f"{r['feed_samples_per_s']:>11,.0f}{spread:>16}{r.get('vs_baseline', float('nan')):>8.2f}"
    line += f"{r['floor_samples_per_s']:>11,.0f}{r['floor_ratio']:>7.3f}{r.get('device_idle_fraction', 1.0):>6.2f}"
    gil = r["gil_us_per_sample"]
    line += f"{r['cpu_us_per_sample']:>8.3f}{gil if gil is not None else float('nan'):>8.3f}"
    print(line + "".join(f"{r.get(f'{s}_ms', float('nan')):>9.2f}" for s in STAGES))
    print(" " * 106 + "".join(f"{'(%.2f)' % r.get(f'{s}_cpu_ms', float('nan')):>9}" for s in STAGES))


def plot_workers(results: List[Dict[str, Any]], path: str) -> None:
  """Per (source, batch, step): samples/s against the worker counts (left), and each stage's ms a batch
  beside the batch's own time (right): the stage whose line meets the batch's time bounds samples/s."""
  plt = jobs.pyplot()
  series: Dict[tuple, List[Dict[str, Any]]] = {}
  for r in results:
    if r["label"] == "new":
      series.setdefault((r["source"], r["batch"], r["step"]), []).append(r)
  fig, axes = plt.subplots(len(series), 2, figsize=(12, 4 * len(series)), squeeze=False)
  for (left, right), ((source, batch, step), rs) in zip(axes, sorted(series.items())):
    rs = sorted(rs, key=lambda r: r["workers"])
    w = [r["workers"] for r in rs]
    left.plot(w, [r["feed_samples_per_s"] / 1e6 for r in rs], "o-", label="samples/s")
    left.set(xlabel="host workers", ylabel="M samples/s", title=f"{source}, batch {batch}, step {step}")
    right.plot(w, [1e3 * batch / r["feed_samples_per_s"] for r in rs], "k--", lw=2, label="a batch (1/throughput)")
    for stage in STAGES:
      ys = [r.get(f"{stage}_ms", float("nan")) for r in rs]
      if stage != "wait" and any(y > 0 for y in ys):
        right.plot(w, ys, "o-", label=stage)
    right.set(xlabel="host workers", ylabel="ms a batch (wall, on its thread)", title="where a batch's time goes")
    right.legend(fontsize=8)
    for ax in (left, right):
      ax.set_xticks(w)
      ax.grid(alpha=0.3)
  jobs.save_plot(fig, path)


def schedule(records: int, batch: int, workers: int) -> Dict[str, int]:
  """Steps, warm-up and log interval of a setting. The warm-up is one pass over ``records`` (at least
  ``--warmup_steps``); both it and the run end on a train record. The workers fill their queue of
  ``workers + 2`` batches while the first step compiles, so the warm-up also covers the queue, and
  the timed steps are at least three times its length (else they would time batches made before)."""
  queued = workers + 2
  one_pass = max(_WARMUP.value, -(-records // batch), queued)
  every = max(1, -(-one_pass // 2))  # two records a pass (each flushes the pushes); the first compiles, untimed
  warmup = -(-one_pass // every) * every
  timed = max(-(-_SAMPLES.value // batch), _MIN_STEPS.value - warmup, 3 * queued, 1)
  return {"warmup": warmup, "steps": warmup + -(-timed // every) * every, "log_every": every}


def sweep(data_dir: str, bw: float, failed: List[str]) -> Dict[tuple, List[Dict[str, Any]]]:
  """(source, batch, label, workers, step) -> each run's figures, the runs interleaved; a line in ``failed`` per failure."""
  workers = [int(w) for w in (_WORKERS.value or sorted({1, len(os.sched_getaffinity(0))}))]
  files = criteo_files(data_dir, _RECORDS.value) if {"tsv", "cache"} & set(_SOURCES.value) else None
  codes = [("new", outputs.ROOT)] + ([("base", os.path.abspath(_BASELINE.value))] if _BASELINE.value else [])
  common = {
    "first_timed": _WARMUP.value,
    "files": files,
    "cache_dir": os.path.join(data_dir, "cache"),
    "memcpy_bytes_per_s": bw,
    "gil": _GIL.value,
  }
  runs: Dict[tuple, List[Dict[str, Any]]] = {}
  os.makedirs(data_dir, exist_ok=True)  # synthetic alone writes no files there, so nothing else made it
  work = tempfile.mkdtemp(prefix="work_", dir=data_dir)  # each setting's workdir, removed after it
  try:
    for source, batch, rep in itertools.product(
      _SOURCES.value, (int(b) for b in _BATCHES.value), range(_REPEATS.value)
    ):
      for label, root in codes[::-1]:  # the baseline first, then this checkout's worker counts
        for w, step in itertools.product([1] if label == "base" else workers, _STEP.value):
          setting = {
            **common,
            **schedule(_RECORDS.value, batch, w),
            "label": label,
            "rep": rep,
            "source": source,
            "batch": batch,
            "workers": w,
            "step": step,
            "code_root": root,
            "workdir": os.path.join(work, f"{len(failed) + sum(map(len, runs.values()))}"),
          }
          if _GIL_RAW.value:
            name = f"gil_{label}_{source}_{batch}_w{w}_{step}_r{rep}.txt"
            setting["gil_raw"] = os.path.abspath(os.path.join(_GIL_RAW.value, name))
            setting["cpu_profile"] = _CPU_PROFILE.value
          print(f"{setting_name(setting)} ...", file=sys.stderr, flush=True)
          r, why = child(setting)
          if setting.get("gil_raw") and os.path.exists(setting["gil_raw"]):
            outputs.wrote(setting["gil_raw"])
          if r is None:
            failed.append(f"setting {setting_name(setting)} failed: {why}")
            print(failed[-1], file=sys.stderr, flush=True)
            continue
          r["label"] = label
          runs.setdefault((source, batch, label, w, step), []).append(r)
  finally:
    if not os.listdir(work):  # logs of failed settings stay beside their names
      os.rmdir(work)
  return runs


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _SETTING.value:
    print(json.dumps(run_setting(json.loads(_SETTING.value))), flush=True)
    return
  if _SMOKE.value:  # a tiny sweep (the test suite's): flags given on the command line still win
    for name, value in SMOKE.items():
      if not flags.FLAGS[name].present:
        flags.FLAGS[name].value = value
  data_dir = os.path.abspath(_DATA_DIR.value)
  bw = Memcpy(1).best()
  print(
    f"{len(os.sched_getaffinity(0))} cores, memcpy {bw / 1e9:.1f} GB/s (read + written), load {os.getloadavg()}",
    file=sys.stderr,
  )
  failed: List[str] = []
  runs = sweep(data_dir, bw, failed)
  results = []
  for (source, batch, label, _, step), rs in runs.items():
    rs = sorted(rs, key=lambda r: r["feed_samples_per_s"])
    r = dict(rs[len(rs) // 2])  # the median run, whole (of an even number, the faster middle one)
    r["runs_samples_per_s"] = [x["feed_samples_per_s"] for x in rs]
    base = runs.get((source, batch, "base", 1, step))
    if label == "new" and base:
      r["vs_baseline"] = r["feed_samples_per_s"] / sorted(x["feed_samples_per_s"] for x in base)[len(base) // 2]
    results.append(r)
  print()
  print_table(results)
  print(f"load average at the end: {os.getloadavg()}\n")
  lines = [json.dumps(r) for r in results]
  if _JSON_OUT.value:
    outputs.write_text(_JSON_OUT.value, "\n".join(lines) + "\n")
  if _PNG_OUT.value and results:
    plot_workers(results, _PNG_OUT.value)
  for line in lines + failed:  # the failed settings again at the end, where a reader of the table looks
    print(line)
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
