"""A checkpoint is one cut of everything a resume reads: killed or out of disk anywhere in a save,
the run resumes equal.

The hot-rows run of configs/tiny.py (k = 0, a checkpoint every 10 steps) is SIGKILLed at named
points of a save (``RECSYS_JAX_CRASH_AT``, :func:`recsys_jax.checkpoint_files.fault_point`), above all
just after orbax committed the dense state and meta (where the hot set used to be written after
the commit), and at random moments (slow). On a small tmpfs, the disk is filled at the points
before the PS snapshot, the hot set and orbax's write (``RECSYS_JAX_FILL_DISK_AT``): the run ends
with one ``error:`` line and exit 2, keeping every checkpoint committed before. Each run, run again
on its workdir, must end as the uninterrupted run did: every dense weight bit for bit (the final
checkpoint's CRC32 of every array) and the final AUC and logloss exactly.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 40
ARGS = (
  "--config=configs/tiny.py",
  f"--config.num_steps={STEPS}",
  "--config.checkpoint_every=10",
  "--config.eval_samples=4096",
  "--config.staleness=0",
)


def _env(crash=None, fill=None):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("RECSYS_JAX_CRASH_AT", None)
  env.pop("RECSYS_JAX_FILL_DISK_AT", None)
  if crash:
    env["RECSYS_JAX_CRASH_AT"] = crash
  if fill:
    env["RECSYS_JAX_FILL_DISK_AT"] = fill
  return env


def _train(workdir, *extra, crash=None, fill=None):
  """One run of the trainer on ``workdir``: (exit status, stderr)."""
  p = subprocess.run(
    [sys.executable, "-m", "recsys_jax.main", f"--workdir={workdir}", *ARGS, *extra],
    cwd=ROOT,
    env=_env(crash, fill),
    capture_output=True,
    text=True,
    timeout=600,
  )
  return p.returncode, p.stderr


def _steps(workdir):
  path = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []


def _end(workdir):
  """What a finished run leaves: AUC, logloss, steps and the CRC32 of every dense array at the end."""
  with open(os.path.join(workdir, "summary.json")) as f:
    s = json.load(f)
  with open(os.path.join(workdir, "checkpoints", str(STEPS), "meta", "metadata")) as f:
    crc = json.load(f)["state_crc32"]
  # The parts (hot sets) of the kept checkpoints, no others: those of older ones went with them.
  assert sorted(os.listdir(os.path.join(workdir, "checkpoint_parts")), key=int) == list(map(str, _steps(workdir)))
  return {"auc": s["auc"], "logloss": s["logloss"], "steps": s["steps"], "dense_crc32": crc}


def _config():
  """The config of ``ARGS``, for a run in this process."""
  from configs import tiny

  c = tiny.get_config()
  for arg in ARGS[1:]:
    key, value = arg[len("--config.") :].split("=")
    c[key] = type(c[key])(value)
  return c


def _train_here(workdir):
  """A run of the same job in this process (compiled once for all of them): its summary."""
  from recsys_jax import train

  return train.train_and_evaluate(_config(), workdir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("cut") / "reference")
  _train_here(workdir)
  return _end(workdir)


def _resumed_equal(reference, workdir, killed_at, here=False):
  """Runs the killed run's workdir to the end; it must end as the uninterrupted run."""
  if here:
    assert _train_here(workdir)["resumed_from"] == killed_at
  else:
    code, err = _train(workdir)
    assert code == 0, err[-3000:]
    assert f"resumed from {os.path.join(workdir, 'checkpoints')}/{killed_at}" in err, err[-3000:]
  got = _end(workdir)
  assert got == reference, {k: (got[k], reference[k]) for k in got if got[k] != reference[k]}


def test_a_crash_just_after_the_commit_resumes_equal(reference, tmp_path, monkeypatch):
  """Stopped dead right after orbax committed checkpoint 20 (before anything else of the save; here
  by a raise, in this process: tests below SIGKILL): the resume starts from it, with its hot set,
  and ends equal."""
  from recsys_jax import checkpoint_files as checkpoint

  workdir = str(tmp_path / "run")
  monkeypatch.setenv(checkpoint.CRASH_AT_ENV, "committed:20:raise")
  with pytest.raises(checkpoint.Crash):
    _train_here(workdir)
  monkeypatch.delenv(checkpoint.CRASH_AT_ENV)
  assert _steps(workdir) == [10, 20]
  _resumed_equal(reference, workdir, 20, here=True)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before_snapshot", "before_parts", "before_commit", "committed", "collected"])
