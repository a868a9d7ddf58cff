"""The HTTP side of the model server as an ASGI application under uvicorn (for people, curl and anything
that speaks HTTP).

- ``POST /v1/predict`` with ``{"records": [{...}, ...]}`` -> ``{"version": ..., "dense_version": ..., "row_version": ..., "scores": [...]}``
- ``GET /v1/model`` -> the version served, its step, its request fields, the reload counters
- ``GET /v1/health`` -> ``{"status": "serving", "version": ..., "dense_version": ..., "row_version": ...}``
- ``/v2/...``: the Open Inference Protocol (KServe v2), ``serving/v2/rest.py``

Errors are JSON ``{"error", "field", "record"}``: 400 (malformed JSON, a bad record: missing,
unknown or mistyped feature), 401 (a token is set and the request lacks ``Authorization:
Bearer <token>``), 404 (no such path), 405 (wrong method), 411 (no Content-Length), 413 (a body
over ``max_body_bytes`` or more records than ``--max_batch``), 503 (overloaded), 500 (the model
failed).

uvicorn (its ``httptools`` parser) reads requests on one event loop thread, so a slow or idle
connection holds no thread; a request whose body has arrived is answered in a pool of ``threads``
threads (the parsing, the micro-batcher's wait). HTTP/1.1 keep-alive; an idle connection is
closed after ``keep_alive_s``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading
from typing import Any, Dict, List, Optional, Tuple

import uvicorn

from recsys_jax.serving.front import Front, FrontError
from recsys_jax.serving.v2 import rest as v2_rest

_MAX_SKIP = 64 << 20  # bodies of refused requests up to this are read and dropped; larger ones close the connection
_ROUTES = {"/v1/predict": "POST", "/v1/model": "GET", "/v1/health": "GET"}
DEFAULT_BACKLOG = 1024
Reply = Tuple[int, Dict[str, str], bytes]


def _json(status: int, body: Dict[str, Any], extra: Optional[Dict[str, str]] = None) -> Reply:
  return status, {"Content-Type": "application/json", **(extra or {})}, json.dumps(body).encode("utf-8")


class _Headers(Dict[str, str]):
  """A request's headers by lower-case name; ``get`` takes any case."""

  def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
    return super().get(name.lower(), default)


def _unread(headers: Dict[str, str]) -> Dict[str, str]:
  """The headers of an answer given before the body was read: the connection closes when the body is too
  long to read and drop (uvicorn drops what follows an answer) so that it carries another request."""
  length = headers.get("content-length")
  return {"Connection": "close"} if length is not None and (not length.isdigit() or int(length) > _MAX_SKIP) else {}


def _error(e: FrontError, extra: Optional[Dict[str, str]] = None) -> Reply:
  return _json(
    e.http_status, e.body(), {**({"WWW-Authenticate": "Bearer"} if e.http_status == 401 else {}), **(extra or {})}
  )


