"""Freshness: how soon a row the trainer updates is scored by the model server, and what publishing costs.

    python experiments/bench_freshness.py [--config=configs/tiny.py] [--steps=3000] [--repeats=1]
        [--publish_every_s=1] [--publish_dense_every_s=10] [--deltas_every_s=0.1] [--clients=2]
        [--rate=50] [--records=1] [--set=key=value ...] [--json_out=FILE]
    python experiments/bench_freshness.py --stream [--duration_s=60] [--ratio_pairs=1] [--ratio_s=30] ...

Run from the repository root. A summary on stderr, one JSON line on stdout (also to ``--json_out``).

Default mode: a short run (``--base_steps``) writes the checkpoint the measured runs resume from. In
each run (``--repeats`` times publishing off, then on) a trainer process trains ``--steps`` more steps
at full speed (``python -m recsys_jax.main``, the config's synthetic data) while this process serves
its workdir as ``python -m recsys_jax.serve`` does (``FreshModelHolder``, the micro-batcher, no HTTP) to
``--clients`` threads sending ``--rate`` requests a second of ``--records`` records. ``freshness_*_s``:
per delta published during the run, from the oldest update it carries (``first_update`` in the index:
the first step after the previous publish handing its ids to the pusher) to the first answer naming a
row version at or past its step (``final_delta_s``: the delta published after the last step;
``cut_to_answer_p50_s``: from the delta's cut). ``serving_p99_ms_deltas`` / ``_no_deltas``: the clients'
latency publishing on / off. ``train_ratio``: the trainer's samples/s (its summary, compiles left out)
on over off. Each figure is the median over the repeats.

Stream mode (``--stream``), every part a real process: the trainer (``configs/tiny.py`` on CSV columns
``label,d1,c1,c2,item``) follows ``config.data.stream_dir``, which a writer thread fills with files of
``--file_records`` records, ``--backlog_files`` ahead of the step the trainer's metrics.jsonl shows;
``python -m recsys_jax.serve`` applies its deltas every ``--deltas_every_s``; ``--clients`` client
processes send paced requests over HTTP. Each run resumes from a run on the base files (200 known ids,
label 0). In the measured run (``--duration_s``, publishing on) every ``--event_every_s`` a file starts
with 4 records of a new id (label 1) or, in turn, of a known id with its label turned over; an event's
freshness is from its file counting to the first answer of a prober (every ``--probe_every_s``) whose
score for a record with that id (its other ids never trained, its dense value fixed) moved.
``main.each``: per event [kind, id, the step training it, seconds to the first answer scored with that
step's rows, seconds to the score's move]. ``--ratio_pairs`` runs of ``--ratio_s`` seconds off and on
(no events) give ``train_ratio`` (steps x batch over the seconds, from metrics.jsonl) and
``serving_p99_ms_no_deltas``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Sequence

import numpy as np
from absl import app, flags
from harness import outputs, processes, stats, stream

from recsys_jax.async_ps.snapshot import published
from recsys_jax.serving.client import HttpClient

_CONFIG = flags.DEFINE_string("config", "configs/tiny.py", "The trainer's config file.")
_SET = flags.DEFINE_multi_string("set", [], "More config overrides, key=value (e.g. batch_size=1024).")
_BASE = flags.DEFINE_integer("base_steps", 2, "Steps of the run the measured runs resume from.")
_STEPS = flags.DEFINE_integer("steps", 3000, "Steps each measured run trains.")
_CKPT = flags.DEFINE_integer("checkpoint_every", 1000, "The trainer's checkpoint_every (checkpoints prune deltas).")
_EVERY = flags.DEFINE_float("publish_every_s", 1.0, "The trainer's config.publish_every_s when on.")
_DENSE = flags.DEFINE_float("publish_dense_every_s", 10.0, "The trainer's config.publish_dense_every_s when on.")
_POLL = flags.DEFINE_float("deltas_every_s", 0.1, "How often the server applies deltas.")
_CLIENTS = flags.DEFINE_integer("clients", 2, "Clients.")
_RATE = flags.DEFINE_float("rate", 50.0, "Requests a second per client.")
_RECORDS = flags.DEFINE_integer("records", 1, "Records per request.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Scratch directory, kept (default: a temporary one, removed).")
_JSON = flags.DEFINE_string("json_out", None, "Also write the JSON result here.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Runs of each mode, off and on in turn; the figures are medians.")
_STREAM = flags.DEFINE_bool("stream", False, "Stream mode: a writer feeds the trainer's stream_dir; the real server.")
_DURATION = flags.DEFINE_float("duration_s", 60.0, "Stream mode: seconds of the measured run (publishing on).")
_RATIO_S = flags.DEFINE_float("ratio_s", 30.0, "Stream mode: seconds of each off/on run for the samples/s ratio.")
_PAIRS = flags.DEFINE_integer("ratio_pairs", 1, "Stream mode: off/on pairs for the ratio (0: no ratio runs).")
_EVENT_EVERY = flags.DEFINE_float("event_every_s", 0.5, "Stream mode: seconds between probe events (new id / flip).")
_FILE_RECORDS = flags.DEFINE_integer("file_records", 512, "Stream mode: records per stream file.")
_BACKLOG = flags.DEFINE_integer("backlog_files", 2, "Stream mode: files written ahead of what the trainer trained.")
_PROBE_EVERY = flags.DEFINE_float("probe_every_s", 0.05, "Stream mode: seconds between the prober's requests.")


def _trainer(workdir: str, steps: int, publish: bool, more: Sequence[str] = (), stream_dir: str = "") -> List[str]:
  """A trainer's command: ``--config``, or with ``stream_dir`` configs/tiny.py following it."""
  sets = [f"num_steps={steps}", "progress_bar=False", f"checkpoint_every={_CKPT.value}"]
  sets += [f"publish_every_s={_EVERY.value if publish else 0.0}", f"publish_dense_every_s={_DENSE.value}"]
  sets += [*more, f"data.stream_dir={stream_dir}"] if stream_dir else []
  return processes.trainer("configs/tiny.py" if stream_dir else _CONFIG.value, workdir, sets + _SET.value)


