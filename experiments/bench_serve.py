"""The model server under load: predictions/s and latency by protocol and request size, and freshness.

    python experiments/bench_serve.py --workdir=W [--model_module=recsys_jax.serving.scorer] [--rounds=1]
        [--protocols=http,grpc,v2http,v2bin,v2grpc] [--batches=1,64,512] [--clients=4] [--seconds=10]
        [--max_batch=512] [--max_wait_ms=2] [--trainer_cmd="..."] [--freshness_s=30] [--json_out=FILE]

Run from the repository root. Starts ``python -m recsys_jax.serve`` on ``--workdir`` (a training
run's directory), then per setting (protocol x records per request) ``--clients`` client processes
send requests back to back, each on one connection, for ``--seconds`` after a warm-up second; per
records count, the protocols in turn, ``--rounds`` times. Protocols: ``/v1`` over ``http`` and
``grpc``; the Open Inference Protocol with JSON tensors (``v2http``), binary tensors (``v2bin``), over
gRPC (``v2grpc``). Requests are built beforehand from records drawn for the served model's fields
(``GET /v1/model``) or read from ``--records_file`` (JSON lines), the same records for every protocol.

Per setting: ``predictions_per_s`` (records answered / ``span_s``: the window, or longer where the
last timed answer came after it), ``requests_per_s``, ``p50_ms`` / ``p99_ms`` (round trips at the
client), ``failed`` requests, and the server's ``records_per_batch`` (mean records per micro-batch).
Per records count, v2 against v1 on its transport (medians of the rounds): ``v2http_over_http_p99``,
``..._predictions``, and so for ``v2bin_over_http`` and ``v2grpc_over_grpc``.

Freshness (with ``--trainer_cmd``, a command writing new checkpoints or PS snapshots into the
workdir): every ``--poll_ms`` the bench asks the model module's ``newest_step`` and sends a batch-1
predict, for ``--freshness_s`` seconds; a step's lag is from ``newest_step`` first naming it to the
first answer of a new version (at most the server's ``--reload_every_s`` plus the load, the warm-up
with ``--warm_reload``, and the bench's poll). ``first_answer_ms``: each new version's first round
trip, against ``poll_p50_ms``, the polls' median. ``--batches=`` (empty) measures freshness alone.

``--model_module=tests.helpers.serve_fakes`` serves the test suite's linear model (a workdir of
``ckpt-<step>`` files with ``{"n_dense": 13, "n_cat": 26}``): the front alone (HTTP/gRPC, JSON,
micro-batching, the reload); its trainer is ``python tests/helpers/serve_fakes.py W EVERY_S COUNT 13 26``.
A table on stderr, JSON lines on stdout (also appended to ``--json_out``).
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import numpy as np
from absl import app, flags
from harness import outputs, processes, stats

from recsys_jax.serving import client
from recsys_jax.serving.client import HttpClient

_WORKDIR = flags.DEFINE_string("workdir", None, "The training run to serve.")
_MODULE = flags.DEFINE_string("model_module", "recsys_jax.serving.scorer", "The server's --model_module.")
_PROTOCOLS = flags.DEFINE_list("protocols", ["http", "grpc", "v2http", "v2bin", "v2grpc"], "Protocols to measure.")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "Times each records count's protocols are measured in turn.")
_BATCHES = flags.DEFINE_list("batches", ["1", "64", "512"], "Records per request.")
_CLIENTS = flags.DEFINE_integer("clients", 4, "Client processes at once.")
_SECONDS = flags.DEFINE_float("seconds", 10.0, "Timed seconds per setting (after a warm-up second).")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 512, "The server's --max_batch.")
_MAX_WAIT = flags.DEFINE_float("max_wait_ms", 2.0, "The server's --max_wait_ms.")
_WORKERS = flags.DEFINE_integer("batch_workers", 1, "The server's --batch_workers.")
_RELOAD = flags.DEFINE_float("reload_every_s", 1.0, "The server's --reload_every_s.")
_WARM = flags.DEFINE_bool("warm_reload", True, "The server's --warm_reload.")
_RECORDS_FILE = flags.DEFINE_string("records_file", None, "JSON lines of records to send (default: drawn).")
_TRAINER = flags.DEFINE_string("trainer_cmd", None, "A command writing new checkpoints into the workdir.")
_FRESH_S = flags.DEFINE_float("freshness_s", 30.0, "How long to measure freshness.")
_POLL_MS = flags.DEFINE_float("poll_ms", 10.0, "The bench's poll interval for freshness, ms.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also append the JSON lines to this file.")


def measure(
  protocol: str, port: int, n: int, bodies: Dict[str, Any], admin: HttpClient, lead_s: float = 2.0
) -> Dict[str, Any]:
  """One setting's figures. The client processes start and connect within ``lead_s``; where one was
  late (a loaded machine) the setting is measured again with twice the lead, up to 16 s."""
  start = time.time() + lead_s
  spec = {"protocol": protocol, "port": port, "rate": 0, "model": "bench", **bodies}
  spec.update(start=start, timed_from=start + 1.0, end=start + 1.0 + _SECONDS.value)
  ctx = multiprocessing.get_context("spawn")
  with tempfile.TemporaryDirectory() as d:
    outs = [os.path.join(d, f"client{i}.json") for i in range(_CLIENTS.value)]
    procs = [ctx.Process(target=processes.client, args=(spec, out)) for out in outs]
    for p in procs:
      p.start()
    time.sleep(max(0.0, spec["timed_from"] - time.time()))
    b0, load0 = admin.model()["batching"], os.getloadavg()[0]
    for p in procs:
      p.join()
    if any(p.exitcode != 0 for p in procs):
      raise SystemExit(f"a client process failed: exit codes {[p.exitcode for p in procs]}")
    b1 = admin.model()["batching"]
    runs = []
    for out in outs:
      with open(out) as f:
        runs.append(json.load(f))
  if any(r["late"] for r in runs) and lead_s < 16:
    print(f"  a client started late ({lead_s:.0f} s lead): measuring again with {2 * lead_s:.0f} s", file=sys.stderr)
    return measure(protocol, port, n, bodies, admin, 2 * lead_s)
  lat = [x * 1e3 for r in runs for x in r["latency_s"]]
  q = stats.quantiles(lat, (50, 99))
  span = max(r["span"] for r in runs)  # the window, or longer where the last answer came after it
  batches = b1.get("batches", 0) - b0.get("batches", 0)
  return {
    "protocol": protocol,
    "records_per_request": n,
    "clients": _CLIENTS.value,
    "seconds": _SECONDS.value,
    "span_s": span,
    "predictions_per_s": n * len(lat) / span,
    "requests_per_s": len(lat) / span,
    "p50_ms": q["p50"] if lat else None,
    "p99_ms": q["p99"] if lat else None,
    "failed": sum(len(r["failures"]) for r in runs),
    "records_per_batch": (b1.get("records", 0) - b0.get("records", 0)) / batches if batches else None,
    "max_batch": _MAX_BATCH.value,
    "max_wait_ms": _MAX_WAIT.value,
    "load_avg": [load0, os.getloadavg()[0]],
  }


def freshness(workdir: str, admin: HttpClient, body: bytes) -> Dict[str, Any]:
  newest = importlib.import_module(_MODULE.value).newest_step
  appeared: Dict[int, float] = {}
  lags: Dict[int, float] = {}
  stop = threading.Event()
  poll = _POLL_MS.value / 1e3

  def watch():
    while not stop.is_set():
      s = newest(workdir)
      if s is not None and s not in appeared:
        appeared[s] = time.time()
      time.sleep(poll)

  trainer = subprocess.Popen(shlex.split(_TRAINER.value), cwd=processes.ROOT)
  watcher = threading.Thread(target=watch, daemon=True)
  watcher.start()
  version = admin.request("POST", "/v1/predict", body)["version"]
  polls, first = [], {}  # each poll's latency; the first answer of each new version's
  end, done = time.time() + _FRESH_S.value, None
  while time.time() < end:
    if done is None and trainer.poll() is not None:
      done = time.time()
    if done is not None and time.time() > done + 2 * _RELOAD.value + 1:  # its last snapshot had time to load
      break
    t0 = time.time()
    v = admin.request("POST", "/v1/predict", body)["version"]
    t = time.time()
    polls.append(t - t0)
    if v != version:
      version = v
      step = admin.model()["step"]
      first[step] = t - t0
      if step in appeared:
        lags[step] = t - appeared[step]
    time.sleep(poll)
  stop.set()
  trainer.terminate()
  trainer.wait()
  vals = list(lags.values())
  return {
    "freshness_lag_s": {str(k): v for k, v in sorted(lags.items())},
    "median_lag_s": stats.median(vals) if vals else None,
    "max_lag_s": max(vals) if vals else None,
    "snapshots_seen": len(appeared),
    "first_answer_ms": {str(k): 1e3 * v for k, v in sorted(first.items())},
    "poll_p50_ms": 1e3 * stats.median(polls) if polls else None,
    "warm_reload": _WARM.value,
    "reload_every_s": _RELOAD.value,
    "poll_ms": _POLL_MS.value,
  }


def ratios(n: int, by: Dict[str, List[Dict[str, Any]]]) -> None:
  """Each Open Inference Protocol side against ``/v1`` on its transport: p99 and predictions/s, the
  medians of the rounds' figures, as ratios (v2 over v1: ``<v2>_over_<v1>_p99``, ``..._predictions``)."""
  med = {p: {k: stats.median([r[k] for r in rs]) for k in ("p99_ms", "predictions_per_s")} for p, rs in by.items()}
  res: Dict[str, Any] = {"records_per_request": n, "rounds": _ROUNDS.value, "load_avg": list(os.getloadavg())}
  for v2, v1 in (("v2http", "http"), ("v2bin", "http"), ("v2grpc", "grpc")):
    if v2 in med and v1 in med:
      res[f"{v2}_over_{v1}_p99"] = med[v2]["p99_ms"] / med[v1]["p99_ms"]
      res[f"{v2}_over_{v1}_predictions"] = med[v2]["predictions_per_s"] / med[v1]["predictions_per_s"]
  if len(res) > 3:
    print("  v2 / v1: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items() if "_over_" in k), file=sys.stderr)
    outputs.emit(res, _JSON_OUT.value, mode="a")


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise SystemExit("error: --workdir is required")
  args = [f"--workdir={_WORKDIR.value}", f"--model_module={_MODULE.value}", "--http_port=0", "--grpc_port=0"]
  args.append("--model_name=bench")
  args += [f"--max_batch={_MAX_BATCH.value}", f"--max_wait_ms={_MAX_WAIT.value}", f"--batch_workers={_WORKERS.value}"]
  args += [f"--reload_every_s={_RELOAD.value}", f"--warm_reload={_WARM.value}"]
  server, ports = processes.start_server(args)
  try:
    admin = HttpClient("127.0.0.1", ports["http"], timeout=120)
    model = admin.model()
    print(f"serving {model['version']} with fields {len(model['fields'])}", file=sys.stderr)
    if _RECORDS_FILE.value:
      with open(_RECORDS_FILE.value) as f:
        pool = [json.loads(line) for line in f if line.strip()]
    else:
      pool = processes.draw_records(model["fields"], 4096, np.random.default_rng(0))
    print(
      f"{'protocol':>8} {'records':>7} {'pred/s':>10} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'batch':>7} fail",
      file=sys.stderr,
    )
    inputs = admin.request("GET", "/v2/models/bench")["inputs"]
    for n in (int(b) for b in _BATCHES.value):
      groups = [[pool[(k * n + j) % len(pool)] for j in range(n)] for k in range(8)]
      forms = [client.v2_request(g, inputs, "bench") for g in groups]  # the v2 protocols' bodies, and v1's
      bodies = {
        p: {"bodies": [f[k] for f in forms]} for p, k in (("v2http", "json"), ("v2bin", "binary"), ("v2grpc", "grpc"))
      }
      bodies["v2bin"]["heads"] = [(f["binary"], f["binary_head"]) for f in forms]
      bodies["http"] = bodies["grpc"] = {"bodies": [json.dumps({"records": g}) for g in groups]}
      by: Dict[str, List[Dict[str, Any]]] = {}
      for _, protocol in [(k, p) for k in range(_ROUNDS.value) for p in _PROTOCOLS.value]:
        r = measure(protocol, ports["grpc" if "grpc" in protocol else "http"], n, bodies[protocol], admin)
        by.setdefault(protocol, []).append(r)
        rpb = r["records_per_batch"]
        p50, p99 = (stats.fmt(r[k], ">8.2f", f"{'-':>8}") for k in ("p50_ms", "p99_ms"))  # none answered
        print(
          f"{protocol:>8} {n:>7} {r['predictions_per_s']:>10.0f} {r['requests_per_s']:>9.0f} {p50} "
          f"{p99} {rpb if rpb is None else round(rpb, 1):>7} {r['failed']}",
          file=sys.stderr,
        )
        outputs.emit(r, _JSON_OUT.value, mode="a")
      ratios(n, by)
    if _TRAINER.value:
      f = freshness(_WORKDIR.value, admin, json.dumps({"records": pool[:1]}).encode())
      print(
        f"freshness: {f['snapshots_seen']} snapshots, lag median {f['median_lag_s']} s, max {f['max_lag_s']} s "
        f"(server polls every {_RELOAD.value} s); first answer of a new version {f['first_answer_ms']} ms "
        f"(median answer {f['poll_p50_ms']:.1f} ms), warm_reload={_WARM.value}",
        file=sys.stderr,
      )
      outputs.emit(f, _JSON_OUT.value, mode="a")
  finally:
    processes.stop(server)


if __name__ == "__main__":
  app.run(main)
