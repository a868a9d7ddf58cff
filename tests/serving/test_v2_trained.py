"""The Open Inference Protocol on trained models: tritonclient's scores are ``/v1``'s and the trainer's.

The three tiny runs of ``test_scorer`` (synthetic DLRM: FP32 and UINT64 tensors; multi-hot DCN-v2:
UINT64 ``[-1, max_len]`` padded with 2**64 - 1; DLRM on Criteo TSV records: BYTES, its counts as decimal
text with ``""`` for a missing one) are served, and each one's eval set (512 records for the
synthetic runs, 300 Criteo lines) is sent in one request built from the model's metadata, over
HTTP (binary tensors and JSON) and gRPC: the scores equal ``/v1``'s for the same records bit for
bit, and the trainer's evaluation (``test_scorer.Reference``) within 1e-6. Bad tensors through
the real encoder are refused naming the tensor and the record.
"""

from __future__ import annotations

import numpy as np
import pytest

from recsys_jax.data import base
from recsys_jax.serving import scorer
from recsys_jax.serving.client import HttpClient
from recsys_jax.serving.server import ServerOptions, Serving
from tests.serving import v2_clients as V
from tests.serving.test_scorer import _records, _sigmoid, refs, runs  # noqa: F401 - the module's fixtures

SIDES = ["http", "http-json", "grpc"]


@pytest.fixture(scope="module")
def servers(runs):  # noqa: F811 - the fixture imported above
  out = {}
  for name, run in runs.items():
    o = ServerOptions(reload_every_s=0, max_wait_s=0.005, model_name=name)
    out[name] = Serving(run["workdir"], scorer.load_scorer, scorer.newest_step, o)
  yield out
  for s in out.values():
    s.stop()


def _inputs(c, side, name):
  meta = c.get_model_metadata(name, **({"as_json": True} if side == "grpc" else {}))
  return [{**t, "shape": [int(d) for d in t["shape"]]} for t in meta["inputs"]]


@pytest.mark.parametrize("name", ["dlrm", "dcn", "criteo"])
def test_scores_equal_v1_and_the_trainers_evaluation(runs, refs, servers, name):  # noqa: F811
  ref, s = refs[name], servers[name]
  cols, want = ref.eval_set()
  recs = _records(name, runs, ref, cols)
  assert len(recs) == base.num_records(cols) == (300 if name == "criteo" else 512)
  v1 = HttpClient("127.0.0.1", s.http_port).predict(recs)
  for side in SIDES:
    c = V.clients(s)["grpc" if side == "grpc" else "http"]
    mod = V.tgrpc if side == "grpc" else V.thttp
    inputs = _inputs(c, side, name)
    kinds = {t["name"]: (t["datatype"], t["shape"]) for t in inputs}
    if name == "criteo":  # counts INT64 as declared, but a missing one needs text: BYTES, "" missing
      assert kinds["I1"] == ("INT64", [-1]) and kinds["C1"] == ("BYTES", [-1])
      datatypes = {f"I{j}": "BYTES" for j in range(1, 14)}
    else:
      assert kinds["dense_00"] == ("FP32", [-1]), kinds
      assert kinds["cat_01"] == (("UINT64", [-1, 3]) if name == "dcn" else ("UINT64", [-1])), kinds
      datatypes = {}
    r = c.infer(name, V.tensors(mod, recs, inputs, binary=side != "http-json", **datatypes))
    got = r.as_numpy("score")
    assert got.dtype == np.float32 and got.tolist() == v1["scores"], side  # bit for bit
    np.testing.assert_allclose(got, _sigmoid(want), rtol=0, atol=1e-6)
    resp = r.get_response(as_json=True) if side == "grpc" else r.get_response()
    step = runs[name]["config"].num_steps
    assert resp["model_version"] == str(step) and v1["version"] == f"step-{step}"
    params = resp["parameters"]
    if side == "grpc":
      params = {k: v.get("string_param", v.get("int64_param")) for k, v in params.items()}
    assert {k: str(v) for k, v in params.items()} == {
      "version": f"step-{step}",
      "row_version": str(step),
      "dense_version": str(step),
    }


@pytest.mark.parametrize("side", SIDES)
def test_bad_values_refused_by_the_real_encoder_naming_tensor_and_record(runs, refs, servers, side):  # noqa: F811
  ref, s = refs["dcn"], servers["dcn"]
  cols, _ = ref.eval_set()
  recs = _records("dcn", runs, ref, cols)[:5]
  c = V.clients(s)["grpc" if side == "grpc" else "http"]
  mod = V.tgrpc if side == "grpc" else V.thttp
  inputs = _inputs(c, side, "dcn")
  good = c.infer("dcn", V.tensors(mod, recs, inputs, binary=side != "http-json")).as_numpy("score")
  cases = {
    "an infinite dense value": ([{**r, "dense_02": float("inf")} if i == 3 else r for i, r in enumerate(recs)], {}),
    "too many ids": ([{**r, "cat_01": [1, 2, 3, 4]} if i == 2 else r for i, r in enumerate(recs)], {}),
    "no id (all padding)": ([{**r, "cat_02": [(1 << 64) - 1]} if i == 1 else r for i, r in enumerate(recs)], {}),
    "text for an id": (recs, {"cat_00": "BYTES"}),
    "floats for ids": (recs, {"cat_03": "FP32"}),
  }
  where = {"an infinite dense value": ("dense_02", 3), "too many ids": ("cat_01", 2)}
  where.update(
    {"no id (all padding)": ("cat_02", 1), "text for an id": ("cat_00", 0), "floats for ids": ("cat_03", None)}
  )
  for case, (rs, datatypes) in cases.items():
    if side == "http-json" and case == "an infinite dense value":
      continue  # JSON has no infinity to send
    with pytest.raises(V.InferenceServerException) as e:
      c.infer("dcn", V.tensors(mod, rs, inputs, binary=side != "http-json", **datatypes))
    tensor, record = where[case]
    assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), (case, e.value)
    at = f"input '{tensor}'" + ("" if record is None else f", record {record}") + ":"
    assert e.value.message().startswith(at), (case, e.value.message())
    if record is None:
      assert "datatype FP32; this int feature is UINT64" in e.value.message(), e.value.message()
    again = c.infer("dcn", V.tensors(mod, recs, inputs, binary=side != "http-json")).as_numpy("score")
    assert again.tolist() == good.tolist(), case


def test_the_serving_pages_tritonclient_examples_work_as_written(servers, capsys):
  """docs/serving.md's two tritonclient examples, run as written but for the ports and the model's name."""
  import os

  from tests.serving.test_serve import ROOT

  with open(os.path.join(ROOT, "docs", "serving.md")) as f:
    text = f.read()
  text = text[text.index("## The Open Inference Protocol") :]
  blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:3]]
  assert "tritonclient.http" in blocks[0] and "tritonclient.grpc" in blocks[1]
  s = servers["dlrm"]
  for code in blocks:
    code = code.replace("localhost:8501", f"127.0.0.1:{s.http_port}").replace(
      "localhost:8500", f"127.0.0.1:{s.grpc_port}"
    )
    exec(compile(code.replace('"serving"', '"dlrm"'), "docs/serving.md", "exec"), {})
  out = capsys.readouterr().out.splitlines()
  assert len(out) == 2 and out[0].startswith("[") and "'dense_version': 12" in out[0] and out[1].endswith(" 12"), out
