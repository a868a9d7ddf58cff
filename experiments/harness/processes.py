"""The processes a measurement runs beside itself: a training or launcher run to its end, a model server
until it is stopped, and clients sending requests at a pace (threads, or processes over HTTP or gRPC)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from harness import outputs

ROOT = outputs.ROOT


def trainer(config: str, workdir: str, sets: Sequence[str], module: str = "recsys_jax.main") -> List[str]:
  """The command line of a training run of ``config`` in ``workdir``, ``sets``: ``key=value`` overrides."""
  cmd = [sys.executable, "-m", module, f"--config={config}", f"--workdir={workdir}"]
  return cmd + [f"--config.{kv}" for kv in sets]


def run(cmd: Sequence[str], log: str, timeout_s: float = 1800) -> float:
  """Runs ``cmd`` from the repository root, its output to ``log``; its wall seconds. Exits with the log's tail
  when it fails."""
  t0 = time.perf_counter()
  with open(log, "w") as f:
    rc = subprocess.call(list(cmd), stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout_s)
  if rc != 0:
    with open(log) as f:
      raise SystemExit(f"{' '.join(cmd)} failed with exit {rc}:\n{f.read()[-3000:]}")
  return time.perf_counter() - t0


def summary(workdir: str) -> Dict[str, Any]:
  """The summary.json a training run writes at its end."""
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


class TrainedSteps:
  """The newest step a training run's metrics.jsonl shows trained, read incrementally; threads may share one."""

  def __init__(self, workdir: str):
    self.path, self.offset, self.step = os.path.join(workdir, "metrics.jsonl"), 0, 0
    self.lock = threading.Lock()

  def read(self) -> int:
    with self.lock:
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


def launch(config: str, workers: int, servers: int, workdir: str, sets: Sequence[str]) -> Dict[str, Any]:
  """A ``recsys_jax.launch`` run of ``workers`` trainers and ``servers`` PS servers (0: in-process) to its end:
  its summary's figures and its wall time."""
  cmd = trainer(config, workdir, ["progress_bar=False", *sets], module="recsys_jax.launch")
  wall = run(cmd + [f"--num_ps={servers}", f"--num_workers={workers}"], workdir + ".log")
  s = summary(workdir)
  row = {"staleness": s["staleness"], "trainers": workers, "ps_servers": servers}
  return row | {k: s[k] for k in ("samples_per_sec", "auc", "steps", "batch_size")} | {"wall_s": wall}


