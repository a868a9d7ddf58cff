"""The command line explains itself: ``--helpconfig`` lists every config field with its value and the comment
beside it in configs/default.py, and a mistyped ``--config.<field>`` is one ``error:`` line with the suggestion."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from configs import default, fields, movielens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(*args):
  return subprocess.run(
    [sys.executable, "-m", "recsys_jax.main", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
  )


def test_every_default_field_has_its_comment():
  docs = fields.field_docs()
  names = [name for name, _ in fields.leaves(default.get_config())]
  assert len(names) > 80
  missing = [n for n in names if not docs.get(n, (0, ""))[1]]
  assert not missing, f"fields of configs/default.py with no comment: {missing}"
  text = fields.describe()
  for n in names:
    assert f"  --config.{n}=" in text, n
  assert docs["seed"][1] == "Seeds parameter init, PS row init and (via data.seed) the data."


def test_comment_rules_on_a_written_file(tmp_path):
  path = tmp_path / "default.py"
  path.write_text(
    "def get_config():\n"
    "  c = ml_collections.ConfigDict()\n"
    "  # A section.\n"
    "  c.s = ml_collections.ConfigDict()\n"
    "  # Two lines\n"
    "  # above.\n"
    "  c.s.a = 1  # And beside.\n"
    "\n"
    "  # Not above b: a blank line is between.\n"
    "\n"
    "  c.s.b = '#not a comment'\n"
    "  c.s.a = 2  # Again.\n"
  )
  docs = fields.field_docs(str(path))
  assert docs == {"s": (4, "A section."), "s.a": (7, "Two lines above. And beside. Again."), "s.b": (11, "")}


def test_helpconfig_prints_the_values_of_the_given_config():
  r = main("--helpconfig")
  assert r.returncode == 0, r.stderr
  assert "  --config.batch_size=4096\n      Global examples per step" in r.stdout
  r = main("--config=configs/movielens.py", "--helpconfig")
  assert r.returncode == 0, r.stderr
  assert f"  --config.batch_size={movielens.get_config().batch_size}\n" in r.stdout
  assert "--config.data.name='movielens'" in r.stdout
  assert "helpconfig" in main("--help").stdout


@pytest.mark.parametrize(
  "flag, line",
  [
    (
      "--config.bach_size=1",
      "error: --config.bach_size: the config has no field 'bach_size'; "
      'did you mean "batch_size" instead of "bach_size"?',
    ),
    (
      "--config.model.kwargs.bottum=1",
      "error: --config.model.kwargs.bottum: the config has no field 'bottum'; "
      'did you mean "bottom" instead of "bottum"?',
    ),
    ("--config.zzzqqq=1", "error: --config.zzzqqq: the config has no field 'zzzqqq'; --helpconfig lists the fields"),
    (
      "--config.batch_size=abc",
      "error: flag --config.batch_size=abc: invalid literal for int() with base 10: 'abc' "
      "(--helpshort lists the flags, --helpconfig the config fields)",
    ),
  ],
)
def test_a_bad_config_flag_is_one_error_line(flag, line, tmp_path):
  r = main("--config=configs/tiny.py", flag, f"--workdir={tmp_path}")
  assert r.returncode == 2
  assert r.stderr.splitlines() == [line]
  assert os.listdir(tmp_path) == []  # nothing started


@pytest.mark.parametrize(
  "args",
  [
    ["--config=configs/tinny.py"],
    ["--config", "configs/tinny.py", "--config.batch_size=3"],
    ["--config=configs/tinny.py", "--helpconfig"],
  ],
)
def test_a_config_file_that_does_not_exist_is_one_error_line(args, tmp_path):
  r = main(*args, f"--workdir={tmp_path}")
  assert r.returncode == 2
  assert r.stderr.splitlines() == [
    "error: --config=configs/tinny.py: the file configs/tinny.py does not exist; did you mean configs/tiny.py?"
  ]
  assert os.listdir(tmp_path) == []  # nothing started


def test_model_specific_fields_carry_their_meaning_from_the_model():
  r = main("--config=configs/dcn_v2.py", "--helpconfig")
  assert r.returncode == 0, r.stderr
  assert (
    "  --config.model.kwargs.num_cross=2\n      Number of cross layers. (dcn_v2's argument; its default 3)" in r.stdout
  )
  assert "(not in configs/default.py)" not in r.stdout


def test_helpconfig_explains_every_config_including_arguments_without_a_default():
  """DIN's ``history`` has no default in its class: --helpconfig said KeyError for configs/din.py."""
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))):
    if "def get_config(" in open(path, encoding="utf-8").read():
      assert "--config.model.kwargs." in fields.describe(path), path
  text = fields.describe(os.path.join(ROOT, "configs", "din.py"))
  assert "(din's argument; required)" in text, text


def test_one_flag_switches_the_model_and_its_kwargs_follow(tmp_path):
  """configs/tiny.py's DLRM kwargs (bottom, top) give way to DCN-v2's defaults, said in one line; an argument
  given on the command line that the model does not take stays an error."""
  r = main(
    "--config=configs/tiny.py",
    "--config.model.name=dcn_v2",
    "--config.num_steps=2",
    "--config.eval_samples=512",
    "--config.eval_batch_size=512",
    f"--workdir={tmp_path / 'a'}",
  )
  assert r.returncode == 0, r.stderr[-3000:]
  dropped = [line for line in r.stderr.splitlines() if line.startswith("model 'dcn_v2'")]
  assert dropped == [
    "model 'dcn_v2' (--config.model.name): the config's model.kwargs bottom, top are not its arguments and were "
    "dropped; it takes deep, low_rank, num_cross, structure (its defaults unless set)"
  ]
  assert "dcn_v2" in r.stdout
  r = main(
    "--config=configs/tiny.py",
    "--config.model.name=dcn_v2",
    "--config.model.kwargs.top=(8,)",
    f"--workdir={tmp_path}/b",
  )
  assert r.returncode == 2
  assert r.stderr.splitlines()[-1].startswith("error: config.model.kwargs.top: model 'dcn_v2' takes no such argument")


def test_helpconfig_lists_the_models_and_a_required_model_argument():
  """DIN's target has no default (--helpconfig of configs/din.py failed on it with a KeyError)."""
  from configs import fields

  text = fields.describe("configs/din.py")
  assert "Name of the candidate-item pooled feature, e.g. 'movie'. (din's argument; required)" in text
  assert "The models: dcn_v2, deepfm, din, dlrm, wide_deep." in text


def test_a_clean_run_ends_without_a_traceback(tmp_path):
  """Nothing in a clean run's stderr or trainer log reads as a failure: no traceback, no exception
  ignored at exit (the log's stream is closed by logging's shutdown at exit, as any handler's is)."""
  workdir = tmp_path / "run"
  r = main(
    "--config=configs/tiny.py",
    "--config.num_steps=2",
    "--config.eval_samples=512",
    "--config.eval_batch_size=512",
    f"--workdir={workdir}",
  )
  assert r.returncode == 0, r.stderr[-3000:]
  (log,) = glob.glob(str(workdir / "trainer_p*.log"))
  with open(log) as f:
    text = f.read()
  for where, out in (("stderr", r.stderr), ("log", text)):
    for bad in ("Traceback", "Exception ignored"):
      assert bad not in out, (where, out[-3000:])
