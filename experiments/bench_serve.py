"""The model server under load: predictions/s and latency by protocol and request size, and freshness.

    python experiments/bench_serve.py --workdir=W [--model_module=recsys_jax.serving.scorer]
        [--protocols=http,grpc] [--batches=1,64,512] [--clients=4] [--seconds=10]
        [--max_batch=512] [--max_wait_ms=2] [--trainer_cmd="..."] [--freshness_s=30] [--json_out=FILE]

Run from the repository root. Starts ``python -m recsys_jax.serve`` on ``--workdir`` (a
training run's directory, e.g. of ``configs/dlrm.py``) in its own process, then per setting
(protocol x records per request) ``--clients`` client processes send requests back to back,
each on one connection (closed loop), for ``--seconds`` after a warm-up second. Request
bodies are built before the clock starts from the served model's fields (``GET /v1/model``;
floats, strings, ints, lists of strings, drawn at random) or taken from ``--records_file``
(JSON lines of records), so the clients spend their time on the wire, not on building JSON.

Per setting: ``predictions_per_s`` (records answered / ``span_s``, all clients: the window, or
longer where the last timed answer came after it on a loaded machine), ``requests_per_s``,
``p50_ms`` / ``p99_ms`` (each request's round trip at the client), ``failed`` requests, and the
server's ``records_per_batch`` (mean records per scored micro-batch over the setting).

Freshness (with ``--trainer_cmd``, a command that writes new checkpoints or PS snapshots into
the workdir, e.g. a running trainer): the bench polls the model module's ``newest_step`` and
a batch-1 predict, both every ``--poll_ms``; a step's lag is the time from ``newest_step`` first
naming it to the first answer naming a new version (the server's ``/v1/model`` step then), for
``--freshness_s`` seconds. The server polls every ``--reload_every_s``, so the lag is at most
that plus the load time (and the warm-up of the new version, ``--warm_reload``), plus the poll
interval of the bench. ``first_answer_ms``: the round trip of the first answer from each new
version (a version's first batch of a shape compiles it unless the server warmed it), against
``poll_p50_ms``, the median round trip of the polls. ``--batches=`` (empty) measures freshness alone.

``--model_module=tests.helpers.serve_fakes`` serves the test suite's linear model instead (a workdir of
``ckpt-<step>`` files with ``{"n_dense": 13, "n_cat": 26}``: Criteo's fields), which measures
the front (HTTP/gRPC, JSON, micro-batching, the reload) with a model that costs next to nothing;
its trainer stand-in is ``python tests/helpers/serve_fakes.py W EVERY_S COUNT 13 26``.

A table on stderr and one JSON line per setting on stdout (also appended to ``--json_out``).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import numpy as np
from absl import app, flags
from harness import outputs

from recsys_jax.serving.client import GrpcClient, HttpClient

_WORKDIR = flags.DEFINE_string("workdir", None, "The training run to serve.")
_MODULE = flags.DEFINE_string("model_module", "recsys_jax.serving.scorer", "The server's --model_module.")
_PROTOCOLS = flags.DEFINE_list("protocols", ["http", "grpc"], "Protocols to measure.")
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
_CLIENT = flags.DEFINE_string("client", None, "(internal) run one client, given as a JSON file, in this process.")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def draw_records(fields: Dict[str, str], n: int, rng: np.random.Generator) -> List[Dict[str, Any]]:
  """``n`` records of random values of each field's kind."""

  def value(kind: str) -> Any:
    if kind in ("float", "dense"):
      return float(np.round(rng.exponential(2.0), 3))
    if kind == "int":
      return int(rng.integers(0, 1000))
    if kind == "list":
      return [f"{v:08x}" for v in rng.integers(0, 1 << 20, int(rng.integers(1, 4)))]
    return f"{int(rng.integers(0, 1 << 20)):08x}"

  return [{f: value(k) for f, k in fields.items()} for _ in range(n)]