def test_a_kill_at_each_point_of_a_save_resumes_equal(reference, tmp_path, point):
  """SIGKILL at each point of the save of checkpoint 20: the resume starts from 20 once orbax
  committed it, else from 10, and ends equal."""
  workdir = str(tmp_path / "run")
  code, err = _train(workdir, crash=f"{point}:20")
  assert code == -signal.SIGKILL, err[-3000:]
  committed = point in ("committed", "collected")
  assert _steps(workdir) == ([10, 20] if committed else [10]), _steps(workdir)
  _resumed_equal(reference, workdir, 20 if committed else 10)


@pytest.fixture
def small_disk(tmp_path):
  """A 64 MiB tmpfs (root only; skipped where mount is refused)."""
  path = tmp_path / "disk"
  path.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)], capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here (needs root)")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", str(path)], check=False)


def _full_disk_at(reference, small_disk, point):
  workdir = str(small_disk / "run")
  code, err = _train(workdir, fill=f"{point}:20")
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == 2, err[-3000:]
  assert len(lines) == 2 and lines[0] == f"workdir: {workdir}", err[-3000:]  # nothing else on the terminal
  ckpt = os.path.join(workdir, "checkpoints")
  assert lines[1].startswith(f"error: checkpoint {ckpt}/20 could not be written: "), lines[1]
  assert "No space left on device" in lines[1], lines[1]
  assert lines[1].endswith(f"; last good checkpoint: {ckpt}/10 (left as it was)"), lines[1]
  assert _steps(workdir) == [10]  # nothing committed is lost, nothing half written is committed
  os.remove(os.path.join(workdir, "disk_filler"))
  _resumed_equal(reference, workdir, 10, here=True)
  return lines[1]


def test_a_full_disk_under_orbax_is_one_error_line_and_the_resume_ends_equal(reference, small_disk):
  """The disk is full when orbax writes the dense state and meta of checkpoint 20 (the hot set and
  PS snapshot written): one line, exit 2, checkpoint 10 intact, and the run resumed ends equal."""
  _full_disk_at(reference, small_disk, "before_commit")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before_snapshot", "before_parts"])
def test_a_full_disk_at_each_write_is_one_error_line(reference, small_disk, point):
  """The same with the disk full for the PS snapshot (tensorstore) and for the hot set (numpy)."""
  line = _full_disk_at(reference, small_disk, point)
  assert ("its PS snapshot" in line) == (point == "before_snapshot"), line
  assert ("its part" in line and "hot_rows_p0.npz" in line) == (point == "before_parts"), line


@pytest.mark.slow
def test_random_kills_resume_equal(reference, tmp_path):
  """SIGKILLs at random moments of one run (some during saves), each followed by a resume."""
  rng = random.Random(7)
  workdir = str(tmp_path / "run")
  kills, left = 0, []  # (exit status, checkpoints left) of each run
  for _ in range(8):
    p = subprocess.Popen(
      [sys.executable, "-m", "recsys_jax.main", f"--workdir={workdir}", *ARGS],
      cwd=ROOT,
      env=_env(),
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
    )
    before = _steps(workdir)
    deadline = time.monotonic() + 300
    while not [s for s in _steps(workdir) if s not in before] and p.poll() is None and time.monotonic() < deadline:
      time.sleep(0.01)  # a new checkpoint is being written or was just written
    time.sleep(rng.uniform(0.0, 0.5))  # a save takes about 0.1-0.3 s here: some kills land in one
    if p.poll() is None:
      p.send_signal(signal.SIGKILL)
    kills += p.wait() == -signal.SIGKILL
    left.append((p.returncode, _steps(workdir)))
    if os.path.exists(os.path.join(workdir, "summary.json")) and _steps(workdir)[-1:] == [STEPS]:
      break
  print(f"{kills} SIGKILLs; each run's exit status and the checkpoints it left: {left}")
  assert kills >= 2, left
  code, err = _train(workdir)
  assert code == 0, err[-3000:]
  got = _end(workdir)
  assert got == reference, {k: (got[k], reference[k]) for k in got if got[k] != reference[k]}
