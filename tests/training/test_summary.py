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
  assert tput and "samples/s (after the first step" in tput[0], first
  again = train.train_and_evaluate(c, str(tmp_path))
  assert again["steps_this_run"] == 0 and again["resumed_from"] == 3
  text = train.format_summary(again)
  assert "nan" not in text.lower(), text
  assert "throughput    no steps run" in text
  one = train.format_summary({**again, "steps_this_run": 1})
  assert "throughput    not measured" in one and "nan" not in one.lower()
  # A resume restores the skipped count from the checkpoint, not the examples the earlier run named.
  restored = train.format_summary({**again, "bad_records_skipped": 2, "bad_record_examples": []})
  assert "bad records   2 skipped (counted by the run before the resume; its log names them)" in restored


def test_a_workdir_past_num_steps_says_so_in_one_line_and_its_summary_is_true(tiny_config, tmp_path, capsys):
  """The README's sections once shared a workdir: a 300-step run found a 2,000-step checkpoint, ran nothing and
  reported ``steps 300 (-1700 this run)``. It now says so in one line and reports the step it evaluated."""
  import json

  c = tiny_config
  c.num_steps = 3
  c.eval_samples = c.eval_batch_size = 4096
  train.train_and_evaluate(c, str(tmp_path))
  capsys.readouterr()
  c.num_steps = 2
  s = train.train_and_evaluate(c, str(tmp_path))
  said = [line for line in capsys.readouterr().err.splitlines() if "num_steps=2" in line]
  assert len(said) == 1 and "is at step 3, at or past num_steps=2: no step to train" in said[0], said
  assert (s["steps"], s["steps_this_run"], s["resumed_from"], s["samples_per_sec"]) == (3, 0, 3, None)
  with open(tmp_path / "summary.json") as f:
    json.loads(f.read(), parse_constant=lambda name: (_ for _ in ()).throw(ValueError(f"{name} in summary.json")))
  text = train.format_summary(s)
  assert "steps         3 (0 this run" in text and "throughput    no steps run" in text, text
