"""Progressive validation: the train step's logits are its pre-update forward pass, and the window's
AUC, logloss and calibration are those of float64 references written here (no sklearn)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from recsys_jax import metrics, train
from recsys_jax.online import progressive as prog_lib
from recsys_jax.training import packing
from recsys_jax.training.writers import Progress


def pairwise_auc(y, s) -> float:
  """P(score of a positive > score of a negative) + half the ties, counted over every pair (None: one class)."""
  s = np.asarray(s, np.float64)
  pos, neg = s[y > 0.5], s[y <= 0.5]
  if not (pos.size and neg.size):
    return None
  gt = int((pos[:, None] > neg[None, :]).sum())
  eq = int((pos[:, None] == neg[None, :]).sum())
  return (2 * gt + eq) / (2.0 * pos.size * neg.size)


def reference(z, y):
  """The window's metrics from the events themselves, in float64."""
  z64 = np.asarray(z, np.float64)
  p = np.clip(1.0 / (1.0 + np.exp(-z64)), 1e-7, 1 - 1e-7)
  y64 = np.asarray(y, np.float64)
  return {
    "auc": pairwise_auc(y64, z64),
    "logloss": float(-np.mean(y64 * np.log(p) + (1 - y64) * np.log(1 - p))),
    "calibration": float(np.mean(1.0 / (1.0 + np.exp(-z64))) / np.mean(y64)),
  }


