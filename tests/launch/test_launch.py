"""The one-machine launcher (recsys_jax/launch/cli.py) with fake children, and the Kubernetes manifests.

The launcher tests run small ``python -c`` children in place of PS servers and trainers; the
manifest tests check that what the pods run exists in the repository and that the numbers that
must agree (replicas, shards, addresses, processes, completions) do.
"""

import importlib.util
import io
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml

from recsys_jax import launch
from tests.helpers.launcher_job import running

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(ROOT, "deploy", "k8s")
PY = sys.executable


def _py(code):
  return [PY, "-c", code]


SLEEPER = _py("import time; print('up', flush=True); time.sleep(60)")


def _gone(child):
  return child.proc.poll() is not None


# --------------------------------------------------------------------------------------
# Argument builders and argv splitting.


def test_ps_argv():
  assert launch.ps_argv(1, 2, python="py") == [
    "py",
    "-m",
    "recsys_jax.async_ps.server",
    "--port=0",
    "--host=127.0.0.1",
    "--shard_index=1",
    "--num_shards=2",
  ]
  argv = launch.ps_argv(0, 3, port=6001, token_file="/t", python="py")
  assert argv[3] == "--port=6001" and argv[-1] == "--token_file=/t"


def test_trainer_argv():
  argv = launch.trainer_argv(
    "configs/tiny.py",
    "/w",
    ["127.0.0.1:1", "127.0.0.1:2"],
    overrides=["--config.num_steps=5", "--config.ps.tier", "memory"],
    extra=["--verbosity=1"],
    python="py",
  )
  assert argv == [
    "py",
    "-m",
    "recsys_jax.main",
    "--config=configs/tiny.py",
    "--workdir=/w",
    "--config.num_steps=5",
    "--config.ps.tier",
    "memory",
    # After the user's overrides, so the addresses the launcher found win.
    "--config.ps.kind=remote",
    "--config.ps.addresses=127.0.0.1:1,127.0.0.1:2",
    "--verbosity=1",
  ]
  local = launch.trainer_argv("c.py", "/w", [], token_file="/t", python="py")
  assert local == ["py", "-m", "recsys_jax.main", "--config=c.py", "--workdir=/w", "--config.ps.token_file=/t"]


def test_trainer_env():
  base = {
    "PATH": "/bin",
    "XLA_FLAGS": "--xla_dump_to=/d --xla_force_host_platform_device_count=8",
    "JAX_PROCESS_ID": "7",
  }
  env = launch.trainer_env(1, 2, "127.0.0.1:999", devices_per_worker=4, base=base)
  assert env["XLA_FLAGS"] == "--xla_dump_to=/d --xla_force_host_platform_device_count=4"
  assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:999"
  assert env["JAX_NUM_PROCESSES"] == "2" and env["JAX_PROCESS_ID"] == "1"
  assert env["JAX_PLATFORMS"] == "cpu" and env["PATH"] == "/bin"
  assert base["JAX_PROCESS_ID"] == "7"  # the base is not modified

  single = launch.trainer_env(0, 1, None, platforms="", base=base)
  assert single["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=1")
  assert not {"JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_PLATFORMS"} & set(single)
  with pytest.raises(ValueError, match="coordinator"):
    launch.trainer_env(0, 2, None, base={})


def test_split_argv():
  own, overrides, extra = launch.split_argv(
    ["launch", "--config=c.py", "--config.num_steps=5", "--config.ps.tier", "memory", "--num_ps=2", "--", "--x", "y"]
  )
  assert own == ["launch", "--config=c.py", "--num_ps=2"]
  assert overrides == ["--config.num_steps=5", "--config.ps.tier", "memory"]
  assert extra == ["--x", "y"]
  assert launch.split_argv(["launch", "--config.progress_bar", "--num_ps=1"]) == (
    ["launch", "--num_ps=1"],
    ["--config.progress_bar"],
    [],
  )