def run_client(spec: Dict[str, Any]) -> Dict[str, Any]:
  """One client: requests back to back from ``start`` to ``end`` (epoch seconds), and past ``end`` until
  one started after ``timed_from`` has answered (a loaded machine); the latencies of those, and
  ``span``, the seconds from ``timed_from`` to the last answer (at least the window)."""
  if spec["protocol"] == "http":
    c = HttpClient("127.0.0.1", spec["port"], timeout=60)
    send = lambda body: c.request("POST", "/v1/predict", body)  # noqa: E731
  else:
    c = GrpcClient(f"127.0.0.1:{spec['port']}", timeout=60)
    send = lambda body: c.call("Predict", body)  # noqa: E731
  bodies = [b.encode("utf-8") for b in spec["bodies"]]
  lat, failed, records, i = [], 0, 0, 0
  late = time.time() > spec["start"]  # ready after the warm-up began: the parent measures again
  while time.time() < spec["start"]:
    time.sleep(0.001)
  last = spec["end"]
  while True:
    t0 = time.time()
    if t0 >= spec["end"] and lat:
      break
    try:
      send(bodies[i % len(bodies)])
      ok = True
    except Exception:  # noqa: BLE001 - counted
      ok = False
    t1 = time.time()
    if t0 >= spec["timed_from"]:
      lat.append(t1 - t0)
      failed += not ok
      records += spec["n"] if ok else 0
      last = max(last, t1)
    i += 1
  span = last - spec["timed_from"]
  return {"latencies": lat, "failed": failed, "records": records, "late": late, "span": span}


def _start_server(workdir: str):
  cmd = [
    sys.executable, "-m", "recsys_jax.serve", f"--workdir={workdir}", f"--model_module={_MODULE.value}",
    "--http_port=0", "--grpc_port=0", f"--max_batch={_MAX_BATCH.value}", f"--max_wait_ms={_MAX_WAIT.value}",
    f"--batch_workers={_WORKERS.value}", f"--reload_every_s={_RELOAD.value}", f"--warm_reload={_WARM.value}",
  ]  # fmt: skip
  p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=_ROOT)
  end = time.monotonic() + 600
  while time.monotonic() < end and p.poll() is None:
    if select.select([p.stdout], [], [], 1.0)[0]:
      line = p.stdout.readline()
      if line.startswith("ready "):
        parts = dict(kv.split("=", 1) for kv in line.split()[1:])
        return p, {k: int(parts[k].rsplit(":", 1)[1]) for k in ("http", "grpc")}
  p.kill()
  raise SystemExit("error: the server did not start (see its log above)")


def measure(
  protocol: str, port: int, n: int, bodies: List[str], admin: HttpClient, lead_s: float = 2.0
) -> Dict[str, Any]:
  """One setting's figures. The client processes import and connect within ``lead_s``; where one was
  late (a loaded machine) the setting is measured again with twice the lead, up to 16 s."""
  now = time.time()
  start = now + lead_s
  spec = {"protocol": protocol, "port": port, "n": n, "bodies": bodies}
  spec.update(start=start, timed_from=start + 1.0, end=start + 1.0 + _SECONDS.value)
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(spec, f)  # too long for a command line at 512 records a request
  procs = [
    subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), f"--client={f.name}"],
      stdout=subprocess.PIPE,
      text=True,
      cwd=_ROOT,
    )
    for _ in range(_CLIENTS.value)
  ]
  time.sleep(max(0.0, spec["timed_from"] - time.time()))
  b0, load0 = admin.model()["batching"], os.getloadavg()[0]
  outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
  os.unlink(f.name)
  b1 = admin.model()["batching"]
  if any(o["late"] for o in outs) and lead_s < 16:
    print(f"  a client started late ({lead_s:.0f} s lead): measuring again with {2 * lead_s:.0f} s", file=sys.stderr)
    return measure(protocol, port, n, bodies, admin, 2 * lead_s)
  lat = np.concatenate([o["latencies"] for o in outs]) * 1e3
  span = max(o["span"] for o in outs)  # the window, or longer where the last answer came after it
  batches = b1.get("batches", 0) - b0.get("batches", 0)
  return {
    "protocol": protocol,
    "records_per_request": n,
    "clients": _CLIENTS.value,
    "seconds": _SECONDS.value,
    "span_s": span,
    "predictions_per_s": sum(o["records"] for o in outs) / span,
    "requests_per_s": len(lat) / span,
    "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
    "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
    "failed": sum(o["failed"] for o in outs),
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

  trainer = subprocess.Popen(shlex.split(_TRAINER.value), cwd=_ROOT)
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
    "median_lag_s": float(np.median(vals)) if vals else None,
    "max_lag_s": max(vals) if vals else None,
    "snapshots_seen": len(appeared),
    "first_answer_ms": {str(k): 1e3 * v for k, v in sorted(first.items())},
    "poll_p50_ms": 1e3 * float(np.median(polls)) if polls else None,
    "warm_reload": _WARM.value,
    "reload_every_s": _RELOAD.value,
    "poll_ms": _POLL_MS.value,
  }


