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

**Stream mode** (``--stream``; ``--duration_s``, ``--clients``, ``--rate``, ``--ratio_s``,
``--ratio_pairs``, ``--event_every_s``, ``--publish_every_s`` ...): what issue 29 asks for, with
every part a real process. The trainer (``python -m recsys_jax.main``, ``configs/tiny.py`` on CSV
columns ``label,d1,c1,c2,item``, ``num_steps=-1``) follows ``config.data.stream_dir``, into which a
writer thread of this process writes files of ``--file_records`` records, each under a temporary
name then renamed into place, staying ``--backlog_files`` files ahead of the step the trainer's
metrics.jsonl shows (so the trainer never waits for data, and an event waits behind at most that
backlog); the model server is ``python -m recsys_jax.serve`` over HTTP, applying the trainer's
deltas every ``--deltas_every_s``. A short run first trains the base files (the history of 200
"known" ids, each with label 0, and traffic) and is the checkpoint every measured run resumes from.

Events: every ``--event_every_s`` the writer puts at the head of its next file 4 records of a new
id (``item=n<k>``, label 1), or, alternating, of a known id with its label turned over. Freshness
of an event: from the moment its file counts (renamed into place) to the first answer of the server
(a prober thread asking every ``--probe_every_s`` for all pending events) whose score for a record
carrying the id (its other ids never trained, its dense value fixed) differs from the score before
the file was written; see ``_Prober`` for dense publishes in between. p50, p95, max over the events
of the measured run (``--duration_s`` of training, publishing on), for all, new and flipped ids.

Beside it ``--clients`` client processes each send ``--rate`` requests a second of ``--records``
traffic records over HTTP for the whole run, counting failed requests and answers whose
``dense_version`` or ``row_version`` is older than one they had before. Then ``--ratio_pairs`` pairs
of runs of ``--ratio_s`` seconds, publishing off then on, same writer and clients (no events), give
the training samples/s ratio: from metrics.jsonl over the measured window (``samples_per_sec_measured``:
steps x batch over wall seconds, recompiles included) and the trainer's summary (compiles left out).
Exit 1 on a failed request, a version going back, an unresolved event or a score moving before its
rows came.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np
from absl import app, flags
from harness import outputs

from recsys_jax.async_ps.snapshot import published

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
# --stream: the trainer follows a directory that a writer fills (see the module doc, "Stream mode").
_STREAM = flags.DEFINE_bool("stream", False, "Stream mode: a writer feeds the trainer's stream_dir; the real server.")
_DURATION = flags.DEFINE_float("duration_s", 60.0, "Stream mode: seconds of the measured run (publishing on).")
_RATIO_S = flags.DEFINE_float("ratio_s", 30.0, "Stream mode: seconds of each off/on run for the samples/s ratio.")
_PAIRS = flags.DEFINE_integer("ratio_pairs", 1, "Stream mode: off/on pairs for the ratio (0: no ratio runs).")
_EVENT_EVERY = flags.DEFINE_float("event_every_s", 0.5, "Stream mode: seconds between probe events (new id / flip).")
_FILE_RECORDS = flags.DEFINE_integer("file_records", 512, "Stream mode: records per stream file.")
_BACKLOG = flags.DEFINE_integer("backlog_files", 2, "Stream mode: files written ahead of what the trainer trained.")
_PROBE_EVERY = flags.DEFINE_float("probe_every_s", 0.05, "Stream mode: seconds between the prober's requests.")


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
  # Imported here: the stream mode's client processes import this module and need no jax.
  from recsys_jax.serving import scorer as scorer_lib
  from recsys_jax.serving.batcher import Batcher
  from recsys_jax.serving.fresh import FreshModelHolder

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


# ------------------------------------------------------------------------------------------ stream mode

