"""Process supervision for the launcher: starts children, echoes their output, stops them all.

Each child runs in its own session (process group) and every line it prints is echoed on stdout
behind ``[ps-0] ``, ``[worker-1] `` etc., whole lines under one lock (``Output``). Server children
(``service``) report ``ready host:port`` on stdout (``wait_ready``) and must run until stopped.

``supervise`` waits for the workers; the first child to exit non-zero or by a signal (or a server
to exit at all) makes it stop all the others (SIGTERM, then SIGKILL after ``grace_s``) and return
an ``Outcome`` naming it and saying whether a restart may help (``restartable``: not after a
child's ``EXIT_CONFIG``). ``launch`` is the whole sequence: servers, their addresses, workers,
supervision; ``recsys_jax.launch.restarts`` runs it again after a failure. Whatever ends a launch, every child is stopped before it returns; SIGINT and SIGTERM
to the launcher only request that (``Stop``, ``install_signal_handlers``). A launcher killed
outright (SIGKILL, a crash) cannot stop anyone, so on Linux each child asks the kernel to SIGKILL
it when the launcher dies (``PR_SET_PDEATHSIG``): no server or trainer outlives its launcher.

Everything here takes plain argv lists, so tests drive it with fake children; the real command
lines and the launcher's flags are in ``recsys_jax.launch``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Mapping, NamedTuple, Sequence

LAUNCHER = "launch"  # prefix of the launcher's own lines

# A child's exit status for a failure that a restart would repeat: bad flags or config, a workdir whose
# checkpoints do not fit the job or cannot be read, a NaN loss (recsys_jax/main.py). argparse and
# the shells use 2 for usage errors too; absl's 1 is what an uncaught exception gives.
EXIT_CONFIG = 2

_READY = re.compile(r"^ready (\S+):(\d+)\s*$")
# Addresses a server may report when it binds every interface; clients on this machine use loopback.
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


class LaunchError(RuntimeError):
  """A child could not be started or made ready; ``name`` is that child, ``code`` the exit status.

  ``restartable``: whether starting again may help (a server killed by a signal, not one that
  refused its flags).
  """

  def __init__(self, message: str, name: str | None = None, code: int = 1, restartable: bool = False):
    super().__init__(message)
    self.name = name
    self.code = code
    self.restartable = restartable


class Stop(threading.Event):
  """Set by the launcher's SIGINT/SIGTERM handler; the waiting loops poll it."""

  signum: int = signal.SIGINT

  def request(self, signum: int) -> None:
    self.signum = signum
    self.set()


