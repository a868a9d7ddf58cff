"""The host pipeline's own timers (recsys_jax/training/stage_times.py) in metrics.jsonl, and the
options a benchmark of the host half needs (config.device_step='none', config.final_checkpoint)."""

import math
import os

import numpy as np

from recsys_jax import train
from recsys_jax.data import readers
from recsys_jax.training.stage_times import COUNTS, STAGES


def test_train_records_carry_stage_times_and_exact_row_counts(tiny_config, tmp_path):
  c = tiny_config
  c.num_steps, c.log_every = 12, 6
  c.hot_rows_bytes = 0  # every row of a batch is looked up on the PS: counted against the data below
  c.device_step = "none"
  c.final_checkpoint = False
  c.eval_samples = c.eval_batch_size = 1024
  c.host_workers = 1  # the reader's parse runs on the worker and is timed there too
  summary = train.train_and_evaluate(c, str(tmp_path))
  recs = train.read_metrics(str(tmp_path), "train")
  assert [r["step"] for r in recs] == [6, 12]
  for r in recs:
    keys = [f"host_{s}_ms" for s in STAGES] + [f"host_{s}_cpu_ms" for s in STAGES] + [f"{k}_per_step" for k in COUNTS]
    assert all(math.isfinite(r[k]) and r[k] >= 0 for k in keys), r
    for stage in ("read", "parse", "prepare", "lookup", "place", "push"):  # work each step does
      assert r[f"host_{stage}_ms"] > 0, (stage, r)
    assert r["loss"] == 0.0  # the no-op step
    assert r["train_s"] > 0 and r["samples_per_sec"] == (6 * c.batch_size) / r["train_s"]
  # The cold rows a step looks up: the distinct ids of each table in its batch, from the data alone.
  reader = readers.build_reader(c)
  distinct = []
  for _, (batch, _pos) in zip(range(c.num_steps), reader.train()):
    distinct.append(sum(len(np.unique(ids)) for ids in batch["sparse"].values()))  # tiny: one table a feature
  # Each record counts what ran since the last one (a lookup runs ahead of its step), so the run's
  # total is every step's.
  assert sum(6 * r["rows_per_step"] for r in recs) == sum(distinct)
  assert all(r["bucket_rows_per_step"] >= r["rows_per_step"] for r in recs)
  assert not os.path.exists(tmp_path / "checkpoints") or not os.listdir(tmp_path / "checkpoints")
  assert summary["steps_this_run"] == 12 and math.isfinite(summary["auc"])
