"""The HTTP/JSON side of the model server (for people, curl and anything that speaks HTTP).

- ``POST /v1/predict`` with ``{"records": [{...}, ...]}`` -> ``{"version": ..., "dense_version": ..., "row_version": ..., "scores": [...]}``
- ``GET /v1/model`` -> the version served, its step, its request fields, the reload counters
- ``GET /v1/health`` -> ``{"status": "serving", "version": ..., "dense_version": ..., "row_version": ...}``
- ``/v2/...``: the Open Inference Protocol (KServe v2), ``serving/v2/rest.py``

Errors are JSON ``{"error", "field", "record"}``: 400 (malformed JSON, a bad record: missing,
unknown or mistyped feature), 401 (a token is set and the request lacks ``Authorization:
Bearer <token>``), 404 (no such path), 405 (wrong method), 411 (no Content-Length), 413 (a body
over ``max_body_bytes`` or more records than ``--max_batch``), 503 (overloaded), 500 (the model
failed). HTTP/1.1 keep-alive; a thread per connection (``ThreadingHTTPServer``).
"""

from __future__ import annotations

import http.server
import json
import socket
import ssl
import sys
import threading
from typing import Any, Dict, Optional, Tuple

from absl import logging

from recsys_jax.serving.front import Front, FrontError
from recsys_jax.serving.v2 import rest as v2_rest

_MAX_SKIP = 64 << 20  # bodies of refused requests up to this are read and dropped; larger ones close the connection
_ROUTES = {"/v1/predict": "POST", "/v1/model": "GET", "/v1/health": "GET"}


DEFAULT_BACKLOG = 1024


