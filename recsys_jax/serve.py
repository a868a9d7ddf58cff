"""Serves a trained model's predictions over HTTP/JSON and gRPC, picking up new checkpoints as it serves.

    python -m recsys_jax.serve --workdir=W [--host=127.0.0.1] [--http_port=8501] [--grpc_port=8500] \
      [--token_file=F] [--tls_cert=C --tls_key=K] [--max_batch=512] [--max_wait_ms=2] \
      [--reload_every_s=5] [--step=N] [--model_name=NAME]

Both ports also speak the Open Inference Protocol (KServe v2: ``serving/v2``), the model named
``--model_name`` (default: the workdir's basename). It prints ``ready http=<host>:<port>
grpc=<host>:<port> version=<version> model=<name>`` on stdout once it
serves (a port of 0 picks a free one; -1 leaves that side off). Binds 127.0.0.1 unless ``--host``
says otherwise; with ``--token_file`` every request must carry ``Authorization: Bearer <token>``
(as the PS server's). SIGTERM or SIGINT stops it: the requests in flight are answered, its held
files (``serving/rows/held.py``) removed, and it exits 0. See ``serving/http.py`` and
``serving/grpc_service.py`` for the requests and errors, and README "Serving" for an example.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging as std_logging
import os
import signal
import sys
import threading
from typing import Optional, Sequence

from absl import app, flags, logging

FLAGS = flags.FLAGS


def _define_flags() -> None:
  flags.DEFINE_string("workdir", None, "The training run's directory (its checkpoints are served).")
  flags.DEFINE_string("host", "127.0.0.1", "Address to bind (default loopback only).")
  flags.DEFINE_integer("http_port", 8501, "HTTP/JSON port (0: pick a free one; -1: no HTTP).")
  flags.DEFINE_integer("grpc_port", 8500, "gRPC port (0: pick a free one; -1: no gRPC).")
  flags.DEFINE_string("token_file", None, "File holding a bearer token every request must carry.")
  flags.DEFINE_string("tls_cert", None, "PEM certificate chain (with --tls_key): serve HTTPS and gRPC over TLS.")
  flags.DEFINE_string("tls_key", None, "PEM private key of --tls_cert.")
  flags.DEFINE_integer("max_batch", 512, "Most records in one scored batch, and in one request.")
  flags.DEFINE_float("max_wait_ms", 2.0, "Longest a request waits for others to join its batch, ms.")
  # One: on 2 CPU cores, two workers scored smaller batches in parallel and gave 0.86x the predictions/s
  # of one at 64 records a request (DLRM, experiments/bench_serve.py); more cores or a GPU may differ.
  flags.DEFINE_integer("batch_workers", 1, "Batches scored at once (with 2, one fills while another is scored).")
  flags.DEFINE_float("reload_every_s", 5.0, "How often to look for a newer checkpoint, s (0: never).")
  flags.DEFINE_bool(
    "warm_reload", True, "Score recent requests with a new version before swapping it in (compiles its shapes)."
  )
  flags.DEFINE_float(
    "deltas_every_s",
    0.2,
    "How often to apply the trainer's row deltas and dense publishes, s, when its config publishes them "
    "(config.publish_every_s > 0; 0: never, checkpoints only).",
  )
  flags.DEFINE_string("publish_dir", None, "The trainer's publish directory (default: the one its config names).")
  flags.DEFINE_string(
    "model_name",
    None,
    "The model's name in the Open Inference Protocol (/v2/models/<name>); default: the workdir's basename.",
  )
  flags.DEFINE_integer("step", None, "Serve this step and never reload (default: the newest, reloading).")
  flags.DEFINE_integer("threads", 32, "gRPC calls served at once.")
  flags.DEFINE_integer(
    "listen_backlog", 1024, "HTTP connections the kernel queues before they are accepted (capped by somaxconn)."
  )
  flags.DEFINE_float("max_body_mb", 16.0, "Largest request body or gRPC message, MiB.")
  flags.DEFINE_float(
    "cache_mb", 64.0, "RAM for the tables' rows, MiB: the rows served most recently; the rest are read from disk."
  )
  flags.DEFINE_string(
    "model_module",
    "recsys_jax.serving.scorer",
    "Module whose load_scorer(workdir, step) and newest_step(workdir) load the model (tests serve their own).",
  )


class _Usage(Exception):
  pass


class _QuietLibraries(std_logging.Filter):
  """Drops the libraries' own INFO lines (orbax logs ~30 per checkpoint read, jax its backend
  search): a user reads the server's own lines, warnings and errors from anywhere."""

  _PATHS = tuple(f"{os.sep}{lib}{os.sep}" for lib in ("orbax", "jax", "jaxlib"))

  def filter(self, record: std_logging.LogRecord) -> bool:
    return record.levelno >= std_logging.WARNING or not any(p in record.pathname for p in self._PATHS)


