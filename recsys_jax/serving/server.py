"""The model server assembled: the version served and its poller, the micro-batcher, HTTP and gRPC.

``python -m recsys_jax.serve`` is its command line; tests and benchmarks start one in their own
process with any ``load``/``newest`` pair (see ``reload.ModelHolder``).
"""

from __future__ import annotations

from typing import Optional

from recsys_jax.serving.batcher import Batcher
from recsys_jax.serving.fresh import FreshModelHolder
from recsys_jax.serving.front import Front
from recsys_jax.serving.grpc_service import serve_grpc
from recsys_jax.serving.http import serve_http
from recsys_jax.serving.reload import Load, ModelHolder, Newest


class Serving:
  """A running model server.

  Args:
    workdir: the training run's directory.
    load, newest: ``serving.scorer.load_scorer`` and ``newest_step`` (or a test's own).
    steps, signature: ``serving.scorer.complete_steps`` and ``step_signature`` (``reload.ModelHolder``).
    backlog: the HTTP listener's queue of connections not yet accepted.
    host: the address both sides bind (default loopback only).
    http_port, grpc_port: 0 picks a free port; None leaves that side off.
    token: if set, every request must carry ``authorization: Bearer <token>``.
    tls_cert, tls_key: paths of a PEM certificate chain and its key: both sides serve TLS.
    max_batch, max_wait_s, batch_workers: the micro-batcher's (``batcher.Batcher``); ``max_batch``
      also bounds the records of one request.
    reload_every_s: how often to look for a newer checkpoint (0: never).
    publish_dir: the trainer's publish directory: apply its row deltas and dense parameters between
      batches (``fresh.FreshModelHolder``) every ``deltas_every_s`` seconds; None: checkpoints only.
    warm_reload: score recent requests' records with a new version before it serves (``Batcher.warm``).
    step: serve this step (None: the newest).
    threads: gRPC calls served at once.
    max_body_bytes: the largest request body or message.
    timeout_s: longest a request waits for its batch.
  """

  def __init__(
    self,
    workdir: str,
    load: Load,
    newest: Newest,
    host: str = "127.0.0.1",
    http_port: Optional[int] = 0,
    grpc_port: Optional[int] = 0,
    token: Optional[str] = None,
    tls_cert: Optional[str] = None,
    tls_key: Optional[str] = None,
    max_batch: int = 512,
    max_wait_s: float = 0.002,
    batch_workers: int = 1,
    reload_every_s: float = 5.0,
    warm_reload: bool = True,
    step: Optional[int] = None,
    threads: int = 32,
    max_body_bytes: int = 16 << 20,
    timeout_s: float = 30.0,
    steps=None,
    signature=None,
    backlog: int = 1024,
    publish_dir: Optional[str] = None,
    deltas_every_s: float = 0.2,
  ):
    if (tls_cert is None) != (tls_key is None):
      raise ValueError("TLS needs both --tls_cert and --tls_key")
    self.holder: ModelHolder
    if publish_dir is not None and step is None:
      self.holder = FreshModelHolder(
        workdir, load, newest, publish_dir, steps=steps, signature=signature, reload_every_s=reload_every_s or 5.0
      )
    else:
      self.holder = ModelHolder(workdir, load, newest, step, steps=steps, signature=signature)
    self.batcher = Batcher(self.holder.current, max_batch, max_wait_s, batch_workers, on_gone=self.holder.check)
    if warm_reload:
      self.holder.warm = self.batcher.warm
    self.front = Front(self.holder, self.batcher, token, timeout_s)
    self.http = self.grpc = None
    self.http_port = self.grpc_port = None
    try:
      if http_port is not None:
        self.http, self.http_port, _ = serve_http(
          self.front, host, http_port, max_body_bytes, tls_cert, tls_key, backlog
        )
      if grpc_port is not None:
        cert = key = None
        if tls_cert is not None:
          assert tls_key is not None  # both or neither, checked above
          with open(tls_cert, "rb") as f:
            cert = f.read()
          with open(tls_key, "rb") as f:
            key = f.read()
        self.grpc, self.grpc_port = serve_grpc(self.front, host, grpc_port, threads, max_body_bytes, cert, key)
    except BaseException:
      self.stop()
      raise
    if step is None:
      self.holder.start(deltas_every_s if isinstance(self.holder, FreshModelHolder) else reload_every_s)
    self.host = host

  def stop(self) -> None:
    """Stops listening, answers the requests queued, stops the poller."""
    if self.http is not None:
      self.http.shutdown()
      self.http.server_close()
    if self.grpc is not None:
      self.grpc.stop(grace=2.0).wait()
    self.batcher.close()
    self.holder.close()
