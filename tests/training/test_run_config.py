"""A resume whose config does not fit the workdir's checkpoints names the field, its value in the checkpoint's
config and in the one given, and the fix, in one line; the checkpoints and the config they were written with are
left as they were (a failed resume writes no config.<n>.json that a scorer would then read)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from configs import tiny
from recsys_jax import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _short(c, steps=2):
  c.num_steps = steps
  c.eval_samples = c.eval_batch_size = 512
  return c


def test_a_resume_with_another_model_shape_names_the_field_and_both_values(tiny_config, tmp_path):
  train.train_and_evaluate(_short(tiny_config), str(tmp_path))
  before = sorted(os.listdir(tmp_path / "checkpoints")), sorted(os.listdir(tmp_path))
  c = _short(tiny_config, 4)
  c.model.kwargs.top = (64,)
  c.embeddings.optimizer = "sgd"
  with pytest.raises(ValueError) as e:
    train.train_and_evaluate(c, str(tmp_path))
  assert str(e.value) == (
    f"{tmp_path}/checkpoints holds checkpoints of another config (config.json): embeddings.optimizer = 'adagrad' "
    "there, 'sgd' here; model.kwargs.top = (32,) there, (64,) here; they cannot be restored into this one: use a new "
    "--workdir, or the values they were written with"
  )
  assert (sorted(os.listdir(tmp_path / "checkpoints")), sorted(os.listdir(tmp_path))) == before
  # Only the run's length changed: the resume goes on.
  assert train.train_and_evaluate(_short(tiny.get_config(), 4), str(tmp_path))["steps_this_run"] == 2


def test_the_command_line_says_it_in_one_line(tmp_path):
  args = [sys.executable, "-m", "recsys_jax.main", "--config=configs/tiny.py", f"--workdir={tmp_path}"]
  args += ["--config.num_steps=2", "--config.eval_samples=512", "--config.eval_batch_size=512"]
  assert subprocess.run(args, capture_output=True, cwd=ROOT, timeout=300).returncode == 0
  r = subprocess.run(
    args + ["--config.embeddings.dim=4", "--config.model.kwargs.bottom=(16,4)"],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=300,
  )
  assert r.returncode == 2
  lines = r.stderr.splitlines()
  assert len(lines) == 2 and lines[0] == f"workdir: {tmp_path}", lines
  assert lines[1].startswith(f"error: {tmp_path}/checkpoints holds checkpoints of another config (config.json): ")
  assert "embeddings.dim = 8 there, 4 here" in lines[1] and lines[1].endswith(
    "use a new --workdir, or the values they were written with"
  )


def test_a_damaged_checkpoint_is_not_blamed_on_a_field_that_shapes_no_state(tiny_config, tmp_path):
  """A restore that fails for another reason (here the hot set's part is gone) with only a learning rate and
  the snapshot cadence changed is the damage it is, not a config mismatch."""
  from recsys_jax.checkpoint import CheckpointError

  train.train_and_evaluate(_short(tiny_config), str(tmp_path))
  parts = tmp_path / "checkpoint_parts" / "2"
  assert sorted(os.listdir(parts)) == ["hot_rows_p0.npz"]
  (parts / "hot_rows_p0.npz").unlink()
  c = _short(tiny.get_config(), 4)
  c.optimizer.learning_rate, c.checkpoint_full_every = 1e-2, 3
  with pytest.raises(CheckpointError, match="hot_rows_p0.npz cannot be read"):
    train.train_and_evaluate(c, str(tmp_path))


def test_a_config_written_before_a_field_existed_loads_with_that_fields_default(tmp_path):
  """``run_config.load`` of a config.json that lacks fields (a run of an older version wrote it):
  each missing field, at any depth, comes from configs/default.py, every written value is kept,
  and the sections whose keys are the config's own (the model's arguments, per-table and
  per-feature maps) get nothing added: a two-tower model's kwargs must not gain DLRM's."""
  import json

  from configs import default
  from recsys_jax.training import run_config

  want = default.get_config()
  written = run_config.to_dict(tiny.get_config())
  for gone in ("hot_count_every", "publish_dense_every_s", "progressive", "place_pinned_host"):
    del written[gone]
  del written["ps"]["read_ahead"], written["data"]["cache_dir"]
  written["model"] = {"name": "two_tower", "kwargs": {"tower": [8]}}
  written["hot_every"] = 7
  with open(tmp_path / "config.json", "w") as f:
    json.dump(written, f)
  got = run_config.load(str(tmp_path))
  assert got.hot_count_every == want.hot_count_every and got.publish_dense_every_s == want.publish_dense_every_s
  assert got.progressive.window == want.progressive.window and got.place_pinned_host == want.place_pinned_host
  assert got.ps.read_ahead == want.ps.read_ahead and got.data.cache_dir == want.data.cache_dir
  assert got.hot_every == 7 and got.ps.num_shards == written["ps"]["num_shards"]
  assert got.model.to_dict() == {"name": "two_tower", "kwargs": {"tower": (8,)}}
  assert run_config.to_dict(run_config.from_dict(written)) != run_config.to_dict(got)  # something was filled


def _flip_a_key(path):
  """One damaged byte in a key of a written config (the file still parses as JSON)."""
  with open(path, "rb") as f:
    data = f.read()
  assert data.count(b'"initializer"') == 1
  with open(path, "wb") as f:
    f.write(data.replace(b'"initializer"', b'"initializdr"'))


def test_a_damaged_config_file_is_refused_a_changed_config_is_kept_beside(tmp_path):
  """The config files carry their checksum: one whose bytes changed is refused by every reader (the
  trainer's save at a resume, ``load``, ``load_scorer``), naming the file, and nothing is written; a
  config that really changed is written beside the old one, which is kept."""
  from recsys_jax.serving import scorer
  from recsys_jax.training import run_config

  d = str(tmp_path)
  c = _short(tiny.get_config())
  assert run_config.save(d, c) is None
  assert run_config.load(d).to_dict() == c.to_dict()
  _flip_a_key(tmp_path / "config.json")
  damaged = (tmp_path / "config.json").read_bytes()
  match = rf"^{tmp_path}/config\.json is damaged: it does not match its checksum \(written [0-9a-f]{{8}}, read [0-9a-f]{{8}}\)"
  with pytest.raises(ValueError, match=match):
    run_config.save(d, c)
  with pytest.raises(ValueError, match=match):
    run_config.load(d)
  with pytest.raises(ValueError, match=match):
    scorer.load_scorer(d)
  assert sorted(os.listdir(d)) == ["config.json"] and (tmp_path / "config.json").read_bytes() == damaged
  # A real change, on an intact file: kept beside, and the fields that changed are returned.
  os.remove(tmp_path / "config.json")
  assert run_config.save(d, c) is None
  c.num_steps = 99
  assert run_config.save(d, c) == ["num_steps"]
  assert sorted(os.listdir(d)) == ["config.1.json", "config.json"] and run_config.load(d).num_steps == 99


def test_a_resume_over_a_damaged_config_file_exits_2_in_one_line_and_keeps_everything(tmp_path):
  """``python -m recsys_jax.main`` on a workdir whose config.json has one damaged byte: one ``error:``
  line naming the file, exit 2, and the workdir as it was (no config.<n>.json, the same checkpoints)."""
  args = [sys.executable, "-m", "recsys_jax.main", "--config=configs/tiny.py", f"--workdir={tmp_path}"]
  args += ["--config.num_steps=2", "--config.eval_samples=512", "--config.eval_batch_size=512"]
  assert subprocess.run(args, capture_output=True, cwd=ROOT, timeout=300).returncode == 0
  _flip_a_key(tmp_path / "config.json")
  before = sorted(os.listdir(tmp_path)), sorted(os.listdir(tmp_path / "checkpoints"))
  damaged = (tmp_path / "config.json").read_bytes()
  r = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert r.returncode == 2, r.stderr[-3000:]
  lines = r.stderr.splitlines()
  assert len(lines) == 2 and lines[1].startswith(f"error: {tmp_path}/config.json is damaged: "), lines
  assert "another config" not in r.stderr
  assert (sorted(os.listdir(tmp_path)), sorted(os.listdir(tmp_path / "checkpoints"))) == before
  assert (tmp_path / "config.json").read_bytes() == damaged
