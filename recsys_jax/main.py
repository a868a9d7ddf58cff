"""Command-line entry: flags only; the job is ``train.train_and_evaluate``.

    python -m recsys_jax.main --config=configs/dlrm.py [--workdir=DIR] [--config.num_steps=100]

Pointing ``--workdir`` at a directory with a checkpoint resumes that run. Several trainer
processes (one per host) join one job with ``--coordinator_address``, ``--num_processes`` and
``--process_id`` (or the environment variables ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``, as the Kubernetes Job sets them) and share remote
PS servers (``--config.ps.kind=remote --config.ps.addresses=...``); ``recsys_jax.launch``
starts such a job on one machine.

SIGTERM (one trainer process) stops training after the step under way: the final checkpoint is
at the step reached, the evaluation and summary follow, and the exit status is 0, so a launcher or
Kubernetes does not restart it; a second SIGTERM ends the process at once. A write that hangs (a
disk or file server that does not answer) cannot hold it: once one of the run's writes has made no
progress for ``--stop_write_timeout_s`` seconds after SIGTERM, one line names it and the last good
checkpoint, and the process exits 2 (``_stop_on_sigterm``). ``--config.num_steps=-1``
trains until then (an online run on a stream, ``--config.data.stream_dir``). With several trainer
processes SIGTERM ends each at once (they would have to agree on the step to stop at).

Exit status: 0 done; 2 (``EXIT_CONFIG``) for a failure that running again would repeat: bad flags
or config, a workdir whose checkpoints do not fit the job or none of which can be read, a NaN loss
(training from the same checkpoint replays the same steps), a file the run cannot write (a full
disk: a checkpoint, metrics, TensorBoard events, a publish, the log; one line names it and the last
good checkpoint), or one that hangs after SIGTERM; 1 for anything else, such as a lost PS server. The launcher restarts a job after 1 or a signal, never after 2.
"""

import ast
import difflib
import errno
import faulthandler
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Optional

from absl import app, flags, logging
from ml_collections import config_flags

from recsys_jax import train, write_waits
from recsys_jax import workdir as workdir_lib
from recsys_jax.checkpoint import CheckpointError
from recsys_jax.checkpoint_files import WriteError, cause
from recsys_jax.launch.supervisor import EXIT_CONFIG

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an ml_collections config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config file name>).")
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address", os.environ.get("JAX_COORDINATOR_ADDRESS"), "host:port of trainer process 0 (several hosts)."
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", int(os.environ.get("JAX_NUM_PROCESSES", "1")), "Trainer processes in the job."
)
_PROCESS_ID = flags.DEFINE_integer("process_id", int(os.environ.get("JAX_PROCESS_ID", "0")), "This trainer's rank.")
_STOP_WRITE_TIMEOUT = flags.DEFINE_float(
  "stop_write_timeout_s",
  10.0,
  "After SIGTERM, a write (checkpoint, metrics, TensorBoard, publish, summary, log) that makes no progress for this "
  "long is taken as hung: the run ends with one error line and exit 2 (0: wait for it).",
)
# Read in _parse_flags, before the other flags are; defined so that --help lists it.
flags.DEFINE_boolean(
  "helpconfig", False, "Print every --config.<field>: its value (of --config's file, else the defaults) and meaning."
)


def _limit_malloc_arenas(n: int = 2) -> None:
  """Caps glibc's malloc arenas before the worker threads start.

  The prefetcher, pusher, PS shards and tensorstore allocate and free rows on different
  threads; with glibc's default of 8 arenas per core the freed memory stays spread over them
  and peak RSS grew by tens of MiB (measured with the disk tier). No-op off glibc.
  """
  if os.environ.get("MALLOC_ARENA_MAX"):
    return
  try:
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-8, n)  # M_ARENA_MAX
  except (OSError, AttributeError):
    pass


def _no_such_field(e: Exception, argv) -> str:
  """One line for a --config.<field> the config lacks. ml_collections raises it as
  ``KeyError("'bach_size'\\nDid you mean \"batch_size\" instead of \"bach_size\"?")`` (or AttributeError)."""
  text = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
  if text[:1] in "'\"":  # the AttributeError wraps the KeyError's repr
    try:
      text = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      pass
  key, _, hint = text.partition("\n")
  key = key.strip("'\"")
  flag = next((a.split("=")[0] for a in argv if a.startswith("--config.") and key in a.split("=")[0].split(".")), None)
  hint = hint.strip().replace("Did you mean", "did you mean") if hint else "--helpconfig lists the fields"
  return f"{flag or '--config.' + key}: the config has no field {key!r}; {hint}"