class App:
  """The ASGI application: the routes over ``front``, bodies up to ``max_body_bytes``."""

  def __init__(self, front: Front, max_body_bytes: int, threads: int):
    self.front, self.max_body_bytes, self.v2 = front, max_body_bytes, v2_rest.Routes(front)
    self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="serve-http")

  async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
      return
    headers = _Headers((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"])
    status, out, body = await self._reply(scope["method"], scope["path"], headers, receive)
    raw: List[Tuple[bytes, bytes]] = [(b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in out.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})

  async def _reply(self, method: str, path: str, headers: Dict[str, str], receive: Any) -> Reply:
    want = _ROUTES.get(path) or v2_rest.method(path)
    if want is None:
      try_ = sorted(_ROUTES) + ["/v2", "/v2/models/<name>", "/v2/models/<name>/infer"]
      return _error(FrontError("not_found", f"no such path {path!r}; try {try_}"), _unread(headers))
    if want != method:
      error = {"error": f"{path} takes {want}, not {method}", "field": None, "record": None}
      return _json(405, error, {"Allow": want, **_unread(headers)})
    try:
      self.front.authenticate(headers.get("authorization"))
    except FrontError as e:
      return _error(e, _unread(headers))
    body = b""
    if method == "POST":
      length = headers.get("content-length")
      if length is None or not length.isdigit():
        error = {"error": "send the body with a Content-Length", "field": None, "record": None}
        return _json(411, error, {"Connection": "close"})
      if int(length) > self.max_body_bytes:
        limit = self.max_body_bytes
        return _error(
          FrontError("too_large", f"a body of {length} bytes is over the server's {limit}"), _unread(headers)
        )
      parts, more = [], True
      while more:
        message = await receive()
        if message["type"] == "http.disconnect":
          return 400, {"Connection": "close"}, b""  # nobody to answer
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
      body = b"".join(parts)
    loop = asyncio.get_running_loop()
    if path not in _ROUTES:
      return await loop.run_in_executor(self.pool, self.v2.handle, method, path, headers, body)
    if path == "/v1/predict":
      return await loop.run_in_executor(self.pool, self._predict, body)
    return _json(200, self.front.model() if path == "/v1/model" else self.front.health())

  def _predict(self, body: bytes) -> Reply:
    try:
      return _json(200, self.front.predict(body))
    except FrontError as e:
      return _error(e)


class HttpServer:
  """uvicorn serving ``App`` on a bound socket, in a daemon thread with its own event loop."""

  def __init__(self, app: App, sock: socket.socket, config: uvicorn.Config):
    self.app, self.socket = app, sock
    self.server_address = sock.getsockname()
    self.uvicorn = uvicorn.Server(config)
    self.thread = threading.Thread(target=self._run, name="serve-http", daemon=True)
    self._started = threading.Event()
    self.thread.start()
    self._started.wait(30)

  def _run(self) -> None:
    async def serve() -> None:
      self._started.set()
      await self.uvicorn.serve(sockets=[self.socket])

    asyncio.run(serve())

  def shutdown(self) -> None:
    """Stops accepting, lets the requests in flight finish, closes the connections."""
    self.uvicorn.should_exit = True
    self.thread.join(30)
    self.app.pool.shutdown(wait=False)

  def server_close(self) -> None:
    self.socket.close()


def serve_http(
  front: Front,
  host: str,
  port: int,
  max_body_bytes: int = 16 << 20,
  tls_cert: Optional[str] = None,
  tls_key: Optional[str] = None,
  backlog: int = DEFAULT_BACKLOG,
  threads: int = 64,
  keep_alive_s: float = 60.0,
) -> Tuple[HttpServer, int, threading.Thread]:
  """Starts the HTTP server in a daemon thread.

  Args:
    front: the request handling.
    host, port: where to listen (port 0: a free one).
    max_body_bytes: larger bodies are refused with 413 before they are read.
    tls_cert, tls_key: paths of a PEM certificate chain and its key: serve HTTPS (both or neither).
    backlog: connections the kernel queues before they are accepted (capped by its somaxconn).
    threads: requests handled at once (their bodies read; waiting for their batch).
    keep_alive_s: an idle connection is closed after this long.

  Returns:
    The server (stop it with ``.shutdown()`` then ``.server_close()``), its port, its thread.

  Raises:
    RuntimeError: the address cannot be bound.
  """
  if (tls_cert is None) != (tls_key is None):
    raise ValueError("TLS needs both a certificate and a key")
  # IPPROTO_TCP named: asyncio turns Nagle's algorithm off only on sockets that say they are TCP (with it on,
  # an answer's body, written after its headers, waited for the client's delayed ACK: 40 ms).
  sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
    sock.listen(backlog)
  except OSError as e:
    sock.close()
    raise RuntimeError(f"cannot listen on {host}:{port} (HTTP): {e}") from None
  app = App(front, max_body_bytes, threads)
  config = uvicorn.Config(
    app,
    http="httptools",
    loop="asyncio",
    lifespan="off",
    access_log=False,
    log_config=None,  # absl's logging stays as it is
    backlog=backlog,
    timeout_keep_alive=int(keep_alive_s),
    server_header=False,
    date_header=False,
    ssl_certfile=tls_cert,
    ssl_keyfile=tls_key,
  )
  server = HttpServer(app, sock, config)
  return server, server.server_address[1], server.thread
