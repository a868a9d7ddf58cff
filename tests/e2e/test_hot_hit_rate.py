"""experiments/hot_hit_rate.py, small: its hit rates against a plain-loop reference over the same batches."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from configs import default as default_config
from recsys_jax.data.synthetic import TRAIN, SyntheticConfig, SyntheticData

ROOT = pathlib.Path(__file__).resolve().parents[2]
WARMUP, EVAL, BATCH = 3, 2, 128
BUDGETS = [1 << 10, 4 << 10, 16 << 10, 1 << 30]  # 8, 32, 128 rows of 128 B, and all


def _reference():
  """Per ranking and budget: (hit rate, distinct hot share), from dicts and sorted() over the batches."""
  cfg = default_config.get_config().data
  data = SyntheticData(SyntheticConfig(vocab_sizes=tuple(cfg.vocab_sizes), zipf_alpha=cfg.zipf_alpha, seed=0))
  names = data.feature_names
  steps, occ = {}, {}
  for i in range(WARMUP):
    b = data.batch(TRAIN, i, BATCH)
    for t, n in enumerate(names):
      ids = b["sparse"][n].reshape(-1).tolist()
      for x in set(ids):
        steps[(t, x)] = steps.get((t, x), 0) + 1
      for x in ids:
        occ[(t, x)] = occ.get((t, x), 0) + 1
  evals = [data.batch(TRAIN, i, BATCH) for i in range(WARMUP, WARMUP + EVAL)]
  out = {}
  for source, counts in (("oracle", steps), ("oracle_occ", occ)):
    ranking = sorted(counts, key=lambda k: (-counts[k], k[0], k[1]))
    for budget in BUDGETS:
      hot = set(ranking[: budget // 128])
      hits = total = dhot = dtotal = 0
      for b in evals:
        for t, n in enumerate(names):
          ids = b["sparse"][n].reshape(-1).tolist()
          hits += sum((t, x) in hot for x in ids)
          total += len(ids)
          dhot += sum((t, x) in hot for x in set(ids))
          dtotal += len(set(ids))
      out[(source, budget)] = (hits / total, dhot / dtotal)
  return out


def test_hot_hit_rate_small_run_matches_a_plain_loop(tmp_path):
  cmd = [
    sys.executable,
    str(ROOT / "experiments" / "hot_hit_rate.py"),
    f"--warmup_steps={WARMUP}",
    f"--eval_steps={EVAL}",
    f"--batch_size={BATCH}",
    "--budgets=1KiB,4KiB,16KiB,1GiB",
    f"--out_dir={tmp_path}",
  ]
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  with open(tmp_path / "hot_hit_rate.json") as f:
    assert [json.loads(line) for line in f] == lines
  assert (tmp_path / "hot_hit_rate.png").stat().st_size > 10_000
  wrote = [
    line for line in proc.stdout.splitlines() if line.startswith("wrote ")
  ]  # experiments/harness/outputs.py's lines
  assert wrote == [f"wrote {tmp_path / 'hot_hit_rate.json'}", f"wrote {tmp_path / 'hot_hit_rate.png'}"], proc.stdout
  records, summary = lines[:-1], lines[-1]
  assert summary["summary"] and summary["row_bytes"] == 128 and summary["fields"] == 26
  assert [r["budget_bytes"] for r in records] == BUDGETS
  assert [r["hot_rows"] for r in records[:3]] == [8, 32, 128]
  assert records[-1]["hot_rows"] == summary["rows_seen_in_warmup"]
  want = _reference()
  for r in records:
    for source in ("oracle", "oracle_occ"):
      hit, share = want[(source, r["budget_bytes"])]
      np.testing.assert_allclose(r[f"{source}_hit_rate"], hit, rtol=1e-12)
      np.testing.assert_allclose(r[f"{source}_distinct_hot_share"], share, rtol=1e-12)
    # A few hundred ids per table in 65536 columns: the sketch counts exactly, so it ranks as the oracle.
    hit, share = want[("oracle", r["budget_bytes"])]
    np.testing.assert_allclose(r["hit_rate"], hit, rtol=1e-12)
    np.testing.assert_allclose(r["distinct_hot_share"], share, rtol=1e-12)
  hits = [r["hit_rate"] for r in records]
  assert hits == sorted(hits) and 0 < hits[0] < hits[-1] < 1
