"""The in-process PS at the main job's shape, one thread against several, in one run.

    python experiments/bench_ps_threads.py [--threads=1,2] [--batches=30] [--sweep=True]

Shape: 26 Adagrad tables of dim 16, batches of 8192 samples of Zipf(1.1) ids over Criteo's field
cardinalities, deduplicated per table, every id created first (untimed). One PS per thread count,
all fed the same batches, each batch timed on every PS before the next, so the load falls on all
alike: the figure is the median per-batch time ratio (``speedup_vs_first``). The PSs' snapshots are
compared array-equal at the end. ``--sweep``: the same ratio for smaller calls (from 128 rows), pool
threads forced on (``min_rows=0``): where it crosses 1 is ``workers.MIN_ROWS``. ``handover_us``:
what dealing empty tasks to the pool costs over running them on the caller. ``free_core_speedup``: a
pure-CPU ``nogil`` kernel on as many threads at once over one after the other, before and after
(about 1: no core was free for a second thread). The last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numba
import numpy as np
from absl import app, flags
from harness import data
from harness.ps import adagrad_specs, grads

from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.async_ps.store.workers import Workers

_THREADS = flags.DEFINE_list("threads", ["1", "2"], "PS thread counts to compare (the first is the baseline).")
_BATCHES = flags.DEFINE_integer("batches", 30, "Timed batches.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed batches first.")
_BATCH = flags.DEFINE_integer("batch_size", 8192, "Samples per batch.")
_DIM = flags.DEFINE_integer("dim", 16, "Row width.")
_SWEEP = flags.DEFINE_bool("sweep", True, "Also time small requests (for the pool threshold).")

# Criteo Kaggle's 26 categorical field cardinalities.
CRITEO_VOCABS = (
  1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306, 10, 5652,
  2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip


def criteo_batches(n: int, batch: int, alpha: float = 1.1, seed: int = 0):
  """Per batch, per table: the distinct ids of ``batch`` Zipf draws over that field's cardinality."""
  out = []
  for b in range(n):
    rng = np.random.default_rng([seed, b])
    d = {}
    for f, v in enumerate(CRITEO_VOCABS):
      # Zipf ranks by inverse transform of a continuous power law, capped at the cardinality.
      rank = np.minimum(np.floor((1 - rng.random(batch)) ** (-1 / (alpha - 1))), v) - 1
      d[f"c{f:02d}"] = np.unique(data.hashed(rank.astype(np.int64), f))
    out.append(d)
  return out


def make_ps(batches, threads, min_rows=None):
  """A PS of ``threads`` threads with every id of ``batches`` created: the timed calls serve, as in a long run."""
  kw = {} if min_rows is None else {"min_rows": min_rows}
  ps = ParameterServer(adagrad_specs(list(batches[0]), _DIM.value), threads=threads, **kw)
  ps.lookup_many({t: np.unique(np.concatenate([b[t] for b in batches])) for t in batches[0]}, create=True, step=0)
  return ps


def step(ps, b, g, i, cpu=None):
  """Seconds of one lookup_many + apply_many; adds the process's CPU seconds (all threads) to ``cpu[0]``."""
  c0, t0 = time.process_time(), time.perf_counter()
  ps.lookup_many(b, create=True, step=i)
  ps.apply_many({t: (ids, g[: len(ids)]) for t, ids in b.items()}, step=i)
  t1 = time.perf_counter()
  if cpu is not None:
    cpu[0] += time.process_time() - c0
  return t1 - t0


@numba.njit(nogil=True, cache=False)
def _spin(n):
  s = 0.0
  for i in range(n):
    s += (i % 7) * 0.5
  return s


def free_core_speedup(threads: int, n: int = 100_000_000, repeats: int = 3) -> float:
  """A pure-CPU nogil kernel on ``threads`` threads at once over one after the other (median of
  ``repeats``): about ``threads`` on an idle machine, about 1 where the other cores are taken."""
  _spin(10)
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(threads):
      _spin(n)
    t1 = time.perf_counter()
    ts = [threading.Thread(target=_spin, args=(n,)) for _ in range(threads)]
    for t in ts:
      t.start()
    for t in ts:
      t.join()
    out.append((t1 - t0) / (time.perf_counter() - t1))
  return float(np.median(out))


