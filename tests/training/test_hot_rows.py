"""Hot rows on the device against runs without them: the same rows and weights, whatever moves.

With k = 0 a hot row trains exactly as it would on the PS (synchronously, with the same optimizer
math), so a run whose hot set holds every row it has seen, re-chosen every few steps (rows and
their optimizer slots moving to the device and back each time), must end where a run without a
hot set ends: dense weights and every PS row, within float32 rounding. So must a run whose budget
holds far fewer rows than it sees, so that every re-choice demotes rows that trained on the device.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from recsys_jax.embeddings import dedup as dedup_lib
from recsys_jax.embeddings import hot as hot_lib
from tests.helpers.run_outcome import checkpoint_contents, outcome

STEPS = 50


def _config(tiny_config, hot_bytes, **kw):
  c = tiny_config
  c.num_steps = STEPS
  c.checkpoint_every = 30  # checkpoints after steps 30 and 50
  c.log_every = 10
  c.eval_samples = 4096
  c.eval_batch_size = 4096
  c.host_workers = 1
  c.hot_rows_bytes = hot_bytes
  c.hot_warmup_steps = 3
  c.hot_every = 70  # slots stay free: re-chosen every 70 // 10 = 7 steps from step 3; rows move both ways
  c.hot_min_count = 1
  for k, v in kw.items():
    c[k] = v
  return c


def _assert_close(a, b, what, tol=1e-5):
  assert a.keys() == b.keys(), what
  for k in a:
    if isinstance(a[k], dict):
      _assert_close(a[k], b[k], f"{what}/{k}", tol)
    elif a[k].dtype.kind == "f":
      np.testing.assert_allclose(a[k], b[k], rtol=tol, atol=tol, err_msg=f"{what}/{k}")
    else:
      np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}/{k}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The tiny job for 50 steps at k = 0 without hot rows, and with a budget for every row."""
  from configs import tiny

  tmp = tmp_path_factory.mktemp("hot")
  out = {}
  for name, hot_bytes in (("cold", 0), ("hot", 1 << 22)):
    c = _config(tiny.get_config(), hot_bytes)
    out[name] = (c, str(tmp / name), outcome(c, str(tmp / name)))
  return out


def test_a_hot_set_of_every_row_at_k0_equals_the_run_without_one(runs):
  (_, _, (s_cold, l_cold, p_cold, r_cold)), (_, _, (s_hot, l_hot, p_hot, r_hot)) = runs["cold"], runs["hot"]
  _assert_close(p_hot, p_cold, "dense")
  _assert_close(r_hot, r_cold, "rows")  # weights and optimizer slots of every row, written back
  assert [s for s, _ in l_hot] == [s for s, _ in l_cold]
  np.testing.assert_allclose([x for _, x in l_hot], [x for _, x in l_cold], rtol=1e-5)
  assert s_hot["auc"] == pytest.approx(s_cold["auc"], abs=1e-4)


def test_the_hot_set_really_held_the_rows(runs):
  """Not a vacuous equality: most lookups were served on the device, and rows moved."""
  import json
  import os

  _, workdir, _ = runs["hot"]
  with open(os.path.join(workdir, "summary.json")) as f:
    hot = json.load(f)["hot"]
  assert hot["hot_hit_rate"] > 0.8, hot
  assert hot["hot_rows_held"] > 1000
  choices = hot["choices"]
  assert [c["step"] for c in choices] == [3, 10, 17, 24, 31, 38, 45]
  assert choices[0]["promoted"] > 500 and sum(c["promoted"] for c in choices[1:]) > 0
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    logged = [r for r in map(json.loads, f) if r["kind"] == "train"]
  assert all("hot_hit_rate" in r and "h2d_row_bytes_per_step" in r for r in logged)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
  """The same job with a hot budget of 64 rows, far fewer than the rows it sees, re-chosen every 5
  steps: each choice demotes rows that trained on the device (their weights and slots must go back
  into the PS), and promotes others."""
  from configs import tiny

  c = _config(tiny.get_config(), 1 << 12, hot_every=5)
  workdir = str(tmp_path_factory.mktemp("hot_small") / "small")
  return c, workdir, outcome(c, workdir)


