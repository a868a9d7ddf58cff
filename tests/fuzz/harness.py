"""The fuzz harness: a worker process draws inputs with hypothesis and runs them; a parent
process watches it and counts what happened.

Why a subprocess per target and not a watchdog thread: a hang can be a loop in C (numpy, a
decompressor, tensorstore) holding the GIL, which no thread of the same process can interrupt,
and a crash can kill the process (a segfault, the kernel's OOM killer). So the inputs run in a
worker process that announces each one on its stdout (``start``, after writing the input to
``current.json``) and its outcome (``done``). The parent waits for each outcome at most the
input's time limit; past it, it kills the worker, counts a hang, keeps the input, and starts a
new worker at the next hypothesis round (the same round would draw the same input again). A
worker that dies with an input in flight is a crash of that input.

Inputs are drawn by hypothesis (the maintained property-based testing library for Python:
structured strategies, edge values such as 0, -1, 2**63 and empty collections drawn often,
and reproducible draws from a seed) in rounds: round ``r`` is a run of ``@given`` with
``@seed(seed * 1_000_003 + r)``, so a run is a pure function of ``--seed`` and the budget.
Only the generate phase runs: a crash is recorded and the run goes on instead of shrinking.

Every input is JSON (bytes as ``{"b64": ...}``) and is saved when it crashes or hangs, with the
target's name, so ``python -m tests.fuzz --replay=FILE`` runs it again in-process.
"""

from __future__ import annotations

import base64
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUND_EXAMPLES = 25  # inputs per hypothesis round: a restart after a hang skips at most this many
OUTCOMES = ("clear", "accepted")


class Crash(Exception):
  """A wrong behaviour a target's checks found (a wrong error type, an unclear message, bad values)."""


class _StopRound(BaseException):
  """Raised inside a hypothesis run when the time is up (a BaseException: never taken for a result)."""


# -- inputs ----------------------------------------------------------------------------------


# Tags of values JSON cannot hold; a drawn dict whose one key is a tag is wrapped, so it is never
# taken for one (the wire target draws arbitrary JSON objects).
_TAGS = ("\0b64", "\0float", "\0dict")