def test_cli_rejects_bad_flags():
  typo = subprocess.run(
    [PY, "-m", "recsys_jax.launch", "--config=c.py", "--num_pss=1"], cwd=ROOT, capture_output=True, text=True
  )
  assert typo.returncode != 0 and "num_pss" in typo.stderr
  no_ps = subprocess.run(
    [PY, "-m", "recsys_jax.launch", "--config=c.py", "--num_ps=0", "--num_workers=2", "--config.num_steps=1"],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert no_ps.returncode != 0 and "--num_ps >= 1" in no_ps.stdout + no_ps.stderr


# --------------------------------------------------------------------------------------
# Supervision with fake children.


def test_output_is_prefixed_whole_lines():
  out = io.StringIO()
  output = launch.Output(out)
  # Each child writes half a line, flushes, then the rest: lines must still come out whole.
  noisy = "import sys\nfor i in range(200):\n  s = sys.stdout if i % 2 else sys.stderr\n"
  noisy += "  s.write('{n}%d ' % i + 'x' * 40); s.flush(); s.write('y' * 40 + '\\n'); s.flush()\n"
  children = [launch.start(n, _py(noisy.format(n=n)), output=output) for n in ("a", "b")]
  children.append(launch.start("c", _py("import sys; sys.stdout.write('no newline at the end')"), output=output))
  outcome = launch.supervise(children)
  assert outcome.code == 0, outcome
  lines = out.getvalue().splitlines()
  for name in ("a", "b"):
    mine = [ln for ln in lines if ln.startswith(f"[{name}] ")]
    assert len(mine) == 200
    assert all(re.fullmatch(rf"\[{name}\] {name}\d+ x{{40}}y{{40}}", ln) for ln in mine), mine[:3]
  assert "[c] no newline at the end" in lines
  assert len(lines) == 401


def test_failure_stops_the_others():
  out = io.StringIO()
  output = launch.Output(out)
  t0 = time.monotonic()
  children = [
    launch.start("ps-0", SLEEPER, service=True, output=output),
    launch.start("worker-0", SLEEPER, output=output),
    launch.start("worker-1", _py("import sys, time; time.sleep(0.3); print('bye'); sys.exit(3)"), output=output),
  ]
  outcome = launch.supervise(children, grace_s=2.0)
  assert time.monotonic() - t0 < 5.0
  assert outcome.code == 1 and outcome.failed == "worker-1"
  assert "worker-1" in outcome.message and "exit code 3" in outcome.message
  assert all(_gone(c) for c in children)
  assert children[0].proc.returncode == children[1].proc.returncode == -signal.SIGTERM
  assert "[worker-1] bye" in out.getvalue()


def test_sigkill_after_grace():
  buf = io.StringIO()
  output = launch.Output(buf)
  stubborn = _py(
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
  )
  s = launch.start("stubborn", stubborn, output=output)
  while "up" not in buf.getvalue():  # SIGTERM is ignored from here on
    time.sleep(0.01)
  bad = launch.start("bad", _py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), output=output)
  t0 = time.monotonic()
  outcome = launch.supervise([s, bad], grace_s=0.5)
  assert outcome.failed == "bad" and "signal SIGKILL" in outcome.message
  assert s.proc.returncode == -signal.SIGKILL
  assert 0.4 < time.monotonic() - t0 < 4.0


def test_success_stops_the_services():
  output = launch.Output(io.StringIO())
  server = launch.start("ps-0", SLEEPER, service=True, output=output)
  workers = [launch.start(f"worker-{i}", _py(f"import time; time.sleep({0.1 * i})"), output=output) for i in range(2)]
  outcome = launch.supervise([server, *workers])
  assert outcome.code == 0 and outcome.failed is None
  assert server.proc.returncode == -signal.SIGTERM
  assert [w.proc.returncode for w in workers] == [0, 0]


def test_service_exit_is_a_failure():
  output = launch.Output(io.StringIO())
  server = launch.start("ps-1", _py("pass"), service=True, output=output)
  worker = launch.start("worker-0", SLEEPER, output=output)
  outcome = launch.supervise([server, worker])
  assert outcome.code == 1 and outcome.failed == "ps-1" and "exit code 0" in outcome.message
  assert _gone(worker)


