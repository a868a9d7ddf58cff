"""The main job with tables larger than their RAM cache: the disk tier against all in RAM, in one run.

    python experiments/bench_tier_train.py [--num_steps=200] [--fractions=2,4,8,16,32] [--rounds=3]
        [--staleness=0] [--eval_samples=32768] [--read_ahead=N] [--without_read_ahead=4,16]
        [--config=configs/dlrm.py] [--config.FIELD=VALUE ...] [--json_out=FILE] [--png_out=FILE] [--workdir=DIR]

Run from the repository root. The job of ``--config`` runs by ``python -m recsys_jax.main`` in a fresh
process per run (``--num_steps`` steps, no hot rows, one eval at the end), as variants: ``ram`` (all
rows in RAM); ``1/F`` for each F of ``--fractions`` (tables over the disk tier, one capacity for
every table, the largest at which the RAM cache holds at most 1/F of all rows: sum_t min(rows_t, C);
a table's rows are the distinct ids of the run's batches); ``1/F ra0`` for each F of
``--without_read_ahead`` (``ps.read_ahead=0``; ``--read_ahead`` sets it for the other tier runs).
``--rounds`` rounds run each variant once, every other round reversed, after a one-step RAM-only
run (the memory bound's baseline). The runs ask XLA for deterministic ops; ``--compilation_cache``
lets them use JAX's persistent cache (off: a run that compiles peaks higher, as the bound must see).

Per variant, from what the job records: samples/s and its ratio to the same round's RAM-only run
(medians over rounds; ``ratio_4x``, ``ratio_16x``, ``meets_0_8_at_4x``, and without read-ahead); eval
AUC and logloss compared with ``==`` to RAM-only (``auc_identical``: at staleness 0 the tier changes
timing only); peak RSS (VmHWM at exit) against the bound docs/parameter-server.md states (the peak
after one step + cache rows x (row + slots + 40 B) + 128 MiB: ``rss_within_bound``), and the largest
RssAnon / RssFile polled every 0.1 s; the RAM cache's hit rate (without the rows a read-ahead
brought), ms per lookup, the waits of the loop (for batches) and of the lookups (on the tier), and
the read-ahead's counters. A table on stderr; the JSON to ``--json_out`` and the last stdout line;
a PNG of samples/s and hit rate against the cache fraction to ``--png_out``.
"""

from __future__ import annotations

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
from harness import jobs, outputs, stats
from ml_collections import config_flags

from recsys_jax.async_ps.optim import optimizers
from recsys_jax.data import synthetic