def to_json(x: Any) -> Any:
  """An input as JSON: bytes become ``{"\\0b64": ...}``, NaN and inf ``{"\\0float": ...}``, tuples lists."""
  if isinstance(x, (bytes, bytearray)):
    return {"\0b64": base64.b64encode(bytes(x)).decode()}
  if isinstance(x, dict):
    if len(x) == 1 and next(iter(x)) in _TAGS:
      return {"\0dict": [[k, to_json(v)] for k, v in x.items()]}
    return {str(k): to_json(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [to_json(v) for v in x]
  if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
    return {"\0float": repr(x)}
  return x


def from_json(x: Any) -> Any:
  """The inverse of :func:`to_json` (tuples come back as lists)."""
  if isinstance(x, dict):
    if set(x) == {"\0b64"}:
      return base64.b64decode(x["\0b64"])
    if set(x) == {"\0float"}:
      return float(x["\0float"])
    if set(x) == {"\0dict"}:
      return {k: from_json(v) for k, v in x["\0dict"]}
    return {k: from_json(v) for k, v in x.items()}
  if isinstance(x, list):
    return [from_json(v) for v in x]
  return x


def clear_error(e: BaseException, types: Sequence[type], names: Sequence[str], what: str) -> str:
  """Classifies an exception: 'clear' if it is one of ``types`` and its message holds one of
  ``names`` (what it must name: a file, a field); else raises :class:`Crash` saying why."""
  msg = str(e)
  if not isinstance(e, tuple(types)):
    raise Crash(f"{what}: {type(e).__name__} instead of {'/'.join(t.__name__ for t in types)}: {msg[:300]}")
  if names and not any(n in msg for n in names):
    raise Crash(f"{what}: {type(e).__name__} does not name {list(names)[:3]}: {msg[:300]}")
  return "clear"


class Target:
  """One thing to fuzz. Subclasses set ``name`` and ``deadline_s`` and implement the methods."""

  name = ""
  deadline_s = 10.0
  """Per-input time limit (the hang threshold)."""
  note = ""
  """Set by ``run`` to count a kind of input apart (e.g. 'built' for a config that ran a step)."""
  memory_limit_gib: Optional[float] = None
  """RLIMIT_AS of the worker: an allocation driven by a lying length fails instead of eating the host."""

  def setup(self, workdir: str) -> None:
    """Once per worker, before any input (e.g. writes a template checkpoint); ``workdir`` is private."""

  def strategy(self):
    """The hypothesis strategy of inputs (JSON-able, bytes allowed)."""
    raise NotImplementedError

  def deadline_for(self, case: Any) -> float:
    return self.deadline_s

  def run(self, case: Any) -> str:
    """Runs one input: returns 'clear' (the documented error, naming the place) or 'accepted'
    (a result that passed the checks); raises :class:`Crash` or anything else for a crash."""
    raise NotImplementedError


def run_case(target: Target, case: Any) -> Dict[str, Any]:
  """One input through ``target``: {'outcome': 'clear' | 'accepted' | 'crash', 'detail': ...}."""
  target.note = ""
  try:
    outcome = target.run(case)
    if outcome not in OUTCOMES:
      raise Crash(f"target returned {outcome!r}")
    return {"outcome": outcome, "detail": "", "note": target.note}
  except Crash as e:
    return {"outcome": "crash", "detail": str(e)}
  except Exception as e:  # noqa: BLE001 - every other exception of the product is a crash
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return {"outcome": "crash", "detail": f"{type(e).__name__}: {str(e)[:300]}\n{''.join(tb[-6:])[-2000:]}"}


# -- the worker --------------------------------------------------------------------------------


def _emit(out, **event) -> None:
  out.write(json.dumps(event) + "\n")
  out.flush()


def fuzz_settings(examples: int):
  """hypothesis settings of a fuzz round: ``examples`` inputs, generation only (a crash is
  counted, not shrunk), no example database, no deadline (the parent keeps the time)."""
  from hypothesis import HealthCheck, Phase, Verbosity, settings

  return settings(
    max_examples=examples,
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
    verbosity=Verbosity.quiet,
    report_multiple_bugs=False,
  )


def work(target: Target, seed: int, first_round: int, until: float, max_examples: int, state_dir: str, out) -> None:
  """Runs hypothesis rounds from ``first_round`` until ``until`` (time.time) or ``max_examples``
  inputs, announcing each input on ``out`` (see the module docstring)."""
  from absl import logging
  from hypothesis import given
  from hypothesis import seed as hseed

  logging.set_verbosity(logging.ERROR)  # refusals are logged as warnings: thousands of lines
  if target.memory_limit_gib:
    limit = int(target.memory_limit_gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  target.setup(os.path.join(state_dir, "setup"))
  current = os.path.join(state_dir, "current.json")
  tried = 0
  r = first_round
  while time.time() < until and tried < max_examples:
    _emit(out, event="round", r=r)
    n = min(ROUND_EXAMPLES, max_examples - tried)

    @fuzz_settings(n)
    @hseed(seed * 1_000_003 + r)
    @given(target.strategy())
    def one(case):
      nonlocal tried
      if time.time() >= until or tried >= max_examples:
        raise _StopRound()
      data = to_json(case)
      with open(current + ".tmp", "w") as f:
        json.dump({"target": target.name, "seed": seed, "round": r, "case": data}, f)  # noqa: B023 - run at once
      os.replace(current + ".tmp", current)
      _emit(out, event="start", i=tried, deadline=target.deadline_for(case))
      result = run_case(target, from_json(data))  # what runs is what a replay runs
      tried += 1
      _emit(out, event="done", **result)

    try:
      one()
    except _StopRound:
      break
    r += 1
  _emit(out, event="end", r=r)


# -- the parent ----------------------------------------------------------------------------------


def _save(crash_dir: str, kind: str, target: str, record: Dict[str, Any], detail: str, n: int) -> str:
  os.makedirs(crash_dir, exist_ok=True)
  path = os.path.join(crash_dir, f"{target}-{kind}-s{record.get('seed', 0)}-r{record.get('round', 0)}-{n}.json")
  with open(path, "w") as f:
    json.dump(dict(record, kind=kind, detail=detail), f, indent=1)
  return path


def supervise(
  target: str,
  *,
  seed: int,
  budget_s: float,
  max_examples: int,
  crash_dir: str,
  setup_limit_s: float = 600.0,
  log: Callable[[str], None] = lambda s: None,
) -> Dict[str, Any]:
  """Runs ``target`` in worker processes for ``budget_s`` seconds (or ``max_examples`` inputs)
  and counts inputs tried, clear errors, accepted inputs, crashes and hangs."""
  stats = {"target": target, "tried": 0, "clear": 0, "accepted": 0, "crashes": 0, "hangs": 0, "restarts": 0}
  stats.update(seed=seed, wall_s=0.0, notes={}, first_crashes=[], saved=[])
  t0 = time.time()
  until = t0 + budget_s
  next_round = 0
  with tempfile.TemporaryDirectory(prefix=f"fuzz-{target}-") as tmp:
    while time.time() < until and stats["tried"] < max_examples:
      state = os.path.join(tmp, f"w{stats['restarts']}")
      os.makedirs(state)
      err_path = os.path.join(state, "stderr.txt")
      cmd = [sys.executable, "-m", "tests.fuzz", f"--worker={target}", f"--seed={seed}"]
      cmd += [f"--first_round={next_round}", f"--until={until}", f"--examples={max_examples - stats['tried']}"]
      cmd += [f"--state_dir={state}"]
      with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, cwd=ROOT, start_new_session=True)
      in_flight: Optional[Dict[str, Any]] = None
      limit = setup_limit_s
      buf = b""
      ended = timed_out = False
      try:
        while True:
          if b"\n" not in buf:
            ready, _, _ = select.select([proc.stdout], [], [], limit)
            if not ready:
              timed_out = True  # a hang (or a setup that never finished)
              break
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
              break  # the worker exited
            buf += chunk
            continue
          line, buf = buf.split(b"\n", 1)
          try:
            ev = json.loads(line)
          except json.JSONDecodeError:
            continue  # a library printed to stdout
          if ev.get("event") == "round":
            next_round = ev["r"] + 1
          elif ev.get("event") == "start":
            in_flight, limit = ev, float(ev["deadline"])
          elif ev.get("event") == "done":
            stats["tried"] += 1
            if ev["outcome"] == "crash":
              stats["crashes"] += 1
              record = _read_json(os.path.join(state, "current.json"))
              path = _save(crash_dir, "crash", target, record, ev["detail"], stats["crashes"] + stats["hangs"])
              stats["saved"].append(path)
              if len(stats["first_crashes"]) < 5:
                stats["first_crashes"].append(ev["detail"].splitlines()[0][:300])
              log(f"[{target}] crash: {ev['detail'][:2000]}\n  saved {path}")
            else:
              stats[ev["outcome"]] += 1
            if ev.get("note"):
              stats["notes"][ev["note"]] = stats["notes"].get(ev["note"], 0) + 1
            in_flight, limit = None, setup_limit_s
          elif ev.get("event") == "end":
            ended = True
            break
      finally:
        if proc.poll() is None:
          os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
      if ended:
        break
      stats["restarts"] += 1
      if in_flight is not None:
        record = _read_json(os.path.join(state, "current.json"))
        if timed_out:
          kind, detail = "hang", f"no outcome within {limit:g} s"
          stats["hangs"] += 1
        else:
          kind, detail = "crash", f"the worker died (exit status {proc.returncode}): {_tail(err_path)}"
          stats["crashes"] += 1
        stats["tried"] += 1
        path = _save(crash_dir, kind, target, record, detail, stats["crashes"] + stats["hangs"])
        stats["saved"].append(path)
        if len(stats["first_crashes"]) < 5:
          stats["first_crashes"].append(f"{kind}: {detail[:300]}")
        log(f"[{target}] {kind}: {detail}\n  saved {path}")
      else:
        if time.time() < until:
          why = f"set no input going within {limit:g} s" if timed_out else "stopped before any input"
          raise RuntimeError(f"fuzz worker for {target} {why}: {_tail(err_path, 4000)}")
        break
  stats["wall_s"] = round(time.time() - t0, 1)
  return stats


def _read_json(path: str) -> Dict[str, Any]:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return {}


def _tail(path: str, n: int = 1500) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()[-n:]
  except OSError:
    return ""


TARGETS = {
  "readers": ".readers:ReadersTarget",
  "config": ".config:ConfigTarget",
  "checkpoint": ".checkpoint:CheckpointTarget",
  "wire": ".wire:WireTarget",
}


def make_target(name: str) -> Target:
  """The target ``name`` (its module is imported only now: each pulls in its own libraries)."""
  import importlib

  module, _, cls = TARGETS[name].partition(":")
  return getattr(importlib.import_module(module, __package__), cls)()


def replay(path: str) -> Dict[str, Any]:
  """Runs a saved input again in this process; returns its result."""
  from absl import logging

  logging.set_verbosity(logging.ERROR)
  record = _read_json(path)
  target = make_target(record["target"])
  with tempfile.TemporaryDirectory(prefix="fuzz-replay-") as tmp:
    target.setup(os.path.join(tmp, "setup"))
    return run_case(target, from_json(record["case"]))


def table(rows: List[Dict[str, Any]]) -> str:
  """The per-target table the run prints."""
  cols = ("target", "tried", "clear", "accepted", "crashes", "hangs", "wall_s")
  widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
  lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
  lines += ["  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)) for r in rows]
  return "\n".join(lines)
