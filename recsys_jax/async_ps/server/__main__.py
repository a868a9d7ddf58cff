"""A PS shard server: one process holding the rows routed to it, served over gRPC to ``RemotePS``.

Run it as::

  python -m recsys_jax.async_ps.server --port=5051 [--host=127.0.0.1] \
    [--shard_index=I --num_shards=K] [--token_file=F] [--tls_cert=C --tls_key=K] \
    [--max_message_mb=256] [--max_inflight_mb=1024] [--local_shards=1] [--threads=32] \
    [--snapshot_root=DIR] [--max_wait_s=300] [--step_window=1000] [--read_ahead_rows=0] [--nowarmup]

It prints ``ready <host>:<port>`` on stdout once it serves (``--port=0`` picks a free port),
so launchers can wait for that line; before that it compiles its numba kernels
(``warmup``), so that no call compiles them within its deadline. Binds 127.0.0.1 unless ``--host`` says otherwise: the PS
trusts its callers to name snapshot directories, so expose it only with a token (and TLS) on
a trusted network.

This module is the command line; the package's ``__init__`` names what other code may import.
The server's parts live in:

- ``service``: the shard's service logic (``ShardService``: configure, lookups with the
  staleness wait, pushes buffered per step, snapshots and restores), independent of gRPC;
  the steps' pushes are summed in worker order by ``pushes.sum_pushes``.
- ``rpc``: the gRPC side (``ShardServer``: request decoding and checks, authentication,
  status codes; ``serve`` starts a server in this process).
- ``budget``: the bytes of calls in flight (``--max_inflight_mb``) and the waiting calls.
- ``staging``: the chunks of pushes sent in several messages, until all are in.
- ``warmup``: the numba kernels compiled before the ready line.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Optional, Sequence, Union

from absl import app, flags, logging

from recsys_jax.async_ps.server import warmup
from recsys_jax.async_ps.server.rpc import serve
from recsys_jax.async_ps.server.service import MAX_WAIT_S, STEP_WINDOW


def _define_flags() -> None:
  flags.DEFINE_integer("port", None, "Port to listen on (0: pick a free one; the ready line names it).")
  flags.DEFINE_string("host", "127.0.0.1", "Address to bind (default loopback only).")
  flags.DEFINE_integer("shard_index", None, "This server's index among --num_shards (default: from Configure).")
  flags.DEFINE_integer("num_shards", None, "Number of PS servers (with --shard_index).")
  flags.DEFINE_string("token_file", None, "File holding a bearer token every call must carry.")
  flags.DEFINE_string("tls_cert", None, "PEM certificate chain (with --tls_key): serve TLS.")
  flags.DEFINE_string("tls_key", None, "PEM private key of --tls_cert.")
  flags.DEFINE_integer("max_message_mb", 256, "Largest request or response, MiB.")
  flags.DEFINE_float(
    "max_inflight_mb", 1024, "Bytes of requests and answers in flight, MiB (more wait for room; 0: no bound)."
  )
  flags.DEFINE_bool("warmup", True, "Compile the numba kernels before the ready line.")
  flags.DEFINE_integer("local_shards", 1, "Shards (threads) of the in-process PS.")
  flags.DEFINE_integer("threads", 32, "RPCs served at once (all but 2 may wait for pushes).")
  flags.DEFINE_string("snapshot_root", None, "If set, snapshots may only be written and read under it.")
  flags.DEFINE_float("max_wait_s", MAX_WAIT_S, "Longest wait of a call for pushes, whatever its deadline.")
  flags.DEFINE_integer(
    "step_window", STEP_WINDOW, "Steps more than staleness + this ahead of the applied step are refused (>= 2)."
  )
  flags.DEFINE_integer(
    "read_ahead_rows",
    0,
    "Per table shard, the most rows ReadAheads may hold pinned in the RAM cache for later steps (0: half its capacity).",
  )
  flags.mark_flag_as_required("port")


def _read(path: Optional[str], what: str) -> Optional[bytes]:
  if not path:
    return None
  try:
    with open(path, "rb") as fh:
      return fh.read()
  except OSError as e:
    raise app.UsageError(f"cannot read {what} {path}: {e}") from None


def main(argv: Sequence[str]) -> None:
  """Serves until SIGTERM or SIGINT.

  Args:
    argv: leftover command-line arguments (none are accepted).
  """
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  fl = flags.FLAGS
  token: Optional[Union[bytes, str]]  # the file's bytes, then the token
  token = _read(fl.token_file, "--token_file")
  if token is not None:
    token = token.decode("utf-8").strip()
    if not token:
      raise app.UsageError(f"--token_file {fl.token_file} is empty")
  try:
    server, port, _ = serve(
      fl.host,
      fl.port,
      shard_index=fl.shard_index,
      num_shards=fl.num_shards,
      local_shards=fl.local_shards,
      token=token,
      tls_cert=_read(fl.tls_cert, "--tls_cert"),
      tls_key=_read(fl.tls_key, "--tls_key"),
      max_message_mb=fl.max_message_mb,
      max_inflight_mb=fl.max_inflight_mb,
      threads=fl.threads,
      snapshot_root=fl.snapshot_root,
      max_wait_s=fl.max_wait_s,
      step_window=fl.step_window,
      read_ahead_rows=fl.read_ahead_rows,
    )
  except (ValueError, RuntimeError) as e:
    raise app.UsageError(str(e)) from None
  if fl.warmup:  # while the port is bound but before the ready line: calls wait, none compiles
    logging.info("numba kernels warmed up in %.2f s", warmup.warm_up(fl.local_shards))
  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  signal.signal(signal.SIGINT, lambda *_: stop.set())
  print(f"ready {fl.host}:{port}", flush=True)
  while not stop.wait(1.0):
    pass
  server.stop(grace=2.0).wait()
  sys.stdout.flush()


if __name__ == "__main__":
  _define_flags()
  app.run(main)