def _measure(base: str, workdir: str, publish: bool) -> Dict[str, Any]:
  """One run of the default mode: the trainer beside the in-process server and its client threads."""
  from recsys_jax.serving import scorer as sl
  from recsys_jax.serving.batcher import Batcher
  from recsys_jax.serving.fresh import FreshModelHolder

  shutil.copytree(base, workdir)
  pub = os.path.join(workdir, "publish")
  holder = FreshModelHolder(workdir, sl.load_scorer, sl.newest_step, pub, steps=sl.complete_steps)
  batcher = Batcher(holder.current, max_batch=512, max_wait_s=0.002)
  recs = processes.draw_records(holder.current().fields(), 64, np.random.default_rng(0))
  batcher.predict(recs[: _RECORDS.value])  # compiled before the clock starts
  seen: List[tuple] = []  # (wall time, row version) of each answer
  entries: Dict[int, Dict[str, Any]] = {}  # every delta published, by seq (checkpoints prune them from the index)
  halt = threading.Event()

  def client():
    send = lambda k: batcher.predict([recs[(k + j) % 64] for j in range(_RECORDS.value)], timeout=30)  # noqa: E731
    return processes.paced(send, _RATE.value, halt.is_set, lambda p: seen.append((time.time(), p.row_version)))

  def watch() -> None:
    while not halt.wait(0.02):
      try:
        index = published.read_index(pub)
      except published.PublishError:
        index = None  # written whole by a rename: a failed read is the bench's bug, shown as a missed delta
      for d in (index or {}).get("deltas", []):
        entries.setdefault(d["seq"], d)

  t0 = time.time()
  try:
    with ThreadPoolExecutor(_CLIENTS.value + 1) as pool:
      clients = [pool.submit(client) for _ in range(_CLIENTS.value)]
      pool.submit(watch)
      holder.start(_POLL.value)
      try:
        processes.run(_trainer(workdir, _BASE.value + _STEPS.value, publish), workdir + ".log")
        time.sleep(3 * _POLL.value + 0.2)  # the last delta reaches the clients
      finally:
        halt.set()
  finally:
    holder.close()
    batcher.close()
  lat = [x for c in clients for x in c.result()[0]]
  failures = [x for c in clients for x in c.result()[1]]
  out = {"samples_per_sec": processes.summary(workdir)["samples_per_sec"], "seconds": time.time() - t0}
  out.update(_latency(lat, failures), failures=failures[:5])
  if publish:
    out.update(_delta_lags([entries[s] for s in sorted(entries)], sorted(x for x in seen if x[1] is not None)))
    out.update(deltas_applied=holder.deltas_applied, catch_ups=holder.catch_ups, bad=dict(holder.bad))
  return out