def test_timeout_and_stop():
  output = launch.Output(io.StringIO())
  c = launch.start("worker-0", SLEEPER, output=output)
  outcome = launch.supervise([c], timeout_s=0.3)
  assert outcome.code == 124 and _gone(c)

  stop = launch.Stop()
  c = launch.start("worker-0", SLEEPER, output=output)
  threading.Timer(0.3, stop.request, args=(signal.SIGTERM,)).start()
  outcome = launch.supervise([c], stop=stop)
  assert outcome.code == 128 + signal.SIGTERM and "SIGTERM" in outcome.message and _gone(c)


def test_wait_ready():
  output = launch.Output(io.StringIO())
  servers = [
    launch.start("ps-0", _py("import time; print('ready 0.0.0.0:4321', flush=True); time.sleep(60)"), output=output),
    launch.start("ps-1", _py("import time; print('ready 10.1.2.3:99'); time.sleep(60)"), output=output),
  ]
  try:
    assert launch.wait_ready(servers, 10.0) == ["127.0.0.1:4321", "10.1.2.3:99"]
  finally:
    launch.terminate(servers)


def test_wait_ready_times_out():
  output = launch.Output(io.StringIO())
  servers = [
    launch.start("ps-0", _py("print('ready 127.0.0.1:1')"), output=output),
    launch.start("ps-1", _py("import time; print('starting', flush=True); time.sleep(60)"), output=output),
  ]
  t0 = time.monotonic()
  with pytest.raises(launch.LaunchError, match=r"ps-1 did not print 'ready host:port' within 0.5 s") as e:
    launch.wait_ready(servers[1:], 0.5)
  assert e.value.name == "ps-1" and time.monotonic() - t0 < 3.0
  launch.terminate(servers)
  assert all(_gone(c) for c in servers)


def test_wait_ready_server_dies():
  buf = io.StringIO()
  output = launch.Output(buf)
  s = launch.start("ps-0", _py("import sys; print('bad flag', file=sys.stderr); sys.exit(2)"), output=output)
  with pytest.raises(launch.LaunchError, match="ps-0 exited with exit code 2 before"):
    launch.wait_ready([s], 10.0)
  launch.terminate([s])
  assert "[ps-0] bad flag" in buf.getvalue()


_FAKE_SERVER = "import sys, time; print(f'ready 127.0.0.1:{sys.argv[1]}', flush=True); time.sleep(60)"
_FAKE_TRAINER = "import os, sys; print(os.environ['JAX_PROCESS_ID'], sys.argv[1])"


def test_launch_with_fake_servers_and_trainers():
  out = io.StringIO()
  servers = [launch.Spec(f"ps-{i}", _py(_FAKE_SERVER) + [str(5000 + i)]) for i in range(2)]

  def workers(addresses):
    return [
      launch.Spec(f"worker-{i}", _py(_FAKE_TRAINER) + [",".join(addresses)], launch.trainer_env(i, 2, "127.0.0.1:1"))
      for i in range(2)
    ]

  outcome = launch.launch(servers, workers, output=launch.Output(out))
  assert outcome.code == 0, out.getvalue()
  lines = out.getvalue().splitlines()
  assert "[launch] servers ready at 127.0.0.1:5000,127.0.0.1:5001" in lines
  assert "[worker-0] 0 127.0.0.1:5000,127.0.0.1:5001" in lines
  assert "[worker-1] 1 127.0.0.1:5000,127.0.0.1:5001" in lines


def test_launch_fails_when_a_server_is_not_ready():
  out = io.StringIO()
  servers = [
    launch.Spec("ps-0", _py("import os; print('pid', os.getpid(), flush=True); " + _FAKE_SERVER) + ["5000"]),
    launch.Spec("ps-1", _py("import time; time.sleep(60)")),
  ]
  started = []

  def workers(addresses):
    started.append(addresses)
    return []

  t0 = time.monotonic()
  outcome = launch.launch(servers, workers, ready_timeout_s=0.5, output=launch.Output(out))
  assert outcome.code == 1 and outcome.failed == "ps-1" and "ready" in outcome.message
  assert not started and time.monotonic() - t0 < 4.0
  pid = int(re.search(r"^\[ps-0\] pid (\d+)$", out.getvalue(), re.M).group(1))
  assert not os.path.exists(f"/proc/{pid}")  # the ready server was stopped too