def test_demoted_rows_keep_what_they_learnt_on_the_device(runs, small):
  """Rows that leave the device at a re-choice are written back with their weights and optimizer
  slots: at k = 0 the run with a budget smaller than its rows ends where the run without hot rows
  ends (dense weights, every PS row and slot, losses), and so does its checkpoint at 30."""
  import json
  import os

  c_cold, cold_dir, (s_cold, l_cold, p_cold, r_cold) = runs["cold"]
  c, workdir, (s, losses, p, r) = small
  with open(os.path.join(workdir, "summary.json")) as f:
    hot = json.load(f)["hot"]
  choices = hot["choices"]
  assert hot["hot_rows_held"] == 64 and 0.2 < hot["hot_hit_rate"] < 0.9, hot
  assert sum(x["demoted"] for x in choices) > 20 and sum(x["demoted"] > 0 for x in choices) >= 5, choices
  assert sum(len(v["ids"]) for v in r.values()) > 10 * 64  # most rows were never hot
  _assert_close(p, p_cold, "dense")
  _assert_close(r, r_cold, "rows")  # weights and optimizer slots of every row
  assert [x for x, _ in losses] == [x for x, _ in l_cold]
  np.testing.assert_allclose([x for _, x in losses], [x for _, x in l_cold], rtol=1e-5)
  assert s["auc"] == pytest.approx(s_cold["auc"], abs=1e-4)
  p30, r30 = checkpoint_contents(c, workdir, 30)
  p30_cold, r30_cold = checkpoint_contents(c_cold, cold_dir, 30)
  _assert_close(p30, p30_cold, "dense at 30")
  _assert_close(r30, r30_cold, "rows at 30")


@pytest.mark.parametrize("budget", [0, 1 << 12])
def test_restore_into_another_budget_reads_the_same_rows(runs, budget):
  """The checkpoint after step 30 holds the hot rows (written back before the snapshot): restored
  with no hot set or a small one, every row and slot equals the run without hot rows at 30."""
  from configs import tiny

  c_cold, cold_dir, _ = runs["cold"]
  _, hot_dir, _ = runs["hot"]
  other = _config(tiny.get_config(), budget)
  p_ref, r_ref = checkpoint_contents(c_cold, cold_dir, 30)
  p, r = checkpoint_contents(other, hot_dir, 30)
  _assert_close(p, p_ref, "dense")
  _assert_close(r, r_ref, "rows")


def _resumed(runs, tmp_path, damage=None, drop=50):
  """The hot run resumed from its checkpoint at 30 (the one at ``drop`` removed, or, with ``drop``
  None, set aside for its damaged hot set) and run to 50."""
  import os
  import shutil

  c, hot_dir, _ = runs["hot"]
  workdir = str(tmp_path / "resumed")
  shutil.copytree(hot_dir, workdir, ignore=shutil.ignore_patterns("probe_*"))
  if drop:
    shutil.rmtree(os.path.join(workdir, "checkpoints", str(drop)))
  saved = os.path.join(workdir, "checkpoint_parts", "30" if drop else "50", "hot_rows_p0.npz")
  assert os.path.getsize(saved) > 1000
  if damage:
    damage(workdir, saved)
  return outcome(c.copy_and_resolve_references(), workdir)


def _assert_same_run(runs, got):
  _, _, (s_hot, _, p_hot, r_hot) = runs["hot"]
  s, _, p, r = got
  for k in p_hot:
    np.testing.assert_array_equal(p[k], p_hot[k], err_msg=k)
  for t in r_hot:
    for k in r_hot[t]:
      np.testing.assert_array_equal(r[t][k], r_hot[t][k], err_msg=f"{t}/{k}")
  assert s["auc"] == s_hot["auc"] and s["logloss"] == s_hot["logloss"]


def test_a_resumed_run_goes_on_exactly_as_the_one_that_saved(runs, tmp_path):
  """The hot set and its counts are saved with the checkpoint: resumed at 30, the run holds the
  same rows in the same slots and re-chooses as the uninterrupted one did, to the bit."""
  _assert_same_run(runs, _resumed(runs, tmp_path))