def _config_file_error(argv):
  """One line for a ``--config`` file that is not there (absl's ``--config=X`` or ``--config X``, the last
  one given), with the nearest file name beside it; None when it exists. ml_collections would defer the
  error to the config's first use and report it over five lines, under the name ``config_config``."""
  path = None
  for i, a in enumerate(argv[1:], 1):
    if a == "--":
      break
    name, eq, value = a.lstrip("-").partition("=")
    if a.startswith("-") and name == "config":
      path = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
  file = (path or "").split(":", 1)[0]  # 'file.py:arg' passes arg to get_config
  if not file or os.path.isfile(file):
    return None
  if os.path.isdir(file):
    return f"--config={path}: {file} is a directory, not a config file"
  directory, base = os.path.split(file)
  names = os.listdir(directory or ".") if os.path.isdir(directory or ".") else []
  near = difflib.get_close_matches(base, names, n=1)
  hint = f"; did you mean {os.path.join(directory, near[0])}?" if near else ""
  return f"--config={path}: the file {file} does not exist{hint}"


def _parse_flags(argv):
  """absl's flag parsing, exiting with ``EXIT_CONFIG`` rather than 1 on a bad flag: one ``error:`` line."""
  missing = _config_file_error(argv)
  if missing:
    print(f"error: {missing}", file=sys.stderr)
    sys.exit(EXIT_CONFIG)
  if "--helpconfig" in argv[1:]:  # before parsing: it needs no --config, and a bad override should not hide it
    from configs import fields  # beside default.py, whose comments it reads

    print(fields.describe(next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)))
    sys.exit(0)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"error: {e} (--helpshort lists the flags, --helpconfig the config fields)", file=sys.stderr)
  # config_flags applies the --config.<field> overrides here and lets their errors through
  # (KeyError or AttributeError for a field the config does not have).
  except (AttributeError, KeyError) as e:
    print(f"error: {_no_such_field(e, argv)}", file=sys.stderr)
  except Exception as e:
    print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
  sys.exit(EXIT_CONFIG)


def _load_config():
  # config_flags defers an unreadable config file's error to the first use of the config.
  config = _CONFIG.value
  try:
    config.keys()
  except OSError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(EXIT_CONFIG)
  return config


def _model_kwargs_follow_the_model(config) -> None:
  """``--config.model.name`` switches the model; the config file's ``model.kwargs`` were written for
  its own model, so those the new model does not take give way to its defaults (one line names
  them). Without the flag, an argument the model does not take stays an error (a typo in a config
  file), and so does one given on the command line."""
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  if "model.name" not in overrides:
    return
  from recsys_jax import models

  if config.model.name not in models.names():
    return  # validate_config refuses it, naming the models there are
  takes = models.arguments(config.model.name)
  kwargs = config.model.kwargs
  drop = [k for k in kwargs if k not in takes and f"model.kwargs.{k}" not in overrides]
  if drop:
    with config.unlocked():
      for k in drop:
        del kwargs[k]
    print(
      f"model {config.model.name!r} (--config.model.name): the config's model.kwargs {', '.join(drop)} are not its "
      f"arguments and were dropped; it takes {', '.join(sorted(takes))} (its defaults unless set)",
      file=sys.stderr,
    )


_LOG_RESERVE = 1 << 20


def _reserve(log) -> None:
  """Allocates ``_LOG_RESERVE`` bytes of disk past the log's end, its size unchanged
  (``fallocate`` with ``FALLOC_FL_KEEP_SIZE``): what the log writes later goes there, so a disk
  that fills during the run still takes the traceback of the error that ends it. Where the file
  system or the platform has no such call, nothing is reserved."""
  try:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    libc.fallocate(log.fileno(), 1, os.fstat(log.fileno()).st_size, _LOG_RESERVE)  # 1: FALLOC_FL_KEEP_SIZE
  except (OSError, AttributeError):
    pass


