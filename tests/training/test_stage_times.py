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
  # The reading work runs ahead of the loop (the feed and the prefetcher hold several batches), so an
  # interval may have read none of its own: each of these is timed somewhere in the run.
  for stage in ("read", "parse", "prepare", "resolve"):
    assert sum(r[f"host_{stage}_ms"] for r in recs) > 0, stage
  for r in recs:
    keys = [f"host_{s}_ms" for s in STAGES] + [f"host_{s}_cpu_ms" for s in STAGES] + [f"{k}_per_step" for k in COUNTS]
    assert all(math.isfinite(r[k]) and r[k] >= 0 for k in keys), r
    for stage in ("lookup", "place", "push"):  # work each step does, in its own interval at k = 0
      assert r[f"host_{stage}_ms"] > 0, (stage, r)
    assert r["loss"] == 0.0  # the no-op step
    assert r["train_s"] > 0 and r["samples_per_sec"] == (6 * c.batch_size) / r["train_s"]
  # The cold rows a step looks up: the distinct ids of each table in its batch, from the data alone.
  reader = readers.build_reader(c)
  distinct, batch_bytes = [], []
  for _, (batch, _pos) in zip(range(c.num_steps), reader.train()):
    distinct.append(sum(len(np.unique(ids)) for ids in batch["sparse"].values()))  # tiny: one table a feature
    # placed besides the rows: dense features, labels, and an int32 inverse index per id (one-hot: no weights)
    batch_bytes.append(
      batch["dense"].nbytes + batch["label"].nbytes + sum(4 * ids.size for ids in batch["sparse"].values())
    )
  # Each record counts what ran since the last one (a lookup runs ahead of its step), so the run's
  # total is every step's.
  assert sum(6 * r["rows_per_step"] for r in recs) == sum(distinct)
  assert all(r["bucket_rows_per_step"] >= r["rows_per_step"] for r in recs)
  # The bytes placed on the device: every bucket row (float32, width dim), and the rest of the batch.
  assert sum(6 * r["place_row_bytes_per_step"] for r in recs) == sum(
    6 * r["bucket_rows_per_step"] * 4 * c.embeddings.dim for r in recs
  )
  assert sum(6 * r["place_batch_bytes_per_step"] for r in recs) == sum(batch_bytes)
  # In two host-to-device copies a step: its inputs packed in two buffers (training/packing.py).
  assert sum(6 * r["place_copies_per_step"] for r in recs) == 2 * c.num_steps  # (records split it as steps ran)
  assert not os.path.exists(tmp_path / "checkpoints") or not os.listdir(tmp_path / "checkpoints")
  assert summary["steps_this_run"] == 12 and math.isfinite(summary["auc"])


def test_hot_rows_record_their_own_time_and_place_counts_their_slots(tiny_config, tmp_path):
  """With hot rows, the placed row bytes (counted by ``HostPipeline.place`` from the arrays it
  copies) equal ``HotRows``'s own count of them (buckets and 4-byte hot slots, counted in its
  split), and the hot rows time their split, counting and re-choices (``HotRows.metrics``)."""
  c = tiny_config
  c.num_steps, c.log_every = 12, 6
  c.hot_warmup_steps = 3
  c.hot_every = 40  # with free slots the next choice comes a tenth later: at 3, 7 and 11
  c.final_checkpoint = False
  c.eval_samples = c.eval_batch_size = 1024
  summary = train.train_and_evaluate(c, str(tmp_path))
  recs = train.read_metrics(str(tmp_path), "train")
  hot = summary["hot"]
  assert [x["step"] for x in hot["choices"]] == [3, 7, 11], hot["choices"]
  placed = sum(6 * r["place_row_bytes_per_step"] for r in recs)
  assert placed == hot["h2d_row_bytes_per_step"] * c.num_steps > 0
  assert hot["split_ms_per_step"] > 0 and hot["count_ms_per_step"] > 0
  assert all(x["seconds"] > 0 for x in hot["choices"])
  assert hot["rechoose_s"] == sum(x["seconds"] for x in hot["choices"])
