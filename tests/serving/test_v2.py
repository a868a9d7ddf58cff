"""The Open Inference Protocol (KServe v2) as a client this project did not write speaks it.

tritonclient's HTTP and gRPC clients ask a server of the fake model (``serve_fakes``): health,
server and model metadata, inference (HTTP binary tensors, HTTP JSON, gRPC raw contents) whose
scores equal ``/v1``'s bit for bit; bad tensors refused naming the tensor (and the record), the
next good request answered; the token and TLS as ``/v1`` has them; the model name flag; and the
committed generated code is what ``generate.sh`` makes. The trained models: ``test_v2_trained``.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest

from recsys_jax.serving.client import HttpClient
from recsys_jax.serving.server import ServerOptions, Serving
from recsys_jax.serving.v2 import grpc_predict_v2_pb2 as pb
from tests.helpers import serve_fakes as F
from tests.serving import v2_clients as V
from tests.serving.test_serve import ROOT, start_server, stop_server

NAME = "ctr"
SIDES = ["http", "http-json", "grpc"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  w = str(tmp_path_factory.mktemp("w"))
  F.publish(w, 100)
  s = Serving(w, F.load_scorer, F.newest_step, ServerOptions(max_batch=8, reload_every_s=0, model_name=NAME))
  yield s
  s.stop()


def _client(s, side, **kw):
  return V.clients(s, **kw)["grpc" if side == "grpc" else "http"]


def _mod(side):
  return V.tgrpc if side == "grpc" else V.thttp


def _inputs(s):
  return V.metadata_inputs(V.clients(s)["http"], NAME)


def _v1(s, recs):
  return HttpClient("127.0.0.1", s.http_port).predict(recs)


def _infer(s, side, recs, headers=None, tls_ca=None, **datatypes):
  c = _client(s, side, tls_ca=tls_ca)
  ins = V.tensors(_mod(side), recs, _inputs(s), binary=side != "http-json", **datatypes)
  return c.infer(NAME, ins, headers=headers)


def test_health_and_metadata(server):
  want_inputs = [{"name": n, "datatype": "FP32", "shape": [-1]} for n in F.DENSE]
  want_inputs += [{"name": n, "datatype": "BYTES", "shape": [-1]} for n in F.CATS]
  for side, c in V.clients(server).items():
    assert c.is_server_live() and c.is_server_ready(), side
    assert c.is_model_ready(NAME) and c.is_model_ready(NAME, "100"), side
    assert not c.is_model_ready("other") and not c.is_model_ready(NAME, "99"), side
    meta = c.get_server_metadata(**({"as_json": True} if side == "grpc" else {}))
    assert meta["name"] == "recsys_jax" and "binary_tensor_data" in meta["extensions"], meta
    m = c.get_model_metadata(NAME, **({"as_json": True} if side == "grpc" else {}))
    assert m["name"] == NAME and m["versions"] == ["100"] and m["platform"] == "recsys_jax", m
    assert V.metadata_inputs(c, NAME) == want_inputs, side
    outs = [{**o, "shape": [int(d) for d in o["shape"]]} for o in m["outputs"]]
    assert outs == [{"name": "score", "datatype": "FP32", "shape": [-1]}]
    with pytest.raises(V.InferenceServerException, match="no model 'other'.*'ctr'"):
      c.get_model_metadata("other")


@pytest.mark.parametrize("side", SIDES)
def test_scores_equal_v1_bit_for_bit(server, side):
  recs = [{**r, "i1": float(np.float32(r["i1"]))} for r in F.records(8, seed=3)]  # FP32 carries float32 values
  want = _v1(server, recs)
  r = _infer(server, side, recs)
  got = r.as_numpy("score")
  assert got.dtype == np.float32 and got.shape == (8,)
  assert got.tolist() == want["scores"]  # the same float32 values
  resp = r.get_response(as_json=True) if side == "grpc" else r.get_response()
  assert resp["model_name"] == NAME and resp["model_version"] == "100"
  params = {k: (v.get("string_param") if isinstance(v, dict) else v) for k, v in resp["parameters"].items()}
  assert params == {"version": "step-100"}  # the fake knows no row or dense step: none is sent


def test_the_answer_carries_row_and_dense_versions_when_known(server, monkeypatch):
  from recsys_jax.serving.batcher import Prediction

  monkeypatch.setattr(server.front, "score", lambda recs: Prediction("rows-7.dense-5", [0.5] * len(recs), 5, 7, 3))
  recs = F.records(2, seed=1)
  r = _infer(server, "http", recs)
  assert r.get_response()["parameters"] == {"version": "rows-7.dense-5", "row_version": 7, "dense_version": 5}
  assert r.get_response()["model_version"] == "3"
  g = _infer(server, "grpc", recs).get_response()
  assert {k: g.parameters[k].int64_param for k in ("row_version", "dense_version")} == {
    "row_version": 7,
    "dense_version": 5,
  }
  assert g.parameters["version"].string_param == "rows-7.dense-5" and g.model_version == "3"


def _bad_cases(recs):
  """name -> (datatypes, a change to the tensors, the words the error must hold)."""
  return {
    "wrong datatype": ({"c1": "FP32"}, ("values", "c1"), ["'c1'", "datatype FP32", "BYTES"]),
    "wrong shape": ({}, ("i2", [len(recs), 2]), ["'i2'", "shape [3, 2]"]),
    "a missing feature": ({}, ("drop", "c2"), ["'c2'", "missing"]),
    "an unknown tensor": ({}, ("extra", "zz"), ["'zz'", "no such input"]),
    "rows that disagree": ({}, ("i3", [2]), ["'i3'"]),
    "a value the model refuses": ({"c2": "INT64"}, ("values", "c2"), ["'c2'", "record 0", "string"]),
  }


def _bad_tensors(mod, recs, inputs, datatypes, change, binary):
  if change and change[0] == "values":  # numbers where the feature holds strings
    recs = [{**r, change[1]: i + 7} for i, r in enumerate(recs)]
  ins = V.tensors(mod, recs, inputs, binary=binary, **datatypes)
  if change[0] == "values":
    return ins
  what, arg = change
  if what == "drop":
    return [x for x in ins if x.name() != arg]
  if what == "extra":
    x = mod.InferInput(arg, [len(recs)], "FP32")
    x.set_data_from_numpy(np.ones(len(recs), np.float32), **({"binary_data": binary} if mod is V.thttp else {}))
    return ins + [x]
  # (name, shape): that tensor with another shape
  x = mod.InferInput(what, arg, "FP32")
  x.set_data_from_numpy(np.ones(arg, np.float32), **({"binary_data": binary} if mod is V.thttp else {}))
  return [x if y.name() == what else y for y in ins]


@pytest.mark.parametrize("side", SIDES)
def test_bad_tensors_are_refused_naming_them_then_good_answered(server, side):
  recs = F.records(3, seed=5)
  inputs = _inputs(server)
  c, mod = _client(server, side), _mod(side)
  want = _v1(server, recs)["scores"]
  for case, (datatypes, change, words) in _bad_cases(recs).items():
    with pytest.raises(V.InferenceServerException) as e:
      c.infer(NAME, _bad_tensors(mod, recs, inputs, datatypes, change, side != "http-json"))
    status = "StatusCode.INVALID_ARGUMENT" if side == "grpc" else "400"
    assert e.value.status() == status, (case, e.value)
    for w in words:
      assert w in e.value.message(), (case, e.value.message())
    assert c.infer(NAME, V.tensors(mod, recs, inputs, binary=side != "http-json")).as_numpy("score").tolist() == want
  with pytest.raises(V.InferenceServerException) as e:  # more rows than --max_batch (8)
    c.infer(NAME, V.tensors(mod, F.records(9, seed=1), inputs, binary=side != "http-json"))
  assert e.value.status() == ("StatusCode.INVALID_ARGUMENT" if side == "grpc" else "413") and "max_batch" in str(
    e.value
  )
  with pytest.raises(V.InferenceServerException) as e:
    c.infer("other", V.tensors(mod, recs, inputs, binary=side != "http-json"))
  assert e.value.status() == ("StatusCode.NOT_FOUND" if side == "grpc" else "404"), e.value


def _post(s, path, body, headers=None):
  conn = http.client.HTTPConnection("127.0.0.1", s.http_port, timeout=30)
  conn.request("POST", path, body, headers or {})
  r = conn.getresponse()
  return r.status, r.read()


def test_malformed_http_requests_are_refused_and_the_connection_kept(server):
  path = f"/v2/models/{NAME}/infer"
  good = {"inputs": [{"name": n, "datatype": "FP32", "shape": [1], "data": [1.0]} for n in F.DENSE]}
  good["inputs"] += [{"name": n, "datatype": "BYTES", "shape": [1], "data": ["a"]} for n in F.CATS]
  cases = {
    "not JSON": (b"{", {}, "malformed JSON"),
    "no inputs": (b"{}", {}, "inputs"),
    "a string for FP32": (
      json.dumps({"inputs": [dict(good["inputs"][0], data=["1"])] + good["inputs"][1:]}),
      {},
      "'i1'",
    ),
    "too few values": (json.dumps({"inputs": [dict(good["inputs"][0], data=[])] + good["inputs"][1:]}), {}, "'i1'"),
    "binary past the body": (
      json.dumps({"inputs": [dict(good["inputs"][0], parameters={"binary_data_size": 4})]}),
      {},
      "'i1'",
    ),
    "a bad header length": (json.dumps(good), {"Inference-Header-Content-Length": "99999"}, "Inference-Header"),
    "compressed": (json.dumps(good), {"Content-Encoding": "gzip"}, "Content-Encoding"),
  }
  for case, (body, headers, words) in cases.items():
    status, out = _post(server, path, body, headers)
    assert status == 400 and words in json.loads(out)["error"], (case, status, out)
  status, out = _post(server, path, json.dumps(good))
  assert status == 200, out
  res = json.loads(out)
  assert res["outputs"][0]["data"] == _v1(server, [{**{n: 1.0 for n in F.DENSE}, **{n: "a" for n in F.CATS}}])["scores"]


def _meta_inputs(c, side, **kw):
  meta = c.get_model_metadata(NAME, **kw, **({"as_json": True} if side == "grpc" else {}))
  return [{**t, "shape": [int(d) for d in t["shape"]]} for t in meta["inputs"]]


def test_token_on_both_protocols(tmp_path):
  F.publish(str(tmp_path), 100)
  o = ServerOptions(reload_every_s=0, token="s3cret", model_name=NAME)
  s = Serving(str(tmp_path), F.load_scorer, F.newest_step, o)
  try:
    recs = F.records(2, seed=2)
    want = HttpClient("127.0.0.1", s.http_port, token="s3cret").predict(recs)["scores"]
    for side in SIDES:
      key = "authorization" if side == "grpc" else "Authorization"
      good, bad = {key: "Bearer s3cret"}, {key: "Bearer nope"}
      c, mod = _client(s, side), _mod(side)
      for headers in (None, bad):
        with pytest.raises(V.InferenceServerException) as e:
          c.get_model_metadata(NAME, headers=headers)
        assert e.value.status() in ("401", "StatusCode.UNAUTHENTICATED"), (side, e.value)
      ins = V.tensors(mod, recs, _meta_inputs(c, side, headers=good), binary=side != "http-json")
      with pytest.raises(V.InferenceServerException, match="token"):
        c.infer(NAME, ins, headers=bad)
      assert c.infer(NAME, ins, headers=good).as_numpy("score").tolist() == want, side
  finally:
    s.stop()


def test_tls_on_both_protocols(tmp_path, self_signed_cert):
  cert, key = self_signed_cert
  F.publish(str(tmp_path), 100)
  o = ServerOptions(reload_every_s=0, tls_cert=str(cert), tls_key=str(key), model_name=NAME)
  s = Serving(str(tmp_path), F.load_scorer, F.newest_step, o)
  try:
    recs = F.records(4, seed=4)
    want = HttpClient("127.0.0.1", s.http_port, tls_ca=str(cert)).predict(recs)["scores"]
    for side in SIDES:
      c = _client(s, side, tls_ca=cert)
      assert c.is_server_ready() and c.is_model_ready(NAME), side
      got = c.infer(NAME, V.tensors(_mod(side), recs, _meta_inputs(c, side), binary=side != "http-json"))
      got = got.as_numpy("score")
      assert got.tolist() == want, side
    with pytest.raises(V.InferenceServerException):  # plaintext to the TLS port
      V.clients(s)["grpc"].is_server_live(client_timeout=5)
  finally:
    s.stop()


def test_grpc_typed_contents_are_taken_too(server):
  """``contents`` instead of ``raw_input_contents`` (what other KServe clients send), with the stock gRPC stub."""
  recs = F.records(3, seed=6)
  req = pb.ModelInferRequest(model_name=NAME, id="r1")
  for n in F.DENSE:
    t = req.inputs.add(name=n, datatype="FP32", shape=[3])
    t.contents.fp32_contents.extend([r[n] for r in recs])
  for n in F.CATS:
    t = req.inputs.add(name=n, datatype="BYTES", shape=[3])
    t.contents.bytes_contents.extend([r[n].encode() for r in recs])
  with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
    call = ch.unary_unary(
      "/inference.GRPCInferenceService/ModelInfer",
      request_serializer=pb.ModelInferRequest.SerializeToString,
      response_deserializer=pb.ModelInferResponse.FromString,
    )
    res = call(req, timeout=30)
  want = _v1(server, [{**r, **{n: float(np.float32(r[n])) for n in F.DENSE}} for r in recs])["scores"]
  assert res.id == "r1" and np.frombuffer(res.raw_output_contents[0], "<f4").tolist() == want


def test_model_name_flag_and_default(tmp_path):
  w = tmp_path / "my-run"
  w.mkdir()
  F.publish(str(w), 100)
  for args, name in ((["--model_name=ctr-v2"], "ctr-v2"), ([], "my-run")):
    p, hp, gp, _ = start_server(str(w), "--reload_every_s=0", *args)
    try:
      assert V.thttp.InferenceServerClient(f"127.0.0.1:{hp}").is_model_ready(name)
      assert V.tgrpc.InferenceServerClient(f"127.0.0.1:{gp}").is_model_ready(name)
    finally:
      stop_server(p)


def test_the_generated_code_is_what_generate_sh_makes(tmp_path):
  here = os.path.join(ROOT, "recsys_jax", "serving", "v2")
  for f in ("generate.sh", "grpc_predict_v2.proto"):
    shutil.copy(os.path.join(here, f), tmp_path / f)
  env = dict(os.environ, PYTHON=sys.executable)
  subprocess.run(["sh", str(tmp_path / "generate.sh")], check=True, env=env, capture_output=True, timeout=120)
  with open(os.path.join(here, "grpc_predict_v2_pb2.py")) as f:
    assert (tmp_path / "grpc_predict_v2_pb2.py").read_text() == f.read()
  with open(os.path.join(here, "grpc_predict_v2.proto")) as f:
    assert (
      "package inference;" in f.read()
    )  # the protocol's package: tritonclient calls /inference.GRPCInferenceService/...