def start(module: str, args: Sequence[str], log: Optional[str] = None, env=None, timeout_s: float = 600):
  """Starts ``python -m <module> *args`` from the repository root (its stderr to the file ``log``, else to
  this process's) and waits for its line ``ready ...``. Returns the process and that line."""
  err = open(log, "w") if log else None
  p = subprocess.Popen(
    [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env
  )
  if err is not None:
    err.close()  # the server has its own copy
  end = time.monotonic() + timeout_s
  while time.monotonic() < end and p.poll() is None:
    if select.select([p.stdout], [], [], 1.0)[0]:
      line = p.stdout.readline()
      if line.startswith("ready "):
        threading.Thread(target=p.stdout.read, daemon=True).start()  # drains what follows
        return p, line
  p.kill()
  p.wait()
  raise SystemExit(f"{module} did not start (exit {p.returncode}); its log: {log or 'above'}")


def start_server(args: Sequence[str], log: Optional[str] = None, timeout_s: float = 600):
  """``start`` of ``recsys_jax.serve``: the process and its ports by protocol."""
  p, line = start("recsys_jax.serve", args, log, timeout_s=timeout_s)
  parts = dict(kv.split("=", 1) for kv in line.split()[1:])  # "ready http=<host>:<port> grpc=... version=..."
  return p, {k: int(v.rsplit(":", 1)[1]) for k, v in parts.items() if k in ("http", "grpc")}


def stop(p: subprocess.Popen, timeout_s: float = 60) -> int:
  """SIGTERM to ``p`` (SIGKILL when it has not ended after ``timeout_s``); its exit code."""
  if p.poll() is None:
    p.terminate()
  try:
    return p.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    p.kill()
    return p.wait()


def paced(
  send: Callable[[int], Any], rate: float, done: Callable[[], bool], on_answer: Optional[Callable[[Any], None]] = None
) -> Tuple[List[float], List[str]]:
  """Calls ``send(k)``, k = 0, 1, ..., ``rate`` times a second (0: back to back) until ``done()``; the
  latency of each call answered (each answer also to ``on_answer``) and the error of each that failed."""
  lat: List[float] = []
  failures: List[str] = []
  k, nxt = 0, time.perf_counter()
  while True:
    t0 = time.perf_counter()
    try:
      answer = send(k)
    except Exception as e:  # noqa: BLE001 - counted and shown
      failures.append(f"{type(e).__name__}: {e}")
    else:
      lat.append(time.perf_counter() - t0)
      if on_answer is not None:
        on_answer(answer)
    k += 1
    if done():
      return lat, failures
    if rate:
      nxt += 1.0 / rate
      time.sleep(max(0.0, nxt - time.perf_counter()))


def poster(spec: Dict[str, Any]) -> Tuple[Callable[[bytes], Any], Any]:
  """A function sending a predict request's body over ``spec["protocol"]`` to ``spec["port"]``, and its client
  (``close()`` it). ``http``, ``grpc``: ``/v1``; ``v2http``, ``v2bin``, ``v2grpc``: the Open Inference Protocol
  with JSON tensors, binary tensors (``spec["heads"]``: body -> its JSON header's length) and over gRPC, to
  the model ``spec["model"]``."""
  from recsys_jax.serving.client import GrpcClient, HttpClient

  if "grpc" in spec["protocol"]:
    g = GrpcClient(f"127.0.0.1:{spec['port']}", timeout=60)
    return (g.infer if spec["protocol"] == "v2grpc" else lambda body: g.call("Predict", body)), g
  c = HttpClient("127.0.0.1", spec["port"], timeout=60)
  if spec["protocol"] == "http":
    return lambda body: c.request("POST", "/v1/predict", body), c
  heads = dict(spec.get("heads") or {})
  return lambda body: c.infer(spec["model"], body, heads.get(body)), c


def client(spec: Dict[str, Any], out: str, stopped: Any = None) -> None:
  """A client process (a spawn target): sends ``spec["bodies"]`` in turn to ``spec["port"]`` over
  ``spec["protocol"]`` (``http``, ``grpc``), ``spec["rate"]`` a second, untimed from ``spec["start"]`` (epoch
  seconds), timed from ``spec["timed_from"]`` until ``spec["end"]`` or ``stopped`` is set. Writes to ``out``
  ``latency_s``, ``failures``, ``late`` (began after ``start``), ``span`` (``timed_from`` to the last answer)
  and, with ``spec["versions"]``, ``backwards``: answers whose dense or row version went back."""
  post, c = poster(spec)
  bodies = [b.encode("utf-8") if isinstance(b, str) else b for b in spec["bodies"]]
  last = {"dense_version": -1, "row_version": -1}
  backwards: List[str] = []

  def check(answer: Dict[str, Any]) -> None:
    for key, before in last.items():
      v = answer.get(key)
      if v is None or v < before:
        backwards.append(f"{key} {before} -> {v}")
      else:
        last[key] = v

  late = time.time() > spec["start"]
  time.sleep(max(0.0, spec["start"] - time.time()))
  send = lambda k: post(bodies[k % len(bodies)])  # noqa: E731
  paced(send, spec["rate"], lambda: time.time() >= spec["timed_from"])
  done = lambda: time.time() >= spec["end"] or (stopped is not None and stopped.is_set())  # noqa: E731
  lat, failures = paced(send, spec["rate"], done, check if spec.get("versions") else None)
  span = max(spec["end"] if np.isfinite(spec["end"]) else 0.0, time.time()) - spec["timed_from"]
  c.close()
  with open(out, "w") as f:
    json.dump({"latency_s": lat, "failures": failures, "late": late, "span": span, "backwards": backwards}, f)


def draw_records(fields: Dict[str, str], n: int, rng: np.random.Generator) -> List[Dict[str, Any]]:
  """``n`` records of random values for a served model's ``fields`` (name -> kind, as ``/v1/model`` gives them)."""

  def value(kind: str) -> Any:
    if kind in ("float", "dense"):
      return float(np.round(rng.exponential(2.0), 3))
    if kind == "int":
      return int(rng.integers(0, 1000))
    if kind == "list":
      return [f"{v:08x}" for v in rng.integers(0, 1 << 20, int(rng.integers(1, 4)))]
    return f"{int(rng.integers(0, 1 << 20)):08x}"

  return [{f: value(k) for f, k in fields.items()} for _ in range(n)]