# --------------------------------------------------------------------------------------
# Restarts (recsys_jax/launch/restarts.py) with fake children. A marker file tells a child whether it
# runs for the first time; the restart lines are checked whole.

_RESTART_LINE = re.compile(r"^\[launch\] (.*); restart (\d+)/(\d+) from the last checkpoint$", re.M)


def _first_time(marker):
  """Python code: True in the first child that runs it (creates ``marker``), False after."""
  return f"(lambda p: not __import__('os').path.exists(p) and not open(p, 'w').close())({str(marker)!r})"


def _fake_server(port, first_time="False", then=""):
  """A fake PS server: prints its ready line and sleeps; ``then`` runs in its first life after ready."""
  code = f"import os, signal, sys, time\nfirst = {first_time}\nprint('ready 127.0.0.1:{port}', flush=True)\n"
  return _py(code + (f"if first:\n  {then}\n" if then else "") + "time.sleep(60)")


def _servers(n=2, special=None):
  """``n`` fake servers; ``special``: {index: _fake_server keyword arguments}."""
  return [launch.Spec(f"ps-{i}", _fake_server(5000 + i, **(special or {}).get(i, {}))) for i in range(n)]


def _fake_workers(code, n=2):
  def make(addresses):
    return [launch.Spec(f"worker-{i}", _py(code)) for i in range(n)]

  return make


def _relaunch(servers, make_workers, **kw):
  out = io.StringIO()
  outcome = launch.launch_with_restarts(servers, make_workers, output=launch.Output(out), **kw)
  return outcome, out.getvalue()


def _starts(text, name):
  return [int(p) for p in re.findall(rf"^\[launch\] started {name} \(pid (\d+)\)", text, re.M)]


def test_a_failing_worker_restarts_the_whole_job(tmp_path):
  first = _first_time(tmp_path / "failed")
  worker = f"import sys, time\nif {first}:\n  time.sleep(0.2); print('lost', flush=True); sys.exit(1)\ntime.sleep(0.3)"
  outcome, text = _relaunch(_servers(), _fake_workers(worker), grace_s=2.0)
  assert outcome.code == 0 and outcome.message == "all 2 workers finished", text
  # Both workers run the same code: the one that made the marker failed.
  loser = re.search(r"^\[(worker-\d)\] lost$", text, re.M)[1]
  assert _RESTART_LINE.findall(text) == [(f"{loser} failed with exit code 1; stopped all processes", "1", "3")], text
  # The whole job again: every child started twice, the first ones all gone.
  for name in ("ps-0", "ps-1", "worker-0", "worker-1"):
    pids = _starts(text, name)
    assert len(pids) == 2 and pids[0] != pids[1] and not running(pids[0]), (name, text)


@pytest.mark.parametrize("when", ["after its ready line", "before its ready line"])
def test_a_killed_server_restarts_the_whole_job(tmp_path, when):
  first = _first_time(tmp_path / "killed")
  if when == "after its ready line":
    servers = _servers(
      special={1: dict(first_time=first, then="time.sleep(0.3); os.kill(os.getpid(), signal.SIGKILL)")}
    )
  else:
    suicide = f"import os, signal, time\nif {first}:\n  os.kill(os.getpid(), signal.SIGKILL)\n"
    servers = [
      *_servers(1),
      launch.Spec("ps-1", _py(suicide + "print('ready 127.0.0.1:5001', flush=True)\ntime.sleep(60)")),
    ]
  outcome, text = _relaunch(servers, _fake_workers("import time; time.sleep(1.0)"), max_restarts=1, grace_s=2.0)
  assert outcome.code == 0, text
  [(what, i, n)] = _RESTART_LINE.findall(text)
  assert what.startswith("ps-1 ") and "signal SIGKILL" in what and (i, n) == ("1", "1"), text
  assert len(_starts(text, "ps-0")) == 2
  # Killed after ready: the workers had started and were stopped; before: they had not started.
  assert len(_starts(text, "worker-0")) == (2 if when == "after its ready line" else 1), text


