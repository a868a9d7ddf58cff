"""The run summary's samples/s leaves out the time of every train step compile, not only the first
step's: a later one (a re-chosen hot set changes the step's shapes) blocked the loop for seconds
inside the timed interval, and a short dcn_v2 run reported 12k samples/s while its bar showed ~45k."""

from __future__ import annotations

import time

import pytest

from recsys_jax import train
from recsys_jax.training import job as job_lib
from recsys_jax.training.writers import TrainStats


def test_throughput_leaves_out_the_time_of_later_compiles():
  """Injected times: 9 steps of 0.5 s after the first, a 3 s compile at step 4, one at step 1 that
  began before the first push was applied (0.3 s of it inside the interval), one at the first step
  and one at a step never applied (both outside): 9 steps in 4.5 s, closed form."""
  s, B = TrainStats(), 10
  s.compiled(0, 0.0, 9.0)
  s.record(0, 0.0, now=10.0)
  s.compiled(1, 9.8, 10.3)
  applied = {1: 10.8, 2: 11.3, 3: 11.8}
  s.compiled(4, 11.9, 14.9)
  applied.update({4: 15.3, 5: 15.8, 6: 16.3, 7: 16.8, 8: 17.3, 9: 17.8})
  for t, now in applied.items():
    s.record(t, 0.0, now=now)
  s.compiled(10, 17.9, 18.0)
  sps, k, secs = s.throughput(B)
  assert (k, secs) == (2, pytest.approx(3.3))
  assert sps == pytest.approx(9 * B / (9 * 0.5))
  one = TrainStats()
  one.record(0, 0.0, now=1.0)
  assert one.throughput(B) == (None, 0, 0.0)


SLEEP = 0.5  # seconds a trace of the train step sleeps: a slow compile


def test_a_run_whose_step_recompiles_reports_the_steady_rate(tiny_config, tmp_path, monkeypatch):
  """A tiny run whose step compiles again after the first (the hot set chosen after 3 steps, the
  cold rows' shapes growing: 3 later compiles here), each compile made SLEEP s slower: the time the
  reported samples/s implies for the steps after the first, (steps - 1) * batch / samples/s, must
  hold none of the later compiles. Those steps take ~0.1 s here, under SLEEP * recompiles / 2;
  with the later compiles inside (as it was), it is over SLEEP * recompiles."""
  make = job_lib.make_train_step

  def slow_make_train_step(*args, **kwargs):
    step = make(*args, **kwargs)

    def train_step(state, hot, rows, batch):
      time.sleep(SLEEP)  # runs only while jax traces the step: each compile is SLEEP s slower
      return step(state, hot, rows, batch)

    return train_step

  monkeypatch.setattr(job_lib, "make_train_step", slow_make_train_step)
  c = tiny_config
  c.num_steps, c.hot_warmup_steps = 6, 3
  c.eval_samples = c.eval_batch_size = 4096
  t = time.perf_counter()
  s = train.train_and_evaluate(c, str(tmp_path))
  took = time.perf_counter() - t
  assert s["train_step_traces"] >= 2, s["train_step_traces"]  # the hot choice recompiled the step
  assert s["recompiles"] == s["train_step_traces"] - 1 and s["recompile_s"] >= SLEEP * s["recompiles"], s
  steps_s = (c.num_steps - 1) * c.batch_size / s["samples_per_sec"]
  assert steps_s < SLEEP * s["recompiles"] / 2, (steps_s, s["samples_per_sec"], s["recompile_s"], took)
  line = [x for x in train.format_summary(s).splitlines() if x.startswith("throughput")][0]
  want = f"samples/s (after the first step, less {s['recompile_s']:.1f} s of {s['recompiles']} later compile"
  assert want in line, line
