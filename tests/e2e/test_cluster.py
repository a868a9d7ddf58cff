"""Two PS server processes + two trainer processes on loopback, against the in-process run.

The servers are ``python -m recsys_jax.async_ps.server``; the trainers are ``python -m
recsys_jax.main`` joined by ``jax.distributed`` (one CPU device each), each reading its half of
every batch and doing its own lookups and pushes. The first test starts them all with
``python -m recsys_jax.launch``; the failure test starts them itself, to kill one server. The
last ones run the launcher in the background: its token, a SIGKILL of it, a SIGSTOPped server.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import grpc
import jax
import numpy as np
import pytest

from recsys_jax import train
from tests.helpers.launcher_job import RESTART, LauncherJob, running

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_servers(n, log_dir):
  procs, addresses = [], []
  for i in range(n):
    log = open(os.path.join(log_dir, f"ps-{i}.log"), "w")
    p = subprocess.Popen(
      [sys.executable, "-m", "recsys_jax.async_ps.server", "--port=0", f"--shard_index={i}", f"--num_shards={n}"],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=log,
      text=True,
    )
    line = p.stdout.readline().strip()
    assert line.startswith("ready "), f"server {i} said {line!r}; see {log.name}"
    procs.append(p)
    addresses.append(line.split()[1])
  return procs, addresses


def _start_trainers(n, addresses, workdir, extra=()):
  port = _free_port()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  return [
    subprocess.Popen(
      [
        sys.executable,
        "-m",
        "recsys_jax.main",
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        f"--coordinator_address=127.0.0.1:{port}",
        f"--num_processes={n}",
        f"--process_id={i}",
        "--config.ps.kind=remote",
        f"--config.ps.addresses={','.join(addresses)}",
        *extra,
      ],
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(n)
  ]


def _stop(procs):
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()


@pytest.fixture(scope="module")
def in_process(tiny_run):
  return tiny_run[0]  # the summary of tests/conftest.py's run of configs/tiny.py


CHECKPOINT_EVERY = ("--config.checkpoint_every=20",)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
  """A launcher job (2 servers, 2 trainers, tiny config, a checkpoint every 20 steps) run to its
  end: its stdout and summary."""
  workdir = tmp_path_factory.mktemp("launched") / "run"
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "recsys_jax.launch",
      "--config=configs/tiny.py",
      "--num_ps=2",
      "--num_workers=2",
      f"--workdir={workdir}",
      *CHECKPOINT_EVERY,
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
  return out.stdout, json.load(open(workdir / "summary.json"))


def test_two_servers_two_trainers_match_the_in_process_run(in_process, launched):
  """Through the launcher: real servers and trainers, log lines prefixed, exit 0."""
  stdout, s = launched
  lines = stdout.splitlines()
  for name in ("ps-0", "ps-1", "worker-0", "worker-1"):
    assert any(line.startswith(f"[{name}] ") for line in lines), name
  assert s["steps"] == in_process["steps"] and s["devices"] == 2
  assert s["eval_samples"] == in_process["eval_samples"]
  assert abs(s["auc"] - in_process["auc"]) <= 0.005, (s["auc"], in_process["auc"])
  assert s["ps_rows"] > 0


def test_a_server_sigkilled_between_checkpoints_restarts_and_ends_like_no_kill(launched, tmp_path):
  """The default suite's form of tests/e2e/test_chaos.py: the same launcher job with one restart
  allowed; PS server 1 is SIGKILLed between checkpoints (once checkpoint 20 and both trainers'
  hot-set files are written). One restart, naming it; the job resumes from the newest checkpoint
  left and ends with the auc, logloss and steps (==) of the uninterrupted job."""
  from tests.e2e.test_chaos import _checkpoints, _new_checkpoint, _started_in, _wait

  workdir = str(tmp_path / "run")
  job = LauncherJob(workdir, *CHECKPOINT_EVERY, "--max_restarts=1", num_steps=None)
  try:
    pid = _wait(lambda: _started_in(job, "ps-1", 0), job, "ps-1 of attempt 0")
    step = _new_checkpoint(job, 0)
    hot = [os.path.join(workdir, "checkpoint_parts", str(step), f"hot_rows_p{i}.npz") for i in range(2)]
    _wait(lambda: all(map(os.path.exists, hot)), job, f"the hot-set files of checkpoint {step}")
    landed = running(pid)
    os.kill(pid, signal.SIGKILL)
    left = _checkpoints(workdir)
    restart = job.wait_for(RESTART.pattern)
    assert job.proc.wait(300) == 0, job.tail()
  finally:
    job.end()
  ref = launched[1]
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert landed and job.restarts() == [(restart[1], 1, 1)], job.restarts()
  assert restart[1].startswith("ps-1 ") and "signal SIGKILL" in restart[1], restart[1]
  assert summary["resumed_from"] in left and summary["resumed_from"] >= step, (summary["resumed_from"], left)
  assert ref["resumed_from"] is None and ref["steps"] == summary["steps"] == 120
  assert {m: summary[m] for m in ("auc", "logloss", "steps")} == {m: ref[m] for m in ("auc", "logloss", "steps")}


def _config_flags(c, fields):
  """``--config.<field>=<value>`` for each dotted field of ``c``: a trainer started by hand gets the
  config the test built."""
  out = []
  for field in fields:
    node, _, leaf = field.rpartition(".")
    out.append(f"--config.{field}={(c[node] if node else c)[leaf]}")
  return out


HOT_STEPS = 14


def test_two_trainers_with_hot_rows_give_the_weights_and_rows_of_one_process_without(tmp_path):
  """k = 0, SGD on the dense weights and on the rows (Adagrad from a zero accumulator and Adam hide
  a gradient's scale; SGD does not): 2 trainers x 1 device with hot rows, each reading half of
  every batch and pushing its own cold rows' gradients to 2 PS servers, against one process with
  the in-process PS, no hot rows, on the whole batches. Long enough for the hot set to be chosen
  at step 2 and re-chosen every 3 steps (rows promoted and demoted through the PS each time), so
  the hot rows' update summed over the processes (``psum`` in ``training/steps.py``) is compared
  with the PS's own update of the same rows: a hot row updated twice, or not at all, is 2.0 x lr x
  its gradient away from the reference, far above the tolerance.

  Every dense weight (orbax checkpoint) and every row (the PS snapshot of the same checkpoint,
  into which the hot rows are written back first) agrees to 1e-6 plus 1e-5 of its size. Not bit
  for bit: each trainer sums its half (rows: per row; dense: the mean's part), then the server
  (cold rows) or the all-reduce (hot rows, dense) adds the two halves, in another order than one
  process's sum over the whole batch (measured: at most 6e-8 after 14 steps).

  Several trainers need the remote PS: ``ps.kind='local'`` with two processes is refused (each
  would train its own tables)."""
  from configs import tiny
  from tests.parallel.test_mesh import _dense_params, _rows, _sgd

  c = _sgd(tiny.get_config())
  c.num_steps = HOT_STEPS
  c.hot_rows_bytes, c.hot_warmup_steps, c.hot_every, c.hot_min_count = 1 << 13, 2, 3, 1  # 256 rows
  flags = _config_flags(
    c,
    ("num_steps", "eval_samples", "eval_batch_size", "optimizer.name", "optimizer.learning_rate")
    + ("embeddings.optimizer", "embeddings.learning_rate", "staleness")
    + ("hot_rows_bytes", "hot_warmup_steps", "hot_every", "hot_min_count"),
  )
  servers, addresses = _start_servers(2, str(tmp_path))
  try:
    trainers = _start_trainers(2, addresses, str(tmp_path / "two"), flags)
    one = c.copy_and_resolve_references()
    one.hot_rows_bytes = 0
    assert train.train_and_evaluate(one, str(tmp_path / "one"))["hot"] is None  # meanwhile
    _run_to_end(trainers)
  finally:
    _stop(servers)
  hot = json.load(open(tmp_path / "two" / "summary.json"))["hot"]
  # The hot rows did the work: chosen 4 times, most lookups hit them, rows moved at each re-choice.
  assert [x["step"] for x in hot["choices"]] == [2, 5, 8, 11], hot["choices"]
  assert hot["hot_hit_rate"] > 0.5 and hot["hot_rows_held"] == 256, hot
  assert all(x["promoted"] > 0 for x in hot["choices"]), hot["choices"]
  job = train.build_job(c, str(tmp_path / "probe"))  # the template of one process's topology
  init = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(job.state.params)[0]}
  ref = _dense_params(str(tmp_path / "one"), HOT_STEPS)
  got = _dense_params(str(tmp_path / "two"), HOT_STEPS, job.state)
  assert got.keys() == ref.keys()
  for k in ref:
    np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert max(float(np.max(np.abs(ref[k] - init[k]))) for k in ref) > 1e-2  # the steps moved them
  ref_rows = _rows(c, str(tmp_path / "one"), job.ps, HOT_STEPS)
  got_rows = _rows(c, str(tmp_path / "two"), job.ps, HOT_STEPS)
  assert got_rows.keys() == ref_rows.keys() and len(ref_rows) > 500
  for key, w in ref_rows.items():
    np.testing.assert_allclose(got_rows[key], w, rtol=1e-5, atol=1e-6, err_msg=str(key))
  job.ps.restore({})  # empty: a lookup without create reads each row's initial value
  moved = max(
    float(np.max(np.abs(w - job.ps.lookup_many({t: np.array([i], np.uint64)}, create=False)[t][0])))
    for (t, i), w in ref_rows.items()
  )
  job.ps.close()
  assert moved > 1e-2, moved


def _run_to_end(trainers):
  outs = [t.communicate(timeout=300)[0] for t in trainers]
  for i, (t, out) in enumerate(zip(trainers, outs)):
    assert t.returncode == 0, f"trainer {i}:\n{out[-4000:]}"


@pytest.mark.slow  # about 36 s; the stopped-server test covers a lost server in the default run
def test_a_killed_server_stops_the_trainers_and_a_restart_finishes_like_no_failure(tmp_path):
  ckpt = ["--config.checkpoint_every=20", "--config.ps.timeout_s=5"]
  # The run without failures, for reference.
  servers, addresses = _start_servers(2, str(tmp_path))
  try:
    _run_to_end(_start_trainers(2, addresses, str(tmp_path / "reference"), ckpt))
  finally:
    _stop(servers)
  ref = json.load(open(tmp_path / "reference" / "summary.json"))

  # The same run; server 1 is SIGKILLed once a checkpoint exists.
  run = tmp_path / "run"
  servers, addresses = _start_servers(2, str(tmp_path))
  trainers = []
  try:
    trainers = _start_trainers(2, addresses, str(run), ckpt + ["--config.num_steps=100000"])
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "checkpoints" / "40").exists():
      time.sleep(0.05)
    servers[1].send_signal(signal.SIGKILL)
    killed = time.time()
    outs = [t.communicate(timeout=60)[0] for t in trainers]
    took = time.time() - killed
  finally:
    _stop(servers + trainers)
  assert took < 30, took
  assert all(t.returncode != 0 for t in trainers), [t.returncode for t in trainers]
  assert any(addresses[1] in out for out in outs), "\n---\n".join(o[-2000:] for o in outs)
  resumed_at = max(int(n) for n in os.listdir(run / "checkpoints") if n.isdigit())
  assert 40 <= resumed_at < 120

  # Fresh servers (new ports, empty); the trainers restore them from the last checkpoint.
  servers, addresses = _start_servers(2, str(tmp_path))
  try:
    _run_to_end(_start_trainers(2, addresses, str(run), ckpt))
  finally:
    _stop(servers)
  s = json.load(open(run / "summary.json"))
  assert s["resumed_from"] == resumed_at
  assert s["auc"] == ref["auc"] and s["logloss"] == ref["logloss"], (s["auc"], ref["auc"])


# -- the launcher in the background (tests/helpers/launcher_job.py) -------------------------------


# -m slow (5 s): its parts are each checked in the default run: the token file's mode and the
# servers' and trainers' --token_file (tests/launch/test_launch.py: test_job_token_file, test_ps_argv,
# test_trainer_argv), a server with a token refusing a client without (tests/async_ps/test_remote.py,
# UNAUTHENTICATED), the children of a SIGKILLed launcher ending (test_launch.py:
# test_children_die_with_a_sigkilled_launcher), and the launched job above trains through it all.
@pytest.mark.slow
def test_the_launchers_token_and_a_sigkilled_launcher(tmp_path):
  """The job's servers demand a token only the user can read; SIGKILL of the launcher ends every child."""
  from recsys_jax.async_ps.client.transport import RemotePSError, Transport

  job = LauncherJob(str(tmp_path / "run"))
  token_file = None
  try:
    token_file = job.wait_for(r"^\[launch\] PS token: (\S+)$")[1]
    addresses = job.wait_for(r"^\[launch\] servers ready at (\S+)$")[1].split(",")
    assert os.stat(token_file).st_mode & 0o777 == 0o600
    job.wait_training()  # the trainers have the token
    stranger = Transport(addresses, timeout_s=10)
    with pytest.raises(RemotePSError) as err:
      stranger.call(1, "Health", {})
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    stranger.close()
    with open(token_file) as f:
      member = Transport(addresses, token=f.read().strip(), timeout_s=10)
    assert member.call(1, "Health", {}).fields["configured"]
    member.close()

    pids = job.pids()
    assert sorted(pids) == ["ps-0", "ps-1", "worker-0", "worker-1"] and all(map(running, pids.values()))
    job.proc.kill()
    job.proc.wait()
    killed = time.monotonic()
    while any(map(running, pids.values())) and time.monotonic() - killed < 10:
      time.sleep(0.02)
    took = time.monotonic() - killed
    left = {name: pid for name, pid in pids.items() if running(pid)}
    print(f"children gone {took:.2f} s after the launcher's SIGKILL")
    assert not left, f"alive {took:.1f} s after the launcher's SIGKILL: {left}"
    assert took < 3.0, took
  finally:
    job.end()
    if token_file:  # a SIGKILLed launcher cannot remove its token
      shutil.rmtree(os.path.dirname(token_file), ignore_errors=True)


def test_a_stopped_server_stops_the_job_within_timeout_s(tmp_path):
  """SIGSTOP of a server (hung, not dead): each trainer ends non-zero within ps.timeout_s, naming it."""
  timeout = 5.0  # the servers' first lookup compiles their kernels: seconds on a loaded machine
  # --max_restarts=0: the first failure ends the job (a restart would be a new job, tests/e2e/test_chaos.py).
  job = LauncherJob(str(tmp_path / "run"), f"--config.ps.timeout_s={timeout}", "--max_restarts=0")
  try:
    addresses = job.wait_for(r"^\[launch\] servers ready at (\S+)$")[1].split(",")
    job.wait_training()
    pids = job.pids()
    os.kill(pids["ps-1"], signal.SIGSTOP)
    t0 = time.monotonic()
    ended = {}
    while len(ended) < 2 and time.monotonic() - t0 < 60:
      for name in ("worker-0", "worker-1"):
        if name not in ended and not running(pids[name]):
          ended[name] = time.monotonic() - t0
      time.sleep(0.02)
    code = job.proc.wait(60)
    took = time.monotonic() - t0
  finally:
    job.end()
  print(f"trainers ended {ended} s after SIGSTOP of ps-1 (timeout_s {timeout}); launcher after {took:.1f} s")
  assert code == 1, job.tail()
  assert len(ended) == 2 and max(ended.values()) < timeout + 3.0, (ended, job.tail())
  assert re.search(
    rf"^\[worker-\d\] error: PS server {re.escape(addresses[1])} \(shard 1 of 2\)", job.tail(n=None), re.M
  )
  assert re.search(r"^\[launch\] worker-\d failed with exit code 1", job.tail(n=None), re.M), job.tail()