def _latency(lat: List[float], failures: List[str]) -> Dict[str, Any]:
  q = stats.quantiles([x * 1e3 for x in lat], (50, 99))
  return {"requests": len(lat), "failed": len(failures), "p50_ms": q["p50"], "p99_ms": q["p99"]}


def _delta_lags(deltas: List[Dict[str, Any]], seen: List[tuple]) -> Dict[str, Any]:
  """Per delta, from its oldest update (and from its cut) to the first answer with a row version at or past its step."""
  if [d["seq"] for d in deltas] != list(range(deltas[0]["seq"], deltas[-1]["seq"] + 1)):
    raise SystemExit("the bench missed a delta between two reads of the index")
  times, versions = np.array([t for t, _ in seen]), np.array([v for _, v in seen])
  last = max(d["step"] for d in deltas)
  lags, cut_lags, final = [], [], []
  for d in deltas:
    at = np.flatnonzero(versions >= d["step"])
    if not at.shape[0]:
      raise SystemExit(f"no answer scored with the rows of step {d['step']} ({d['name']}); the server fell behind")
    if d["step"] == last:  # published after the run's last step, its final checkpoint saved first
      final.append(times[at[0]] - d["first_update"])
    else:
      lags.append(times[at[0]] - d["first_update"])
      cut_lags.append(times[at[0]] - d["cut"])
  q = stats.quantiles(lags, (50, 95))
  return {
    "deltas": len(lags),
    "delta_rows_mean": float(np.mean([d["rows"] for d in deltas])),
    "freshness_p50_s": q["p50"],
    "freshness_p95_s": q["p95"],
    "freshness_max_s": q["max"],
    "cut_to_answer_p50_s": stats.median(cut_lags),
    "lags_s": [round(float(x), 3) for x in lags],
    "final_delta_s": float(max(final)),
  }


# ------------------------------------------------------------------------------------------ stream mode


