"""A checkpoint is one cut of everything a resume reads: killed anywhere in a save, the run resumes equal.

The hot-rows run of configs/tiny.py (k = 0, a checkpoint every 10 steps) is SIGKILLed at named
points of a save (``RECSYS_JAX_CRASH_AT``, :func:`recsys_jax.checkpoint.crash_point`), above all
just after orbax committed the dense state and meta, and at random moments (slow). Each killed run,
run again on its workdir, must end as the uninterrupted run did: every dense weight bit for bit (the
final checkpoint's CRC32 of every array) and the final AUC and logloss exactly.
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


def _env(crash=None):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("RECSYS_JAX_CRASH_AT", None)
  if crash:
    env["RECSYS_JAX_CRASH_AT"] = crash
  return env


def _train(workdir, *extra, crash=None):
  """One run of the trainer on ``workdir``: (exit status, stderr)."""
  p = subprocess.run(
    [sys.executable, "-m", "recsys_jax.main", f"--workdir={workdir}", *ARGS, *extra],
    cwd=ROOT,
    env=_env(crash),
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
  return {"auc": s["auc"], "logloss": s["logloss"], "steps": s["steps"], "dense_crc32": crc}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("cut") / "reference")
  code, err = _train(workdir)
  assert code == 0, err[-3000:]
  return _end(workdir)


def _resumed_equal(reference, workdir, killed_at):
  """Runs the killed run's workdir to the end; it must end as the uninterrupted run."""
  code, err = _train(workdir)
  assert code == 0, err[-3000:]
  assert f"resumed from {os.path.join(workdir, 'checkpoints')}/{killed_at}" in err, err[-3000:]
  got = _end(workdir)
  assert got == reference, {k: (got[k], reference[k]) for k in got if got[k] != reference[k]}
  return err


@pytest.mark.parametrize("point", ["committed"])
def test_a_kill_just_after_the_commit_resumes_equal(reference, tmp_path, point):
  """SIGKILL right after orbax committed checkpoint 20: the resume starts from it and ends equal."""
  workdir = str(tmp_path / "run")
  code, err = _train(workdir, crash=f"{point}:20")
  assert code == -signal.SIGKILL, err[-3000:]
  assert 20 in _steps(workdir), _steps(workdir)
  _resumed_equal(reference, workdir, 20)


@pytest.mark.slow
def test_random_kills_resume_equal(reference, tmp_path):
  """SIGKILLs at random moments of one run (some during saves), each followed by a resume."""
  rng = random.Random(7)
  workdir = str(tmp_path / "run")
  kills = 0
  for _ in range(6):
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
    time.sleep(rng.uniform(0.0, 1.5))
    if p.poll() is None:
      p.send_signal(signal.SIGKILL)
      kills += 1
    p.wait()
    if os.path.exists(os.path.join(workdir, "summary.json")) and _steps(workdir)[-1:] == [STEPS]:
      break
  assert kills >= 2, kills
  code, err = _train(workdir)
  assert code == 0, err[-3000:]
  got = _end(workdir)
  assert got == reference, {k: (got[k], reference[k]) for k in got if got[k] != reference[k]}