def test_a_failure_past_the_budget_ends_the_job():
  outcome, text = _relaunch(_servers(), _fake_workers("import sys; sys.exit(1)"), max_restarts=2, grace_s=2.0)
  assert outcome.code == 1 and outcome.failed in ("worker-0", "worker-1"), text
  assert [(i, n) for _, i, n in _RESTART_LINE.findall(text)] == [("1", "2"), ("2", "2")], text
  assert outcome.message.endswith("restart budget spent (2 restarts, --max_restarts)"), outcome.message
  assert len(_starts(text, "ps-0")) == len(_starts(text, "worker-1")) == 3


def test_a_failure_a_restart_would_repeat_is_not_restarted():
  config_error = f"import sys; sys.exit({launch.EXIT_CONFIG})"
  outcome, text = _relaunch(_servers(), _fake_workers(config_error, n=1), grace_s=2.0)
  assert outcome.code == 1 and outcome.failed == "worker-0" and not _RESTART_LINE.findall(text), text
  assert outcome.message.endswith("not restarted: a restart would fail the same way"), outcome.message
  assert f"exit code {launch.EXIT_CONFIG}" in outcome.message
  # A server that exits (not killed) before its ready line: bad flags, token file or port.
  refused = [launch.Spec("ps-0", _py("import sys; sys.exit(1)"))]
  outcome, text = _relaunch(refused, _fake_workers("pass"), grace_s=2.0)
  assert outcome.code == 1 and outcome.failed == "ps-0" and not _RESTART_LINE.findall(text), text
  assert len(_starts(text, "ps-0")) == 1 and "before printing 'ready" in outcome.message


class _StopOnceGone(launch.Stop):
  """A stop request that arrives once the process whose pid is in ``path`` has exited."""

  def __init__(self, path):
    super().__init__()
    self.path = path

  def is_set(self):
    if not super().is_set() and os.path.exists(self.path) and open(self.path).read():
      if not running(int(open(self.path).read())):
        self.request(signal.SIGINT)
    return super().is_set()


def test_a_stop_request_or_the_timeout_never_restarts(tmp_path):
  # SIGTERM to the launcher while the workers run.
  stop = launch.Stop()
  threading.Timer(0.5, stop.request, args=(signal.SIGTERM,)).start()
  outcome, text = _relaunch(_servers(), _fake_workers("import time; time.sleep(60)"), stop=stop, grace_s=2.0)
  assert outcome.code == 128 + signal.SIGTERM and "SIGTERM" in outcome.message, text
  assert not _RESTART_LINE.findall(text) and len(_starts(text, "worker-0")) == 1, text
  # SIGINT arriving just as a worker fails (a terminal's Ctrl-C reaching the whole group): no restart.
  stop = _StopOnceGone(tmp_path / "pid")
  worker = f"import os, sys; open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid())); sys.exit(1)"
  outcome, text = _relaunch([], _fake_workers(worker, n=1), stop=stop, grace_s=2.0)
  assert outcome.code == 128 + signal.SIGINT and not _RESTART_LINE.findall(text), (outcome, text)
  # timeout_s bounds the whole run, restarts included: 2 s in the first attempt leave 1 s to the second.
  first = _first_time(tmp_path / "failed")
  worker = f"import sys, time\nif {first}:\n  time.sleep(2.0); sys.exit(1)\ntime.sleep(60)"
  t0 = time.monotonic()
  outcome, text = _relaunch([], _fake_workers(worker, n=1), timeout_s=3.0, grace_s=2.0)
  took = time.monotonic() - t0
  assert outcome.code == 124 and outcome.message == "timed out after 3 s; stopped all processes", (outcome, text)
  assert len(_RESTART_LINE.findall(text)) == 1 and 3.0 <= took < 4.5, (took, text)