def handover_us(threads: int, repeats: int = 2000) -> float:
  """Median extra microseconds of a call dealt to ``threads`` bins of empty tasks, over one bin."""
  par, one = Workers(threads, min_rows=0), Workers(1)
  tasks = [(1, lambda: None)] * threads
  ts = []
  for _ in range(repeats):
    for w in (par, one):
      t0 = time.perf_counter()
      w.run(tasks)
      ts.append(time.perf_counter() - t0)
  par.close()
  return 1e6 * float(np.median(ts[0::2]) - np.median(ts[1::2]))


def main(argv):
  del argv
  threads = [int(t) for t in _THREADS.value]
  load0 = os.getloadavg()[0]
  free0 = free_core_speedup(max(threads))
  batches = criteo_batches(_WARMUP.value + _BATCHES.value, _BATCH.value)
  names = list(batches[0])
  rows = [sum(len(v) for v in b.values()) for b in batches]
  g = grads(max(_BATCH.value, 8192), _DIM.value)  # the sweep's largest calls too
  pss = [make_ps(batches, t) for t in threads]
  secs = np.zeros((len(batches), len(threads)))
  cpus = [[0.0] for _ in threads]
  for i, b in enumerate(batches):
    for j, ps in enumerate(pss):
      secs[i, j] = step(ps, b, g, i + 1, cpus[j] if i >= _WARMUP.value else None)
  secs = secs[_WARMUP.value :]
  snaps = [ps.snapshot() for ps in pss]
  identical = all(np.array_equal(s[t][k], snaps[0][t][k]) for s in snaps[1:] for t in names for k in snaps[0][t])
  for ps in pss:
    ps.close()
  med = np.median(secs, axis=0)
  res = {
    "threads": threads,
    "distinct_rows_per_batch": float(np.mean(rows)),
    "median_ms_per_batch": [1e3 * m for m in med],
    "rows_per_s": [float(np.mean(rows)) / m for m in med],
    "speedup_vs_first": [float(np.median(secs[:, 0] / secs[:, j])) for j in range(len(threads))],
    "cpu_ms_per_batch": [1e3 * c[0] / secs.shape[0] for c in cpus],
    "snapshots_identical": identical,
    "handover_us": {t: handover_us(t) for t in threads if t > 1},
  }
  print(
    f"main shape: {res['distinct_rows_per_batch']:.0f} distinct rows a batch over 26 tables, dim {_DIM.value}; "
    + ", ".join(f"{t} thread(s) {m:.2f} ms" for t, m in zip(threads, res["median_ms_per_batch"]))
    + f"; speedup (median of per-batch ratios) {res['speedup_vs_first']}; CPU ms a batch (all threads) "
    + f"{res['cpu_ms_per_batch']}; hand-over us {res['handover_us']}; snapshots identical: {identical}",
    file=sys.stderr,
  )
  if _SWEEP.value:
    sweep = {}
    for n in (128, 512, 2048, 8192, 16384, 32768, 65536):
      small = criteo_batches(_WARMUP.value + 40, max(8, n // 8), seed=7)
      pair = [make_ps(small, 1), make_ps(small, max(threads), min_rows=0)]
      ts = np.array([[step(ps, b, g, i + 1) for ps in pair] for i, b in enumerate(small)])[_WARMUP.value :]
      r = float(np.mean([sum(len(v) for v in b.values()) for b in small]))
      sweep[int(r)] = float(np.median(ts[:, 0] / ts[:, 1]))
      print(f"  {r:7.0f} rows a call: {max(threads)} threads are {sweep[int(r)]:.2f}x one", file=sys.stderr)
      for ps in pair:
        ps.close()
    res["sweep_speedup_by_rows"] = sweep
  res["load_average_start"], res["load_average_end"] = load0, os.getloadavg()[0]
  res["free_core_speedup_start"], res["free_core_speedup_end"] = free0, free_core_speedup(max(threads))
  print(
    f"control: a pure-CPU nogil kernel on {max(threads)} threads is {free0:.2f}x one thread before, "
    f"{res['free_core_speedup_end']:.2f}x after (about 1: no core was free for a second thread)",
    file=sys.stderr,
  )
  print(json.dumps(res))


if __name__ == "__main__":
  app.run(main)
