"""Freshness: how soon a row the trainer updates is scored by the model server, and what publishing costs.

    python experiments/bench_freshness.py [--config=configs/tiny.py] [--steps=3000] [--publish_every_s=1]
        [--publish_dense_every_s=10] [--deltas_every_s=0.1] [--clients=2] [--rate=50] [--records=1]
        [--set=key=value ...] [--json_out=FILE]

Run from the repository root. A short run (``--base_steps``) writes the checkpoint both measured
runs resume from. Then, twice (publishing off, then on), a trainer process resumes from a copy of
it for ``--steps`` more steps at full speed (``python -m recsys_jax.main``; the synthetic data of
the config), while this process serves the copy the way ``python -m recsys_jax.serve`` does
(``serving.fresh.FreshModelHolder`` + the micro-batcher, in process: no HTTP) and ``--clients``
client threads each send ``--rate`` requests a second of ``--records`` records (paced; the latency
of each is its wait and scoring).

Freshness (publishing on): for each delta the trainer published during the run (the one after its
last step, published once its final checkpoint is saved, is shown apart as ``final_delta_s``), the time from the oldest update
it carries (``first_update`` in its index entry: the wall clock when the first step after the
previous publish handed its ids to the pusher; the push is applied after it, so this overstates
by the push time) to the first answer of any client naming a row version at or past the delta's
step (the answer was scored with its rows: a version names what it scores with). p50, p95 and max
over the deltas; ``cut_to_answer``: the same from the time the delta's rows were read.

Serving: the clients' p50/p99 latency with deltas applied (publishing on) and without (off).
Training: the trainer's own samples/s (its summary.json, compiles left out) on vs off, and their
ratio; with ``--repeats`` the modes alternate and each figure is the median over the repeats. Both runs have the same server and clients beside them, so the ratio is the cost of
publishing, not of serving; on a machine with 2 cores the trainer, server and clients share them.

A table on stderr and one JSON line on stdout (also written to ``--json_out``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import numpy as np
import outputs  # experiments/outputs.py, beside this script: where results go
from absl import app, flags

from recsys_jax.async_ps.snapshot import published
from recsys_jax.serving import scorer as scorer_lib
from recsys_jax.serving.batcher import Batcher
from recsys_jax.serving.fresh import FreshModelHolder

_CONFIG = flags.DEFINE_string("config", "configs/tiny.py", "The trainer's config file.")
_SET = flags.DEFINE_multi_string("set", [], "More config overrides, key=value (e.g. batch_size=1024).")
_BASE = flags.DEFINE_integer("base_steps", 2, "Steps of the run both measured runs resume from.")
_STEPS = flags.DEFINE_integer("steps", 3000, "Steps each measured run trains.")
_CKPT = flags.DEFINE_integer(
  "checkpoint_every",
  1000,
  "The trainers' config.checkpoint_every (publishing needs checkpoints: they prune the deltas).",
)
_EVERY = flags.DEFINE_float("publish_every_s", 1.0, "The trainer's config.publish_every_s when on.")
_DENSE = flags.DEFINE_float("publish_dense_every_s", 10.0, "The trainer's config.publish_dense_every_s when on.")
_POLL = flags.DEFINE_float("deltas_every_s", 0.1, "How often the server applies deltas.")
_CLIENTS = flags.DEFINE_integer("clients", 2, "Client threads.")
_RATE = flags.DEFINE_float("rate", 50.0, "Requests a second per client.")
_RECORDS = flags.DEFINE_integer("records", 1, "Records per request.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Scratch directory (default: a temporary one, removed).")
_JSON = flags.DEFINE_string("json_out", None, "Also write the JSON result here.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Runs of each mode, alternating off and on; the figures are medians.")
_ORDER = ("off", "on")


def _trainer(workdir: str, steps: int, publish: bool) -> List[str]:
  cmd = [sys.executable, "-m", "recsys_jax.main", f"--config={_CONFIG.value}", f"--workdir={workdir}"]
  cmd += [f"--config.num_steps={steps}", "--config.progress_bar=False", f"--config.checkpoint_every={_CKPT.value}"]
  cmd += [
    f"--config.publish_every_s={_EVERY.value if publish else 0.0}",
    f"--config.publish_dense_every_s={_DENSE.value}",
  ]
  return cmd + [f"--config.{kv}" for kv in _SET.value]


def _records(sc, n: int, seed: int) -> List[Dict[str, Any]]:
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    r = {}
    for f, k in sc.fields().items():
      if k == "float":
        r[f] = float(rng.exponential())
      elif k == "int":
        r[f] = int(rng.integers(0, 1000))
      elif k == "string":
        r[f] = f"{rng.integers(0, 1000):08x}"
      else:
        raise SystemExit(f"bench_freshness draws floats, ints and strings; field {f} holds {k}")
    out.append(r)
  return out


def _measure(base: str, workdir: str, publish: bool) -> Dict[str, Any]:
  shutil.copytree(base, workdir)
  holder = FreshModelHolder(
    workdir,
    scorer_lib.load_scorer,
    scorer_lib.newest_step,
    os.path.join(workdir, "publish"),
    steps=scorer_lib.complete_steps,
  )
  batcher = Batcher(holder.current, max_batch=512, max_wait_s=0.002)
  recs = _records(holder.current(), 64, seed=0)
  batcher.predict(recs[: _RECORDS.value])  # compiled before the clock starts
  answers: List[List[tuple]] = [[] for _ in range(_CLIENTS.value)]
  failures: List[str] = []
  stop = threading.Event()

  def client(i: int) -> None:
    period, k = 1.0 / _RATE.value, 0
    nxt = time.perf_counter()
    while not stop.is_set():
      rs = [recs[(k + j) % len(recs)] for j in range(_RECORDS.value)]
      t0 = time.perf_counter()
      try:
        p = batcher.predict(rs, timeout=30)
      except Exception as e:  # noqa: BLE001 - counted and shown
        failures.append(f"{type(e).__name__}: {e}")
        continue
      answers[i].append((time.time(), time.perf_counter() - t0, p.row_version))
      k += 1
      nxt += period
      time.sleep(max(0.0, nxt - time.perf_counter()))

  entries: Dict[int, Dict[str, Any]] = {}  # every delta published, by seq (checkpoints prune them from the index)

  def watch() -> None:
    while not stop.is_set():
      try:
        index = published.read_index(os.path.join(workdir, "publish"))
      except published.PublishError:
        index = None  # written whole by a rename: a read failing now is the bench's bug, shown below
      for d in (index or {}).get("deltas", []):
        entries.setdefault(d["seq"], d)
      time.sleep(0.02)

  threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(_CLIENTS.value)]
  threads.append(threading.Thread(target=watch, daemon=True))
  for t in threads:
    t.start()
  holder.start(_POLL.value)
  log = os.path.join(workdir, "trainer.log")
  t0 = time.time()
  try:
    with open(log, "w") as f:
      rc = subprocess.call(_trainer(workdir, _BASE.value + _STEPS.value, publish), stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
      with open(log) as f:
        tail = f.read()[-3000:]
      raise SystemExit(f"the trainer ({'publishing' if publish else 'not publishing'}) failed with exit {rc}:\n{tail}")
    time.sleep(3 * _POLL.value + 0.2)  # the last delta reaches the clients
  finally:
    stop.set()
    for t in threads:
      t.join()
    holder.close()
    batcher.close()
  t1 = time.time()
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  lat = np.array([a[1] for a in sum(answers, [])]) * 1e3
  out: Dict[str, Any] = {
    "samples_per_sec": float(summary["samples_per_sec"]),
    "requests": int(lat.shape[0]),
    "failed": len(failures),
    "p50_ms": float(np.percentile(lat, 50)),
    "p99_ms": float(np.percentile(lat, 99)),
    "seconds": t1 - t0,
  }
  if failures:
    out["failures"] = failures[:5]
  if publish:
    deltas = [entries[s] for s in sorted(entries)]
    seen = sorted((t, v) for a in answers for t, _, v in a if v is not None)
    times, versions = np.array([t for t, _ in seen]), np.array([v for _, v in seen])
    lags, cut_lags = [], []
    if [d["seq"] for d in deltas] != list(range(deltas[0]["seq"], deltas[-1]["seq"] + 1)):
      raise SystemExit("the bench missed a delta between two reads of the index")
    last = max(d["step"] for d in deltas)
    final = []
    for d in deltas:
      at = np.flatnonzero(versions >= d["step"])
      if not at.shape[0]:
        raise SystemExit(
          f"no answer scored with the rows of step {d['step']} (delta {d['name']}); the server fell behind"
        )
      first = times[at[0]]
      if d["step"] == last:  # published after the run's last step, its final checkpoint saved first
        final.append(first - d["first_update"])
        continue
      lags.append(first - d["first_update"])
      cut_lags.append(first - d["cut"])
    lags, cut_lags = np.array(lags), np.array(cut_lags)
    out.update(
      deltas=len(lags),
      delta_rows_mean=float(np.mean([d["rows"] for d in deltas])),
      freshness_p50_s=float(np.percentile(lags, 50)),
      freshness_p95_s=float(np.percentile(lags, 95)),
      freshness_max_s=float(lags.max()),
      cut_to_answer_p50_s=float(np.percentile(cut_lags, 50)),
      lags_s=[round(float(x), 3) for x in lags],
      final_delta_s=float(max(final)),
      deltas_applied=holder.deltas_applied,
      catch_ups=holder.catch_ups,
      bad=dict(holder.bad),
    )
  return out


def _median(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
  """The median of each figure over the repeats (the last run's lists and counters), and every run's samples/s."""
  out = dict(runs[-1])
  for k, v in runs[-1].items():
    if isinstance(v, float):
      out[k] = float(np.median([r[k] for r in runs]))
  out["failed"] = sum(r["failed"] for r in runs)
  out["samples_per_sec_each"] = [r["samples_per_sec"] for r in runs]
  return out


def main(argv) -> None:
  del argv
  scratch = _WORKDIR.value or tempfile.mkdtemp(prefix="bench_freshness_")
  try:
    base = os.path.join(scratch, "base")
    shutil.rmtree(base, ignore_errors=True)
    cmd = _trainer(base, _BASE.value, False)
    subprocess.run(cmd, check=True, capture_output=True)
    every: Dict[str, List[Dict[str, Any]]] = {m: [] for m in _ORDER}
    for r in range(_REPEATS.value):
      for mode in _ORDER:
        w = os.path.join(scratch, f"{mode}{r}")
        shutil.rmtree(w, ignore_errors=True)
        every[mode].append(_measure(base, w, mode == "on"))
        shutil.rmtree(w, ignore_errors=True)
  finally:
    if _WORKDIR.value is None:
      shutil.rmtree(scratch, ignore_errors=True)
  runs = {m: _median(v) for m, v in every.items()}
  on, off = runs["on"], runs["off"]
  result = {
    "config": _CONFIG.value,
    "overrides": list(_SET.value),
    "steps": _STEPS.value,
    "publish_every_s": _EVERY.value,
    "publish_dense_every_s": _DENSE.value,
    "deltas_every_s": _POLL.value,
    "clients": _CLIENTS.value,
    "rate": _RATE.value,
    "records": _RECORDS.value,
    "freshness_p50_s": on["freshness_p50_s"],
    "freshness_p95_s": on["freshness_p95_s"],
    "freshness_max_s": on["freshness_max_s"],
    "serving_p99_ms_deltas": on["p99_ms"],
    "serving_p99_ms_no_deltas": off["p99_ms"],
    "samples_per_sec_on": on["samples_per_sec"],
    "samples_per_sec_off": off["samples_per_sec"],
    "train_ratio": on["samples_per_sec"] / off["samples_per_sec"],
    "repeats": _REPEATS.value,
    "failed": on["failed"] + off["failed"],
    "runs": runs,
  }
  w = sys.stderr.write
  w(f"{'':24s}{'off':>12s}{'on':>12s}\n")
  for k in ("samples_per_sec", "p50_ms", "p99_ms", "requests", "failed"):
    w(f"{k:24s}{off[k]:12.1f}{on[k]:12.1f}\n")
  w(
    f"freshness over {on['deltas']} deltas (mean {on['delta_rows_mean']:.0f} rows): p50 {on['freshness_p50_s']:.2f} s, "
    f"p95 {on['freshness_p95_s']:.2f} s, max {on['freshness_max_s']:.2f} s (cut to answer p50 "
    f"{on['cut_to_answer_p50_s']:.2f} s); training with publishing {result['train_ratio']:.3f}x without\n"
  )
  if _JSON.value:
    outputs.write_json(_JSON.value, result)
  print(json.dumps(result), flush=True)
  if result["failed"] or on["bad"]:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
