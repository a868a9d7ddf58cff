"""A resume whose config does not fit the workdir's checkpoints names the field, its value in the checkpoint's
config and in the one given, and the fix, in one line; the checkpoints and the config they were written with are
left as they were (a failed resume writes no config.<n>.json that a scorer would then read)."""

from __future__ import annotations

import json
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


# Damage that a checksum alone would not see: a flipped byte in the checksum's own key (the file then looks
# like one written before configs carried a checksum) or in its value, or one that breaks the JSON. Each
# must be refused as damage, in one line naming the file, by every reader; a file written before the
# checksum existed (legacy_configs/: written by run_config.save at the commit named, the first to write
# config.json and the last before the checksum) must still be read.

LEGACY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "legacy_configs")
LEGACY_FILES = sorted(os.listdir(LEGACY))


def _refused_or_same(data: bytes, want: dict) -> bool:
  """True if ``data``, as a config file's bytes, reads back as ``want``; False if refused as damage in one line
  naming the file; anything else (another content, another error, a traceback) fails. (``parse`` is what every
  reader of a config file runs on its bytes; the readers themselves are below.)"""
  from recsys_jax.training import run_config

  try:
    got = run_config.parse(data, "/w/config.json")
  except ValueError as e:
    msg = str(e)
    assert msg.startswith("/w/config.json is damaged: ") and len(msg.splitlines()) == 1, (data, msg)
    return False
  assert got == {k: v for k, v in want.items() if k != "config_crc32"}, data
  return True


def _checksummed(tmp_path) -> bytes:
  from recsys_jax.training import run_config

  run_config.save(str(tmp_path), _short(tiny.get_config()))
  return (tmp_path / "config.json").read_bytes()


def _span(data: bytes, text: bytes):
  start = data.index(text)
  assert data.count(text) == 1
  return range(start, start + len(text))


def test_every_byte_of_the_checksum_key_and_value_changed_to_any_other_is_refused(tmp_path):
  """Each byte from the key's opening quote to the value's closing one, replaced by each of the other 255
  values: refused (a key no longer the checksum's is not read as a file without one), unless the byte was
  whitespace and still is (the same config)."""
  data = _checksummed(tmp_path)
  want = json.loads(data)
  span = _span(data, b'"config_crc32": "' + want["config_crc32"].encode() + b'"')
  accepted = []
  for i in span:
    for b in range(256):
      if b != data[i] and _refused_or_same(data[:i] + bytes([b]) + data[i + 1 :], want):
        accepted.append((data[i : i + 1], bytes([b])))
  assert set(accepted) <= {(b" ", w) for w in (b"\t", b"\n", b"\r")}, accepted


def test_every_bit_of_a_written_config_flipped_is_refused_or_harmless(tmp_path):
  """Any one bit of the whole file flipped: refused as damage, or read back as the same config."""
  data = _checksummed(tmp_path)
  want = json.loads(data)
  for i in range(len(data)):
    for bit in range(8):
      _refused_or_same(data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1 :], want)


@pytest.mark.parametrize("name", LEGACY_FILES)
def test_a_config_written_before_the_checksum_is_read(name, tmp_path):
  """By ``verify`` and ``load``; a resume over it writes the config it had, with the defaults it lacked, beside it."""
  from recsys_jax.training import run_config

  data = open(os.path.join(LEGACY, name), "rb").read()
  assert b"crc" not in data
  (tmp_path / "config.json").write_bytes(data)
  run_config.verify(str(tmp_path))
  got = run_config.load(str(tmp_path))
  assert got.to_dict() == run_config.from_dict(run_config.with_defaults(json.loads(data))).to_dict()
  run_config.save(str(tmp_path), got)
  assert run_config.load(str(tmp_path)).to_dict() == got.to_dict()
  assert (tmp_path / "config.json").read_bytes() == data


@pytest.mark.parametrize("name", LEGACY_FILES)
def test_a_legacy_config_with_a_top_level_key_damaged_is_refused(name, tmp_path):
  """In a file without a checksum, every bit of every top-level key's name (and its quotes) flipped in turn: the
  key is then no field of the config (no two fields are one character apart), and the file is refused."""
  data = open(os.path.join(LEGACY, name), "rb").read()
  want = json.loads(data)
  for key in want:
    for i in _span(data, b'\n "' + key.encode() + b'":')[2:-1]:
      for bit in range(8):
        assert not _refused_or_same(data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1 :], want)


def test_a_repeated_key_is_refused(tmp_path):
  """JSON keeps the last of two equal keys: a file ``save`` never writes, whose first value would be lost."""
  data = open(os.path.join(LEGACY, LEGACY_FILES[0]), "rb").read()
  assert not _refused_or_same(data.replace(b'\n "seed": ', b'\n "seed": 5,\n "seed": ', 1), {})


def _damages(data: bytes):
  """One of each kind: the checksum's key changed (a letter, a byte that makes an escape and so a control
  character in the key), its value (a letter that is no hex digit, a control character, not a string), the
  JSON broken."""
  value = json.loads(data)["config_crc32"]
  yield data.replace(b'"config_crc32"', b'"confog_crc32"')
  yield data.replace(b'"config_crc32"', b'"co\\fig_crc32"')
  yield data.replace(value.encode(), value[:-1].encode() + b"g")
  yield data.replace(value.encode(), b"\\f" + value[2:].encode())
  yield data.replace(b'"' + value.encode() + b'"', value[:-1].encode())
  yield data.replace(b'"config_crc32": "', b'"config_crc32" "')


def test_each_reader_refuses_a_damaged_checksum_in_one_line_and_writes_nothing(tmp_path):
  """``verify`` (the trainer's first look), ``save`` (a resume's), ``load`` and ``load_scorer``: the same line."""
  from recsys_jax.serving import scorer
  from recsys_jax.training import run_config

  d, c = str(tmp_path), _short(tiny.get_config())
  for damaged in _damages(_checksummed(tmp_path)):
    (tmp_path / "config.json").write_bytes(damaged)
    messages = set()
    for read in (run_config.verify, lambda d: run_config.save(d, c), run_config.load, scorer.load_scorer):
      with pytest.raises(ValueError) as e:
        read(d)
      messages.add(str(e.value))
    assert len(messages) == 1, messages
    msg = messages.pop()
    assert msg.startswith(f"{tmp_path}/config.json is damaged: ") and len(msg.splitlines()) == 1, msg
    assert os.listdir(d) == ["config.json"] and (tmp_path / "config.json").read_bytes() == damaged


def test_the_trainer_and_the_server_refuse_a_damaged_checksum_key_in_one_line(tmp_path):
  """``python -m recsys_jax.main`` and ``python -m recsys_jax.serve`` on a workdir whose config.json has the
  checksum's key damaged: one ``error:`` line naming the file and the key, exit 2, the file as it was and no
  other config written (the serving side checks it before looking for a checkpoint)."""
  damaged = next(_damages(_checksummed(tmp_path)))
  (tmp_path / "config.json").write_bytes(damaged)
  train_args = ["-m", "recsys_jax.main", "--config=configs/tiny.py", f"--workdir={tmp_path}", "--config.num_steps=2"]
  serve_args = ["-m", "recsys_jax.serve", f"--workdir={tmp_path}", "--http_port=0", "--grpc_port=-1"]
  for args in (train_args, serve_args):
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {tmp_path}/config.json is damaged: "), r.stderr
    assert '"confog_crc32"' in errors[0] and "Traceback" not in r.stderr
    assert (tmp_path / "config.json").read_bytes() == damaged
    assert not [n for n in os.listdir(tmp_path) if n.startswith("config.") and n != "config.json"]
