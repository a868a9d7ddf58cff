"""Where parameter-server table capacity comes from: host RAM per row, and a disk tier beyond it.

    python experiments/capacity.py [--full] [--ram_budget_gib=4] [--batches=12] [--json_out=FILE] [--png_out=FILE]

Each table is built in a fresh worker process (this script with ``--worker``), so its RSS growth is
that table's. [1] bytes per row and per parameter of a RAM-only table for three optimizer / storage
configs, against the ideal (``overhead``); [2] the rows MemAvailable would hold (an EXTRAPOLATION),
then the largest table whose peak fits ``--ram_budget_gib``, created and timed; [3] a RAM cache of
``--cache_rows`` over the disk tier, K times that in all (``--tier_k``): peak RSS, rows/s, hit rate,
bytes per spilled row, and the capacity free disk and RAM would allow (an EXTRAPOLATION); [4] rows/s
of prefilled RAM-only tables of ``--ram_rows``: Zipf(1.1) batches, one ``lookup_many`` +
``apply_many`` each. ``--full``: larger sizes. Prints a table per step (stderr), writes
``--json_out`` and ``--png_out``, and last on stdout one JSON line of the headline figures.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np
from absl import app, flags
from harness import data, jobs, outputs
from harness.ps import grads, prefill, proc_bytes

_FULL = flags.DEFINE_bool("full", False, "Larger sizes (see the module docstring).")
_DIM = flags.DEFINE_integer("dim", 64, "Row width.")
_ROWS_BPP = flags.DEFINE_integer("rows_bpp", 1 << 20, "Rows for the bytes-per-parameter step.")
_BUDGET = flags.DEFINE_float("ram_budget_gib", None, "Peak RSS growth budget of the largest table (4; --full 6).")
_RAM_ROWS = flags.DEFINE_list("ram_rows", None, "RAM-only table sizes (100000,1000000,4000000; --full adds 8M).")
_CACHE = flags.DEFINE_integer("cache_rows", None, "RAM cache rows of the tiered tables (131072; --full 1Mi).")
_TIER_K = flags.DEFINE_list("tier_k", ["1", "2", "4", "8"], "Tiered table sizes, in multiples of the cache.")
_BATCHES = flags.DEFINE_integer("batches", 12, "Timed batches per table.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed batches first.")
_BATCH = flags.DEFINE_integer("batch_size", 4096, "Samples per batch.")
_FEATURES = flags.DEFINE_integer("features", 26, "Ids per sample (all into one table).")
_ALPHA = flags.DEFINE_float("zipf_alpha", 1.1, "Zipf exponent of id frequencies.")
_JSON_OUT = flags.DEFINE_string("json_out", outputs.default("capacity.json"), "JSON result file.")
_PNG_OUT = flags.DEFINE_string("png_out", outputs.default("capacity.png"), "Plot file.")
_WORKER = flags.DEFINE_string("worker", None, "Internal: run one measurement (a JSON job) and print JSON.")

_CONFIGS = [("adagrad", "float32"), ("rowwise_adagrad", "float32"), ("adagrad", "bfloat16")]


def _disk_bytes(path: str) -> Dict[str, int]:
  """Allocated bytes (st_blocks) under ``path`` by zarr array (``weights``, ``slot_*``)."""
  out: Dict[str, int] = {}
  for root, _, files in os.walk(path):
    rel = os.path.relpath(root, path).split(os.sep)
    key = next((p for p in rel if p == "weights" or p.startswith("slot_")), "other")
    for name in files:
      out[key] = out.get(key, 0) + os.stat(os.path.join(root, name)).st_blocks * 512
  return out


def _worker(job: Dict) -> Dict:
  """Builds (and with ``job["time"]`` times) one table in this process; its figures."""
  from recsys_jax.async_ps.optim import optimizers
  from recsys_jax.async_ps.store.ps import ParameterServer
  from recsys_jax.embeddings.specs import TableSpec, storage_numpy_dtype

  dim, rows, cache = job["dim"], job["rows"], job.get("cache", 0)
  slots = optimizers.make(job["opt"], learning_rate=0.05).init(1, dim)
  # The ideal row: its weights, its optimizer slots, and 16 bytes of id map (an 8-byte id, an 8-byte row number).
  ideal = dim * storage_numpy_dtype(job["dtype"]).itemsize + sum(v.nbytes for v in slots.values()) + 16
  spec = TableSpec(name="t", dim=dim, optimizer=job["opt"], storage_dtype=job["dtype"], capacity=cache)
  # Workload drawn first, so its arrays are in the baseline and not counted as table bytes.
  n = job["warmup"] + job["batches"]
  batches = [b["t00"] for b in data.zipf_batches(n, rows, job["alpha"], job["samples"], 1)] if job["time"] else []
  tmp = tempfile.TemporaryDirectory(prefix="capacity_tier_") if cache else None
  tier = {"driver": "file", "path": tmp.name} if tmp else None
  # Warm-up on a throwaway table: loading the compiled kernels (and tensorstore's drivers)
  # costs tens of MB of RSS once per process, which must not be charged to the table's rows.
  warm = ParameterServer(
    [TableSpec(name="w", dim=dim, optimizer=job["opt"], storage_dtype=job["dtype"], capacity=2048 if cache else 0)],
    tier=tier,
  )
  for s in range(1, 9):
    w = data.hashed(np.arange(s * 1024, (s + 1) * 1024) % 5000, 0)
    warm.lookup_many({"w": w}, create=True, step=s)
    warm.apply_many({"w": (w, np.zeros((len(w), dim), np.float32))}, step=s)
  warm.close()
  del warm
  ps = ParameterServer([spec], tier=tier)
  rss0, hwm0 = proc_bytes("VmRSS"), proc_bytes("VmHWM")
  t0 = time.perf_counter()
  # Chunks stay well under the cache's 20% eviction slack.
  first = prefill(ps, ["t"], rows, min(1 << 16, max(1024, cache // 8)) if cache else 1 << 16)
  out = {
    **job,
    "ideal_row_bytes": ideal,
    "create_s": time.perf_counter() - t0,
    "rss_base": rss0,
    "rss_growth": proc_bytes("VmRSS") - rss0,
    "hwm_growth": proc_bytes("VmHWM") - hwm0,
    "ps_bytes": ps.stats()["t"]["bytes"],
  }
  if batches:
    g = grads(max(len(b) for b in batches), dim)
    t_lookup = t_apply = 0.0
    n = 0
    for i, b in enumerate(batches):
      if i == job["warmup"]:
        st0 = ps.stats()["t"]
      t1 = time.perf_counter()
      ps.lookup_many({"t": b}, create=True, step=first + i)
      t2 = time.perf_counter()
      ps.apply_many({"t": (b, g[: len(b)])}, step=first + i)
      t3 = time.perf_counter()
      if i >= job["warmup"]:
        t_lookup, t_apply, n = t_lookup + t2 - t1, t_apply + t3 - t2, n + len(b)
    st = ps.stats()["t"]
    out.update(
      distinct_per_batch=n / job["batches"],
      lookup_rows_per_s=n / t_lookup,
      apply_rows_per_s=n / t_apply,
      rows_per_s=n / (t_lookup + t_apply),
      hit_rate=(st["hits"] - st0["hits"]) / (st["lookups"] - st0["lookups"]),
      ram_rows=int(st["rows"]),
      tier_rows=int(st["tier_rows"]),
    )
  out["peak_rss"] = proc_bytes("VmHWM")
  out["rss_end"] = proc_bytes("VmRSS")
  garbage = int(ps.shards[0]["t"].tier.stats()["garbage_rows"]) if tmp else 0
  ps.close()  # flushes the tier's pending chunks, so the directory holds every row
  if tmp is not None:
    out["disk_bytes_by_array"] = _disk_bytes(tmp.name)
    out["disk_bytes"] = sum(out["disk_bytes_by_array"].values())
    out["disk_garbage_rows"] = garbage
    tmp.cleanup()
  return out


def _run_worker(job: Dict) -> Dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--worker=" + json.dumps(job)]
  p = subprocess.run(cmd, capture_output=True, text=True)
  if p.returncode:
    raise RuntimeError(f"worker {job} failed:\n{p.stderr[-3000:]}")
  return json.loads(p.stdout.strip().splitlines()[-1])


_log = functools.partial(print, file=sys.stderr, flush=True)


def _plot(path: str, ram: List[Dict], tier: List[Dict], cache: int) -> None:
  fig, (a, b) = jobs.pyplot().subplots(1, 2, figsize=(11, 4.2))
  a.plot([r["rows"] for r in ram], [r["rows_per_s"] / 1e6 for r in ram], "o-", label="RAM only")
  a.plot([r["rows"] for r in tier], [r["rows_per_s"] / 1e6 for r in tier], "s-", label=f"tier, cache {cache:,} rows")
  a.set(
    xscale="log", yscale="log", xlabel="table rows", ylabel="lookup+apply, M rows/s", title="Throughput vs table size"
  )
  b.plot([r["rows"] for r in ram], [r["peak_rss"] / 2**30 for r in ram], "o-", label="RAM only, peak RSS")
  b.plot([r["rows"] for r in ram], [r["rss_end"] / 2**30 for r in ram], "o--", label="RAM only, end RSS")
  b.plot([r["rows"] for r in tier], [r["peak_rss"] / 2**30 for r in tier], "s-", label="tier, peak RSS")
  b.set(xlabel="table rows", ylabel="GiB", title="Process RSS vs table rows (adagrad, float32)")
  for ax in (a, b):
    ax.grid(alpha=0.3)
    ax.legend()
  jobs.save_plot(fig, path)


def main(argv):
  del argv
  if _WORKER.value:
    print(json.dumps(_worker(json.loads(_WORKER.value))))
    return
  t_start = time.perf_counter()
  full, dim = _FULL.value, _DIM.value
  budget = _BUDGET.value if _BUDGET.value is not None else (6.0 if full else 4.0)
  ram_sizes = [int(x) for x in (_RAM_ROWS.value or (["100000", "1000000", "4000000"] + (["8000000"] if full else [])))]
  cache = _CACHE.value or ((1 << 20) if full else (1 << 17))
  avail, total = proc_bytes("MemAvailable", "/proc/meminfo"), proc_bytes("MemTotal", "/proc/meminfo")
  base = dict(
    dim=dim,
    alpha=_ALPHA.value,
    samples=_BATCH.value * _FEATURES.value,
    batches=_BATCHES.value,
    warmup=_WARMUP.value,
  )
  _log(
    f"MemTotal {total / 2**30:.1f} GiB, MemAvailable {avail / 2**30:.1f} GiB; dim {dim}; workload "
    f"{_BATCH.value} x {_FEATURES.value} Zipf({_ALPHA.value}) ids per batch into one table"
  )

  # 1. bytes per parameter
  _log(f"\n[1] bytes per row / parameter, RAM only, {_ROWS_BPP.value:,} rows (measured)")
  _log(f"{'config':26s} {'ideal B/row':>11s} {'RSS B/row':>10s} {'peak B/row':>10s} {'B/param':>8s} {'overhead':>8s}")
  bpp = {}
  for opt, dtype in _CONFIGS:
    r = _run_worker({**base, "opt": opt, "dtype": dtype, "rows": _ROWS_BPP.value, "time": False})
    n = r["rows"]
    ideal = r["ideal_row_bytes"]
    rec = {
      "rows": n,
      "ideal_bytes_per_row": ideal,
      "rss_bytes_per_row": r["rss_growth"] / n,
      "peak_bytes_per_row": r["hwm_growth"] / n,
      "ps_stats_bytes_per_row": r["ps_bytes"] / n,
      "bytes_per_param": r["rss_growth"] / (n * dim),
      "ideal_bytes_per_param": ideal / dim,
      "overhead": r["rss_growth"] / (n * ideal),
      "create_rows_per_s": n / r["create_s"],
    }
    bpp[f"{opt}/{dtype}"] = rec
    _log(
      f"{opt + '/' + dtype:26s} {ideal:11d} {rec['rss_bytes_per_row']:10.1f} {rec['peak_bytes_per_row']:10.1f} "
      f"{rec['bytes_per_param']:8.2f} {rec['overhead']:8.2f}"
    )

  # 2. largest RAM-only table: extrapolated, then measured within the budget
  _log(f"\n[2] largest RAM-only table; EXTRAPOLATED from [1] to MemAvailable {avail / 2**30:.1f} GiB (not created):")
  extrap = {}
  for k, rec in bpp.items():
    rows = int(avail / rec["rss_bytes_per_row"])
    extrap[k] = {"rows": rows, "params": rows * dim}
    _log(f"  {k:26s} ~{rows / 1e6:7.1f}M rows = {rows * dim / 1e9:5.2f}G params")
  peak_row = bpp["adagrad/float32"]["peak_bytes_per_row"]
  largest = max(500_000, int(budget * 2**30 / peak_row) // 500_000 * 500_000)
  _log(f"  measured: adagrad/float32, {largest:,} rows (budget {budget} GiB / {peak_row:.0f} peak B/row)")

  # 4 (with 2's table). throughput against size, RAM only
  _log("\n[4] RAM only, prefilled, lookup+apply (measured)")
  hdr = f"{'rows':>11s} {'create s':>8s} {'RSS GiB':>8s} {'peak GiB':>8s} {'distinct':>8s} {'lookup/s':>9s} "
  _log(hdr + f"{'apply/s':>9s} {'rows/s':>9s}")
  ram = []
  for rows in sorted(set(ram_sizes + [largest])):
    r = _run_worker({**base, "opt": "adagrad", "dtype": "float32", "rows": rows, "time": True})
    ram.append(r)
    _log(
      f"{rows:11,d} {r['create_s']:8.1f} {r['rss_end'] / 2**30:8.2f} {r['peak_rss'] / 2**30:8.2f} "
      f"{r['distinct_per_batch']:8.0f} {r['lookup_rows_per_s'] / 1e6:8.2f}M {r['apply_rows_per_s'] / 1e6:8.2f}M "
      f"{r['rows_per_s'] / 1e6:8.2f}M"
    )
  big = next(r for r in ram if r["rows"] == largest)

  # 3. tier
  ks = [int(k) for k in _TIER_K.value]
  _log(f"\n[3] disk tier, RAM cache {cache:,} rows, adagrad/float32 (measured)")
  _log(
    f"{'K':>3s} {'rows':>11s} {'RAM rows':>9s} {'tier rows':>10s} {'peak GiB':>8s} {'RSS GiB':>8s} {'hit':>6s} "
    f"{'lookup/s':>9s} {'apply/s':>9s} {'rows/s':>9s} {'disk B/row':>10s} {'RAM B/tier row':>14s}"
  )
  tier = []
  for k in ks:
    r = _run_worker({**base, "opt": "adagrad", "dtype": "float32", "rows": k * cache, "cache": cache, "time": True})
    # Disk rows include garbage (old copies of rows read back and re-spilled) until compaction.
    # Undefined (nan) when everything fits in the cache (K = 1: nothing spilled).
    cache_bytes = r["ram_rows"] * bpp["adagrad/float32"]["rss_bytes_per_row"]
    spilled = r["tier_rows"] or float("nan")
    r["disk_bytes_per_row"] = r["disk_bytes"] / spilled
    r["ram_bytes_per_tier_row"] = (r["rss_end"] - r["rss_base"] - cache_bytes) / spilled
    tier.append(r)
    _log(
      f"{k:3d} {r['rows']:11,d} {r['ram_rows']:9,d} {r['tier_rows']:10,d} {r['peak_rss'] / 2**30:8.2f} "
      f"{r['rss_end'] / 2**30:8.2f} {r['hit_rate']:6.3f} {r['lookup_rows_per_s'] / 1e6:8.2f}M "
      f"{r['apply_rows_per_s'] / 1e6:8.2f}M {r['rows_per_s'] / 1e6:8.2f}M {r['disk_bytes_per_row']:10.0f} "
      f"{r['ram_bytes_per_tier_row']:14.0f}"
    )
  free_disk = os.statvfs(tempfile.gettempdir())
  free_disk = free_disk.f_bavail * free_disk.f_frsize
  spilled = sorted((r for r in tier if r["tier_rows"]), key=lambda r: r["tier_rows"])
  last = spilled[-1]
  # The marginal RAM per tier row (slope between the two largest tiered runs) leaves out the
  # fixed costs (tensorstore threads and buffers, the cache's 25% headroom) the average carries.
  if len(spilled) > 1:
    a = spilled[-2]
    grow = (last["rss_end"] - last["rss_base"]) - (a["rss_end"] - a["rss_base"])
    grow -= (last["ram_rows"] - a["ram_rows"]) * bpp["adagrad/float32"]["rss_bytes_per_row"]
    marginal = grow / (last["tier_rows"] - a["tier_rows"])
  else:
    marginal = last["ram_bytes_per_tier_row"]
  by = ", ".join(f"{k} {v / last['tier_rows']:.0f}" for k, v in sorted(last["disk_bytes_by_array"].items()))
  _log(f"  disk B/tier row by array at K = {last['rows'] // cache}: {by}")
  _log(f"  marginal RAM per tier row (two largest K): {marginal:.0f} B")
  # Disk holds the rows, RAM holds their index: whichever runs out first bounds the table.
  tier_extrap = min(free_disk / last["disk_bytes_per_row"], avail / max(1.0, marginal))
  _log(
    f"  EXTRAPOLATED tiered capacity: min({free_disk / 2**30:.0f} GiB free disk / "
    f"{last['disk_bytes_per_row']:.0f} B/row, MemAvailable / {marginal:.0f} RAM B/tier row) "
    f"~{tier_extrap / 1e6:.0f}M rows"
  )

  results = {
    "machine": {"mem_total": total, "mem_available": avail, "cpus": os.cpu_count(), "free_disk_tmp": free_disk},
    "workload": {**base, "batch_size": _BATCH.value, "features": _FEATURES.value},
    "bytes_per_param": bpp,
    "ram_only_extrapolated_to_mem_available": extrap,
    "largest_measured": {"budget_gib": budget, **big},
    "ram_only": ram,
    "tier": {
      "cache_rows": cache,
      "runs": tier,
      "marginal_ram_bytes_per_tier_row": marginal,
      "extrapolated_rows": tier_extrap,
      "free_disk_bytes": free_disk,
    },
    "full": full,
    "runtime_s": time.perf_counter() - t_start,
  }
  if _JSON_OUT.value:
    outputs.write_json(_JSON_OUT.value, results, indent=2)
  if _PNG_OUT.value:
    _plot(_PNG_OUT.value, ram, tier, cache)
  _log(f"\nruntime {results['runtime_s']:.0f} s")
  flat = {f"{k}_bytes_per_param": v["bytes_per_param"] for k, v in bpp.items()}
  flat.update({f"{k}_overhead": v["overhead"] for k, v in bpp.items()})
  flat.update(
    largest_ram_rows=largest,
    largest_ram_rows_per_s=big["rows_per_s"],
    largest_ram_peak_rss_gib=big["peak_rss"] / 2**30,
    extrapolated_ram_rows_adagrad_f32=extrap["adagrad/float32"]["rows"],
    tier_cache_rows=cache,
    tier_marginal_ram_bytes_per_tier_row=marginal,
    tier_extrapolated_rows=tier_extrap,
  )
  for r in tier:
    k = r["rows"] // cache
    flat[f"tier_k{k}_peak_rss_gib"] = r["peak_rss"] / 2**30
    flat[f"tier_k{k}_rows_per_s"] = r["rows_per_s"]
    flat[f"tier_k{k}_hit_rate"] = r["hit_rate"]
  print(json.dumps(flat))


if __name__ == "__main__":
  app.run(main)
