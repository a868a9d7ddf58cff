"""The model side of serving, measured: a scorer's load time and predict time per batch size.

Trains configs/tiny.py (DLRM, synthetic data) into a fresh workdir, or uses --workdir if it holds
a checkpoint, then times ``load_scorer`` and ``load_artifact`` and ``encode + predict`` at batch
1, 64 and 512 (median of --repeats after one warm-up call per size, which compiles the bucket),
with an unbounded cache and with one a quarter of the tables' rows.

    python experiments/bench_scorer.py [--workdir=/tmp/tiny_serve] [--repeats=20]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
from harness import stats


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", default="")
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--num_steps", type=int, default=0, help="Training steps of configs/tiny.py (0: the config's).")
  a = ap.parse_args()
  from recsys_jax.serving import artifact, scorer

  workdir = a.workdir or tempfile.mkdtemp(prefix="bench_scorer_")
  if scorer.newest_step(workdir) is None:
    from configs import tiny
    from recsys_jax import train

    c = tiny.get_config()
    c.num_steps = a.num_steps or c.num_steps
    c.progress_bar = False
    t = time.perf_counter()
    train.train_and_evaluate(c, workdir)
    print(f"trained configs/tiny.py in {time.perf_counter() - t:.1f} s -> {workdir}")
  print(f"os.getloadavg() at start: {os.getloadavg()}")
  t = time.perf_counter()
  sc = scorer.load_scorer(workdir)
  print(f"load_scorer: {time.perf_counter() - t:.3f} s ({sc.version}, index {sc.rows.index_bytes()} B)")
  art_dir = os.path.join(tempfile.mkdtemp(prefix="bench_art_"), "art")
  t = time.perf_counter()
  artifact.export_artifact(workdir, art_dir)
  print(f"export_artifact: {time.perf_counter() - t:.3f} s")
  t = time.perf_counter()
  art = artifact.load_artifact(art_dir)
  print(f"load_artifact: {time.perf_counter() - t:.3f} s")
  total = sum(sc.rows.num_rows().values())
  small = scorer.load_scorer(workdir, cache_rows=total // 4)
  rng = np.random.default_rng(0)
  vocab = sc.checkpoint.config.data.vocab_sizes
  names = [n for n, k in sc.fields().items() if k == "int"]
  dense = [n for n, k in sc.fields().items() if k == "float"]
  from recsys_jax.data import synthetic

  data = synthetic.build({k: v for k, v in dict(sc.checkpoint.config.data).items() if k in synthetic.FIELDS})

  def records(n):
    out = []
    for _ in range(n):
      r = {d: float(rng.random() * 4) for d in dense}
      for f, name in enumerate(names):
        rank = np.array([min(int(rng.zipf(1.2)) - 1, vocab[f] - 1)])
        r[name] = int(data.ids_of(f, rank)[0])
      out.append(r)
    return out

  result = {}
  for label, s in (("load_scorer", sc), ("load_artifact", art), ("cache 1/4 of rows", small)):
    for b in (1, 64, 512):
      batches = [records(b) for _ in range(a.repeats + 1)]
      s.predict(s.encode(batches[0]))  # compiles this bucket
      enc, pred = [], []
      for recs in batches[1:]:
        t0 = time.perf_counter()
        e = s.encode(recs)
        t1 = time.perf_counter()
        s.predict(e)
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        pred.append(t2 - t1)
      me, mp = stats.median(enc) * 1e3, stats.median(pred) * 1e3
      result[f"{label} batch {b}"] = {"encode_ms": round(me, 3), "predict_ms": round(mp, 3)}
      print(
        f"{label:18s} batch {b:4d}: encode {me:7.2f} ms, predict {mp:7.2f} ms, {b / (me + mp) * 1e3:9.0f} records/s"
      )
    print(f"  {label}: {s.cache_stats()}")
  print(f"os.getloadavg() at end: {os.getloadavg()}")
  print(json.dumps({**result, "load_avg": os.getloadavg()}))


if __name__ == "__main__":
  main()