_HEADER = "label,d1,c1,c2,item\n"
_KNOWN = 200  # ids the base files teach with label 0; the flip events turn their labels over
_KNOWN_RECORDS = 10  # records of each known id in the base files
_EVENT_RECORDS = 4  # records of one event (one id)
_NEVER = "never-trained"  # the probe records' other ids: no event or traffic carries them, their rows stay defaults
_STREAM_CONFIG = """# Written by experiments/bench_freshness.py --stream: the tiny job on CSV files arriving in a directory.
from configs import tiny


def get_config():
  c = tiny.get_config()
  c.num_steps = -1
  c.log_every = 5  # the bench's writer paces itself on the step metrics.jsonl shows
  c.eval_samples = 256
  c.eval_batch_size = 256
  c.data.name = "csv"
  c.data.stream_poll_s = 0.02
  c.data.eval_files = ({eval!r},)
  c.data.dense = ("d1",)
  c.data.categorical = ("c1", "c2", "item")
  c.data.chunk_records = 512
  return c
"""


def _traffic(rng: np.random.Generator, n: int) -> List[str]:
  """``n`` CSV lines of ordinary traffic: Zipf users and items, a label the item and c2 predict."""
  u, v, it = rng.zipf(1.3, n) % 1000, rng.integers(0, 30, n), rng.zipf(1.2, n) % 20000
  logit = (it % 5 - 2) * 0.6 + (v > 15) - 0.5
  y = rng.random(n) < 1 / (1 + np.exp(-logit))
  d = rng.poisson(3, n)
  return [f"{int(a)},{b},u{c},v{e},i{f}" for a, b, c, e, f in zip(y, d, u, v, it)]


def _event_lines(item: str, label: int) -> List[str]:
  return [f"{label},3,u1,v1,{item}"] * _EVENT_RECORDS


def _probe_record(item: str) -> Dict[str, Any]:
  return {"d1": 3.0, "c1": _NEVER, "c2": _NEVER, "item": item}


def _put(stream: str, name: str, lines: List[str]) -> float:
  """Writes a stream file under a name the reader ignores and renames it into place; the time it counts."""
  tmp = os.path.join(stream, f".{name}.inprogress")
  with open(tmp, "w") as f:
    f.write(_HEADER + "\n".join(lines) + "\n")
  os.rename(tmp, os.path.join(stream, name))
  return time.time()


class _Steps:
  """The newest trained step a trainer's metrics.jsonl shows (read incrementally)."""

  def __init__(self, path: str):
    self.path, self.offset, self.step = path, 0, 0

  def read(self) -> int:
    try:
      with open(self.path, "rb") as f:
        f.seek(self.offset)
        chunk = f.read()
    except FileNotFoundError:
      return self.step
    end = chunk.rfind(b"\n") + 1
    for line in chunk[:end].splitlines():
      r = json.loads(line)
      if r.get("kind") == "train":
        self.step = max(self.step, int(r["step"]))
    self.offset += end
    return self.step


def _stream_trainer(config: str, run: str, stream: str, steps: int, publish: bool) -> List[str]:
  cmd = [sys.executable, "-m", "recsys_jax.main", f"--config={config}", f"--workdir={run}"]
  cmd += [f"--config.data.stream_dir={stream}", f"--config.num_steps={steps}", "--config.progress_bar=False"]
  cmd += [f"--config.checkpoint_every={_CKPT.value}", f"--config.publish_every_s={_EVERY.value if publish else 0.0}"]
  cmd += [f"--config.publish_dense_every_s={_DENSE.value}"]
  return cmd + [f"--config.{kv}" for kv in _SET.value]