def test_a_damaged_hot_set_file_sets_its_checkpoint_aside(runs, tmp_path, capsys):
  """The hot set is a part of its checkpoint: truncated, the checkpoint at 50 is damaged, named in
  one line and set aside; the run resumes from 30 and ends exactly as the uninterrupted one."""
  import os

  def truncate(workdir, path):
    with open(path, "r+b") as f:
      f.truncate(100)

  got = _resumed(runs, tmp_path, truncate, drop=None)
  err = capsys.readouterr().err
  damaged = [line for line in err.splitlines() if "hot_rows_p0.npz" in line]
  assert len(damaged) == 1 and "is damaged" in damaged[0] and "resuming from checkpoint 30" in damaged[0], err
  assert os.path.isdir(str(tmp_path / "resumed" / "checkpoints_damaged" / "50" / "parts"))
  _assert_same_run(runs, got)


def test_a_checkpoint_written_before_parts_is_read_as_before(runs, tmp_path):
  """A checkpoint from before the hot set was a part (the file inside the checkpoint directory, no
  ``parts_crc32`` in the meta) resumes with its hot set, exactly."""
  import json
  import os

  from recsys_jax import checkpoint as checkpoint_lib

  def old_layout(workdir, path):
    os.replace(path, os.path.join(workdir, "checkpoints", "30", "hot_rows_p0.npz"))
    meta_file = os.path.join(workdir, "checkpoints", "30", "meta", "metadata")
    with open(meta_file) as f:
      meta = json.load(f)
    del meta["parts_crc32"]
    meta["meta_crc32"] = checkpoint_lib.meta_checksum(meta)
    with open(meta_file, "w") as f:
      json.dump(meta, f)

  _assert_same_run(runs, _resumed(runs, tmp_path, old_layout))