class Spec(NamedTuple):
  """A child to start: its name (the output prefix), command line and full environment (None: inherit)."""

  name: str
  argv: list[str]
  env: Mapping[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
  """How a launch ended: the launcher's exit status, a one-line message, the child to blame (if any).

  ``restartable``: a child failed in a way that starting the job again may mend (see ``supervise``).
  """

  code: int
  message: str
  failed: str | None = None
  restartable: bool = False


class Output:
  """Writes whole lines under one lock, so lines of different children never interleave."""

  def __init__(self, stream: IO[str] | None = None):
    self._stream = stream
    self._lock = threading.Lock()

  def write(self, name: str, text: str) -> None:
    """Writes ``[name] text`` as one line and flushes it.

    Args:
      name: the prefix, without brackets.
      text: the line, without its newline.
    """
    # sys.stdout is looked up per line: pytest and callers may swap it after construction.
    stream = self._stream or sys.stdout
    with self._lock:
      stream.write(f"[{name}] {text}\n")
      stream.flush()


@dataclasses.dataclass
class Child:
  """A started child process and the threads that echo its output.

  ``service`` children (the PS servers) are expected to run until stopped, so their exiting at all
  is a failure; the others (the trainers) are done when they exit 0. ``address`` is the
  ``host:port`` of its ``ready`` line once ``ready`` is set.
  """

  name: str
  proc: subprocess.Popen
  service: bool = False
  address: str | None = None
  ready: threading.Event = dataclasses.field(default_factory=threading.Event)
  readers: list[threading.Thread] = dataclasses.field(default_factory=list)


def describe_exit(code: int) -> str:
  """Says how a process ended, from a Popen return code.

  Args:
    code: ``Popen.returncode``; negative for death by a signal.

  Returns:
    'exit code 3' or 'signal SIGKILL'.
  """
  if code >= 0:
    return f"exit code {code}"
  try:
    return f"signal {signal.Signals(-code).name}"
  except ValueError:
    return f"signal {-code}"


_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
  if not sys.platform.startswith("linux"):
    return None
  try:
    return ctypes.CDLL(None).prctl  # the C library the interpreter is linked with
  except (OSError, AttributeError):
    return None


# Looked up once, in the launcher: the child runs only this between fork and exec.
_PRCTL = _prctl()


def _die_with(parent: int) -> Callable[[], None] | None:
  """What a child runs before exec so that the kernel SIGKILLs it once ``parent`` dies."""
  prctl = _PRCTL
  if prctl is None:
    return None

  def preexec() -> None:
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # the launcher died before the request took effect
      os.kill(os.getpid(), signal.SIGKILL)

  return preexec


def _local_address(host: str, port: str) -> str:
  return f"{'127.0.0.1' if host in _WILDCARD_HOSTS else host}:{port}"


def _pump(child: Child, pipe: IO[bytes], output: Output, watch_ready: bool) -> None:
  # Bytes, decoded per line: a child's bad UTF-8 must not kill the thread and stall its pipe.
  try:
    for raw in iter(pipe.readline, b""):
      line = raw.decode("utf-8", "replace").rstrip("\r\n")
      if watch_ready and not child.ready.is_set():
        m = _READY.match(line)
        if m:
          child.address = _local_address(m.group(1), m.group(2))
          child.ready.set()
      output.write(child.name, line)
  finally:
    pipe.close()


def start(
  name: str,
  argv: Sequence[str],
  env: Mapping[str, str] | None = None,
  *,
  service: bool = False,
  output: Output | None = None,
) -> Child:
  """Starts a child in its own process group, with threads echoing its stdout and stderr.

  Args:
    name: the child's name, used as its output prefix and in error messages.
    argv: the command line.
    env: the full environment (None: the launcher's). ``PYTHONUNBUFFERED=1`` is added unless set,
      so Python children's lines (and a server's ready line) arrive as they are printed.
    service: whether the child runs until stopped (see ``Child``).
    output: where lines go (default: stdout).

  Returns:
    The running child. On Linux it is SIGKILLed when the thread that started it ends (the
    kernel ties ``PR_SET_PDEATHSIG`` to that thread): call this from a thread that lives as long
    as the child, as the launcher's main thread does.
  """
  env = dict(os.environ if env is None else env)
  env.setdefault("PYTHONUNBUFFERED", "1")
  # Own session: signals go to the child's whole process group (trainers may fork helpers), and a
  # Ctrl-C in the terminal reaches only the launcher, which then stops everyone in order.
  proc = subprocess.Popen(
    list(argv),
    env=env,
    stdin=subprocess.DEVNULL,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    start_new_session=True,
    preexec_fn=_die_with(os.getpid()),
  )
  child = Child(name=name, proc=proc, service=service)
  output = output or Output()
  for pipe, watch in ((proc.stdout, True), (proc.stderr, False)):
    t = threading.Thread(target=_pump, args=(child, pipe, output, watch), name=f"pump-{name}", daemon=True)
    t.start()
    child.readers.append(t)
  return child


def _signal(child: Child, signum: int) -> None:
  # Only children not yet reaped are signalled: a reaped pid (and its group id) may be reused.
  if child.proc.poll() is not None:
    return
  # A stopped child (SIGSTOP, a debugger) acts on SIGTERM only once continued.
  for sig in (signum, signal.SIGCONT) if signum == signal.SIGTERM else (signum,):
    try:
      os.killpg(child.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
      try:
        child.proc.send_signal(sig)
      except ProcessLookupError:
        pass


def terminate(children: Sequence[Child], grace_s: float = 10.0) -> None:
  """Stops every child still running: SIGTERM, then SIGKILL after ``grace_s``; waits for their output.

  Args:
    children: the children (finished ones are skipped).
    grace_s: seconds between SIGTERM and SIGKILL.
  """
  live = [c for c in children if c.proc.poll() is None]
  for c in live:
    _signal(c, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  for c in live:
    try:
      c.proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass
  for c in live:
    if c.proc.poll() is None:
      _signal(c, signal.SIGKILL)
      c.proc.wait()
  # A grandchild that left the process group may hold a pipe open; do not wait on it for long.
  for c in children:
    for t in c.readers:
      t.join(timeout=1.0)


def interrupted(stop: Stop) -> str:
  """The launcher's last line when SIGINT or SIGTERM stopped it."""
  return f"interrupted by {signal.Signals(stop.signum).name}; stopped all processes"


def wait_ready(children: Sequence[Child], timeout_s: float, *, stop: Stop | None = None) -> list[str]:
  """Waits until every child has printed ``ready host:port``.

  Args:
    children: the servers, all started.
    timeout_s: the deadline for all of them together, in seconds.
    stop: when set, give up at once.

  Returns:
    Their ``host:port`` addresses, in the order of ``children`` (wildcard hosts become 127.0.0.1).

  Raises:
    LaunchError: a child exited first, the deadline passed, or ``stop`` was set. The caller stops
      the children.
  """
  deadline = time.monotonic() + timeout_s
  while True:
    pending = [c for c in children if not c.ready.is_set()]
    if not pending:
      return [c.address for c in children]
    for c in pending:
      code = c.proc.poll()
      # The ready line may still be in the pipe when the process is gone.
      if code is not None and not c.ready.wait(0.2):
        # A server's start is its flags, its token file and a port: an exit there would repeat.
        message = f"{c.name} exited with {describe_exit(code)} before printing 'ready host:port'"
        raise LaunchError(message, c.name, restartable=code < 0)
    if stop is not None and stop.is_set():
      raise LaunchError(interrupted(stop), code=128 + stop.signum)
    if time.monotonic() > deadline:
      names = ", ".join(c.name for c in pending)
      raise LaunchError(f"{names} did not print 'ready host:port' within {timeout_s:g} s", pending[0].name)
    time.sleep(0.02)


def supervise(
  children: Sequence[Child],
  *,
  timeout_s: float = 0.0,
  grace_s: float = 10.0,
  stop: Stop | None = None,
  poll_s: float = 0.05,
) -> Outcome:
  """Waits for the non-service children to finish, then stops the rest; stops all at the first failure.

  A failure is any child exiting non-zero or by a signal, or a service child exiting at all; it is
  ``restartable`` unless the child exited with ``EXIT_CONFIG``. Whatever happens, every child is
  stopped (``terminate``) before this returns.

  Args:
    children: the running children.
    timeout_s: wall-clock limit in seconds (0: none).
    grace_s: seconds between SIGTERM and SIGKILL when stopping children.
    stop: when set (the launcher got SIGINT/SIGTERM), stop everything.
    poll_s: seconds between checks.

  Returns:
    Code 0 when every non-service child exited 0; 1 naming the first failed child; 124 on
    timeout; 128 + signal when stopped.
  """
  deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
  workers = [c for c in children if not c.service]
  try:
    while True:
      for c in children:
        code = c.proc.poll()
        if code is None or (code == 0 and not c.service):
          continue
        if code == 0:
          message = f"{c.name} exited (exit code 0) while the workers were running; stopped all processes"
          return Outcome(1, message, c.name, restartable=True)
        message = f"{c.name} failed with {describe_exit(code)}; stopped all processes"
        return Outcome(1, message, c.name, restartable=code != EXIT_CONFIG)
      if all(c.proc.returncode == 0 for c in workers):
        return Outcome(0, f"all {len(workers)} workers finished")
      if stop is not None and stop.is_set():
        return Outcome(128 + stop.signum, interrupted(stop))
      if deadline is not None and time.monotonic() > deadline:
        return Outcome(124, f"timed out after {timeout_s:g} s; stopped all processes")
      time.sleep(poll_s)
  finally:
    terminate(children, grace_s)


def _started(output: Output, child: Child, spec: Spec) -> None:
  output.write(LAUNCHER, f"started {spec.name} (pid {child.proc.pid}): {shlex.join(spec.argv)}")


def launch(
  servers: Sequence[Spec],
  make_workers: Callable[[list[str]], Sequence[Spec]],
  *,
  ready_timeout_s: float = 120.0,
  timeout_s: float = 0.0,
  grace_s: float = 10.0,
  stop: Stop | None = None,
  output: Output | None = None,
) -> Outcome:
  """Starts the servers, waits until they are ready, starts the workers and supervises them all.

  Args:
    servers: the server processes (service children; each must print ``ready host:port``).
    make_workers: the servers' addresses -> the worker processes.
    ready_timeout_s: deadline for all servers to be ready, in seconds.
    timeout_s: wall-clock limit of the workers' run (0: none).
    grace_s: seconds between SIGTERM and SIGKILL when stopping children.
    stop: when set, stop everything.
    output: where lines go (default: stdout).

  Returns:
    The outcome (see ``supervise``); every child has been stopped.
  """
  output = output or Output()
  children: list[Child] = []
  try:
    for spec in servers:
      children.append(start(spec.name, spec.argv, spec.env, service=True, output=output))
      _started(output, children[-1], spec)
    addresses = wait_ready(children, ready_timeout_s, stop=stop)
    if addresses:
      output.write(LAUNCHER, f"servers ready at {','.join(addresses)}")
    for spec in make_workers(addresses):
      children.append(start(spec.name, spec.argv, spec.env, output=output))
      _started(output, children[-1], spec)
  except LaunchError as e:
    terminate(children, grace_s)
    return Outcome(e.code, str(e), e.name, e.restartable)
  except BaseException:
    terminate(children, grace_s)
    raise
  return supervise(children, timeout_s=timeout_s, grace_s=grace_s, stop=stop)


def install_signal_handlers(stop: Stop) -> None:
  """Makes SIGINT and SIGTERM request a stop instead of killing the launcher (main thread only).

  Args:
    stop: the event the handlers set.
  """
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda s, _frame: stop.request(s))