def test_a_trainer_that_exits_0_after_sigterm_is_not_restarted():
  """A trainer told to stop from outside (SIGTERM from Kubernetes or a person, not the launcher)
  saves its final checkpoint and exits 0, as recsys_jax.main does: that is the end of the job, and
  the servers are stopped; one killed by the signal instead is restarted."""
  graceful = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "time.sleep(0.2); os.kill(os.getpid(), signal.SIGTERM); time.sleep(60)"
  )
  outcome, text = _relaunch(_servers(), _fake_workers(graceful, n=1), grace_s=2.0)
  assert outcome.code == 0 and outcome.message == "all 1 workers finished", text
  assert not _RESTART_LINE.findall(text) and len(_starts(text, "ps-0")) == 1, text


def test_max_restarts_must_not_be_negative():
  with pytest.raises(ValueError, match="max_restarts must be >= 0"):
    launch.launch_with_restarts([], _fake_workers("pass"), max_restarts=-1)


_SIGNALLED_LAUNCHER = """
import sys
from recsys_jax import launch
stop = launch.Stop()
launch.install_signal_handlers(stop)
c = launch.start("worker-0", [sys.executable, "-c", "import time; time.sleep(60)"])
print("child", c.proc.pid, flush=True)
outcome = launch.supervise([c], stop=stop)
print(outcome.message, flush=True)
sys.exit(outcome.code)
"""


def test_sigint_to_the_launcher_stops_the_children():
  p = subprocess.Popen(_py(_SIGNALLED_LAUNCHER), cwd=ROOT, stdout=subprocess.PIPE, text=True)
  pid = int(p.stdout.readline().split()[1])
  p.send_signal(signal.SIGINT)
  rest = p.stdout.read()
  assert p.wait(10) == 128 + signal.SIGINT
  assert "interrupted by SIGINT" in rest
  assert not os.path.exists(f"/proc/{pid}")  # stopped and reaped by the launcher


def _kill_left(pids):
  for pid in pids:
    if running(pid):
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass


_KILLED_LAUNCHER = """
import sys
from recsys_jax import launch
sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
children = [launch.start("ps-0", sleep, service=True), launch.start("worker-0", sleep)]
print(*[c.proc.pid for c in children], flush=True)
launch.supervise(children)
"""


def test_children_die_with_a_sigkilled_launcher():
  p = subprocess.Popen(_py(_KILLED_LAUNCHER), cwd=ROOT, stdout=subprocess.PIPE, text=True)
  pids = []
  try:
    pids = [int(x) for x in p.stdout.readline().split()]
    assert len(pids) == 2 and all(running(pid) for pid in pids)
    p.kill()  # SIGKILL: the launcher stops nobody itself
    p.wait(10)
    deadline = time.monotonic() + 5
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
      time.sleep(0.02)
    assert not [pid for pid in pids if running(pid)], "children outlived their launcher"
  finally:
    p.kill()
    p.wait()
    _kill_left(pids)


def test_terminate_continues_a_stopped_child():
  c = launch.start("ps-0", SLEEPER, service=True, output=launch.Output(io.StringIO()))
  os.kill(c.proc.pid, signal.SIGSTOP)
  t0 = time.monotonic()
  try:
    launch.terminate([c], grace_s=5.0)
  finally:
    _kill_left([c.proc.pid])
  # SIGTERM with SIGCONT: it ends by SIGTERM at once, not by SIGKILL after the grace period.
  assert c.proc.returncode == -signal.SIGTERM and time.monotonic() - t0 < 3.0


def test_job_token_file(tmp_path):
  with launch.job_token_file() as path:
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    token = open(path).read().strip()
    assert len(token) >= 32 and token.isalnum()
    with launch.job_token_file() as other:
      assert open(other).read().strip() != token
  assert not os.path.exists(os.path.dirname(path))


_TOKEN_HOLDER = """
import time
from recsys_jax import launch
with launch.job_token_file() as path:
  print(path, flush=True)
  time.sleep(120)
"""