def _stream_base(scratch: str) -> Dict[str, Any]:
  """The run every measured run resumes from: the known ids' label-0 history and some traffic, trained."""
  rng = np.random.default_rng(0)
  os.makedirs(scratch, exist_ok=True)
  config = os.path.join(scratch, "stream_config.py")
  eval_path = os.path.join(scratch, "eval.csv")
  with open(eval_path, "w") as f:
    f.write(_HEADER + "\n".join(_traffic(rng, 256)) + "\n")
  with open(config, "w") as f:
    f.write(_STREAM_CONFIG.format(eval=eval_path))
  base = os.path.join(scratch, "base")
  stream = os.path.join(base, "stream")
  os.makedirs(stream)
  lines = [f"0,3,u{j % 7},v{j % 11},k{j}" for j in range(_KNOWN) for _ in range(_KNOWN_RECORDS)]
  B = _batch_size(config)
  n = -(-len(lines) // B) * B * 2  # whole batches: the measured runs start at a file boundary
  lines += _traffic(rng, n - len(lines))
  lines = [lines[i] for i in rng.permutation(len(lines))]
  files = 4
  for k in range(files):
    _put(stream, f"{k:08d}.csv", lines[k * n // files : (k + 1) * n // files])
    time.sleep(0.01)  # distinct mtimes: the arrival order is the names' order
  steps = n // B
  log = os.path.join(scratch, "base.log")
  with open(log, "w") as f:
    rc = subprocess.call(
      _stream_trainer(config, os.path.join(base, "run"), stream, steps, False), stdout=f, stderr=subprocess.STDOUT
    )
  if rc != 0:
    with open(log) as f:
      raise SystemExit(f"the base stream run failed with exit {rc}:\n{f.read()[-3000:]}")
  return {"dir": base, "config": config, "records": n, "steps": steps, "files": files, "batch_size": B}


def _batch_size(config: str) -> int:
  """The batch size of the stream config with the overrides of --set (the writer's unit of progress)."""
  for kv in _SET.value:
    if kv.startswith("batch_size="):
      return int(kv.split("=", 1)[1])
  from configs import tiny

  return int(tiny.get_config().batch_size)


def _connect(port: int):
  """An HTTP client of the server on ``port`` (imported here: the client processes need no more)."""
  from recsys_jax.serving.client import HttpClient

  return HttpClient("127.0.0.1", port, timeout=30)


class _Prober:
  """Events for probing: records of a new id (or of a known id with its label turned over), and the
  time from the file carrying them counting (renamed into place) to the first answer of the server
  whose score for a record with that id differs from the score before the file was written.

  The probe record's other ids are never trained and its dense feature is fixed, so its score moves
  only with the id's row or with the dense parameters. The bench knows the step that trains the
  event's records (a stream's batches are its records in order), so it knows which answer is the
  first scored with them (its row_version reaches that step): the event counts at that answer if
  the score moved, and is unresolved if it did not (the rows came and changed nothing: a bug). A
  dense publish before that answer re-takes the score to compare with (``rebased``); one in that
  same answer is counted (``with_dense``). A score that moves before the rows are there
  (``moved_before_rows``) would mean the measure is wrong; the bench fails on one or an unresolved
  event."""

  def __init__(self, port: int, timeout_s: float = 60.0):
    self.base_client, self.client = _connect(port), _connect(port)
    self.pending: List[Dict[str, Any]] = []
    self.done: List[Dict[str, Any]] = []
    self.lock = threading.Lock()
    self.timeout_s = timeout_s
    self.rebased = 0
    self.early = 0
    self.failures: List[str] = []
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._loop, daemon=True)

  def prepare(self, kind: str, item: str) -> Dict[str, Any]:
    a = self.base_client.predict([_probe_record(item)])
    return {"kind": kind, "item": item, "score": a["scores"][0], "dense": a["dense_version"]}

  def register(self, ev: Dict[str, Any], t: float, step: int) -> None:
    """``step``: the step that trains the event's last record (a stream's batches are its records in order)."""
    ev["t"], ev["step"] = t, step
    with self.lock:
      self.pending.append(ev)

  def _loop(self) -> None:
    while not self.stop.wait(_PROBE_EVERY.value):
      with self.lock:
        pending = list(self.pending)
      if not pending:
        continue
      try:
        a = self.client.predict([_probe_record(e["item"]) for e in pending])
      except Exception as e:  # noqa: BLE001 - counted and shown
        self.failures.append(f"{type(e).__name__}: {e}")
        continue
      now, rv = time.time(), a["row_version"]
      for e, score in zip(pending, a["scores"]):
        has_rows = rv is not None and rv >= e["step"]
        moved = abs(score - e["score"]) > 1e-6
        if "rows_at" in e:  # the rows came and the score did not move: when does it, if ever (unresolved either way)?
          if moved or a["dense_version"] != e["dense"] or now - e["t"] > self.timeout_s:
            e["lag"], e["late"] = None, now - e["t"] if moved and a["dense_version"] == e["dense"] else None
          continue
        if has_rows:
          e["rows_at"] = now - e["t"]  # the first answer scored with rows that include the event's
        if a["dense_version"] != e["dense"] and not has_rows:
          e["score"], e["dense"] = score, a["dense_version"]
          self.rebased += 1
        elif has_rows:  # scored with the event's rows (an answer names the rows it was scored with)
          e["with_dense"] = a["dense_version"] != e["dense"]  # and new dense parameters in the same answer
          if moved:
            e["lag"] = now - e["t"]
          # else: the rows came and the score did not move (a bug somewhere); followed on, unresolved
        elif moved:
          e["lag"] = now - e["t"]
          self.early += 1  # the score moved before the event's rows came: never, if the bench is right
        elif now - e["t"] > self.timeout_s:
          e["lag"] = None
      with self.lock:
        self.done += [e for e in pending if "lag" in e]
        self.pending = [e for e in self.pending if "lag" not in e]

  def close(self) -> None:
    self.stop.set()
    self.thread.join()
    self.client.close()
    self.base_client.close()


def _client_proc(port: int, stop, rate: float, records: int, seed: int, out: str) -> None:
  """A client process: ``rate`` requests a second of ``records`` traffic records until ``stop``;
  counts failures and answers whose dense or row version is older than an earlier answer's."""
  rng = np.random.default_rng(seed)
  recs = []
  for line in _traffic(rng, 64):
    _, d, c1, c2, item = line.split(",")
    recs.append({"d1": float(d), "c1": c1, "c2": c2, "item": item})
  client = _connect(port)
  lat, failures, backwards, k = [], [], [], 0
  last = {"dense_version": -1, "row_version": -1}
  period, nxt = 1.0 / rate, time.perf_counter()
  while not stop.is_set():
    rs = [recs[(k + j) % len(recs)] for j in range(records)]
    t0 = time.perf_counter()
    try:
      a = client.predict(rs)
    except Exception as e:  # noqa: BLE001 - counted and shown
      failures.append(f"{type(e).__name__}: {e}")
      time.sleep(0.05)
      continue
    lat.append(time.perf_counter() - t0)
    for key in last:
      v = a.get(key)
      if v is None or v < last[key]:
        backwards.append(f"{key} {last[key]} -> {v}")
      else:
        last[key] = v
    k += 1
    nxt += period
    time.sleep(max(0.0, nxt - time.perf_counter()))
  client.close()
  with open(out, "w") as f:
    json.dump({"latency_s": lat, "failures": failures, "backwards": backwards, "last": last}, f)


def _stream_run(scratch: str, base: Dict[str, Any], name: str, publish: bool, duration: float, events: bool):
  """One measured run: a copy of the base run, its server, the writer, the trainer, the clients (and
  with ``events``, the prober) for ``duration`` seconds of training; then SIGTERM to the trainer."""
  import multiprocessing

  w = os.path.join(scratch, name)
  shutil.copytree(base["dir"], w)
  run, stream = os.path.join(w, "run"), os.path.join(w, "stream")
  B = base["batch_size"]
  serve = [sys.executable, "-m", "recsys_jax.serve", f"--workdir={run}", "--http_port=0", "--grpc_port=-1"]
  serve += [f"--deltas_every_s={_POLL.value}"] + ([f"--publish_dir={os.path.join(run, 'publish')}"] if publish else [])
  server_log = open(os.path.join(w, "server.log"), "w")
  server = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=server_log, text=True)
  trainer = writer = prober = None
  clients, stop = [], threading.Event()
  ctx = multiprocessing.get_context("spawn")
  client_stop = ctx.Event()
  try:
    line = server.stdout.readline()  # "ready http=127.0.0.1:<port> version=..."
    if not line.startswith("ready"):
      server.wait(timeout=30)
      with open(server_log.name) as f:
        raise SystemExit(f"the server did not start (exit {server.returncode}):\n{f.read()[-3000:]}")
    port = int(line.split("http=")[1].split()[0].rsplit(":", 1)[1])
    threading.Thread(target=server.stdout.read, daemon=True).start()  # drains it
    prober = _Prober(port) if events else None
    steps = _Steps(os.path.join(run, "metrics.jsonl"))
    started, in_flight = threading.Event(), threading.Lock()
    written = [base["records"]]
    limit = _BACKLOG.value * _FILE_RECORDS.value + 5 * B  # + the 5 steps between metrics lines
    rng = np.random.default_rng(hash(name) % 2**32)

    def write() -> None:
      seq, next_event, n_events, flips = base["files"], 0.0, 0, {}
      while not stop.is_set():
        if written[0] - steps.read() * B >= limit:
          time.sleep(0.005)
          continue
        lines, ev = _traffic(rng, _FILE_RECORDS.value), None
        with in_flight:  # an event the writer began is registered before the run looks for pending ones
          if prober is not None and started.is_set() and time.time() >= next_event:
            try:
              if n_events % 2 == 0:
                ev = prober.prepare("new", f"n{n_events}")
                lines = _event_lines(ev["item"], 1) + lines
              else:
                j = (n_events // 2) % _KNOWN
                flips[j] = flips.get(j, 0) + 1
                ev = prober.prepare("flip", f"k{j}")
                lines = _event_lines(ev["item"], flips[j] % 2) + lines  # label 0 -> 1 -> 0 ...
            except Exception as e:  # noqa: BLE001 - counted and shown
              prober.failures.append(f"{type(e).__name__}: {e}")
            n_events += 1
            next_event = time.time() + _EVENT_EVERY.value
          t = _put(stream, f"{seq:08d}.csv", lines)
          if ev is not None:  # its records are the stream's records written[0] ... written[0] + _EVENT_RECORDS - 1
            prober.register(ev, t, (written[0] + _EVENT_RECORDS - 1) // B + 1)
        seq += 1
        written[0] += len(lines)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    log = open(os.path.join(w, "trainer.log"), "w")
    cmd = _stream_trainer(base["config"], run, stream, -1, publish)
    trainer = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while steps.read() <= base["steps"] + 5:  # training, compiled
      if trainer.poll() is not None or time.time() > deadline:
        raise SystemExit(f"the stream trainer did not start training (exit {trainer.poll()}); see {log.name}")
      time.sleep(0.05)
    for i in range(_CLIENTS.value):
      out = os.path.join(w, f"client{i}.json")
      p = ctx.Process(target=_client_proc, args=(port, client_stop, _RATE.value, _RECORDS.value, i, out))
      p.start()
      clients.append((p, out))
    if prober is not None:
      prober.thread.start()
    started.set()
    t0, step0 = time.time(), steps.read()
    while time.time() - t0 < duration:
      if trainer.poll() is not None:
        raise SystemExit(f"the stream trainer ended early (exit {trainer.returncode}); see {log.name}")
      time.sleep(0.2)
    started.clear()  # no more events
    with in_flight:
      pass
    seconds, trained = time.time() - t0, steps.read() - step0
    while prober is not None and prober.pending and time.time() - t0 < duration + prober.timeout_s:
      time.sleep(0.1)  # the last events reach the server
    info = _connect(port).model()  # the server's own counts: deltas applied, catch-ups, damage named
    trainer.send_signal(signal.SIGTERM)
    rc = trainer.wait(timeout=300)
    if rc != 0:
      raise SystemExit(f"the stream trainer exited {rc} after SIGTERM; see {log.name}")
  finally:
    stop.set()
    client_stop.set()
    for p, _ in clients:
      p.join(timeout=60)
    if prober is not None:
      prober.close()
    if trainer is not None and trainer.poll() is None:
      trainer.kill()
      trainer.wait()
    server.terminate()
    server.wait(timeout=60)
    server_log.close()
  with open(os.path.join(run, "summary.json")) as f:
    summary = json.load(f)
  got = []
  for p, out in clients:
    if p.exitcode != 0:
      raise SystemExit(f"a client process exited {p.exitcode}")
    with open(out) as f:
      got.append(json.load(f))
  lat = np.array([x for g in got for x in g["latency_s"]]) * 1e3
  out = {
    "samples_per_sec": float(summary["samples_per_sec"]),
    "samples_per_sec_measured": trained * B / seconds,  # from metrics.jsonl over the measured window
    "seconds": seconds,
    "steps": trained,
    "requests": int(lat.shape[0]),
    "requests_per_client": [len(g["latency_s"]) for g in got],
    "failed": sum(len(g["failures"]) for g in got),
    "versions_backwards": sum(len(g["backwards"]) for g in got),
    "last_versions": [g["last"] for g in got],
    "p50_ms": float(np.percentile(lat, 50)) if lat.shape[0] else None,
    "p99_ms": float(np.percentile(lat, 99)) if lat.shape[0] else None,
    "server": {k: v for k, v in info.items() if k != "fields"},  # /v1/model at the end: reloads, deltas, damage
  }
  examples = [x for g in got for x in g["failures"][:3] + g["backwards"][:3]]
  if examples:
    out["examples"] = examples[:6]
  if prober is not None:
    done = prober.done + [dict(e, lag=None) for e in prober.pending]
    out["events"] = len(done)
    out["unresolved"] = sum(e["lag"] is None for e in done)
    out["rebased"] = prober.rebased
    out["with_dense"] = sum(bool(e.get("with_dense")) for e in done)
    out["moved_before_rows"] = prober.early
    # kind, id, lag, first answer with its rows, the step that trained it, and for an event whose score
    # did not move with its rows, when it moved later with the same dense parameters (None: not seen)
    out["each"] = [
      [e["kind"], e["item"], _r(e["lag"]), _r(e.get("rows_at")), e["step"], _r(e.get("late"))] for e in done
    ]
    out["probe_failed"] = len(prober.failures)
    for kind in ("all", "new", "flip"):
      lags = np.array([e["lag"] for e in done if e["lag"] is not None and kind in ("all", e["kind"])])
      rows = np.array([e["rows_at"] for e in done if "rows_at" in e and kind in ("all", e["kind"])])
      if lags.shape[0]:
        out[f"freshness_{kind}"] = {
          "n": int(lags.shape[0]),
          "p50_s": float(np.percentile(lags, 50)),
          "p95_s": float(np.percentile(lags, 95)),
          "max_s": float(lags.max()),
          "rows_p50_s": float(np.percentile(rows, 50)) if rows.shape[0] else None,
        }
  return out


def _r(x: Optional[float]) -> Optional[float]:
  return None if x is None else round(float(x), 3)


def _stream_main(scratch: str) -> Dict[str, Any]:
  base = _stream_base(scratch)
  main_run = _stream_run(scratch, base, "stream_on", True, _DURATION.value, events=True)
  m = main_run
  if m["failed"] or m["versions_backwards"] or m["unresolved"] or m["moved_before_rows"] or m["probe_failed"]:
    # the logs of the trainer and the server, its stream and deltas, to look at (with --workdir)
    sys.stderr.write(f"the measured run went wrong: its directory is kept, {os.path.join(scratch, 'stream_on')}\n")
  else:
    shutil.rmtree(os.path.join(scratch, "stream_on"), ignore_errors=True)
  pairs = {"off": [], "on": []}
  for r in range(_PAIRS.value):
    for mode in _ORDER:
      name = f"ratio_{mode}{r}"
      pairs[mode].append(_stream_run(scratch, base, name, mode == "on", _RATIO_S.value, events=False))
      shutil.rmtree(os.path.join(scratch, name), ignore_errors=True)
  fresh = main_run.get("freshness_all", {})
  result = {
    "mode": "stream",
    "overrides": list(_SET.value),
    "duration_s": _DURATION.value,
    "publish_every_s": _EVERY.value,
    "publish_dense_every_s": _DENSE.value,
    "deltas_every_s": _POLL.value,
    "event_every_s": _EVENT_EVERY.value,
    "file_records": _FILE_RECORDS.value,
    "clients": _CLIENTS.value,
    "rate": _RATE.value,
    "records": _RECORDS.value,
    "freshness_p50_s": fresh.get("p50_s"),
    "freshness_p95_s": fresh.get("p95_s"),
    "freshness_max_s": fresh.get("max_s"),
    "failed": main_run["failed"] + main_run["probe_failed"] + sum(r["failed"] for v in pairs.values() for r in v),
    "versions_backwards": main_run["versions_backwards"],
    "unresolved": main_run["unresolved"],
    "moved_before_rows": main_run["moved_before_rows"],
    "serving_p99_ms_deltas": main_run["p99_ms"],
    "main": main_run,
  }
  if _PAIRS.value:
    on = [r["samples_per_sec_measured"] for r in pairs["on"]]
    off = [r["samples_per_sec_measured"] for r in pairs["off"]]
    result.update(
      ratio_s=_RATIO_S.value,
      ratio_pairs=_PAIRS.value,
      samples_per_sec_on=on,
      samples_per_sec_off=off,
      train_ratio=float(np.median(on) / np.median(off)),
      train_ratio_pairs=[a / b for a, b in zip(on, off)],
      summary_samples_per_sec_on=[r["samples_per_sec"] for r in pairs["on"]],
      summary_samples_per_sec_off=[r["samples_per_sec"] for r in pairs["off"]],
      train_ratio_summary=float(
        np.median([r["samples_per_sec"] for r in pairs["on"]]) / np.median([r["samples_per_sec"] for r in pairs["off"]])
      ),
      serving_p99_ms_no_deltas=float(np.median([r["p99_ms"] for r in pairs["off"]])),
      ratio_runs=pairs,
    )
  w = sys.stderr.write
  m = main_run
  w(f"stream run {m['seconds']:.0f} s, {m['steps']} steps, {m['samples_per_sec_measured']:.0f} samples/s; ")
  w(
    f"{_CLIENTS.value} clients: {m['requests']} requests, {m['failed']} failed, {m['versions_backwards']} versions back, "
  )
  w(f"p50 {m['p50_ms']:.1f} ms, p99 {m['p99_ms']:.1f} ms\n")
  for kind in ("all", "new", "flip"):
    f = m.get(f"freshness_{kind}")
    if f:
      w(
        f"freshness ({kind}, {f['n']} events): p50 {f['p50_s']:.2f} s, p95 {f['p95_s']:.2f} s, max {f['max_s']:.2f} s\n"
      )
  w(
    f"events {m['events']}, unresolved {m['unresolved']}, resolved with a dense publish {m['with_dense']}, "
    f"rebased {m['rebased']}, moved before their rows {m['moved_before_rows']}\n"
  )
  if _PAIRS.value:
    w(
      f"training samples/s publishing on {[round(x) for x in on]} vs off {[round(x) for x in off]}: "
      f"{result['train_ratio']:.3f}x (the trainers' summaries, compiles left out: {result['train_ratio_summary']:.3f}x)\n"
    )
  return result


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
  if _STREAM.value:
    try:
      result = _stream_main(scratch)
    finally:
      if _WORKDIR.value is None:
        shutil.rmtree(scratch, ignore_errors=True)
    if _JSON.value:
      outputs.write_json(_JSON.value, result)
    print(json.dumps(result), flush=True)
    bad = result["failed"] or result["versions_backwards"] or result["unresolved"] or result["moved_before_rows"]
    if bad or result["freshness_p50_s"] is None:
      sys.exit(1)
    return
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