class _Server(http.server.ThreadingHTTPServer):
  daemon_threads = True
  front: Front
  max_body_bytes: int
  v2: v2_rest.Routes

  def handle_error(self, request: Any, client_address: Any) -> None:
    # A client that breaks off (or speaks plaintext to TLS) is one log line, not a traceback per connection.
    logging.warning("HTTP connection from %s failed: %s", client_address, sys.exc_info()[1])

  def __init__(self, address: Tuple[str, int], handler, backlog: int):
    if ":" in address[0]:
      self.address_family = socket.AF_INET6
    # socketserver's default of 5 pending connections made a burst of connects wait a SYN retransmit (1 s).
    self.request_queue_size = backlog
    super().__init__(address, handler)


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"  # keep-alive: a client's requests reuse one connection
  # The headers and the body go out in two writes: with Nagle's algorithm on, the body would wait for
  # the client's delayed ACK of the headers (40 ms on Linux) at every request.
  disable_nagle_algorithm = True
  server: _Server
  server_version = "recsys_jax-serve"

  def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
    pass  # a line per request would cost more than the request; errors are in the answers

  def _send(self, status: int, body: Dict[str, Any], extra: Optional[Dict[str, str]] = None) -> None:
    self._send_bytes(status, {"Content-Type": "application/json", **(extra or {})}, json.dumps(body).encode("utf-8"))

  def _send_bytes(self, status: int, headers: Dict[str, str], data: bytes) -> None:
    self.send_response(status)
    self.send_header("Content-Length", str(len(data)))
    for k, v in headers.items():
      self.send_header(k, v)
    self.end_headers()
    self.wfile.write(data)

  def _skip_body(self) -> bool:
    """Reads and drops the body of a request refused before reading it, if it is not too large, so that
    the client, still sending it, gets the answer and the connection carries the next request."""
    length = self.headers.get("Content-Length")
    if length is None:
      return self.headers.get("Transfer-Encoding") is None  # no body at all
    if not length.isdigit() or int(length) > _MAX_SKIP:
      return False
    left = int(length)
    while left > 0:
      chunk = self.rfile.read(min(left, 1 << 16))
      if not chunk:
        return False
      left -= len(chunk)
    return True

  def _fail(self, e: FrontError, unread: bool = False) -> None:
    extra = {"WWW-Authenticate": "Bearer"} if e.http_status == 401 else {}
    if unread and not self._skip_body():  # the connection cannot carry another request
      extra["Connection"] = "close"
      self.close_connection = True
    self._send(e.http_status, e.body(), extra)

  def _route(self, method: str) -> bool:
    path = self.path.split("?", 1)[0]
    want = _ROUTES.get(path) or v2_rest.method(path)
    if want is None:
      try_ = sorted(_ROUTES) + ["/v2", "/v2/models/<name>", "/v2/models/<name>/infer"]
      self._fail(FrontError("not_found", f"no such path {path!r}; try {try_}"), unread=True)
      return False
    if want != method:
      extra = {"Allow": want}
      if not self._skip_body():
        extra["Connection"] = "close"
        self.close_connection = True
      self._send(405, {"error": f"{path} takes {want}, not {method}", "field": None, "record": None}, extra)
      return False
    try:
      self.server.front.authenticate(self.headers.get("Authorization"))
    except FrontError as e:
      self._fail(e, unread=True)
      return False
    return True

  def _v2(self, method: str, body: bytes) -> bool:
    """Answers a request of the Open Inference Protocol; False if the path is not one."""
    path = self.path.split("?", 1)[0]
    if path not in _ROUTES:
      self._send_bytes(*self.server.v2.handle(method, path, self.headers, body))
      return True
    return False

  def do_GET(self) -> None:  # noqa: N802 - the base class's name
    if not self._route("GET") or self._v2("GET", b""):
      return
    front = self.server.front
    self._send(200, front.model() if self.path.startswith("/v1/model") else front.health())

  def do_POST(self) -> None:  # noqa: N802 - the base class's name
    if not self._route("POST"):
      return
    length = self.headers.get("Content-Length")
    if length is None or not length.isdigit():
      self.close_connection = True
      self._send(
        411, {"error": "send the body with a Content-Length", "field": None, "record": None}, {"Connection": "close"}
      )
      return
    if int(length) > self.server.max_body_bytes:
      limit = self.server.max_body_bytes
      self._fail(FrontError("too_large", f"a body of {length} bytes is over the server's {limit}"), unread=True)
      return
    body = self.rfile.read(int(length))
    if self._v2("POST", body):
      return
    try:
      answer = self.server.front.predict(body)
    except FrontError as e:
      self._fail(e)
      return
    self._send(200, answer)

  def do_PUT(self) -> None:  # noqa: N802 - the base class's name
    self._route("PUT")

  do_DELETE = do_PATCH = do_PUT  # noqa: N815 - the base class's names


def serve_http(
  front: Front,
  host: str,
  port: int,
  max_body_bytes: int = 16 << 20,
  tls_cert: Optional[str] = None,
  tls_key: Optional[str] = None,
  backlog: int = DEFAULT_BACKLOG,
) -> Tuple[http.server.ThreadingHTTPServer, int, threading.Thread]:
  """Starts the HTTP server in a daemon thread.

  Args:
    front: the request handling.
    host, port: where to listen (port 0: a free one).
    max_body_bytes: larger bodies are refused with 413 before they are read.
    tls_cert, tls_key: paths of a PEM certificate chain and its key: serve HTTPS (both or neither).
    backlog: connections the kernel queues before they are accepted (capped by its somaxconn).

  Returns:
    The server (stop it with ``.shutdown()`` then ``.server_close()``), its port, its thread.

  Raises:
    RuntimeError: the address cannot be bound.
  """
  if (tls_cert is None) != (tls_key is None):
    raise ValueError("TLS needs both a certificate and a key")
  try:
    server = _Server((host, port), _Handler, backlog)
  except OSError as e:
    raise RuntimeError(f"cannot listen on {host}:{port} (HTTP): {e}") from None
  server.front, server.max_body_bytes, server.v2 = front, max_body_bytes, v2_rest.Routes(front)
  if tls_cert is not None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls_cert, tls_key)
    # The handshake happens on the connection's first read, in its own thread, not in the accept loop.
    server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
  thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="serve-http", daemon=True)
  thread.start()
  return server, server.server_address[1], thread