def test_a_sigkilled_launchers_token_directory_is_removed_by_the_next_launcher(tmp_path, monkeypatch):
  """A SIGKILLed launcher cannot remove its token directory; the next one removes the directories
  of launchers that are gone (this user's only) and leaves a running launcher's alone."""
  import tempfile

  env = dict(os.environ, TMPDIR=str(tmp_path))
  killed = subprocess.Popen(_py(_TOKEN_HOLDER), cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
  alive = subprocess.Popen(_py(_TOKEN_HOLDER), cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
  try:
    killed_dir = os.path.dirname(killed.stdout.readline().strip())
    alive_dir = os.path.dirname(alive.stdout.readline().strip())
    assert os.path.dirname(killed_dir) == str(tmp_path) and os.path.isdir(killed_dir)
    killed.kill()
    killed.wait(10)
    assert os.path.isdir(killed_dir)  # what a SIGKILL leaves
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with launch.job_token_file() as path:
      assert not os.path.exists(killed_dir)
      assert os.path.isdir(alive_dir)
    assert not os.path.exists(os.path.dirname(path))
  finally:
    for p in (killed, alive):
      p.kill()
      p.wait()


def test_cli_rejects_noauth_with_a_token_file():
  p = subprocess.run(
    [PY, "-m", "recsys_jax.launch", "--config=c.py", "--noauth", "--token_file=/t"],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert p.returncode != 0 and "--noauth and --token_file" in p.stdout + p.stderr


# --------------------------------------------------------------------------------------
# Kubernetes manifests.


def _docs(name):
  with open(os.path.join(K8S, name)) as f:
    return {d["kind"]: d for d in yaml.safe_load_all(f) if d}


PS = _docs("ps-statefulset.yaml")
TRAINER = _docs("trainer-job.yaml")


def _pod(doc):
  return doc["spec"]["template"]["spec"]


def _container(doc, name):
  return next(c for c in _pod(doc)["containers"] if c["name"] == name)


def _words(container):
  """The container's command line as words; a ``sh -c`` script is split as the shell would."""
  argv = [*container.get("command", []), *container.get("args", [])]
  if argv[:2] == ["sh", "-c"]:
    return shlex.split(argv[2].replace("exec ", "", 1))
  return argv


def _module(words):
  return words[words.index("-m") + 1]


def _flag(words, name):
  values = [w.split("=", 1)[1] for w in words if w.startswith(f"--{name}=")]
  assert len(values) == 1, (name, words)
  return values[0]


def _env(container):
  return {e["name"]: e for e in container.get("env", [])}


SERVER = _container(PS["StatefulSet"], "ps")
TRAINER_C = _container(TRAINER["Job"], "trainer")


def test_manifests_parse():
  assert set(PS) == {"Service", "PersistentVolumeClaim", "StatefulSet"}
  assert set(TRAINER) == {"Service", "Job"}
  for doc in [*PS.values(), *TRAINER.values()]:
    assert doc["metadata"]["name"]


@pytest.mark.parametrize("container", [SERVER, TRAINER_C], ids=["ps", "trainer"])
def test_container_modules_exist(container):
  module = _module(_words(container))
  assert importlib.util.find_spec(module) is not None, f"{module} (run by the manifests) is not in the repository"


def _defined_flags(module):
  # --helpfull lists every flag the module defines, also those defined only under __main__.
  p = subprocess.run([PY, "-m", module, "--helpfull"], cwd=ROOT, capture_output=True, text=True, timeout=60)
  return set(re.findall(r"^\s+--(?:\[no\])?([A-Za-z0-9_]+):", p.stdout + p.stderr, re.M))


def test_container_flags_are_defined():
  containers = [SERVER, TRAINER_C]
  modules = [_module(_words(c)) for c in containers]
  for container, module in zip(containers, modules):
    words = _words(container)
    passed = {w[2:].split("=", 1)[0].split(".", 1)[0] for w in words[words.index("-m") + 2 :]}
    missing = passed - _defined_flags(module)
    assert not missing, f"{module} does not define {sorted(missing)}"


def test_trainer_config_overrides_exist():
  from configs import dlrm

  words = _words(TRAINER_C)
  assert _flag(words, "config") == "configs/dlrm.py" and os.path.exists(os.path.join(ROOT, "configs", "dlrm.py"))
  config = dlrm.get_config()
  missing = []
  for w in words:
    if w.startswith("--config."):
      path = w[len("--config.") :].split("=", 1)[0]
      node = config
      for part in path.split("."):
        if part not in node:
          missing.append(path)
          break
        node = node[part]
  assert not missing, f"configs/dlrm.py has no {missing}"


def test_trainer_job_env_matches_the_job():
  job, svc = TRAINER["Job"], TRAINER["Service"]
  env = _env(TRAINER_C)
  assert job["spec"]["completionMode"] == "Indexed"
  n = int(env["JAX_NUM_PROCESSES"]["value"])
  assert job["spec"]["completions"] == job["spec"]["parallelism"] == n
  ref = env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
  assert ref == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
  # Process 0's stable name: <job>-0.<subdomain>, the subdomain being the headless Service.
  host, port = env["JAX_COORDINATOR_ADDRESS"]["value"].rsplit(":", 1)
  assert svc["spec"]["clusterIP"] == "None" and _pod(job)["subdomain"] == svc["metadata"]["name"]
  assert host == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
  assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
  assert int(port) in [p["containerPort"] for p in TRAINER_C["ports"]]
  labels = job["spec"]["template"]["metadata"]["labels"]
  assert svc["spec"]["selector"].items() <= labels.items()
  assert _pod(job)["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] > 0


def test_ps_addresses_match_the_statefulset():
  sts, svc = PS["StatefulSet"], PS["Service"]
  server = _words(SERVER)
  port = int(_flag(server, "port"))
  replicas = sts["spec"]["replicas"]
  assert int(_flag(server, "num_shards")) == replicas
  assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
  assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
  assert [p["port"] for p in svc["spec"]["ports"]] == [port]
  assert SERVER["readinessProbe"]["tcpSocket"]["port"] == port
  expected = [f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:{port}" for i in range(replicas)]
  assert _flag(_words(TRAINER_C), "config.ps.addresses").split(",") == expected
  wait = next(c for c in _pod(TRAINER["Job"])["initContainers"] if c["name"] == "wait-for-ps")
  assert wait["args"][-1].split(",") == expected


def test_shard_index_is_the_pod_ordinal(tmp_path):
  # Run the server container's shell script with a fake `python` that prints its arguments.
  fake = tmp_path / "python"
  fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
  fake.chmod(0o755)
  argv = [*SERVER["command"], *SERVER["args"]]
  env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", HOSTNAME="ps-1")
  words = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.split()
  assert "--shard_index=1" in words and "--host=0.0.0.0" in words


def test_volumes_and_security():
  for doc, container in ((PS["StatefulSet"], SERVER), (TRAINER["Job"], TRAINER_C)):
    volumes = {v["name"]: v for v in _pod(doc)["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    words = _words(container)
    token = _flag(words, "token_file" if container is SERVER else "config.ps.token_file")
    assert mounts[os.path.dirname(token)]["secret"]["secretName"] == "ps-token"
    # Trainers and servers mount the shared PVC at the same path: trainers name snapshot dirs.
    assert mounts["/workdir"]["persistentVolumeClaim"]["claimName"] == PS["PersistentVolumeClaim"]["metadata"]["name"]
    assert container["image"] == "recsys-jax:latest"
    pod_sc = _pod(doc)["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    for c in [*_pod(doc).get("initContainers", []), *_pod(doc)["containers"]]:
      sc = c["securityContext"]
      assert not sc.get("privileged") and sc["allowPrivilegeEscalation"] is False
  assert _flag(_words(TRAINER_C), "workdir").startswith("/workdir/")
  assert "ReadWriteMany" in PS["PersistentVolumeClaim"]["spec"]["accessModes"]


def test_wait_for_ps_init_container():
  wait = next(c for c in _pod(TRAINER["Job"])["initContainers"] if c["name"] == "wait-for-ps")
  assert wait["command"] == ["python", "-c"]
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    address = f"127.0.0.1:{s.getsockname()[1]}"
    p = subprocess.run([PY, "-c", wait["args"][0], f"{address},{address}"], capture_output=True, timeout=20)
  assert p.returncode == 0, p.stderr
