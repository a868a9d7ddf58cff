"""bench_ps's ram configuration for several checkouts at once, batch by batch in turn, under one load.

    python experiments/ps_lockstep.py --rounds=120 [--rows=100000] old=/tmp/psb_4ff02be new=.

Each ``name=path`` starts a process whose ``recsys_jax`` is that checkout's (``PYTHONPATH=path``) and
whose workload is this tree's ``harness`` (bench_ps's: 26 Adagrad tables of ``--rows`` ids, dim 64,
prefilled). The processes time one ``lookup_many`` + ``apply_many`` each in turn (the order reversed
every round), with a memcpy every 4 rounds, so the machine's load falls on every checkout alike.
Prints per checkout the median lookup and apply rates (wall and thread CPU) and the fraction of the
median memcpy, after 3 untimed rounds, and last one JSON line of them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags
from harness import data  # this tree's: the script's folder is first on sys.path
from harness.ps import Memcpy, adagrad_specs, grads, prefill, row_bytes

_ROUNDS = flags.DEFINE_integer("rounds", 120, "Rounds: each checkout times one batch a round.")
_ROWS = flags.DEFINE_integer("rows", 100_000, "Ids per table.")
_CHILD = flags.DEFINE_integer("child", 0, "(internal) serve batches of a PS of this many ids a table.")
_DIM = 64


def child(rows: int) -> None:
  """Serves 'go I' (time batch I) and 'memcpy' lines on stdin, one JSON answer each."""
  from recsys_jax.async_ps.store.ps import ParameterServer  # the checkout's: PYTHONPATH

  batches = data.zipf_batches(20, rows, 1.1, 4096, 26)
  names = list(batches[0])
  ps = ParameterServer(adagrad_specs(names, _DIM))
  step = prefill(ps, names, rows)
  g = grads(max(len(v) for b in batches for v in b.values()), _DIM)
  mem = Memcpy(1)
  print("ready", flush=True)
  for line in sys.stdin:
    cmd, i = line.split()
    if cmd == "memcpy":
      nbytes, secs = mem.copy()
      print(json.dumps({"memcpy": nbytes / secs}), flush=True)
      continue
    b = batches[int(i) % len(batches)]
    step += 1
    c0, t0 = time.thread_time(), time.perf_counter()
    ps.lookup_many(b, create=True, step=step)
    c1, t1 = time.thread_time(), time.perf_counter()
    ps.apply_many({t: (ids, g[: len(ids)]) for t, ids in b.items()}, step=step)
    c2, t2 = time.thread_time(), time.perf_counter()
    rows = sum(len(v) for v in b.values())
    print(json.dumps({"rows": rows, "lw": t1 - t0, "aw": t2 - t1, "lc": c1 - c0, "ac": c2 - c1}), flush=True)


def main(argv) -> None:
  trees = [a.split("=", 1) for a in argv[1:]]
  if not trees or not all(len(t) == 2 for t in trees):
    raise app.UsageError(f"expected name=path arguments, got {argv[1:]}")
  if _ROUNDS.value <= 3:
    raise app.UsageError(f"--rounds={_ROUNDS.value}: the first 3 rounds are not timed; give more")
  kids = {}
  for name, tree in trees:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, os.path.abspath(__file__), f"--child={_ROWS.value}"]
    kids[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, cwd="/")
  for name, k in kids.items():
    if k.stdout.readline().strip() != "ready":
      raise SystemExit(f"{name}: the child did not start")

  def ask(k, line):
    k.stdin.write(line + "\n")
    k.stdin.flush()
    return json.loads(k.stdout.readline())

  res = {n: [] for n in kids}
  copies = []
  for r in range(_ROUNDS.value):
    order = list(kids) if r % 2 == 0 else list(kids)[::-1]
    for n in order:
      res[n].append(ask(kids[n], f"go {r}"))
    if r % 4 == 0:
      copies.append(ask(kids[order[0]], "memcpy 0")["memcpy"])
  for k in kids.values():
    k.stdin.close()
    k.wait()
  bw = statistics.median(copies)
  print(f"memcpy median {bw / 1e9:.1f} GB/s, max {max(copies) / 1e9:.1f} (n={len(copies)}), load {os.getloadavg()}")

  def frac(lookup, apply):  # bytes moved per second over the memcpy's
    return sum(row_bytes(_DIM)[:2]) / (1 / lookup + 1 / apply) / bw

  line = {"memcpy_bytes_per_s": bw, "load_avg": os.getloadavg()[0]}
  for n, v in res.items():
    v = v[3:]
    med = {k: statistics.median(x["rows"] / x[k] for x in v) for k in ("lw", "aw", "lc", "ac")}
    line[n] = {
      "lookup_rows_per_s": med["lw"],
      "apply_rows_per_s": med["aw"],
      "memcpy_fraction": frac(med["lw"], med["aw"]),
    }
    print(
      f"{n:12s} wall: lookup {med['lw'] / 1e6:5.2f}M apply {med['aw'] / 1e6:5.2f}M rows/s, "
      f"{frac(med['lw'], med['aw']):.3f} of memcpy | thread CPU: lookup {med['lc'] / 1e6:5.2f}M "
      f"apply {med['ac'] / 1e6:5.2f}M"
    )
  print(json.dumps(line))


if __name__ == "__main__":
  app.run(lambda argv: child(_CHILD.value) if _CHILD.value else main(argv))