def _stream_base(scratch: str) -> Dict[str, Any]:
  """The run every stream run resumes from: the known ids' label-0 history and some traffic, trained."""
  from configs import tiny

  rng = np.random.default_rng(0)
  eval_path, base = os.path.join(scratch, "eval.csv"), os.path.join(scratch, "base")
  with open(eval_path, "w") as f:
    f.write(stream.HEADER + "\n".join(stream.traffic(rng, 256)) + "\n")
  os.makedirs(f"{base}/stream")
  B = int(dict(kv.split("=", 1) for kv in _SET.value).get("batch_size", tiny.get_config().batch_size))
  n = stream.base_files(f"{base}/stream", B, rng)
  sets = stream.SETS + [f"data.eval_files=({eval_path!r},)"]
  processes.run(_trainer(f"{base}/run", n // B, False, sets, f"{base}/stream"), f"{base}.log")
  return {"dir": base, "sets": sets, "records": n, "steps": n // B, "files": 4, "batch_size": B}


def _stream_run(scratch: str, base: Dict[str, Any], name: str, publish: bool, duration: float, events: bool):
  """One run: a copy of the base run, its server, the writer, the trainer and the client processes (with
  ``events``, the prober) for ``duration`` seconds of training; then SIGTERM to the trainer."""
  w = os.path.join(scratch, name)
  shutil.copytree(base["dir"], w)
  run, B = os.path.join(w, "run"), base["batch_size"]
  args = [f"--workdir={run}", "--http_port=0", "--grpc_port=-1", f"--deltas_every_s={_POLL.value}"]
  server, ports = processes.start_server(args + [f"--publish_dir={run}/publish"] * publish, f"{w}/server.log")
  ctx = multiprocessing.get_context("spawn")
  clients_stop, clients, trainer, log = ctx.Event(), [], None, os.path.join(w, "trainer.log")
  prober = stream.Prober(ports["http"], _PROBE_EVERY.value) if events else None
  steps = processes.TrainedSteps(run)
  ahead = _BACKLOG.value * _FILE_RECORDS.value + 5 * B  # + the 5 steps between two lines of metrics.jsonl
  rng = np.random.default_rng(list(name.encode()))
  trained = lambda: steps.read() * B  # noqa: E731
  feed = (f"{w}/stream", base["files"], base["records"], trained, rng, B, _FILE_RECORDS.value, ahead)
  writer = stream.Writer(*feed, prober=prober, every_s=_EVENT_EVERY.value)  # events once writer.events is set
  try:
    with open(log, "w") as f:
      cmd = _trainer(run, -1, publish, base["sets"], f"{w}/stream")
      trainer = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=processes.ROOT)
    deadline = time.time() + 600
    while steps.read() <= base["steps"] + 5:  # training, compiled
      if trainer.poll() is not None or time.time() > deadline:
        raise SystemExit(f"the stream trainer did not start training (exit {trainer.poll()}); see {log}")
      time.sleep(0.05)
    for i in range(_CLIENTS.value):
      recs = stream.records(stream.traffic(np.random.default_rng(i), 64))
      bodies = [json.dumps({"records": [recs[(k + j) % 64] for j in range(_RECORDS.value)]}) for k in range(64)]
      spec = {"protocol": "http", "port": ports["http"], "rate": _RATE.value, "bodies": bodies, "versions": True}
      spec.update(start=time.time(), timed_from=time.time(), end=float("inf"))
      clients.append(ctx.Process(target=processes.client, args=(spec, f"{w}/client{i}.json", clients_stop)))
      clients[-1].start()
    if prober is not None:
      prober.thread.start()
    writer.events.set()
    t0, step0 = time.time(), steps.read()
    while time.time() - t0 < duration:
      if trainer.poll() is not None:
        raise SystemExit(f"the stream trainer ended early (exit {trainer.returncode}); see {log}")
      time.sleep(0.2)
    writer.end_events()
    seconds, trained = time.time() - t0, steps.read() - step0
    while prober is not None and prober.pending and time.time() - t0 < duration + prober.timeout_s:
      time.sleep(0.1)  # the last events reach the server
    info = HttpClient("127.0.0.1", ports["http"], 30).model()  # the server's counts: deltas applied, catch-ups, damage
    if processes.stop(trainer, 300) != 0:
      raise SystemExit(f"the stream trainer exited {trainer.returncode} after SIGTERM; see {log}")
  finally:
    writer.halt.set()
    clients_stop.set()
    for p in clients:
      p.join(timeout=60)
    done = prober.close() if prober is not None else None
    if trainer is not None:
      processes.stop(trainer)
    processes.stop(server)
  got = []
  for i, p in enumerate(clients):
    if p.exitcode != 0:
      raise SystemExit(f"a client process exited {p.exitcode}")
    with open(f"{w}/client{i}.json") as f:
      got.append(json.load(f))
  res = {
    "samples_per_sec": processes.summary(run)["samples_per_sec"],
    "samples_per_sec_measured": trained * B / seconds,  # from metrics.jsonl over the measured window
    "seconds": seconds,
    "steps": trained,
    **_latency([x for g in got for x in g["latency_s"]], [x for g in got for x in g["failures"]]),
    "versions_backwards": sum(len(g["backwards"]) for g in got),
    "server": {k: v for k, v in info.items() if k != "fields"},  # /v1/model at the end: reloads, deltas, damage
  }
  if examples := [x for g in got for x in g["failures"][:3] + g["backwards"][:3]]:
    res["examples"] = examples[:6]
  if done is not None:
    res.update(_events(done, prober))
  return res


def _events(done: List[Dict[str, Any]], prober: stream.Prober) -> Dict[str, Any]:
  r = lambda x: None if x is None else round(float(x), 3)  # noqa: E731
  out = {
    "events": len(done),
    "rebased": prober.rebased,
    "probe_failed": len(prober.failures),
    "with_dense": sum(bool(e.get("with_dense")) for e in done),  # rows and new dense parameters in one answer
    "each": [[e["kind"], e["item"], e["step"], r(e.get("rows_at")), r(e.get("moved_at"))] for e in done],
  }
  for kind in ("all", "new", "flip"):
    mine = [e for e in done if kind in ("all", e["kind"])]
    lags = [e["moved_at"] for e in mine if "moved_at" in e]
    if lags:
      q = stats.quantiles(lags, (50, 95))
      out[f"freshness_{kind}"] = {
        "n": len(lags),
        "p50_s": q["p50"],
        "p95_s": q["p95"],
        "max_s": q["max"],
        "rows_p50_s": stats.median(e.get("rows_at") for e in mine),
      }
  return out


def _pairs(n: int, run: Callable[[str, bool], Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
  """``n`` runs publishing off and ``n`` on, in turn."""
  runs: Dict[str, List[Dict[str, Any]]] = {"off": [], "on": []}
  for r in range(n):
    for mode in runs:
      runs[mode].append(run(f"{mode}{r}", mode == "on"))
  return runs


def _results(scratch: str) -> Dict[str, Any]:
  out: Dict[str, Any] = {
    "overrides": list(_SET.value),
    "publish_every_s": _EVERY.value,
    "publish_dense_every_s": _DENSE.value,
    "deltas_every_s": _POLL.value,
    "clients": _CLIENTS.value,
    "rate": _RATE.value,
    "records": _RECORDS.value,
  }
  if _STREAM.value:
    return _stream_results(scratch, out)
  base = os.path.join(scratch, "base")
  processes.run(_trainer(base, _BASE.value, False), base + ".log")
  pairs = _pairs(_REPEATS.value, lambda name, on: _measure(base, os.path.join(scratch, name), on))
  runs = {m: dict(stats.medians(v), samples_per_sec_each=[r["samples_per_sec"] for r in v]) for m, v in pairs.items()}
  on, off = runs["on"], runs["off"]
  return out | {
    "config": _CONFIG.value,
    "steps": _STEPS.value,
    "repeats": _REPEATS.value,
    "freshness_p50_s": on["freshness_p50_s"],
    "freshness_p95_s": on["freshness_p95_s"],
    "freshness_max_s": on["freshness_max_s"],
    "serving_p99_ms_deltas": on["p99_ms"],
    "serving_p99_ms_no_deltas": off["p99_ms"],
    "samples_per_sec_on": on["samples_per_sec"],
    "samples_per_sec_off": off["samples_per_sec"],
    "train_ratio": on["samples_per_sec"] / off["samples_per_sec"],
    "failed": sum(r["failed"] for v in pairs.values() for r in v),
    "runs": runs,
  }


def _stream_results(scratch: str, out: Dict[str, Any]) -> Dict[str, Any]:
  base = _stream_base(scratch)
  m = _stream_run(scratch, base, "stream_on", True, _DURATION.value, events=True)
  pairs = _pairs(_PAIRS.value, lambda name, on: _stream_run(scratch, base, f"ratio_{name}", on, _RATIO_S.value, False))
  fresh = m.get("freshness_all", {})
  out |= {
    "mode": "stream",
    "duration_s": _DURATION.value,
    "event_every_s": _EVENT_EVERY.value,
    "file_records": _FILE_RECORDS.value,
    "freshness_p50_s": fresh.get("p50_s"),
    "freshness_p95_s": fresh.get("p95_s"),
    "freshness_max_s": fresh.get("max_s"),
    "failed": m["failed"] + m["probe_failed"] + sum(r["failed"] for v in pairs.values() for r in v),
    "versions_backwards": m["versions_backwards"],
    "serving_p99_ms_deltas": m["p99_ms"],
    "main": m,
  }
  if _PAIRS.value:
    on, off = ([r["samples_per_sec_measured"] for r in pairs[k]] for k in ("on", "off"))
    s_on, s_off = ([r["samples_per_sec"] for r in pairs[k]] for k in ("on", "off"))
    out |= {
      "ratio_s": _RATIO_S.value,
      "ratio_pairs": _PAIRS.value,
      "samples_per_sec_on": on,
      "samples_per_sec_off": off,
      "train_ratio": stats.median(on) / stats.median(off),
      "train_ratio_summary": stats.median(s_on) / stats.median(s_off),  # the trainers' summaries: compiles left out
      "serving_p99_ms_no_deltas": stats.median(r["p99_ms"] for r in pairs["off"]),
      "ratio_runs": pairs,
    }
  return out


def main(argv) -> None:
  del argv
  scratch = os.path.abspath(_WORKDIR.value or tempfile.mkdtemp(prefix="bench_freshness_"))
  os.makedirs(scratch, exist_ok=True)
  try:
    result = _results(scratch)
  finally:
    if _WORKDIR.value is None:
      shutil.rmtree(scratch, ignore_errors=True)
  r, f = result.get, stats.fmt
  sys.stderr.write(
    f"freshness p50 {f(r('freshness_p50_s'), '.2f')} s, p95 {f(r('freshness_p95_s'), '.2f')} s, max "
    f"{f(r('freshness_max_s'), '.2f')} s; serving p99 {f(r('serving_p99_ms_deltas'), '.1f')} ms with deltas, "
    f"{f(r('serving_p99_ms_no_deltas'), '.1f')} ms without; training samples/s publishing on / off "
    f"{f(r('train_ratio'), '.3f')}; {r('failed')} failed requests\n"
  )
  if _JSON.value:
    outputs.write_json(_JSON.value, result)
  print(json.dumps(result), flush=True)
  if result["failed"] or result.get("runs", {}).get("on", {}).get("bad"):
    sys.exit(1)  # a request failed or the server refused a delta: the figures are not those of a working server


if __name__ == "__main__":
  app.run(main)