_CONFIG = config_flags.DEFINE_config_file("config", "configs/dlrm.py", "The main job's ml_collections config file.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 200, "Training steps of every run.")
flags.DEFINE_list("fractions", ["2", "4", "8", "16", "32"], "F: runs with 1/F of all rows in RAM.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds; each runs every variant once.")
_STALENESS = flags.DEFINE_integer("staleness", 0, "config.staleness of every run (0: results must be equal).")
_EVAL_SAMPLES = flags.DEFINE_integer("eval_samples", 32768, "config.eval_samples of every run (0: the config's).")
_READ_AHEAD = flags.DEFINE_integer("read_ahead", None, "config.ps.read_ahead of the tier runs (default: the config's).")
flags.DEFINE_list("without_read_ahead", [], "F: also run 1/F with config.ps.read_ahead=0 (variant '1/F ra0').")
_COMPILATION_CACHE = flags.DEFINE_bool("compilation_cache", False, "Let the runs use JAX's persistent cache.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the runs' workdirs go (default: a temp dir, removed).")
_JSON_OUT = flags.DEFINE_string("json_out", outputs.default("bench_tier_train.json"), "The JSON result.")
_PNG_OUT = flags.DEFINE_string("png_out", outputs.default("bench_tier_train.png"), "samples/s, hit rate vs fraction.")

# docs/parameter-server.md: peak RSS <= the job's peak after one step + cache rows x (row + slots + 40 B) + 128 MiB.
BOUND_SLACK = 128 << 20
BOUND_PER_ROW = 40
BOUND_DOC = "docs/parameter-server.md, Memory bound"
STORAGE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The read-ahead's counters in the "ps" records (of tier runs).
READ_AHEAD_KEYS = ("tier_reads", "read_ahead_rows", "read_ahead_hits", "read_ahead_skipped", "read_ahead_late")
READ_AHEAD_KEYS += ("reads_in_flight", "read_ahead_pinned", "write_behind_rows")

# Runs recsys_jax.main as `python -m recsys_jax.main ARGS` does; as it exits, after the job and its threads,
# writes the process's peak RSS (VmHWM, since its exec) and its resident anonymous and file pages to argv[1].
_CHILD = r"""
import atexit, json, runpy, sys
out = sys.argv[1]
def _memory():
  keys = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")
  try:
    with open("/proc/self/status") as f:
      mem = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.split(":")[0] in keys}
  except OSError:
    import resource
    mem = {"VmHWM": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
  with open(out, "w") as f:
    json.dump(mem, f)
atexit.register(_memory)
sys.argv = ["recsys_jax.main"] + sys.argv[2:]
runpy.run_module("recsys_jax.main", run_name="__main__", alter_sys=True)
"""


def table_rows(config, steps: int) -> Tuple[Dict[str, int], Dict[str, int]]:
  """Per table: the distinct ids of train batches 0 .. steps-1 (its rows), and the most of one batch."""
  if config.data.name != "synthetic":
    raise app.UsageError(f"config.data.name = {config.data.name!r}: the rows per table are counted on synthetic data")
  data = synthetic.build({k: v for k, v in dict(config.data).items() if k in synthetic.FIELDS})
  feats = config.embeddings.features
  table = {n: (feats[n].get("table", n) if n in feats else n) for n in data.feature_names}
  seen: Dict[str, List[np.ndarray]] = {t: [] for t in table.values()}  # per table, per step: its distinct ids
  for i in range(steps):
    b = data.batch(synthetic.TRAIN, i, int(config.batch_size))
    weights, step = b.get("sparse_weights", {}), {t: [] for t in seen}
    for n in data.feature_names:
      step[table[n]].append(b["sparse"][n][weights[n] > 0] if n in weights else b["sparse"][n].ravel())
    for t, v in step.items():
      seen[t].append(np.unique(np.concatenate(v)))
  step_max = {t: max(len(u) for u in v) for t, v in seen.items()}
  return {t: len(np.unique(np.concatenate(v))) for t, v in seen.items()}, step_max


def capacity_for(rows: Dict[str, int], fraction: float) -> int:
  """The largest C >= 1 with sum_t min(rows_t, C) <= fraction * sum_t rows_t."""
  r = np.sort(np.asarray(list(rows.values()), np.int64))
  budget = fraction * r.sum()
  lo, hi = 1, int(r.max())
  while lo < hi:  # cache rows grow with C: the last C within the budget
    mid = (lo + hi + 1) // 2
    if np.minimum(r, mid).sum() <= budget:
      lo = mid
    else:
      hi = mid - 1
  return lo


def row_bytes(config) -> int:
  """Bytes of one cached row as the stated bound counts them: weights + optimizer slots + 40 B."""
  e = config.embeddings
  dim = int(e.dim)
  slots = optimizers.make(e.optimizer, learning_rate=float(e.learning_rate)).init(1, dim)
  return STORAGE_BYTES[e.storage_dtype] * dim + int(sum(np.asarray(s).nbytes for s in slots.values())) + BOUND_PER_ROW


def _status(pid: int, keys) -> Dict[str, int]:
  """Fields of /proc/PID/status in bytes ({} once the process is gone, or off Linux)."""
  try:
    with open(f"/proc/{pid}/status") as f:
      return {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.split(":")[0] in keys}
  except (OSError, ValueError, IndexError):
    return {}


def run_job(name: str, workdir: str, args: List[str], env: Dict[str, str]) -> Dict[str, Any]:
  """One ``python -m recsys_jax.main`` run in ``workdir`` (removed after): its figures and its peak RSS."""
  print(f"  {os.path.basename(workdir)}:", file=sys.stderr, end="", flush=True)
  os.makedirs(workdir)
  mem_file, log = os.path.join(workdir, "memory.json"), os.path.join(workdir, "run.log")
  cmd = [sys.executable, "-c", _CHILD, mem_file, f"--workdir={workdir}", *args]
  t0 = time.perf_counter()
  polled = {"RssAnon": 0, "RssFile": 0}
  with open(log, "w") as f:
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    while p.poll() is None:  # the largest anonymous and file-backed resident memory seen, every 0.1 s
      for k, v in _status(p.pid, tuple(polled)).items():
        polled[k] = max(polled[k], v)
      time.sleep(0.1)
  wall = time.perf_counter() - t0
  if p.returncode != 0:
    with open(log) as f:
      tail = f.read()[-3000:]
    raise SystemExit(f"error: run {name} exited {p.returncode} (log {log}):\n{tail}")
  with open(os.path.join(workdir, "summary.json")) as f:
    s = json.load(f)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    recs = [json.loads(line) for line in f if line.strip()]
  ps = [r for r in recs if r["kind"] == "ps"][-1]
  with open(mem_file) as f:
    mem = json.load(f)
  shutil.rmtree(workdir, ignore_errors=True)
  r = {
    "name": name,
    "samples_per_sec": s["samples_per_sec"],
    "auc": s["auc"],
    "logloss": s["logloss"],
    "ps_rows": s["ps_rows"],
    "ps_tier_rows": s["ps_tier_rows"],
    "ps_bytes": s["ps_bytes"],
    # The RAM cache's own: rows a read-ahead brought from the tier are not its hits.
    "hit_rate": ps.get("cache_hit_rate", ps["hit_rate"]),
    "evictions": ps["evictions"],
    "lookup_ms": ps["lookup_ms"],
    "loop_wait_ms_per_step": stats.per_step(
      stats.intervals([r for r in recs if r["kind"] == "train"]), "host_wait_ms", 0.0
    ),
    "tier_wait_s": s["ps_tier_wait_s"],
    "tier_wait_ms_per_step": 1e3 * s["ps_tier_wait_s"] / max(1, s["steps_this_run"]),
    **{k: ps[k] for k in READ_AHEAD_KEYS if k in ps},
    "peak_rss": mem["VmHWM"],
    # What the peak is made of: the largest anonymous and file-backed resident memory polled, and both at exit.
    "polled_max_rss_anon": polled["RssAnon"],
    "polled_max_rss_file": polled["RssFile"],
    "exit_rss_anon": mem.get("RssAnon"),
    "exit_rss_file": mem.get("RssFile"),
    "wall_s": wall,
    "load_avg": os.getloadavg()[0],
  }
  print(
    f" {stats.fmt(r['samples_per_sec'], ',.0f')} samples/s, hit rate {r['hit_rate']:.4f}, peak {_mib(r['peak_rss'])} MiB (anon "
    f"{_mib(r['polled_max_rss_anon'])}, file {_mib(r['polled_max_rss_file'])} MiB at most), {wall:.0f} s, "
    f"load {r['load_avg']:.1f}",
    file=sys.stderr,
  )
  return r


def _mib(x: Optional[float]) -> str:
  return stats.fmt(None if x is None else x / 2**20, ",.0f")


def plot(path: str, variants: Dict[str, Dict[str, Any]], fractions: List[int]) -> None:
  plt = jobs.pyplot()
  ram = variants["ram"]
  x = [1.0 / f for f in fractions]
  fig, (a1, a2) = plt.subplots(2, 1, figsize=(6.4, 6.4), sharex=True)
  for f, xi in zip(fractions, x):
    runs = variants[f"1/{f}"]["runs"]
    a1.scatter([xi] * len(runs), [r["samples_per_sec"] for r in runs], s=10, color="tab:blue", alpha=0.4)
  a1.plot(x, [variants[f"1/{f}"]["samples_per_sec"] for f in fractions], "o-", color="tab:blue", label="tier (median)")
  a1.axhline(ram["samples_per_sec"], color="k", ls="--", label="all in RAM (median)")
  a1.axhline(0.8 * ram["samples_per_sec"], color="tab:red", ls=":", label="0.8 x all in RAM")
  a1.set(ylim=(0, None), ylabel="samples/s", title="main job, tables over the disk tier against all in RAM")
  a1.legend(fontsize=8)
  a2.plot(x, [variants[f"1/{f}"]["hit_rate"] for f in fractions], "o-", color="tab:green", label="tier")
  a2.axhline(ram["hit_rate"], color="k", ls="--", label="all in RAM (misses: new rows)")
  a2.set(ylabel="PS hit rate", xlabel="RAM cache / all rows")
  a2.set_xscale("log", base=2)
  a2.set_xticks(x, [f"1/{f}" for f in fractions])
  a2.legend(fontsize=8)
  jobs.save_plot(fig, path, dpi=120)


def _ints(flag) -> List[int]:
  try:
    return sorted({int(f) for f in flag.value})
  except ValueError:
    raise app.UsageError(f"--{flag.name}={','.join(flag.value)}: integers F (1/F of the rows in RAM)") from None


# Medians over a variant's runs of these figures of a run (``run_job``).
MEDIANS = ("samples_per_sec", "hit_rate", "lookup_ms", "loop_wait_ms_per_step", "tier_wait_ms_per_step")
MEDIANS += ("polled_max_rss_anon", "polled_max_rss_file", "exit_rss_file", "exit_rss_anon")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  steps, rounds = _NUM_STEPS.value, _ROUNDS.value
  if steps < 2 or rounds < 1:
    raise app.UsageError("--num_steps must be >= 2 (the first step compiles) and --rounds >= 1")
  fractions, without = _ints(flags.FLAGS["fractions"]), _ints(flags.FLAGS["without_read_ahead"])
  if not fractions or fractions[0] < 2 or not set(without) <= set(fractions):
    raise app.UsageError("--fractions: integers F >= 2; --without_read_ahead: some of them")
  overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
  if any("=" not in a for a in overrides):
    raise app.UsageError(f"{[a for a in overrides if '=' not in a][0]}: write --config.FIELD=VALUE")
  read_ahead = _READ_AHEAD.value if _READ_AHEAD.value is not None else config.ps.read_ahead

  rows, step_rows = table_rows(config, steps)
  total, biggest, per_row = sum(rows.values()), max(rows.values()), row_bytes(config)
  caps = {f: capacity_for(rows, 1.0 / f) for f in fractions}
  cache_rows = {f: int(sum(min(r, caps[f]) for r in rows.values())) for f in fractions}
  # A step's rows are never evicted (the PS's protect_steps), so a table keeps at least one step's rows in RAM.
  least_rows = {f: int(sum(min(r, max(caps[f], step_rows[t])) for t, r in rows.items())) for f in fractions}

  base = [f"--config={flags.FLAGS['config'].config_filename}", *overrides]
  base += [f"--config.num_steps={steps}", "--config.progress_bar=false", "--config.hot_rows_bytes=0"]
  base += ["--config.checkpoint_every=0", "--config.final_checkpoint=false", "--config.eval_every=0"]
  base += [f"--config.staleness={_STALENESS.value}"]
  base += [f"--config.eval_samples={_EVAL_SAMPLES.value}"] if _EVAL_SAMPLES.value else []
  args, frac = {"ram": base}, {"ram": None}
  for f in fractions + without:
    name = f"1/{f}" if f"1/{f}" not in args else f"1/{f} ra0"
    tier = [f"--config.embeddings.capacity={caps[f]}", "--config.ps.tier=tier"]
    ra = 0 if name.endswith("ra0") else _READ_AHEAD.value
    args[name], frac[name] = base + tier + ([] if ra is None else [f"--config.ps.read_ahead={ra}"]), f
  env = dict(os.environ)
  # GPU scatter-adds (row gradients) use atomics, whose order changes from run to run: "equal to the bit" needs this.
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true".strip()
  if not _COMPILATION_CACHE.value:
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  names = list(args)

  B = int(config.batch_size)
  print(
    f"config {flags.FLAGS['config'].config_filename}: batch {B} x {len(rows)} tables, {steps} steps, "
    f"staleness {_STALENESS.value}, {total:,} rows in all (largest table {biggest:,}), read_ahead {read_ahead}",
    file=sys.stderr,
  )
  t_start = time.perf_counter()
  runs: Dict[str, List[Dict[str, Any]]] = {n: [] for n in names}

  with tempfile.TemporaryDirectory(prefix="bench_tier_train_") as tmp:
    root = _WORKDIR.value or tmp
    baseline = run_job("baseline", os.path.join(root, "baseline_1step"), base + ["--config.num_steps=1"], env)
    for i in range(rounds):
      for name in names if i % 2 == 0 else names[::-1]:
        wd = os.path.join(root, f"r{i}_{name.replace('/', 'of').replace(' ', '_')}")
        runs[name].append(run_job(name, wd, args[name], env))
  elapsed = time.perf_counter() - t_start
  if runs["ram"][0]["ps_rows"] != total:
    raise SystemExit(f"error: {total:,} rows counted, not the RAM-only run's {runs['ram'][0]['ps_rows']:,}")

  ram = runs["ram"]
  variants: Dict[str, Dict[str, Any]] = {}
  for name in names:
    rs, f = runs[name], frac[name]
    cap_rows = total if f is None else cache_rows[f]
    bound = baseline["peak_rss"] + cap_rows * per_row + BOUND_SLACK
    ratios = [r["samples_per_sec"] / q["samples_per_sec"] for r, q in zip(rs, ram)]
    v = variants[name] = {
      "capacity": None if f is None else caps[f],
      "cache_rows": cap_rows,
      "rows_over_cache": total / cap_rows,
      "largest_table_over_capacity": None if f is None else biggest / caps[f],
      "least_ram_rows": total if f is None else least_rows[f],
      "ram_rows_end": stats.median_of(rs, "ps_rows"),
      **{k: stats.median_of(rs, k) for k in MEDIANS},
      "ratio_to_ram": stats.median(ratios),
      "ratios_by_round": ratios,
      "peak_rss": int(max(r["peak_rss"] for r in rs)),
      "rss_bound": int(bound),
      "auc": rs[0]["auc"],
      "logloss": rs[0]["logloss"],
      "auc_identical_to_ram": all(r["auc"] == q["auc"] and r["logloss"] == q["logloss"] for r, q in zip(rs, ram)),
      "max_auc_diff": float(max(abs(r["auc"] - q["auc"]) for r, q in zip(rs, ram))),
      "runs": rs,
    }
    v["rss_within_bound"] = v["peak_rss"] <= bound
  tiers, ratio = names[1:], {n: v["ratio_to_ram"] for n, v in variants.items()}
  ram_same = all(r["auc"] == ram[0]["auc"] and r["logloss"] == ram[0]["logloss"] for r in ram)
  result = {
    "config": flags.FLAGS["config"].config_filename,
    "batch_size": B,
    "tables": len(rows),
    "num_steps": steps,
    "rounds": rounds,
    "staleness": _STALENESS.value,
    "read_ahead": read_ahead,
    "fractions": fractions,
    "total_rows": total,
    "largest_table_rows": biggest,
    "step_rows_max": int(sum(step_rows.values())),
    "ratio_4x": ratio.get("1/4"),
    "ratio_16x": ratio.get("1/16"),
    "ratio_4x_without_read_ahead": ratio.get("1/4 ra0"),
    "ratio_16x_without_read_ahead": ratio.get("1/16 ra0"),
    "meets_0_8_at_4x": None if "1/4" not in ratio else bool(ratio["1/4"] >= 0.8),
    "auc_identical": all(variants[t]["auc_identical_to_ram"] for t in tiers) and ram_same,
    "ram_runs_identical": ram_same if len(ram) > 1 else None,  # one RAM-only run: nothing to compare
    "rss_within_bound": all(variants[t]["rss_within_bound"] for t in tiers),
    "rss_bound_source": BOUND_DOC,
    "rss_baseline_1step": baseline["peak_rss"],
    "rss_bound_row_bytes": per_row,
    "rss_bound_slack": BOUND_SLACK,
    "elapsed_s": elapsed,
    "variants": variants,
  }
  report(result, names, without)
  outputs.write_json(_JSON_OUT.value, result)
  plot(_PNG_OUT.value, variants, fractions)
  print(json.dumps(result), flush=True)


def report(result: Dict[str, Any], names: List[str], without: List[int]) -> None:
  """The table and the checks, on stderr."""
  variants, tiers = result["variants"], names[1:]
  lines = [
    f"\n{result['num_steps']} steps of batch {result['batch_size']}, {result['rounds']} rounds alternated, "
    f"k={result['staleness']}; {result['total_rows']:,} rows in all; ratios paired per round, medians; "
    f"{result['elapsed_s']:.0f} s",
    f"{'variant':8}{'capacity':>9}{'rows/cache':>11}{'big/cap':>8}{'RAM rows':>9}{'samples/s':>11}{'x RAM':>7}"
    f"{'hit rate':>9}{'lookup ms':>10}{'wait ms/st':>11}{'tier ms/st':>11}{'peak MiB':>9}{'bound MiB':>10}{'AUC ==':>7}",
  ]
  for name in names:
    v = variants[name]
    lines.append(
      f"{name:8}{stats.fmt(v['capacity'], ',d'):>9}{v['rows_over_cache']:>11.2f}"
      f"{stats.fmt(v['largest_table_over_capacity'], '.1f'):>8}{v['ram_rows_end']:>9,.0f}"
      f"{v['samples_per_sec']:>11,.0f}{v['ratio_to_ram']:>7.3f}{v['hit_rate']:>9.4f}{v['lookup_ms']:>10.2f}"
      f"{v['loop_wait_ms_per_step']:>11.2f}{v['tier_wait_ms_per_step']:>11.2f}{_mib(v['peak_rss']):>9}"
      f"{_mib(v['rss_bound']):>10}{'yes' if v['auc_identical_to_ram'] else 'NO':>7}"
    )
  met = {True: "met", False: "NOT met", None: "not run"}[result["meets_0_8_at_4x"]]
  ra = [stats.fmt(result[f"ratio_{x}x_without_read_ahead"], ".3f") for x in (4, 16)]
  over = [t for t in tiers if not variants[t]["rss_within_bound"]]
  lines += [
    f"RAM rows: at the end (median), at least one step's rows ({result['step_rows_max']:,} at most); rows/cache: "
    "all rows over sum_t min(rows_t, capacity); big/cap: the largest table over the capacity",
    f"x RAM at 1/4: {stats.fmt(result['ratio_4x'], '.3f')} (>= 0.8: {met}); at 1/16: "
    f"{stats.fmt(result['ratio_16x'], '.3f')}"
    + (f"; without read-ahead {ra[0]} at 1/4, {ra[1]} at 1/16" if without else ""),
    f"AUC and logloss equal to RAM-only, bit for bit: {'yes' if result['auc_identical'] else 'NO'} "
    f"(AUC {variants['ram']['auc']!r}; max |diff| {max(variants[t]['max_auc_diff'] for t in tiers):.3g})",
    f"memory bound ({BOUND_DOC}): peak <= {_mib(result['rss_baseline_1step'])} MiB (this job after one step) "
    f"+ cache rows x {result['rss_bound_row_bytes']} B + 128 MiB: "
    + ("met by every tier run" if not over else f"NOT met at {', '.join(over)} (by the largest run's peak)"),
  ]
  print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
