"""``train.build_job`` on a trained run's workdir is that run's model: the checkpoint's dense state and PS rows are
restored, so evaluating it gives the run's own final evaluation (a notebook's path); ``restore=False`` is a fresh job."""

from __future__ import annotations

import jax
import numpy as np

from recsys_jax import train


def test_build_job_on_a_trained_workdir_evaluates_as_the_run_ended(tiny_config, tmp_path, capsys):
  c = tiny_config
  c.num_steps = 30
  c.eval_samples = c.eval_batch_size = 4096
  workdir = str(tmp_path / "run")
  last = {}
  build = train.build_job

  def recording(config, wd=None, restore=True):  # the run's own final dense params, not read from its checkpoint
    job = build(config, wd, restore)
    step = job.train_step

    def recorded(state, hot, rows, batch):
      out = step(state, hot, rows, batch)
      last["params"] = jax.device_get(out[0].params)
      return out

    job.train_step = recorded
    return job

  train.build_job = recording
  try:
    summary = train.train_and_evaluate(c, workdir)
  finally:
    train.build_job = build
  capsys.readouterr()

  job = train.build_job(c, workdir)
  assert job.step == c.num_steps
  assert "build_job: restored" in capsys.readouterr().err
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(job.state.params), last["params"])
  ev = train.evaluate(job.state, job.eval_step, job.host, c)
  # Every eval logit enters the logloss (float64): equal to the last bit, the rows looked up are the run's too.
  for k in ("auc", "logloss", "calibration", "eval_samples"):
    assert ev[k] == summary[k], (k, ev[k], summary[k])
  job.ps.close()

  fresh = train.build_job(c, workdir, restore=False)
  assert fresh.step == 0
  ev0 = train.evaluate(fresh.state, fresh.eval_step, fresh.host, c)
  assert abs(ev0["auc"] - summary["auc"]) > 0.05, (ev0, summary)
  assert not np.array_equal(
    jax.device_get(fresh.state.params)["top"]["dense_0"]["kernel"], last["params"]["top"]["dense_0"]["kernel"]
  )
  fresh.ps.close()


def test_build_job_on_an_empty_workdir_is_fresh_and_says_nothing(tiny_config, tmp_path, capsys):
  job = train.build_job(tiny_config, str(tmp_path / "new"))
  assert job.step == 0 and "restored" not in capsys.readouterr().err
  job.ps.close()
