"""Every bad request the serving front refuses, over HTTP and gRPC, and that the next good one is answered.

Also: the token (401 / UNAUTHENTICATED), loopback by default, and the answers' scores against
``serve_fakes.reference``.
"""

from __future__ import annotations

import functools
import http.client
import json
import socket

import grpc
import pytest

from recsys_jax.serving.client import GrpcClient, HttpClient, ServeError
from recsys_jax.serving.grpc_service import SERVICE
from recsys_jax.serving.server import ServerOptions, Serving
from tests.helpers import serve_fakes as F

GOOD = {"i1": 1.5, "i2": -2, "i3": 0.25, "c1": "a", "c2": "b"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  w = str(tmp_path_factory.mktemp("w"))
  F.publish(w, 100)
  s = Serving(
    w, F.load_scorer, F.newest_step, ServerOptions(max_batch=8, max_wait_s=0.001, reload_every_s=0, max_body_bytes=4096)
  )
  yield s
  s.stop()


def _clients(s):
  return {"http": HttpClient("127.0.0.1", s.http_port), "grpc": GrpcClient(f"127.0.0.1:{s.grpc_port}")}


def _good_answered(c):
  recs = F.records(3, seed=11) + [GOOD]
  a = c.predict(recs)
  assert a["version"] == "step-100"
  assert a["scores"] == pytest.approx([F.reference(100, r) for r in recs], rel=1e-5)


def _with(**kv):
  r = dict(GOOD, **kv)
  return {k: v for k, v in r.items() if v is not _DROP}


_DROP = object()

# name -> (body bytes, HTTP status, field, record)
BAD = {
  "missing feature": (json.dumps({"records": [GOOD, _with(c2=_DROP)]}), 400, "c2", 1),
  "unknown feature": (json.dumps({"records": [_with(zz=1.0)]}), 400, "zz", 0),
  "wrong type (string for float)": (json.dumps({"records": [_with(i1="1.5")]}), 400, "i1", 0),
  "wrong type (number for string)": (json.dumps({"records": [_with(c1=7)]}), 400, "c1", 0),
  "wrong type (bool for float)": (json.dumps({"records": [_with(i3=True)]}), 400, "i3", 0),
  "null value": (json.dumps({"records": [_with(i2=None)]}), 400, "i2", 0),
  "oversized batch": (json.dumps({"records": [GOOD] * 9}), 413, "records", None),
  "malformed JSON": ('{"records": [{"i1": 1.0,', 400, None, None),
  "NaN": ('{"records": [{"i1": NaN}]}', 400, None, None),
  "not UTF-8": (b'{"records": ["\xff"]}', 400, None, None),
  "not an object": (json.dumps([GOOD]), 400, None, None),
  "records missing": (json.dumps({"rows": [GOOD]}), 400, "rows", None),
  "records not a list": (json.dumps({"records": GOOD}), 400, "records", None),
  "records empty": (json.dumps({"records": []}), 400, "records", None),
  "a record not an object": (json.dumps({"records": [GOOD, [1, 2]]}), 400, "records", 1),
  "deeply nested": ('{"records": ' + "[" * 1900 + "]" * 1900 + "}", 400, None, None),  # past the recursion limit
}


@pytest.mark.parametrize("side", ["http", "grpc"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_then_good(server, side, case):
  body, status, field, record = BAD[case]
  body = body.encode("utf-8") if isinstance(body, str) else body
  c = _clients(server)[side]
  with pytest.raises(ServeError) as e:
    if side == "http":
      c.request("POST", "/v1/predict", body)
    else:
      c.call("Predict", body)
  assert e.value.status == (status if side == "http" else "INVALID_ARGUMENT"), e.value
  assert e.value.field == field and e.value.record == record, e.value
  if field is not None:
    assert repr(field) in e.value.message or field in e.value.message
  _good_answered(c)
  c.close()


def _raw(port, request: bytes) -> tuple[int, dict]:
  with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
    sock.sendall(request)
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    return resp.status, json.loads(resp.read())


def test_http_only_refusals(server):
  p = server.http_port
  c = HttpClient("127.0.0.1", p)
  big = json.dumps({"records": [dict(GOOD, c1="x" * 5000)]}).encode()
  cases = [
    (lambda: c.request("POST", "/v1/predict", big), 413),
    (lambda: c.request("GET", "/v1/predict"), 405),
    (lambda: c.request("POST", "/v1/model", b"{}"), 405),
    (lambda: c.request("GET", "/v2/nothing"), 404),
    (lambda: c.request("POST", "/v2/nothing", b"{}"), 404),
  ]
  for call, status in cases:
    with pytest.raises(ServeError) as e:
      call()
    assert e.value.status == status, e.value
    _good_answered(c)
  # A body far over the limit is read and dropped, so that the client, still sending it, reads the 413.
  with pytest.raises(ServeError) as e:
    c.request("POST", "/v1/predict", b" " * (8 << 20))
  assert e.value.status == 413
  _good_answered(c)
  status, body = _raw(p, b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
  assert status == 411 and "Content-Length" in body["error"]
  _good_answered(c)
  assert c.model()["fields"] == F.LinearScorer(0).fields() and c.health()["version"] == "step-100"


def test_grpc_message_over_the_limit(server):
  c = GrpcClient(f"127.0.0.1:{server.grpc_port}")
  with pytest.raises(ServeError) as e:
    c.call("Predict", json.dumps({"records": [dict(GOOD, c1="x" * 5000)]}).encode())
  assert e.value.status == "RESOURCE_EXHAUSTED"
  _good_answered(c)
  assert c.model()["version"] == "step-100"


def test_token_is_required_when_set(tmp_path):
  F.publish(str(tmp_path), 100)
  s = Serving(str(tmp_path), F.load_scorer, F.newest_step, ServerOptions(token="s3cret", reload_every_s=0))
  try:
    for token in (None, "wrong", "s3cret "):
      h, g = HttpClient("127.0.0.1", s.http_port, token=token), GrpcClient(f"127.0.0.1:{s.grpc_port}", token=token)
      for call in (functools.partial(h.predict, [GOOD]), h.health, h.model):
        with pytest.raises(ServeError) as e:
          call()
        assert e.value.status == 401
      for call in (functools.partial(g.predict, [GOOD]), g.health, g.model):
        with pytest.raises(ServeError) as e:
          call()
        assert e.value.status == "UNAUTHENTICATED"
    _good_answered(HttpClient("127.0.0.1", s.http_port, token="s3cret"))
    _good_answered(GrpcClient(f"127.0.0.1:{s.grpc_port}", token="s3cret"))
    # The raw gRPC metadata, as any client would send it.
    ch = grpc.insecure_channel(f"127.0.0.1:{s.grpc_port}")
    out = ch.unary_unary(f"/{SERVICE}/Health")(b"", metadata=(("authorization", "Bearer s3cret"),), timeout=30)
    assert json.loads(out)["version"] == "step-100"
  finally:
    s.stop()


def _non_loopback_address():
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
      u.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
      ip = u.getsockname()[0]
  except OSError:
    return None
  return None if ip.startswith("127.") else ip


def test_loopback_by_default(server):
  assert server.http.server_address[0] == "127.0.0.1"
  ip = _non_loopback_address()
  if ip is None:
    pytest.skip("this machine has no address besides loopback to try")
  for port in (server.http_port, server.grpc_port):
    with pytest.raises(OSError):
      socket.create_connection((ip, port), timeout=5).close()


def test_tls_on_both_sides(tmp_path, self_signed_cert):
  cert, key = self_signed_cert
  w = tmp_path / "w"
  w.mkdir()
  F.publish(str(w), 100)
  s = Serving(
    str(w), F.load_scorer, F.newest_step, ServerOptions(tls_cert=str(cert), tls_key=str(key), reload_every_s=0)
  )
  try:
    _good_answered(HttpClient("127.0.0.1", s.http_port, tls_ca=str(cert)))
    _good_answered(GrpcClient(f"localhost:{s.grpc_port}", tls_ca=cert.read_bytes()))
    with pytest.raises((ConnectionError, http.client.HTTPException)):
      HttpClient("127.0.0.1", s.http_port, timeout=10).predict([GOOD])  # plaintext to a TLS server
    with pytest.raises(ServeError) as e:
      GrpcClient(f"127.0.0.1:{s.grpc_port}", timeout=10).predict([GOOD])
    assert e.value.status == "UNAVAILABLE"
  finally:
    s.stop()


def test_a_burst_of_idle_connections_does_not_delay_a_request(tmp_path):
  """300 connections opened at once and left idle: every connect and the next request are prompt
  (with socketserver's backlog of 5, connects past it waited a SYN retransmit, about 1 s)."""
  import time

  F.publish(str(tmp_path), 100)
  s = Serving(str(tmp_path), F.load_scorer, F.newest_step, ServerOptions(reload_every_s=0, grpc_port=None))
  socks = []
  try:
    for _ in range(300):
      so = socket.socket()
      so.setblocking(False)
      so.connect_ex(("127.0.0.1", s.http_port))
      socks.append(so)
    t0 = time.monotonic()
    pending = list(socks)
    import select

    while pending and time.monotonic() - t0 < 10:
      _, w, _ = select.select([], pending, [], 1.0)
      pending = [p for p in pending if p not in w]
    connect_s = time.monotonic() - t0
    t0 = time.monotonic()
    _good_answered(HttpClient("127.0.0.1", s.http_port))
    request_s = time.monotonic() - t0
  finally:
    for so in socks:
      so.close()
    s.stop()
  assert not pending and connect_s < 0.5 and request_s < 0.5, (len(pending), connect_s, request_s)


def test_server_options_refuse_a_certificate_without_its_key():
  with pytest.raises(ValueError, match="TLS needs both --tls_cert and --tls_key"):
    ServerOptions(tls_cert="cert.pem")
  with pytest.raises(ValueError, match="TLS needs both"):
    ServerOptions(tls_key="key.pem")
  assert ServerOptions(tls_cert="c", tls_key="k").tls_key == "k"
