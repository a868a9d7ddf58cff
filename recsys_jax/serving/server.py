"""The model server assembled: the version served and its poller, the micro-batcher, HTTP and gRPC.

``python -m recsys_jax.serve`` is its command line; tests and benchmarks start one in their own
process with any ``load``/``newest`` pair (see ``reload.ModelHolder``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from recsys_jax.serving.batcher import Batcher
from recsys_jax.serving.fresh import FreshModelHolder
from recsys_jax.serving.front import Front
from recsys_jax.serving.grpc_service import serve_grpc
from recsys_jax.serving.http import serve_http
from recsys_jax.serving.reload import Load, ModelHolder, Newest


@dataclasses.dataclass(frozen=True)
class ServerOptions:
  """How a model server listens, batches, reloads and follows a trainer (``python -m
  recsys_jax.serve``'s flags; a test's own)."""

  host: str = "127.0.0.1"
  """The address both sides bind (default loopback only)."""
  http_port: Optional[int] = 0
  """0 picks a free port; None leaves the HTTP side off."""
  grpc_port: Optional[int] = 0
  """0 picks a free port; None leaves the gRPC side off."""
  token: Optional[str] = None
  """If set, every request must carry ``authorization: Bearer <token>``."""
  tls_cert: Optional[str] = None
  """Path of a PEM certificate chain (with ``tls_key``): both sides serve TLS."""
  tls_key: Optional[str] = None
  """Path of the certificate's key."""
  max_batch: int = 512
  """The micro-batcher's largest batch (``batcher.Batcher``); also bounds the records of one request."""
  max_wait_s: float = 0.002
  """How long the micro-batcher waits for a batch to fill."""
  batch_workers: int = 1
  """Batches scored at once."""
  reload_every_s: float = 5.0
  """How often to look for a newer checkpoint (0: never)."""
  warm_reload: bool = True
  """Score recent requests' records with a new version before it serves (``Batcher.warm``)."""
  step: Optional[int] = None
  """Serve this step (None: the newest)."""
  threads: int = 32
  """gRPC calls served at once."""
  max_body_bytes: int = 16 << 20
  """The largest request body or message."""
  timeout_s: float = 30.0
  """Longest a request waits for its batch."""
  backlog: int = 1024
  """The HTTP listener's queue of connections not yet accepted."""
  publish_dir: Optional[str] = None
  """The trainer's publish directory: apply its row deltas and dense parameters between batches
  (``fresh.FreshModelHolder``) every ``deltas_every_s`` seconds; None: checkpoints only."""
  deltas_every_s: float = 0.2
  """How often a fresh server looks for deltas."""
  model_name: Optional[str] = None
  """The model's name in the Open Inference Protocol (``/v2/models/<name>``); None: the workdir's basename."""

  def __post_init__(self):
    if (self.tls_cert is None) != (self.tls_key is None):
      raise ValueError("TLS needs both --tls_cert and --tls_key")


class Serving:
  """A running model server.

  Args:
    workdir: the training run's directory.
    load, newest: ``serving.scorer.load_scorer`` and ``newest_step`` (or a test's own).
    options: how it listens, batches, reloads and follows a trainer (``ServerOptions``).
    steps, signature: ``serving.scorer.complete_steps`` and ``step_signature`` (``reload.ModelHolder``).
  """

  def __init__(
    self,
    workdir: str,
    load: Load,
    newest: Newest,
    options: ServerOptions = ServerOptions(),
    steps=None,
    signature=None,
  ):
    o = self.options = options
    self.holder: ModelHolder
    if o.publish_dir is not None and o.step is None:
      self.holder = FreshModelHolder(
        workdir, load, newest, o.publish_dir, steps=steps, signature=signature, reload_every_s=o.reload_every_s or 5.0
      )
    else:
      self.holder = ModelHolder(workdir, load, newest, o.step, steps=steps, signature=signature)
    self.batcher = Batcher(self.holder.current, o.max_batch, o.max_wait_s, o.batch_workers, on_gone=self.holder.check)
    if o.warm_reload:
      self.holder.warm = self.batcher.warm
    name = o.model_name or os.path.basename(os.path.abspath(workdir)) or "model"
    self.front = Front(self.holder, self.batcher, o.token, o.timeout_s, name)
    self.http = self.grpc = None
    self.http_port = self.grpc_port = None
    try:
      if o.http_port is not None:
        self.http, self.http_port, _ = serve_http(
          self.front, o.host, o.http_port, o.max_body_bytes, o.tls_cert, o.tls_key, o.backlog
        )
      if o.grpc_port is not None:
        cert = key = None
        if o.tls_cert is not None and o.tls_key is not None:  # both or neither (ServerOptions)
          with open(o.tls_cert, "rb") as f:
            cert = f.read()
          with open(o.tls_key, "rb") as f:
            key = f.read()
        self.grpc, self.grpc_port = serve_grpc(self.front, o.host, o.grpc_port, o.threads, o.max_body_bytes, cert, key)
    except BaseException:
      self.stop()
      raise
    if o.step is None:
      self.holder.start(o.deltas_every_s if isinstance(self.holder, FreshModelHolder) else o.reload_every_s)
    self.host = o.host

  def stop(self) -> None:
    """Stops listening, answers the requests queued, stops the poller."""
    if self.http is not None:
      self.http.shutdown()
      self.http.server_close()
    if self.grpc is not None:
      self.grpc.stop(grace=2.0).wait()
    self.batcher.close()
    self.holder.close()