def _read_token(path: Optional[str]) -> Optional[str]:
  if not path:
    return None
  try:
    with open(path, "rb") as fh:
      token = fh.read().decode("utf-8").strip()
  except (OSError, UnicodeDecodeError) as e:
    raise _Usage(f"cannot read --token_file {path}: {e}") from None
  if not token:
    raise _Usage(f"--token_file {path} is empty")
  return token


def _port(value: int, name: str) -> Optional[int]:
  if value == -1:
    return None
  if not 0 <= value < 65536:
    raise _Usage(f"--{name} must be a port (0 picks a free one, -1 turns it off), got {value}")
  return value


def _start():
  """The running server, from the flags; ``_Usage`` for what the user must fix."""
  if not FLAGS.workdir:
    raise _Usage("--workdir is required: the training run's directory")
  if not os.path.isdir(FLAGS.workdir):
    raise _Usage(f"--workdir {FLAGS.workdir} is not a directory")
  http_port, grpc_port = _port(FLAGS.http_port, "http_port"), _port(FLAGS.grpc_port, "grpc_port")
  if http_port is None and grpc_port is None:
    raise _Usage("--http_port and --grpc_port are both off: nothing to serve on")
  for name, value in (
    ("max_batch", FLAGS.max_batch),
    ("threads", FLAGS.threads),
    ("batch_workers", FLAGS.batch_workers),
    ("listen_backlog", FLAGS.listen_backlog),
  ):
    if value < 1:
      raise _Usage(f"--{name} must be at least 1, got {value}")
  if (
    FLAGS.max_wait_ms < 0
    or FLAGS.reload_every_s < 0
    or FLAGS.deltas_every_s < 0
    or FLAGS.max_body_mb <= 0
    or not FLAGS.cache_mb >= 0
  ):
    raise _Usage("--max_wait_ms, --reload_every_s, --deltas_every_s and --cache_mb must be >= 0 and --max_body_mb > 0")
  if (FLAGS.tls_cert is None) != (FLAGS.tls_key is None):
    raise _Usage("TLS needs both --tls_cert and --tls_key")
  for name in ("tls_cert", "tls_key"):
    path = getattr(FLAGS, name)
    if path is not None and not os.path.isfile(path):
      raise _Usage(f"--{name} {path} is not a file")
  token = _read_token(FLAGS.token_file)
  if FLAGS.model_module == "recsys_jax.serving.scorer":
    from recsys_jax.training import run_config

    try:  # a damaged config.json is named as such before any checkpoint is looked for or loaded
      run_config.verify(FLAGS.workdir)
    except ValueError as e:
      raise _Usage(str(e)) from None
  try:  # imported here: the model side pulls in jax, which the flag checks above need not wait for
    model = importlib.import_module(FLAGS.model_module)
    load_scorer, newest_step = model.load_scorer, model.newest_step
    steps, signature = getattr(model, "complete_steps", None), getattr(model, "step_signature", None)
  except (ImportError, AttributeError) as e:
    raise _Usage(f"cannot load models for serving with --model_module={FLAGS.model_module}: {e}") from None
  params = inspect.signature(load_scorer).parameters
  if "max_batch" in params:  # the scorer pads to powers of two up to it
    load_scorer = functools.partial(load_scorer, max_batch=1 << (FLAGS.max_batch - 1).bit_length())
  if "cache_bytes" in params:
    load_scorer = functools.partial(load_scorer, cache_bytes=int(FLAGS.cache_mb * (1 << 20)))
  publish_dir = None
  if FLAGS.deltas_every_s > 0 and FLAGS.step is None and FLAGS.model_module == "recsys_jax.serving.scorer":
    from recsys_jax.online import publish

    try:
      config = run_config.load(FLAGS.workdir)
    except (OSError, ValueError) as e:
      raise _Usage(f"cannot read the run's config in {FLAGS.workdir}: {e}") from None
    if FLAGS.publish_dir or float(config.publish_every_s or 0.0) > 0:
      publish_dir = FLAGS.publish_dir or publish.publish_dir(config, FLAGS.workdir)
  from recsys_jax.serving.reload import NoModel
  from recsys_jax.serving.server import ServerOptions, Serving

  try:  # a bad combination of flags (TLS with a certificate but no key) is a usage error
    options = ServerOptions(
      host=FLAGS.host,
      http_port=http_port,
      grpc_port=grpc_port,
      token=token,
      tls_cert=FLAGS.tls_cert,
      tls_key=FLAGS.tls_key,
      max_batch=FLAGS.max_batch,
      max_wait_s=FLAGS.max_wait_ms / 1e3,
      batch_workers=FLAGS.batch_workers,
      reload_every_s=FLAGS.reload_every_s,
      warm_reload=FLAGS.warm_reload,
      step=FLAGS.step,
      threads=FLAGS.threads,
      max_body_bytes=int(FLAGS.max_body_mb * (1 << 20)),
      backlog=FLAGS.listen_backlog,
      publish_dir=publish_dir,
      deltas_every_s=FLAGS.deltas_every_s,
      model_name=FLAGS.model_name,
    )
  except ValueError as e:
    raise _Usage(str(e)) from None
  try:
    return Serving(FLAGS.workdir, load_scorer, newest_step, options, steps=steps, signature=signature)
  except (NoModel, RuntimeError) as e:  # no checkpoint; a port taken
    raise _Usage(str(e)) from None
  except Exception as e:  # noqa: BLE001 - the first load failed (a damaged checkpoint, a --step not there)
    what = f"step {FLAGS.step}" if FLAGS.step is not None else "the newest checkpoint"
    raise _Usage(f"cannot load {what} of {FLAGS.workdir}: {type(e).__name__}: {e}") from None


def main(argv: Sequence[str]) -> None:
  """Serves until SIGTERM or SIGINT."""
  if len(argv) > 1:
    print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
    sys.exit(2)
  logging.get_absl_handler().addFilter(_QuietLibraries())
  try:
    serving = _start()
  except _Usage as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  signal.signal(signal.SIGINT, lambda *_: stop.set())
  host = f"[{serving.host}]" if ":" in serving.host else serving.host
  sides = [f"{name}={host}:{port}" for name, port in (("http", serving.http_port), ("grpc", serving.grpc_port)) if port]
  print(f"ready {' '.join(sides)} version={serving.holder.version} model={serving.front.model_name}", flush=True)
  while not stop.wait(1.0):
    pass
  logging.info("stopping")
  serving.stop()  # the requests in flight answered, new ones refused, the reload poller stopped
  from recsys_jax.serving.rows import held

  held.release(FLAGS.workdir)  # no version is read again: this process's held files go now
  logging.info("stopped")
  # Nothing is left to write: leave without the interpreter's teardown (jax's exit hook clearing
  # its caches and backends, then freeing every module's objects), which cost more CPU than all of
  # the above and so most of the time from the signal to the exit on a loaded machine.
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