class _Log:
  """The trainer's log file, appended to (the runs before this one keep what they wrote), and
  the first failure to write it (``failed``: None while every write went in)."""

  def __init__(self, path: str):
    self.path = path
    self.failed: Optional[Exception] = None
    self._file = None
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      self._file = open(path, "a", buffering=1)
      _reserve(self._file)
    except OSError as e:
      self.failed = e
    self.write(f"==== run started {time.strftime('%Y-%m-%d %H:%M:%S %z')}, pid {os.getpid()}: {' '.join(sys.argv)}\n")

  def write(self, text: str) -> None:
    if self._file is None:
      return
    try:
      with write_waits.writing(f"log {self.path}"):
        self._file.write(text)
        self._file.flush()
    except (OSError, ValueError) as e:
      if self.failed is None:
        self.failed = e

  def where(self) -> str:
    """Where the traceback of an error is: the log, or why it is not there."""
    if self.failed is None:
      return f"traceback: {self.path}"
    return f"traceback not in {self.path}: {cause(self.failed)}"


def _log_to_workdir(workdir: str, process_id: int) -> "_Log":
  """Sends what is not for the person at the terminal to ``<workdir>/trainer_p<i>.log``: absl
  logging (orbax's warnings and errors included), the tracebacks of threads that die, and errors
  Python ignores (a flush at exit on a full disk). The terminal keeps one ``error:`` line per
  failure. Each run appends to the log, after a line that says when it started; a log that cannot
  be written (the same full disk, past what the log reserved) is an error of its own at the end
  of the run (``_Log.failed``), or is named in the line of the error that ended it.
  """
  log = _Log(workdir_lib.trainer_log(workdir, process_id))
  write = log.write

  class _Stream:  # absl's handler writes to .stream, flushes it, and closes it at exit
    def write(self, text):
      write(text)

    def flush(self):
      pass

    def close(self):
      # logging's shutdown at exit closes every handler's stream; the log stays open for what
      # Python reports after it (the unraisable hook below), and the process's end closes it.
      pass

  logging.get_absl_handler().python_handler.stream = _Stream()

  def thread_died(args):
    write(f"exception in thread {getattr(args.thread, 'name', '?')}:\n")
    write("".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))

  def ignored(args):
    write(f"ignored: {args.err_msg or 'exception'} {args.object!r}:\n")
    write("".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))

  threading.excepthook = thread_died
  sys.unraisablehook = ignored
  return log


def _stop_on_sigterm(log: "_Log", limit_s: float) -> threading.Event:
  """An event SIGTERM sets (training then ends after the step under way, with its checkpoint); a
  second SIGTERM gets the default action, so a trainer that does not stop can still be ended.

  After SIGTERM, a write the main thread has made or waited for (``recsys_jax.write_waits``) that
  makes no progress for ``limit_s`` seconds (0: never) ends the process: one ``error:`` line names
  the write and the last good checkpoint, the threads' stacks go to the log, and the exit status
  is 2, as for a write that fails. A hung disk's write cannot be interrupted, so this is done by a
  thread of its own (the watchdog), which also takes the signal: SIGTERM is blocked in the main
  thread and in every thread it starts, since a thread stuck in the kernel (in D state) would keep
  a signal the kernel chose it for; Python's handler, run by whichever thread the kernel does
  choose, writes the signal's number to a socket the watchdog reads (``signal.set_wakeup_fd``).
  """
  stop = threading.Event()
  wake, woken = socket.socketpair()
  woken.setblocking(False)
  signal.set_wakeup_fd(woken.fileno(), warn_on_full_buffer=False)
  signal.signal(signal.SIGTERM, lambda *_: None)  # the watchdog acts; the handler makes the wakeup write
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
  main = threading.main_thread()

  def watch(_keep_open: socket.socket):  # the handler's end of the socket lives as long as the watchdog
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    told = None
    while True:
      if select.select([wake], [], [], None if told is None else 0.25)[0] and signal.SIGTERM in wake.recv(64):
        if told is not None:  # the second, if the default action could not be set at the first
          os._exit(128 + signal.SIGTERM)
        told = time.monotonic()
        _default_action(signal.SIGTERM)
        print("SIGTERM: stopping after the step under way (final checkpoint, then exit 0)", file=sys.stderr)
        stop.set()
      hung = write_waits.stuck(main, told, limit_s) if told is not None and limit_s > 0 else None
      if hung is not None:
        _end_hung(log, *hung)

  threading.Thread(target=watch, args=(woken,), name="sigterm", daemon=True).start()
  return stop


