"""Fuzzes what takes outside input: the data readers, config validation, checkpoint restore and
the PS wire decoder (with the server's request checks behind it), and counts crashes and hangs.

    python -m tests.fuzz --budget_s=600 [--seed=0] [--targets=readers,config,checkpoint,wire]
    python -m tests.fuzz --examples=200        # a fixed number of inputs per target instead
    python -m tests.fuzz --replay=runs/fuzz_crashes/<file>.json

(from the repository's root, which puts ``tests``, ``recsys_jax`` and ``configs`` on the path).

Inputs are drawn by hypothesis, in a worker process per target that a parent watches with a
per-input time limit (``tests/fuzz/harness.py`` says why a process and not a thread).
What counts as correct per target, and the inputs, are in ``tests/fuzz/<target>.py``:
an input either gives the documented clear error (its type, and a message naming the file,
field or place) or is accepted and its result checked; anything else is a crash, an input
still running after its limit a hang. Crashing and hanging inputs are saved under
``--crash_dir`` (default runs/fuzz_crashes) and replayed with ``--replay``.

Prints a table (target, inputs tried, clear errors, accepted, crashes, hangs), then one JSON
line per target and a last JSON line with the totals. Exits 1 if anything crashed or hung.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

from tests.fuzz import harness

_BUDGET = flags.DEFINE_float("budget_s", 0.0, "Total seconds, split evenly over the targets (0: use --examples).")
_EXAMPLES = flags.DEFINE_integer("examples", 100, "Inputs per target (an upper bound when --budget_s is set).")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds every hypothesis round.")
_TARGETS = flags.DEFINE_list("targets", "readers,config,checkpoint,wire", "Targets to fuzz, in order.")
_CRASH_DIR = flags.DEFINE_string("crash_dir", os.path.join("runs", "fuzz_crashes"), "Where crashing inputs are saved.")
_REPLAY = flags.DEFINE_string("replay", None, "Run one saved input again (in this process) and print its outcome.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the per-target and total JSON lines here.")
# Internal: a worker process (started by the parent).
_WORKER = flags.DEFINE_string("worker", None, "(internal) run as the worker of this target.")
_FIRST_ROUND = flags.DEFINE_integer("first_round", 0, "(internal) the first hypothesis round.")
_UNTIL = flags.DEFINE_float("until", 0.0, "(internal) time.time() at which to stop.")
_STATE_DIR = flags.DEFINE_string("state_dir", None, "(internal) the worker's private directory.")


def _wrote(path: str) -> None:
  """Announces a file written for the reader: one stdout line ``wrote <absolute path>``."""
  print(f"wrote {os.path.abspath(path)}", flush=True)


def main(argv):
  del argv
  if _WORKER.value:
    harness.work(
      harness.make_target(_WORKER.value),
      _SEED.value,
      _FIRST_ROUND.value,
      _UNTIL.value,
      _EXAMPLES.value,
      _STATE_DIR.value,
      sys.stdout,
    )
    return
  if _REPLAY.value:
    result = harness.replay(_REPLAY.value)
    print(json.dumps(result))
    return 1 if result["outcome"] == "crash" else 0
  unknown = [t for t in _TARGETS.value if t not in harness.TARGETS]
  if unknown:
    raise app.UsageError(f"--targets: unknown {unknown}; choose from {sorted(harness.TARGETS)}")
  share = _BUDGET.value / len(_TARGETS.value) if _BUDGET.value > 0 else float("inf")
  examples = _EXAMPLES.value if _BUDGET.value <= 0 else max(_EXAMPLES.value, 10**9)
  rows = []
  t0 = time.time()
  for name in _TARGETS.value:
    what = f"{share:.0f} s" if share != float("inf") else f"{examples} inputs"
    print(f"fuzzing {name}: {what}, seed {_SEED.value}", file=sys.stderr, flush=True)
    rows.append(
      harness.supervise(
        name,
        seed=_SEED.value,
        budget_s=share,
        max_examples=examples,
        crash_dir=_CRASH_DIR.value,
        log=lambda s: print(s, file=sys.stderr, flush=True),
      )
    )
  total = {k: sum(r[k] for r in rows) for k in ("tried", "clear", "accepted", "crashes", "hangs")}
  total = {"target": "total", **total, "wall_s": round(time.time() - t0, 1), "seed": _SEED.value}
  total["budget_s"] = _BUDGET.value
  print(harness.table(rows + [total]))
  lines = [json.dumps({k: v for k, v in r.items() if k != "saved"}) for r in rows] + [json.dumps(total)]
  for r in rows:
    for path in r["saved"]:  # written by the harness's supervisor, in this process
      _wrote(path)
  if _JSON_OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_JSON_OUT.value)), exist_ok=True)
    with open(_JSON_OUT.value, "w") as f:
      f.write("\n".join(lines) + "\n")
    _wrote(_JSON_OUT.value)
  print("\n".join(lines))
  return 1 if total["crashes"] or total["hangs"] else 0


if __name__ == "__main__":
  app.run(main)