@pytest.mark.parametrize("ties", [False, True])
def test_auc_float32_equals_the_pairwise_count(ties):
  rng = np.random.default_rng(3)
  for n in (2, 7, 300, 2000):
    s = rng.normal(size=n).astype(np.float32) * 4
    if ties:  # few distinct scores, and both zeros, which are one score
      s = (np.round(s) * 0.5).astype(np.float32)
      s[: n // 4] = np.float32(-0.0)
      s[n // 4 : n // 2] = np.float32(0.0)
    y = (rng.random(n) < 0.3).astype(np.float32)
    y[0], y[-1] = 1, 0
    assert metrics.auc_float32(y, s) == pairwise_auc(y, s), n
    assert metrics.auc_float32(y, s) == metrics.auc(y, s), n
  with pytest.raises(ValueError, match="NaN"):
    metrics.auc_float32([0, 1], [0.0, np.nan])
  with pytest.raises(ValueError, match="both"):
    metrics.auc_float32([1, 1], [0.0, 1.0])


def test_auc_of_keys_on_a_large_window_equals_the_float64_auc():
  # 200k keys: every byte of the shifted keys varies, so every radix pass runs; scores on a grid tie.
  rng = np.random.default_rng(5)
  s = (np.round(rng.normal(size=200_000) * 300) / 100).astype(np.float32)
  y = (rng.random(s.size) < 1 / (1 + np.exp(-s))).astype(np.float32)
  keys = metrics.score_keys(y, s)
  assert metrics.auc_of_keys(keys) == metrics.auc(y, s)
  assert metrics.auc_of_keys(keys[::-1]) == metrics.auc(y, s)  # any order
  with pytest.raises(ValueError, match="score_keys"):
    metrics.auc_of_keys(np.array([0, 1, 1 << 40]))


def test_window_holds_the_last_events_and_sources_their_own():
  rng = np.random.default_rng(0)
  pv = prog_lib.ProgressiveValidation(window=1000)
  z_all, y_all, by_src = [], [], {"a": ([], []), "b": ([], [])}
  sizes = [100, 333, 1, 700, 1500, 64, 999, 2]  # crosses the ring's end, and one batch larger than it
  for i, n in enumerate(sizes):
    z = (rng.normal(size=n) * 2 + 0.5).astype(np.float32)
    y = (rng.random(n) < 1 / (1 + np.exp(-z))).astype(np.float32)
    src = "ab"[i % 2]
    pv.add(z, y, source=src)
    z_all.append(z)
    y_all.append(y)
    by_src[src][0].append(z)
    by_src[src][1].append(y)
    rec, sources = pv.take().metrics()
    zc, yc = np.concatenate(z_all)[-1000:], np.concatenate(y_all)[-1000:]
    ref = reference(zc, yc)
    assert rec["events"] == zc.size and rec["events_seen"] == sum(sizes[: i + 1])
    assert rec["auc"] == ref["auc"]  # exact counts both ways
    np.testing.assert_allclose([rec["logloss"], rec["calibration"]], [ref["logloss"], ref["calibration"]], rtol=1e-12)
    assert list(sources) == [src]  # the other source had no event since the last report: dropped
    zs, ys = np.concatenate(by_src[src][0])[-1000:], np.concatenate(by_src[src][1])[-1000:]
    assert sources[src]["auc"] == pairwise_auc(ys, zs) and sources[src]["events"] == zs.size
    by_src["ab"[(i + 1) % 2]] = ([], [])  # the other one was dropped: it starts again empty
  assert pv.take().metrics()[1] == {}  # nothing new since the last report


def test_window_of_one_class_has_no_auc():
  pv = prog_lib.ProgressiveValidation(window=10)
  empty = pv.report()
  assert empty["auc"] is None and empty["logloss"] is None and empty["events"] == 0
  pv.add(np.zeros(4, np.float32), np.ones(4))
  rec = pv.report()
  assert rec["auc"] is None and rec["calibration"] == 0.5 and rec["events"] == 4
  with pytest.raises(ValueError, match="at least one"):
    prog_lib.ProgressiveValidation(window=0)


def _first_batches(job, c, n):
  """``n`` training batches through the host pipeline: (rows, batch) placed on the device."""
  out = []
  for t, (b, _) in zip(range(n), job.reader.train()):
    p = job.host.lookup(job.host.prepare(t, b), create=True)
    _, rows, batch = job.host.place(p)  # packed in two buffers: the step takes them apart, the test too
    out.append((p, rows, batch))
  return out


# One micro-step in the slow set only (the default suite's time): two cover the accumulation's order too.
@pytest.mark.parametrize("micro_steps", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_step_logits_are_the_forward_pass_before_the_update(tiny_config, micro_steps):
  """The logits the train step returns equal a separate forward pass (the eval step) with the
  parameters and rows from before the step, on a fresh job and on one that trained a few steps;
  ``update=False`` (device_step 'score') returns the same logits and changes nothing."""
  c = tiny_config
  c.hot_rows_bytes = 0  # the eval step reads rows by width, as the cold rows are
  c.micro_steps = micro_steps
  c.progressive.window = 1000
  job = train.build_job(c, restore=False)
  state = job.state
  for t, (p, rows, batch) in enumerate(_first_batches(job, c, 3)):
    before = jax.tree.map(jnp.copy, state.params)  # the step donates the state
    logits_ref = job.eval_step(before, packing.unpack(rows)["cold"], packing.unpack(batch))["logits"]
    state, _, g, m = job.train_step(state, job.hot.tables, rows, batch)
    np.testing.assert_allclose(np.asarray(m["logits"]), np.asarray(logits_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(m["label"]), packing.unpack(batch)["label"])
    assert float(m["loss"]) == pytest.approx(
      float(np.mean(np.logaddexp(0, m["logits"]) - packing.unpack(batch)["label"] * m["logits"])), rel=1e-5
    )
    job.host.push(p.groups, jax.device_get(g), t)  # the next batch sees the updated rows
  assert not np.array_equal(
    np.asarray(m["logits"]),
    np.asarray(job.eval_step(state.params, packing.unpack(rows)["cold"], packing.unpack(batch))["logits"]),
  )

  c.device_step = "score"
  scorer = train.build_job(c, restore=False)
  ((p, rows, batch),) = _first_batches(scorer, c, 1)
  params0 = jax.device_get(scorer.state.params)
  st, _, g, m = scorer.train_step(scorer.state, scorer.hot.tables, rows, batch)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(st.params), params0)
  assert all(not np.asarray(x).any() for x in jax.tree.leaves(g))
  ref = scorer.eval_step(st.params, packing.unpack(rows)["cold"], packing.unpack(batch))["logits"]
  np.testing.assert_allclose(np.asarray(m["logits"]), np.asarray(ref), rtol=1e-5, atol=1e-6)
  job.ps.close()
  scorer.ps.close()


_MESH_CHECK = r"""
import jax, jax.numpy as jnp, numpy as np
from configs import tiny
from recsys_jax import train
from recsys_jax.training import packing
c = tiny.get_config()
c.hot_rows_bytes, c.micro_steps, c.mesh.fsdp, c.batch_size, c.progressive.window = 0, 2, 2, 512, 1000
job = train.build_job(c, restore=False)
state, worst = job.state, 0.0
for t, (b, _) in zip(range(3), job.reader.train()):
  p = job.host.lookup(job.host.prepare(t, b), create=True)
  _, rows, batch = job.host.place(p)
  ref = np.asarray(job.eval_step(jax.tree.map(jnp.copy, state.params), packing.unpack(rows)["cold"], packing.unpack(batch))["logits"])
  state, _, g, m = job.train_step(state, job.hot.tables, rows, batch)
  assert np.array_equal(np.asarray(m["label"]), b["label"])
  worst = max(worst, float(np.abs(np.asarray(m["logits"]) - ref).max()))
  job.host.push(p.groups, jax.device_get(g), t)
assert dict(job.mesh.shape) == {"replica": 4, "fsdp": 2}, job.mesh.shape
assert worst < 1e-5, worst
print("ok", worst)
"""


@pytest.mark.slow
def test_step_logits_on_a_mesh_are_the_batch_in_order():
  """8 devices (4 replicas x 2 fsdp), 2 micro-steps: every device's micro-batches' logits come back
  in the batch's order, equal to the eval step's forward with the pre-step parameters."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  p = subprocess.run(
    [sys.executable, "-c", _MESH_CHECK], cwd=root, env=env, capture_output=True, text=True, timeout=600
  )
  assert p.returncode == 0 and "ok" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


def test_a_run_writes_progressive_records_and_the_summary(tiny_config, tmp_path):
  c = tiny_config
  c.num_steps, c.log_every = 6, 2
  c.progressive.window = 3 * c.batch_size + 10  # full from the second report on
  c.eval_samples = c.eval_batch_size = 1024
  got = []
  summary = train.train_and_evaluate(c, str(tmp_path), on_metrics=lambda s, k, v: got.append((s, k, v)))
  recs = [(s, v) for s, k, v in got if k == "progressive"]
  assert [s for s, _ in recs] == [2, 4, 6]
  assert [v["events_seen"] for _, v in recs] == [2 * 256, 4 * 256, 6 * 256]
  assert [v["events"] for _, v in recs] == [2 * 256, c.progressive.window, c.progressive.window]
  assert all(0.0 < v["auc"] < 1.0 and v["logloss"] > 0 and v["report_ms"] >= 0 and v["add_ms"] > 0 for _, v in recs)
  assert train.read_metrics(str(tmp_path), "progressive")[-1]["auc"] == recs[-1][1]["auc"]
  assert summary["progressive"]["auc"] == recs[-1][1]["auc"]


def test_a_scoring_run_changes_no_row_or_weight(tiny_config, tmp_path):
  """device_step 'score' continues a trained workdir without changing it: with Adam rows (which a zero
  gradient would move) the final evaluation equals the trained run's to the bit, and the scoring
  run's progressive records cover its own steps."""
  c = tiny_config
  c.data.vocab_sizes = (10,) * 8  # every id is trained before the scoring starts, so none is new to it
  c.embeddings.optimizer = "adam"
  c.num_steps, c.log_every, c.progressive.window = 3, 3, 10_000
  c.eval_samples = c.eval_batch_size = 1024
  trained = train.train_and_evaluate(c, str(tmp_path))
  c.num_steps, c.device_step = 6, "score"
  scored = train.train_and_evaluate(c, str(tmp_path))
  for k in ("auc", "logloss", "calibration"):
    assert scored[k] == trained[k], (k, scored[k], trained[k])
  assert scored["progressive"]["events_seen"] == 3 * c.batch_size


@pytest.mark.slow  # a whole run (6 s) for a switch; the default suite's runs all have it on
def test_progressive_off_returns_no_logits(tiny_config, tmp_path):
  c = tiny_config
  c.num_steps, c.log_every, c.progressive.window = 2, 1, 0
  c.eval_samples = c.eval_batch_size = 1024
  summary = train.train_and_evaluate(c, str(tmp_path))
  assert summary["progressive"] is None
  assert train.read_metrics(str(tmp_path), "progressive") == []


def test_source_metrics_are_written_under_their_name(tmp_path):
  """The hook for a stream's files: ``record_step(..., source=name)`` gives the source a window and
  a record of its own (``source`` set), beside the window over every batch."""
  c = tiny.get_config()
  c.progressive.window = 100
  progress = Progress(str(tmp_path), c, 0, 0.0)
  rng = np.random.default_rng(1)
  for t, src in zip(range(4), itertools.cycle(["f0.tsv", "f1.tsv"])):
    z = rng.normal(size=30).astype(np.float32)
    progress.record_step(t, 0.5, {"loss": 0.5, "logits": z, "label": (z > 0).astype(np.float32)}, source=src)
  progress.log_progressive(4)
  progress.flush_reports()  # computed and written on the reporter thread
  progress.writers.close()
  recs = train.read_metrics(str(tmp_path), "progressive")
  assert [r.get("source") for r in recs] == [None, "f0.tsv", "f1.tsv"]
  assert [r["events"] for r in recs] == [100, 60, 60] and all(r["auc"] == 1.0 for r in recs)
  tb = tmp_path / "tensorboard"
  events = b"".join(f.read_bytes() for f in tb.iterdir())  # the tags are stored as they are spelled
  for tag in (b"progressive/auc", b"progressive/f0.tsv/auc", b"progressive/f1.tsv/logloss"):
    assert tag in events, tag