def _default_action(signum: int) -> None:
  """``signum``'s action back to the default, from any thread (``signal.signal`` is the main thread's
  only, and the main thread may be stuck)."""
  try:
    import ctypes

    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(signum, None)  # SIG_DFL
  except (OSError, AttributeError):
    pass  # the second SIGTERM then ends the process by os._exit


def _end_hung(log: "_Log", what: str, waited: float) -> None:
  """Ends the process for a write that hangs (``_stop_on_sigterm``): the line, then the threads'
  stacks to the log by a thread of its own (the log may be on the disk that hangs: waited for 1 s)."""
  line = (
    f"{what} could not be written: no progress in {waited:.0f} s after SIGTERM (a disk or file server that "
    f"does not answer); last good checkpoint: {write_waits.last_good()} (left as it was)"
  )
  print(f"error: {line}", file=sys.stderr, flush=True)
  frames = sys._current_frames()
  stacks = "".join(
    f"thread {t.name}:\n" + "".join(traceback.format_stack(frames[t.ident]))
    for t in threading.enumerate()
    if t.ident in frames
  )
  writer = threading.Thread(target=log.write, args=(f"error: {line}\n{stacks}",), daemon=True)
  writer.start()
  writer.join(1.0)
  os._exit(EXIT_CONFIG)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}", exitcode=EXIT_CONFIG)
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  config = _load_config()  # before joining the job: a config error needs no coordinator
  _model_kwargs_follow_the_model(config)
  if _NUM_PROCESSES.value > 1:
    if not _COORDINATOR.value:
      raise app.UsageError(
        "--num_processes > 1 needs --coordinator_address (or JAX_COORDINATOR_ADDRESS)", exitcode=EXIT_CONFIG
      )
    from recsys_jax.parallel import distributed

    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    # jax.distributed's preemption notifier catches SIGTERM and only records it; nothing here uses
    # it, and a trainer told to stop (by the launcher, by Kubernetes) must stop: the default again.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
  workdir = _WORKDIR.value or os.path.join(
    "runs", os.path.splitext(os.path.basename(flags.FLAGS["config"].config_filename))[0]
  )
  print(f"workdir: {os.path.abspath(workdir)}", file=sys.stderr)
  log = _log_to_workdir(workdir, _PROCESS_ID.value)
  to_log = log.write
  stop = _stop_on_sigterm(log, _STOP_WRITE_TIMEOUT.value) if _NUM_PROCESSES.value == 1 else None
  try:
    summary = train.train_and_evaluate(config, workdir, stop=stop)
  # ConnectionError: a PS server is gone; CheckpointError: no checkpoint of the workdir is intact, or
  # one could not be written; WriteError: another file of the run could not be written (a full disk).
  except (train.NonFiniteLossError, ValueError, ConnectionError, CheckpointError, WriteError) as e:
    to_log("".join(traceback.format_exception(e)))  # with the causes the line leaves out
    print(f"error: {e}" + (f" ({log.where()})" if log.failed is not None else ""), file=sys.stderr)
    if isinstance(e, ConnectionError) and _NUM_PROCESSES.value > 1:
      # A lost PS server, which the other trainers may not have met yet: a normal exit would wait
      # in jax's shutdown barrier for them (up to 5 minutes), so a hung server would hold the job.
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(1)
    # Only a lost server may go away; the others come back the same on the same config and workdir.
    sys.exit(1 if isinstance(e, ConnectionError) else EXIT_CONFIG)
  except Exception as e:  # anything else (numpy, tensorstore, a file): one line here, the traceback in the log
    to_log("".join(traceback.format_exception(e)))
    print(f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0]} ({log.where()})", file=sys.stderr)
    # A full disk stays full for the next attempt: not a failure a restart mends.
    sys.exit(EXIT_CONFIG if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) else 1)
  if log.failed is not None:  # the run's own files are written; its log is not whole
    print(f"error: {WriteError.of('log', log.path, log.failed)}", file=sys.stderr)
    sys.exit(EXIT_CONFIG)
  print(train.format_summary(summary))
  print(f"summary: {os.path.join(os.path.abspath(workdir), 'summary.json')}")


if __name__ == "__main__":
  faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> prints every thread's stack (a stuck job)
  _limit_malloc_arenas()
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=_parse_flags)
