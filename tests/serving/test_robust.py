"""Clients that misbehave on the HTTP side do not stop others from being answered within a second.

A slow client (its request one byte at a time, in the headers and in the body), a Content-Length
of 1 GB followed by a short body, and 1,000 idle keep-alive connections: while each is held open,
new connections' requests (``/v1`` and ``/v2``) are answered within a second, and the connection
that announced 1 GB is refused (413) at once, not read.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from recsys_jax.serving.client import HttpClient, ServeError
from recsys_jax.serving.server import ServerOptions, Serving
from tests.helpers import serve_fakes as F

GOOD = {"i1": 1.5, "i2": -2, "i3": 0.25, "c1": "a", "c2": "b"}
BODY = json.dumps({"records": [GOOD]}).encode()


@pytest.fixture
def server(tmp_path):
  F.publish(str(tmp_path), 100)
  s = Serving(str(tmp_path), F.load_scorer, F.newest_step, ServerOptions(reload_every_s=0, grpc_port=None))
  yield s
  s.stop()


def _others_answered(s, seconds: float) -> list:
  """For ``seconds``: a new connection's ``/v1`` predict and ``/v2`` readiness, in turn; the round trips that
  took a second or more (or failed)."""
  slow, end = [], time.monotonic() + seconds
  while time.monotonic() < end:
    c = HttpClient("127.0.0.1", s.http_port, timeout=2.0)
    t0 = time.monotonic()
    try:
      assert c.request("POST", "/v1/predict", BODY)["version"] == "step-100"
      resp, _ = c.send("GET", "/v2/health/ready")
      assert resp.status == 200
    except (OSError, http.client.HTTPException, ServeError) as e:
      slow.append(f"{type(e).__name__}: {e}")
    else:
      if time.monotonic() - t0 >= 1.0:
        slow.append(f"{time.monotonic() - t0:.2f} s")
    finally:
      c.close()
    time.sleep(0.05)
  return slow


def _trickle(so: socket.socket, data: bytes, every_s: float, stop: threading.Event) -> None:
  """Sends ``data`` on ``so`` one byte every ``every_s`` until it is sent or ``stop`` is set."""
  for b in data:
    if stop.wait(every_s):
      return
    so.send(bytes([b]))


def test_slow_clients_do_not_hold_up_others(server):
  """Two clients sending a byte every 0.5 s, one still in its headers, one in its body (a byte a second
  would only take longer to show the same)."""
  request = b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
  in_body = request.index(b"\r\n\r\n") + 6  # the headers and two bytes of the body
  stop = threading.Event()
  with (
    socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as a,
    socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as b,
  ):
    b.sendall(request[:in_body])
    threads = [
      threading.Thread(target=_trickle, args=args, daemon=True)
      for args in ((a, request, 0.5, stop), (b, request[in_body:], 0.5, stop))
    ]
    for t in threads:
      t.start()
    try:
      slow = _others_answered(server, 3.0)
    finally:
      stop.set()
      for t in threads:
        t.join()
  assert not slow, slow


def test_a_gigabyte_content_length_with_a_short_body_is_refused_at_once(server):
  with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as so:
    so.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n" + BODY)
    so.settimeout(1.0)
    resp = http.client.HTTPResponse(so)
    resp.begin()  # within the second, or socket.timeout
    assert resp.status == 413 and "1000000000" in json.loads(resp.read())["error"]
    assert resp.getheader("Connection", "").lower() == "close"
    # An announced body under the limit, never sent: that connection waits, the others do not.
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as waiting:
      waiting.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n" + BODY)
      assert not _others_answered(server, 1.5)


def test_a_thousand_idle_keep_alive_connections_do_not_hold_up_others(server):
  socks = []
  try:
    for _ in range(1000):  # each asks once and keeps its connection, idle
      so = socket.create_connection(("127.0.0.1", server.http_port), timeout=2)
      socks.append(so)
      so.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
    for so in socks:
      resp = http.client.HTTPResponse(so)
      resp.begin()
      assert resp.status == 200 and not resp.will_close
      resp.read()
    assert not _others_answered(server, 1.5)
  finally:
    for so in socks:
      so.close()
