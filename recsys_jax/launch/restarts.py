"""The launcher's restarts: after a failure, the whole job again, from the last checkpoint.

``launch_with_restarts`` runs ``supervisor.launch`` (servers, then trainers, supervised) and,
when a child fails in a way a restart may mend, stops everything (``launch`` already did), says so
in one line and starts the whole job again: fresh servers (empty, on the ports ``servers`` and
``make_workers`` give, fresh ones with port 0) and fresh trainers. The trainers share the workdir,
so they resume from its newest intact checkpoint and load its PS snapshot into the new servers;
with no checkpoint yet they start from step 0. Trainers that start from the same checkpoint replay
the same steps, so a restarted run ends as an uninterrupted one would (tests/e2e/test_chaos.py).

Which failures are restarted (the rule, also in the README):

- a server or trainer killed by a signal, a trainer exiting non-zero, a server exiting at all once
  ready: restarted, at most ``max_restarts`` times in the whole run;
- a child exiting with ``EXIT_CONFIG`` (2: the trainer refused its flags, config or workdir, or met
  a NaN loss; ``recsys_jax/main.py``), a server exiting with a status before its ready line (bad
  flags, token file or port), servers not ready within the deadline: not restarted, since a
  restart would fail the same way;
- SIGINT or SIGTERM to the launcher and its ``timeout_s``: never restarted.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from recsys_jax.launch.supervisor import LAUNCHER, Outcome, Output, Spec, Stop, interrupted, launch

# Restarts one run may make. A lost process (OOM-killed, a host hiccup) rarely recurs more than once
# or twice in a run; a failure that comes back a fourth time is most likely one the trainer does not
# recognise as permanent, and each restart replays up to checkpoint_every steps and pays a job start.
DEFAULT_MAX_RESTARTS = 3


def launch_with_restarts(
  servers: Sequence[Spec],
  make_workers: Callable[[list[str]], Sequence[Spec]],
  *,
  max_restarts: int = DEFAULT_MAX_RESTARTS,
  ready_timeout_s: float = 120.0,
  timeout_s: float = 0.0,
  grace_s: float = 10.0,
  stop: Stop | None = None,
  output: Output | None = None,
) -> Outcome:
  """``supervisor.launch``, started again after each restartable failure until the budget is spent.

  Args:
    servers: the server processes (service children), the same for every attempt.
    make_workers: the servers' addresses -> the worker processes; called once per attempt.
    max_restarts: restarts allowed in the whole run (0: the first failure ends it).
    ready_timeout_s: deadline for all servers to be ready, per attempt, in seconds.
    timeout_s: wall-clock limit of the whole run, restarts included (0: none), checked while the
      trainers run.
    grace_s: seconds between SIGTERM and SIGKILL when stopping children.
    stop: when set (SIGINT/SIGTERM to the launcher), stop everything; never restarted.
    output: where lines go (default: stdout).

  Returns:
    The last attempt's outcome: 0 when its workers all finished; 1 naming the failed child (with
    'restart budget spent' when it was restartable); 124 on timeout; 128 + signal when stopped.
    Every child has been stopped.
  """
  if max_restarts < 0:
    raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
  output = output or Output()
  deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
  timed_out = Outcome(124, f"timed out after {timeout_s:g} s; stopped all processes")
  restarts = 0
  while True:
    left = 0.0
    if deadline is not None:
      left = deadline - time.monotonic()
      if left <= 0:
        return timed_out
    outcome = launch(
      servers,
      make_workers,
      ready_timeout_s=ready_timeout_s,
      timeout_s=left,
      grace_s=grace_s,
      stop=stop,
      output=output,
    )
    if outcome.code == 0:
      return outcome
    if outcome.code == 124:
      return timed_out  # the message names the run's limit, not what was left of it
    if stop is not None and stop.is_set():
      # A child may have failed on the way down, or just before the launcher's signal arrived.
      return Outcome(128 + stop.signum, interrupted(stop))
    if max_restarts == 0:
      return outcome
    if not outcome.restartable:
      if outcome.failed is None:  # no child to blame (a stop): nothing to explain
        return outcome
      return dataclasses.replace(
        outcome, message=f"{outcome.message}; not restarted: a restart would fail the same way"
      )
    if restarts == max_restarts:
      spent = f"{outcome.message}; restart budget spent ({max_restarts} restarts, --max_restarts)"
      return dataclasses.replace(outcome, message=spent)
    restarts += 1
    output.write(LAUNCHER, f"{outcome.message}; restart {restarts}/{max_restarts} from the last checkpoint")
