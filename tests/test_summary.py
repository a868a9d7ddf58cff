"""The end-of-run summary says something sensible when a run made no steps (a resume of a finished workdir)
or one step (whose time is not measured: it compiles), rather than ``throughput nan samples/s``."""

from __future__ import annotations

from recsys_jax import train


def test_a_resume_with_nothing_left_says_no_steps_run(tiny_config, tmp_path):
  c = tiny_config
  c.num_steps = 3
  c.eval_samples = c.eval_batch_size = 4096
  first = train.format_summary(train.train_and_evaluate(c, str(tmp_path)))
  tput = [line for line in first.splitlines() if line.startswith("throughput")]
  assert tput and tput[0].endswith("samples/s (after the first step)"), first
  again = train.train_and_evaluate(c, str(tmp_path))
  assert again["steps_this_run"] == 0 and again["resumed_from"] == 3
  text = train.format_summary(again)
  assert "nan" not in text.lower(), text
  assert "throughput    no steps run" in text
  one = train.format_summary({**again, "steps_this_run": 1})
  assert "throughput    not measured" in one and "nan" not in one.lower()
