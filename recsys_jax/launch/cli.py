"""Runs a whole parameter-server job on one machine: PS shard servers plus JAX trainer processes.

    python -m recsys_jax.launch --config=configs/dlrm.py --num_ps=2 --num_workers=2 \\
        [--workdir=DIR] [--devices_per_worker=1] [--config.num_steps=100] [-- extra trainer args]

Everything talks over loopback. The launcher starts ``num_ps`` servers
(``python -m recsys_jax.async_ps.server``), waits for each one's ``ready host:port`` line, then
starts ``num_workers`` trainers (``python -m recsys_jax.main``) as one multi-process JAX job
(``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) pointed at the servers
with ``--config.ps.kind=remote --config.ps.addresses=...``, all sharing ``--workdir``. Every
line a child prints is echoed on stdout behind ``[ps-0] ``, ``[worker-1] `` etc.

Arguments of the form ``--config.<field>=<value>`` are not launcher flags: they are forwarded
verbatim to every trainer (the trainer's ``config_flags`` validates them), as is everything after
``--``. The launcher's own flags are parsed strictly, so a typo there is an error.

The servers demand a bearer token: by default the launcher writes a fresh random one for the job
to a file only the user can read (mode 0600, in a private temporary directory removed when the
launcher exits, or, if it was SIGKILLed, by the next launcher) and passes it to the servers (``--token_file``) and the trainers
(``--config.ps.token_file``); ``--token_file`` names your own instead, ``--noauth`` runs without.
The children die with the launcher, even when it is SIGKILLed (``recsys_jax/launch/supervisor.py``).

If any child exits non-zero or dies by a signal (or a server exits at all while the trainers
run), the launcher stops all the others (SIGTERM, then SIGKILL after ``--grace_s``). Up to
``--max_restarts`` times it then starts the whole job again (fresh servers on fresh ports, fresh
trainers, same token and workdir: the trainers resume from the last checkpoint and restore the
servers from its PS snapshot), saying so in a line ``... restart i/N from the last checkpoint``.
A failure a restart would repeat is not restarted (a trainer's exit status 2: bad flags, config or
workdir; the rule is in ``recsys_jax/launch/restarts.py``). Otherwise the launcher exits 1 with a last
line naming the process and how it ended; ``--timeout_s`` (the whole run, restarts included)
gives 124, SIGINT or SIGTERM to the launcher 128 + the signal, never a restart. When every trainer
succeeds the servers are stopped and the launcher exits 0.

This module is the command line: its flags, and ``ps_argv``, ``trainer_argv`` and ``trainer_env``,
pure functions that build the real children's command lines. The process handling (``start``,
``wait_ready``, ``supervise``, ``launch``) is in ``recsys_jax/launch/supervisor.py``, the restarts in
``recsys_jax/launch/restarts.py``, both re-exported here; they take plain argv lists, so tests drive them
with fake children.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
from typing import Iterator, Mapping, Sequence

from absl import app, flags

from recsys_jax.launch.restarts import DEFAULT_MAX_RESTARTS, launch_with_restarts
from recsys_jax.launch.supervisor import (
  EXIT_CONFIG,
  LAUNCHER,
  Child,
  LaunchError,
  Outcome,
  Output,
  Spec,
  Stop,
  describe_exit,
  install_signal_handlers,
  launch,
  start,
  supervise,
  terminate,
  wait_ready,
)

# The process handling lives in recsys_jax/launch/supervisor.py; callers import it from here as before.
__all__ = [
  "Child",
  "DEFAULT_MAX_RESTARTS",
  "EXIT_CONFIG",
  "LAUNCHER",
  "LaunchError",
  "Outcome",
  "Output",
  "PS_MODULE",
  "Spec",
  "Stop",
  "TRAINER_MODULE",
  "describe_exit",
  "free_port",
  "install_signal_handlers",
  "job_token_file",
  "launch",
  "launch_with_restarts",
  "main",
  "ps_argv",
  "split_argv",
  "start",
  "supervise",
  "terminate",
  "trainer_argv",
  "trainer_env",
  "wait_ready",
  "with_device_count",
]

PS_MODULE = "recsys_jax.async_ps.server"
TRAINER_MODULE = "recsys_jax.main"

_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def free_port(host: str = "127.0.0.1") -> int:
  """Returns a TCP port that was free a moment ago (the OS picks it).

  Args:
    host: the interface to probe.

  Returns:
    The port number.
  """
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def ps_argv(
  shard_index: int,
  num_shards: int,
  *,
  port: int = 0,
  host: str = "127.0.0.1",
  token_file: str = "",
  python: str = sys.executable,
) -> list[str]:
  """The command line of one PS shard server.

  Args:
    shard_index: this server's shard, 0 .. num_shards - 1.
    num_shards: how many servers there are.
    port: the port to serve on (0: the server picks a free one and reports it).
    host: the interface to bind.
    token_file: a file with the shared token the server demands ('' = none).
    python: the interpreter.

  Returns:
    The argv list.
  """
  argv = [python, "-m", PS_MODULE, f"--port={port}", f"--host={host}"]
  argv += [f"--shard_index={shard_index}", f"--num_shards={num_shards}"]
  if token_file:
    argv.append(f"--token_file={token_file}")
  return argv


def trainer_argv(
  config: str,
  workdir: str,
  ps_addresses: Sequence[str],
  *,
  overrides: Sequence[str] = (),
  extra: Sequence[str] = (),
  token_file: str = "",
  python: str = sys.executable,
) -> list[str]:
  """The command line of one trainer process (the same for every process of the job).

  Args:
    config: the config file argument (``--config``), forwarded as is.
    workdir: the run directory shared by all trainers.
    ps_addresses: ``host:port`` of the PS servers in shard order; empty: the trainer keeps its
      in-process PS (no ``ps.*`` overrides are added).
    overrides: ``--config.<field>=<value>`` arguments, forwarded before the launcher's own ``ps``
      overrides (so the addresses the launcher found win).
    extra: further trainer arguments, appended last.
    token_file: the PS token file ('' = none), as ``--config.ps.token_file``.
    python: the interpreter.

  Returns:
    The argv list.
  """
  argv = [python, "-m", TRAINER_MODULE, f"--config={config}", f"--workdir={workdir}", *overrides]
  if ps_addresses:
    argv += ["--config.ps.kind=remote", f"--config.ps.addresses={','.join(ps_addresses)}"]
  if token_file:
    argv.append(f"--config.ps.token_file={token_file}")
  return argv + list(extra)


def with_device_count(xla_flags: str, count: int) -> str:
  """Sets the simulated host device count in an ``XLA_FLAGS`` string, keeping the other flags.

  Args:
    xla_flags: the existing value (may be empty).
    count: devices per process.

  Returns:
    The new value.
  """
  kept = [f for f in xla_flags.split() if not f.startswith(_DEVICE_COUNT)]
  return " ".join([*kept, f"{_DEVICE_COUNT}={count}"])


def trainer_env(
  process_id: int,
  num_processes: int,
  coordinator_address: str | None,
  *,
  devices_per_worker: int = 1,
  platforms: str = "cpu",
  base: Mapping[str, str] | None = None,
) -> dict[str, str]:
  """The environment of one trainer process.

  Args:
    process_id: this process's rank in the JAX job.
    num_processes: processes in the job; with 1 no ``JAX_*`` distributed variables are set.
    coordinator_address: ``host:port`` of process 0's coordinator (unused with one process).
    devices_per_worker: host devices each process simulates (``XLA_FLAGS``).
    platforms: ``JAX_PLATFORMS`` ('' keeps the base environment's). 'cpu' keeps several trainers
      on one machine from all claiming the same accelerator.
    base: the environment to extend (default: the launcher's).

  Returns:
    The full environment.
  """
  env = dict(os.environ if base is None else base)
  env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), devices_per_worker)
  if platforms:
    env["JAX_PLATFORMS"] = platforms
  for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(key, None)
  if num_processes > 1:
    if not coordinator_address:
      raise ValueError("several trainer processes need a coordinator address")
    env["JAX_COORDINATOR_ADDRESS"] = coordinator_address
    env["JAX_NUM_PROCESSES"] = str(num_processes)
    env["JAX_PROCESS_ID"] = str(process_id)
  return env


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
  """Separates the launcher's own arguments from those forwarded to the trainers.

  Args:
    argv: the full command line, program name first.

  Returns:
    (the launcher's argv with program name, the ``--config.<field>`` overrides, the arguments
    after ``--``). An override without ``=`` takes the next argument as its value unless that
    starts with '-' (a boolean written ``--config.flag``).
  """
  argv = list(argv)
  extra: list[str] = []
  if "--" in argv[1:]:
    i = argv.index("--", 1)
    argv, extra = argv[:i], argv[i + 1 :]
  own, overrides = argv[:1], []
  i = 1
  while i < len(argv):
    arg = argv[i]
    if arg.startswith(("--config.", "-config.")):
      overrides.append(arg)
      if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
        overrides.append(argv[i + 1])
        i += 1
    else:
      own.append(arg)
    i += 1
  return own, overrides, extra


_CONFIG = flags.DEFINE_string("config", None, "Trainer config file, forwarded to every trainer as --config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory shared by the trainers (default: runs/<config name>).")
_NUM_PS = flags.DEFINE_integer("num_ps", 2, "PS shard servers (0: in-process PS; one worker only).", lower_bound=0)
_NUM_WORKERS = flags.DEFINE_integer("num_workers", 2, "Trainer processes (one JAX job).", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices_per_worker", 1, "Host devices each trainer simulates.", lower_bound=1)
_BASE_PORT = flags.DEFINE_integer(
  "base_port",
  0,
  "0: servers and coordinator pick free ports. Else server i listens on base_port + i and the "
  "coordinator on base_port + num_ps.",
  lower_bound=0,
)
_TIMEOUT = flags.DEFINE_float(
  "timeout_s", 0.0, "Wall-clock limit of the run in seconds, restarts included (0: none); exit 124."
)
_MAX_RESTARTS = flags.DEFINE_integer(
  "max_restarts",
  DEFAULT_MAX_RESTARTS,
  "Times a failed job is started again from its last checkpoint (0: the first failure ends it). "
  "Never after SIGINT/SIGTERM, --timeout_s or a failure a restart would repeat (exit status 2).",
  lower_bound=0,
)
_READY_TIMEOUT = flags.DEFINE_float("ready_timeout_s", 120.0, "Seconds the servers have to print their ready line.")
_GRACE = flags.DEFINE_float("grace_s", 10.0, "Seconds between SIGTERM and SIGKILL when stopping children.")
_PLATFORMS = flags.DEFINE_string("platforms", "cpu", "JAX_PLATFORMS of the trainers ('': keep the environment's).")
_TOKEN_FILE = flags.DEFINE_string(
  "token_file",
  "",
  "Shared PS token file: servers' --token_file and trainers' --config.ps.token_file "
  "('': the launcher writes a random token for the job, readable only by you).",
)
_AUTH = flags.DEFINE_bool(
  "auth", True, "Servers demand a token (--token_file, or a random one). --noauth: any local process may call them."
)


_TOKEN_NAME = "ps-token"
_TOKEN_DIR = re.compile(r"^recsys_jax-launch-(\d+)-")


def _running(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def _remove_stale_token_dirs() -> None:
  """Removes the token directories of this user's launchers that are gone (a SIGKILLed launcher
  cannot remove its own); their pid is in the name. A running launcher's is left alone."""
  root = tempfile.gettempdir()  # one it can write to, so it can list it too
  for name in os.listdir(root):
    m = _TOKEN_DIR.match(name)
    path = os.path.join(root, name)
    try:
      mine = m is not None and os.lstat(path).st_uid == os.getuid() and os.path.isdir(path)
    except OSError:
      continue
    if mine and not _running(int(m[1])):
      shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def job_token_file() -> Iterator[str]:
  """A fresh random token in a file only this user can read, removed on exit (a normal one, or by
  SIGINT or SIGTERM, which the launcher turns into one). A launcher killed outright leaves its
  directory, which the next launcher removes.

  Yields:
    The path of the file (mode 0600, in a new mode 0700 temporary directory).
  """
  _remove_stale_token_dirs()
  directory = tempfile.mkdtemp(prefix=f"recsys_jax-launch-{os.getpid()}-")
  try:
    path = os.path.join(directory, _TOKEN_NAME)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
      f.write(secrets.token_hex(32) + "\n")
    yield path
  finally:
    shutil.rmtree(directory, ignore_errors=True)


def _parse_flags(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
  own, overrides, extra = split_argv(argv)
  rest = app.parse_flags_with_usage(own)
  return rest, overrides, extra


def _default_workdir(config: str) -> str:
  # The trainer's own default (recsys_jax/main.py), made absolute so every process agrees.
  name = os.path.splitext(os.path.basename(config.split(":", 1)[0]))[0]
  return os.path.join("runs", name)


def main(parsed: tuple[list[str], list[str], list[str]]) -> int:
  """Builds the servers' and trainers' command lines from the flags and runs them.

  Args:
    parsed: (remaining launcher argv, config overrides, extra trainer args) from ``_parse_flags``.

  Returns:
    The exit status (see ``supervise``).
  """
  rest, overrides, extra = parsed
  if len(rest) > 1:
    raise app.UsageError(f"unexpected arguments: {rest[1:]} (trainer arguments go after --)")
  num_ps, num_workers = _NUM_PS.value, _NUM_WORKERS.value
  if num_ps == 0 and num_workers > 1:
    # Each trainer would train its own in-process embeddings; the trainer refuses it too, later.
    raise app.UsageError("several workers need PS servers (--num_ps >= 1)")
  workdir = os.path.abspath(_WORKDIR.value or _default_workdir(_CONFIG.value))
  if not _AUTH.value and _TOKEN_FILE.value:
    raise app.UsageError("--noauth and --token_file contradict each other")
  job = (num_ps, num_workers, workdir)
  if _AUTH.value and num_ps and not _TOKEN_FILE.value:
    with job_token_file() as token_file:
      return _run(*job, token_file, overrides, extra)
  return _run(*job, _TOKEN_FILE.value, overrides, extra)


def _run(
  num_ps: int,
  num_workers: int,
  workdir: str,
  token_file: str,
  overrides: list[str],
  extra: list[str],
) -> int:
  """Runs the job with the token file ``token_file`` ('' = none); returns the exit status."""
  base = _BASE_PORT.value
  servers = [
    Spec(f"ps-{i}", ps_argv(i, num_ps, port=base + i if base else 0, token_file=token_file)) for i in range(num_ps)
  ]

  stop = Stop()
  install_signal_handlers(stop)
  output = Output()

  def workers(addresses: list[str]) -> list[Spec]:
    # Called again for each restart: a fresh coordinator port, as the servers get fresh ones.
    coordinator = None
    if num_workers > 1:
      coordinator = f"127.0.0.1:{base + num_ps if base else free_port()}"
      output.write(LAUNCHER, f"coordinator: {coordinator}")
    argv = trainer_argv(_CONFIG.value, workdir, addresses, overrides=overrides, extra=extra, token_file=token_file)
    return [
      Spec(
        f"worker-{i}",
        argv,
        trainer_env(i, num_workers, coordinator, devices_per_worker=_DEVICES.value, platforms=_PLATFORMS.value),
      )
      for i in range(num_workers)
    ]

  output.write(LAUNCHER, f"workdir: {workdir}")
  if num_ps:
    output.write(LAUNCHER, f"PS token: {token_file}" if token_file else "PS servers without a token (--noauth)")
  outcome = launch_with_restarts(
    servers,
    workers,
    max_restarts=_MAX_RESTARTS.value,
    ready_timeout_s=_READY_TIMEOUT.value,
    timeout_s=_TIMEOUT.value,
    grace_s=_GRACE.value,
    stop=stop,
    output=output,
  )
  output.write(LAUNCHER, outcome.message)
  return outcome.code


def run() -> None:
  """The command line: ``python -m recsys_jax.launch`` (``__main__``)."""
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=_parse_flags)
