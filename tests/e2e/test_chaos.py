"""Chaos: children of a launcher job SIGKILLed at random moments; the job still ends as if nothing happened.

``python -m recsys_jax.launch`` runs 2 PS servers + 2 trainers on configs/tiny.py (staleness k=0,
a checkpoint every 20 steps) with ``--max_restarts`` equal to the number of kills. Each child is
killed once, in an order a seeded RNG picks, each kill at another kind of moment:

1. before the first checkpoint, a random 0.5-3 s after the trainers configured the servers;
2. during a restart's startup, just after the launcher printed the victim's ``started`` line;
3. right after a new checkpoint directory appears;
4. between checkpoints, a random 0.2-1.2 s after a new checkpoint appears.

Each kill is made only once the previous one's restart line is out and is aimed at the current
attempt's process, so no two kills fall into one restart: the launcher must report exactly one
restart per kill that landed (the victim was running when SIGKILLed), naming the victim and its
signal. The job must exit 0 with summary.json's auc, logloss and steps equal (==) to those of an
uninterrupted launcher run, and resume its last attempt from the newest checkpoint left when the
last kill landed.

``config.ps.timeout_s`` stays at its default: the launcher sees a dead child as its exit, not
through the trainers' deadlines (tests/e2e/test_cluster.py times those). The default suite's form of
this test, one kill between checkpoints, is in tests/e2e/test_cluster.py.
"""

import functools
import json
import os
import random
import signal
import time

import pytest

from tests.helpers.launcher_job import RESTART, STARTED, LauncherJob, reference_run, running

SEED = 13
CHILDREN = ("ps-0", "ps-1", "worker-0", "worker-1")
MOMENTS = ("before the first checkpoint", "in a restart's startup", "right after a checkpoint", "between checkpoints")
ARGS = ("--config.checkpoint_every=20",)
METRICS = ("auc", "logloss", "steps")


def _checkpoints(workdir):
  path = os.path.join(workdir, "checkpoints")
  return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []


def _wait(predicate, job, what, timeout=300):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    value = predicate()
    if value:
      return value
    if job.proc.poll() is not None:
      break
    time.sleep(0.01)
  pytest.fail(f"{what}: not seen\n{job.tail()}")


def _new_checkpoint(job, than):
  return _wait(lambda: [s for s in _checkpoints(job.workdir) if s > than], job, f"a checkpoint after {than}")[-1]


def _started_in(job, name, attempt):
  """The pid of ``name`` in attempt ``attempt`` (0: the first) if the launcher started it yet.

  Attempts are counted by restart lines: an attempt whose server died before its ready line
  started no trainers."""
  seen = 0
  for line in list(job.lines):
    if RESTART.match(line):
      seen += 1
    elif seen == attempt and (m := STARTED.match(line)) and m[1] == name:
      return int(m[2])
  return None


@pytest.mark.slow
def test_random_sigkills_end_like_an_uninterrupted_run(tmp_path):
  ref, t_reference = reference_run(str(tmp_path / "reference"), *ARGS, "--max_restarts=0")
  assert ref["staleness"] == 0 and ref["steps"] == 120 and ref["resumed_from"] is None

  rng = random.Random(SEED)
  victims = rng.sample(CHILDREN, len(MOMENTS))  # every child killed once, in a random order
  workdir = str(tmp_path / "run")
  job = LauncherJob(workdir, *ARGS, f"--max_restarts={len(MOMENTS)}", num_steps=None)
  kills = []
  t1 = time.monotonic()
  try:
    for attempt, (moment, victim) in enumerate(zip(MOMENTS, victims)):
      if moment == "before the first checkpoint":
        job.wait_for(r"^\[ps-\d\] .*configured: shard")  # the trainers are past their start (attempt 0)
        time.sleep(rng.uniform(0.5, 3.0))
      pid = _wait(functools.partial(_started_in, job, victim, attempt), job, f"{victim} of attempt {attempt}")
      before = _checkpoints(workdir)
      if moment == "right after a checkpoint":
        _new_checkpoint(job, max(before, default=0))
      elif moment == "between checkpoints":
        _new_checkpoint(job, max(before, default=0))
        time.sleep(rng.uniform(0.2, 1.2))
      landed = running(pid)
      os.kill(pid, signal.SIGKILL)
      at = time.monotonic() - t1
      restart = job.wait_for(RESTART.pattern, count=attempt + 1)
      kills.append(dict(victim=victim, moment=moment, at_s=round(at, 1), landed=landed, line=restart[1]))
      kills[-1]["checkpoints"] = _checkpoints(workdir)  # at the restart: what the next attempt resumes from
    code = job.proc.wait(300)
    took = time.monotonic() - t1
  finally:
    job.end()
  print(f"reference run {t_reference:.0f} s, run with kills {took:.0f} s, seed {SEED}")
  for k in kills:
    print(k)
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  print({m: (summary[m], ref[m]) for m in METRICS}, "resumed_from", summary["resumed_from"])

  assert code == 0 and job.lines[-1] == "[launch] all 2 workers finished", job.tail()
  assert all(k["landed"] for k in kills), kills
  restarts = job.restarts()
  assert len(restarts) == len(kills) == len(MOMENTS), (restarts, kills)
  for i, (k, (what, n, budget)) in enumerate(zip(kills, restarts)):
    assert (n, budget) == (i + 1, len(MOMENTS)), restarts
    # The victim is the one blamed: it ended first, and by our signal.
    assert what.startswith(f"{k['victim']} ") and "signal SIGKILL" in what, (k, what)
  assert not kills[0]["checkpoints"], kills[0]  # the first kill came before any checkpoint
  assert summary["resumed_from"] == max(kills[-1]["checkpoints"]) > 0, (summary["resumed_from"], kills[-1])
  assert {m: summary[m] for m in METRICS} == {m: ref[m] for m in METRICS}