def _emit(res: Dict[str, Any]) -> None:
  line = json.dumps(res)
  if _JSON_OUT.value:
    outputs.write_text(_JSON_OUT.value, line + "\n", mode="a")
  print(line, flush=True)


def main(argv):
  del argv
  if _CLIENT.value:
    with open(_CLIENT.value) as f:
      print(json.dumps(run_client(json.load(f))))
    return
  if not _WORKDIR.value:
    raise SystemExit("error: --workdir is required")
  server, ports = _start_server(_WORKDIR.value)
  try:
    admin = HttpClient("127.0.0.1", ports["http"], timeout=120)
    model = admin.model()
    print(f"serving {model['version']} with fields {len(model['fields'])}", file=sys.stderr)
    if _RECORDS_FILE.value:
      with open(_RECORDS_FILE.value) as f:
        pool = [json.loads(line) for line in f if line.strip()]
    else:
      pool = draw_records(model["fields"], 4096, np.random.default_rng(0))
    rows = []
    print(
      f"{'protocol':>8} {'records':>7} {'pred/s':>10} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'batch':>7} fail",
      file=sys.stderr,
    )
    for n in (int(b) for b in _BATCHES.value):
      bodies = [json.dumps({"records": [pool[(k * n + j) % len(pool)] for j in range(n)]}) for k in range(8)]
      for protocol in _PROTOCOLS.value:
        r = measure(protocol, ports[protocol], n, bodies, admin)
        rows.append(r)
        rpb = r["records_per_batch"]
        p50, p99 = (f"{r[k]:>8.2f}" if r[k] is not None else f"{'-':>8}" for k in ("p50_ms", "p99_ms"))  # none answered
        print(
          f"{protocol:>8} {n:>7} {r['predictions_per_s']:>10.0f} {r['requests_per_s']:>9.0f} {p50} "
          f"{p99} {rpb if rpb is None else round(rpb, 1):>7} {r['failed']}",
          file=sys.stderr,
        )
        _emit(r)
    if _TRAINER.value:
      f = freshness(_WORKDIR.value, admin, json.dumps({"records": pool[:1]}).encode())
      print(
        f"freshness: {f['snapshots_seen']} snapshots, lag median {f['median_lag_s']} s, max {f['max_lag_s']} s "
        f"(server polls every {_RELOAD.value} s); first answer of a new version {f['first_answer_ms']} ms "
        f"(median answer {f['poll_p50_ms']:.1f} ms), warm_reload={_WARM.value}",
        file=sys.stderr,
      )
      _emit(f)
  finally:
    server.terminate()
    server.wait(timeout=60)


if __name__ == "__main__":
  app.run(main)
