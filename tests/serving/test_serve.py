"""``python -m recsys_jax.serve`` as a process: its ready line, its errors for bad flags, and a load test.

The server serves ``serve_fakes``' linear model (``--model_module=tests.helpers.serve_fakes``), so
every answer can be checked against the version it names. The load test runs two client
processes (each over HTTP and gRPC in turn) while new checkpoints appear (and one broken one):
no request may fail, every answer's scores must all come from the version it names, and each
client's versions must only move forward.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from recsys_jax.serving.client import GrpcClient, HttpClient
from tests.helpers import serve_fakes as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = "--model_module=tests.helpers.serve_fakes"


def _run(*args, timeout=120):
  return subprocess.run(
    [sys.executable, "-m", "recsys_jax.serve", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout
  )


def start_server(workdir, *args, timeout=300, model_module=FAKE):
  """The server process, its http and grpc ports and version, once it printed its ready line."""
  extra = [model_module] if model_module else []
  p = subprocess.Popen(
    [sys.executable, "-m", "recsys_jax.serve", f"--workdir={workdir}", "--http_port=0", "--grpc_port=0", *extra, *args],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    cwd=ROOT,
  )
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if select.select([p.stdout], [], [], 1.0)[0]:
      line = p.stdout.readline()
      if line.startswith("ready "):
        parts = dict(kv.split("=", 1) for kv in line.split()[1:])
        return p, int(parts["http"].rsplit(":", 1)[1]), int(parts["grpc"].rsplit(":", 1)[1]), parts["version"]
      if not line:
        break
  p.kill()
  raise AssertionError(f"no ready line; stderr: {p.communicate()[1][-2000:]}")


def stop_server(p):
  p.send_signal(signal.SIGTERM)
  try:
    rc = p.wait(timeout=60)
  finally:
    p.kill()
  assert rc == 0, p.stderr.read()[-2000:]


def _one_error_line(result, *words):
  assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
  for w in words:
    assert w in lines[0], lines[0]


def test_bad_flags_get_one_error_line(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  _one_error_line(_run(f"--workdir={empty}", FAKE, "--http_port=0", "--grpc_port=0"), "no checkpoint", str(empty))
  _one_error_line(_run(f"--workdir={tmp_path}/nope", FAKE), "not a directory")
  _one_error_line(_run(FAKE), "--workdir is required")
  _one_error_line(_run(f"--workdir={empty}", "--model_module=no.such.module"), "--model_module=no.such.module")
  _one_error_line(_run(f"--workdir={empty}", FAKE, "--http_port=70000"), "--http_port")
  _one_error_line(_run(f"--workdir={empty}", FAKE, "--http_port=-1", "--grpc_port=-1"), "nothing to serve")
  _one_error_line(_run(f"--workdir={empty}", FAKE, "--max_batch=0"), "--max_batch")
  _one_error_line(_run(f"--workdir={empty}", FAKE, "--cache_mb=-1"), "--cache_mb")
  (tmp_path / "token").write_text("\n")
  _one_error_line(_run(f"--workdir={empty}", FAKE, f"--token_file={tmp_path}/token"), "--token_file", "empty")
  _one_error_line(_run(f"--workdir={empty}", FAKE, "--tls_cert=/x"), "--tls_key")
  F.publish(str(empty), 5)
  _one_error_line(_run(f"--workdir={empty}", FAKE, "--step=7"), "cannot load step 7", "FileNotFoundError")
  broken = tmp_path / "broken"
  broken.mkdir()
  F.publish(str(broken), 6, broken=True)
  _one_error_line(_run(f"--workdir={broken}", FAKE), "no checkpoint", "loads", "checkpoint 6 is broken")
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    _one_error_line(
      _run(f"--workdir={empty}", FAKE, f"--http_port={port}", "--grpc_port=0"), "cannot listen", str(port)
    )


def test_serves_with_a_token_and_stops_on_sigterm(tmp_path):
  F.publish(str(tmp_path), 42)
  (tmp_path / "tok").write_text("abc\n")
  p, hp, gp, version = start_server(tmp_path, f"--token_file={tmp_path}/tok")
  try:
    assert version == "step-42"
    recs = F.records(5)
    want = [F.reference(42, r) for r in recs]
    for c in (HttpClient("127.0.0.1", hp, token="abc"), GrpcClient(f"127.0.0.1:{gp}", token="abc")):
      a = c.predict(recs)
      assert a["version"] == "step-42" and a["scores"] == pytest.approx(want, rel=1e-5)
    with pytest.raises(Exception, match="401"):
      HttpClient("127.0.0.1", hp).predict(recs)
  finally:
    stop_server(p)


def test_a_damaged_newest_checkpoint_at_start_serves_the_newest_intact_one(tmp_path):
  w = str(tmp_path)
  F.publish(w, 600)
  F.publish(w, 100000, broken=True)
  p, hp, _, version = start_server(w, "--reload_every_s=0.1")
  try:
    assert version == "step-600"
    c = HttpClient("127.0.0.1", hp)
    assert c.model()["skipped"] == {"100000": "ValueError: checkpoint 100000 is broken"}
    time.sleep(1.0)  # ten polls: the damaged step is not tried again
    F.publish(w, 700)
    end = time.monotonic() + 30
    while c.model()["version"] != "step-700" and time.monotonic() < end:
      time.sleep(0.05)
    model = c.model()
    assert model["version"] == "step-700" and model["failed_loads"] == 1, model
    recs = F.records(4)
    assert c.predict(recs)["scores"] == pytest.approx([F.reference(700, r) for r in recs], rel=1e-5)
  finally:
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
  named = [line for line in err.splitlines() if "100000" in line]
  assert len(named) == 1 and "cannot be served" in named[0] and "skipping it" in named[0], err[-3000:]


def _load_test(tmp_path, seconds):
  w = str(tmp_path / "w")
  os.makedirs(w)
  F.publish(w, 100, delay_s=0.002)
  p, hp, gp, _ = start_server(w, "--reload_every_s=0.2", "--max_wait_ms=2")
  try:
    clients = [
      subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.serve_load_client", str(hp), str(gp), str(seconds)]
        + [str(tmp_path / f"client{c}.json"), str(c + 1)],
        cwd=ROOT,
      )
      for c in range(2)
    ]
    t0 = time.monotonic()
    plan = [(0.2, 200, {}), (0.35, 250, {"broken": True}), (0.5, 300, {}), (0.75, 400, {})]
    for frac, step, opts in plan:
      time.sleep(max(0.0, t0 + frac * seconds - time.monotonic()))
      F.publish(w, step, delay_s=0.002, **opts)
    for c in clients:
      assert c.wait(timeout=seconds + 120) == 0
    model = HttpClient("127.0.0.1", hp).model()
  finally:
    stop_server(p)
  assert model["version"] == "step-400" and model["loads"] == 4 and model["failed_loads"] == 1, model
  seen = set()
  total = 0
  for c in range(2):
    with open(tmp_path / f"client{c}.json") as f:
      out = json.load(f)
    assert not out["failures"], out["failures"][:5]
    steps = [int(v.split("-")[1]) for _, _, v, _ in out["answers"]]
    assert steps == sorted(steps), "a client saw an older version after a newer one"
    for (rseed, n, version, scores), step in zip(out["answers"], steps):
      want = [F.reference(step, r) for r in F.records(n, seed=rseed)]
      assert scores == pytest.approx(want, rel=1e-5, abs=1e-6), (rseed, version)
    seen |= set(steps)
    total += len(steps)
  assert seen == {100, 200, 300, 400}, seen
  assert total > 10 * seconds, total  # the clients were served all along, not stuck
  return total


def test_load_while_reloading_short(tmp_path):
  _load_test(tmp_path, 8)


@pytest.mark.slow
def test_load_while_reloading_60s(tmp_path):
  _load_test(tmp_path, 60)