def test_shapes_start_over_once_at_the_first_choice_and_then_only_grow_past_their_room(tiny_config):
  """The step compiles once per shape, so shapes change rarely: a step pads to the shape compiled
  last (same rows, same slots, only the hot entries' base moves). The hot slots are the most a
  batch can use from the first step on; the cold bucket never shrinks but once, at the run's first
  choice (which makes most rows hot), and grows only past its room, with a quarter more."""
  from recsys_jax import train
  from recsys_jax.data import synthetic

  c = _config(tiny_config, 1 << 20, hot_warmup_steps=100, hot_every=0)
  job = train.build_job(c)
  hot, host = job.hot, job.host
  mb = dedup_lib.MIN_BUCKET

  def groups(step, batch_size):
    return host.prepare(step, job.reader.data.batch(synthetic.TRAIN, step, batch_size)).groups

  for step in range(3):  # counted and created on the PS; nothing is hot yet
    host.lookup(host.prepare(step, job.reader.data.batch(synthetic.TRAIN, step, 1024)), create=True)
  warm_cold, warm_hot = hot._bucket_floor[8]
  assert warm_hot == dedup_lib.bucket_size(min(hot.set.capacity[8], groups(0, 1024)[8].inverse.size), mb)
  cold, hot_idx = hot.split(groups(3, 64), mb)  # a small warm-up batch: the warm-up shapes
  assert (cold[8].bucket, hot_idx["8"].shape[0]) == (warm_cold, warm_hot)

  hot.rechoose(4, job.ps)
  assert hot.set.size() > 100
  big, medium, small = groups(5, 1024), groups(6, 900), groups(7, 64)
  hot.split(big, mb)
  bucket, bucket_h = hot._bucket_floor[8]
  own = hot.set.split(big[8]).group.bucket
  assert bucket == dedup_lib.bucket_size(own + own // 4, mb) < warm_cold and bucket_h == warm_hot  # started over
  for g in (medium, small):
    alone = hot.set.split(g[8])  # the step's own buckets: smaller
    assert alone.group.bucket < bucket and alone.hot_idx.shape[0] <= bucket_h
    cold, hot_idx = hot.split(g, mb)
    got = cold[8]
    assert (got.bucket, hot_idx["8"].shape[0]) == (bucket, bucket_h)  # padded to the compiled shapes
    assert [(n, i.tolist(), o) for n, i, o in got.tables] == [(n, i.tolist(), o) for n, i, o in alone.group.tables]
    n_hot = int(np.count_nonzero(alone.hot_idx < hot.set.capacity[8]))
    np.testing.assert_array_equal(hot_idx["8"][:n_hot], alone.hot_idx[:n_hot])
    assert (hot_idx["8"][n_hot:] == hot.set.capacity[8]).all()
    a = alone.group.inverse
    np.testing.assert_array_equal(got.inverse, np.where(a >= alone.group.bucket, a - alone.group.bucket + bucket, a))
  hot.rechoose(8, job.ps)  # a later choice: no new shape
  cold, hot_idx = hot.split(small, mb)
  assert (cold[8].bucket, hot_idx["8"].shape[0]) == (bucket, bucket_h)
  huge = groups(9, 8192)  # more cold rows than the room: the cold bucket grows, with a quarter more
  own = hot.set.split(huge[8]).group.bucket
  assert own > bucket
  cold, hot_idx = hot.split(huge, mb)
  assert cold[8].bucket == dedup_lib.bucket_size(own + own // 4, mb) and hot_idx["8"].shape[0] >= bucket_h
  job.ps.close()


def _slow(add, delay):
  def add_later(name, ids):
    time.sleep(delay)
    add(name, ids)

  return add_later


def test_a_choice_counts_every_earlier_step_though_counting_lags(tiny_config):
  """Counting runs on its own thread; a re-choice waits for it: with every add slowed down, the
  counts it reads equal a counter fed the same steps' ids in order on this thread."""
  from recsys_jax import train
  from recsys_jax.data import synthetic
  from recsys_jax.embeddings.frequency import FrequencyCounter

  c = _config(tiny_config, 1 << 20, hot_warmup_steps=100, hot_every=0)
  job = train.build_job(c)
  hot, host = job.hot, job.host
  ref = FrequencyCounter(hot.counter.tables, hot.counter.capacity, seed=c.seed)
  hot.counter.add = _slow(hot.counter.add, 0.01)
  for step in range(6):
    p = host.prepare(step, job.reader.data.batch(synthetic.TRAIN, step, 256))
    for name, ids, _ in p.groups[8].tables:
      ref.add(name, ids)
    host.lookup(p, create=True)
  hot.rechoose(6, job.ps)
  cap = hot.set.capacity
  want = hot_lib.choose({t: ref.top(t, cap[8]) for t in ref.tables}, hot.groups, cap, hot.overrides, hot.min_count)
  for t in ref.tables:
    np.testing.assert_array_equal(hot.set.hot(t)[0], want[t], err_msg=t)
  assert 100 < hot.set.size() < cap[8]  # not vacuous: ids seen once stay cold, so a lagging count changes the set
  hot.close()
  job.ps.close()


def test_counting_one_step_in_n_counts_the_steps_whose_number_n_divides(tiny_config):
  """``hot_count_every = 3``: the counter holds exactly what a counter fed the ids of steps 0, 3, 6,
  ... holds, whatever step the job started from (a resumed run counts the same steps as one that
  never stopped: the step's number decides, not how many steps this process split)."""
  from recsys_jax import train
  from recsys_jax.data import synthetic
  from recsys_jax.embeddings.frequency import FrequencyCounter

  c = _config(tiny_config, 1 << 20, hot_warmup_steps=100, hot_every=0)
  c.hot_count_every = 3
  for first in (0, 4):  # a fresh run, and one resumed at step 4
    job = train.build_job(c)
    hot, host = job.hot, job.host
    ref = FrequencyCounter(hot.counter.tables, hot.counter.capacity, seed=c.seed)
    for step in range(first, first + 8):
      p = host.prepare(step, job.reader.data.batch(synthetic.TRAIN, step, 256))
      if step % 3 == 0:
        for name, ids, _ in p.groups[8].tables:
          ref.add(name, ids)
      host.lookup(p, create=True)
    hot.counted()
    got, want = hot.counter.state(), ref.state()
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=f"first step {first}: {k}")
    assert want["sketch_0"].any()
    hot.close()
    job.ps.close()


def test_a_counting_failure_stops_the_next_choice_and_never_a_lookup(tiny_config):
  from recsys_jax import train
  from recsys_jax.data import synthetic

  c = _config(tiny_config, 1 << 20, hot_warmup_steps=100, hot_every=0)
  job = train.build_job(c)
  hot, host = job.hot, job.host

  def broken(name, ids):
    raise ValueError(f"cannot count {name}")

  hot.counter.add = broken
  for step in range(12):  # more steps than the queue holds: a failed count must not block a split
    host.lookup(host.prepare(step, job.reader.data.batch(synthetic.TRAIN, step, 64)), create=True)
  with pytest.raises(RuntimeError, match="hot rows: counting ids failed: ValueError.'cannot count cat_"):
    hot.rechoose(12, job.ps)
  hot.close()
  job.ps.close()
