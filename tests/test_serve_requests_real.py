"""Bad records through the real model: the serving front with ``recsys_jax.serving.scorer`` on a
trained run, so each refusal comes from the real encoder (``serving/encode.py``), not from the
fake model's own checks that ``test_serve_requests`` exercises.

Each case must be refused over HTTP (400) and gRPC (INVALID_ARGUMENT) naming the field and the
record, and the next good request must be answered with the scores the same checkpoint gives in
this process.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_serve_requests import BAD

from recsys_jax import train
from recsys_jax.serving import scorer as scorer_lib
from recsys_jax.serving.client import GrpcClient, HttpClient, ServeError
from recsys_jax.serving.server import Serving


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """A 3-step tiny DLRM run (synthetic data: float and int fields), served by the real scorer."""
  from configs import tiny

  c = tiny.get_config()
  c.num_steps, c.eval_samples, c.eval_batch_size = 3, 1024, 1024
  w = str(tmp_path_factory.mktemp("run"))
  train.train_and_evaluate(c, w)
  s = Serving(w, scorer_lib.load_scorer, scorer_lib.newest_step, max_batch=8, max_wait_s=0.001, reload_every_s=0)
  yield s, scorer_lib.load_scorer(w)
  s.stop()


DROP = object()  # a field left out of the record


def _good(fields, i=0):
  return {f: (0.25 * i + 0.5 if kind == "float" else 3 * i + 1) for f, kind in fields.items()}


def _cases(fields):
  """name -> (records, field, record index): the fake's record-level cases, on this model's fields."""
  floats = [f for f, k in fields.items() if k == "float"]
  ints = [f for f, k in fields.items() if k == "int"]
  assert floats and ints and set(fields) == set(floats) | set(ints), fields
  good = _good(fields)

  def bad(**kv):
    r = dict(good, **kv)
    return [good, {k: v for k, v in r.items() if v is not DROP}]

  f, n = floats[0], ints[-1]
  return {
    "missing feature": (bad(**{n: DROP}), n),
    "missing dense feature": (bad(**{f: DROP}), f),
    "unknown feature": (bad(zz=1.0), "zz"),
    "wrong type (string for float)": (bad(**{f: "1.5"}), f),
    "wrong type (bool for float)": (bad(**{f: True}), f),
    "wrong type (string for int)": (bad(**{n: "a"}), n),
    "wrong type (fraction for int)": (bad(**{n: 1.5}), n),
    "wrong type (bool for int)": (bad(**{n: True}), n),
    "wrong type (list for int)": (bad(**{n: [1, 2]}), n),
    "null value": (bad(**{f: None}), f),
    "a record not an object": ([good, [1, 2]], "records"),
  }


# The fake model's record-level cases (a field and a record named) must all have a real-model twin.
_RECORD_LEVEL = {name for name, (_, _, field, record) in BAD.items() if record is not None}


def test_every_record_level_case_of_the_fake_is_here_too(served):
  mine = set(_cases(served[1].fields()))
  missing = {c for c in _RECORD_LEVEL if c not in mine and c.replace("number for string", "string for int") not in mine}
  assert not missing, missing


@pytest.mark.parametrize("side", ["http", "grpc"])
def test_bad_records_refused_by_the_real_encoder_then_good_answered(served, side):
  s, sc = served
  fields = sc.fields()
  goods = [_good(fields, i) for i in range(3)]
  want = np.asarray(sc.predict(sc.encode(goods)), np.float64)
  c = HttpClient("127.0.0.1", s.http_port) if side == "http" else GrpcClient(f"127.0.0.1:{s.grpc_port}")
  try:
    for case, (records, field) in _cases(fields).items():
      body = json.dumps({"records": records}).encode()
      with pytest.raises(ServeError) as e:
        if side == "http":
          c.request("POST", "/v1/predict", body)
        else:
          c.call("Predict", body)
      assert e.value.status == (400 if side == "http" else "INVALID_ARGUMENT"), (case, e.value)
      assert (e.value.field, e.value.record) == (field, 1), (case, e.value)
      assert field in e.value.message, (case, e.value)
      a = c.predict(goods)
      assert a["version"] == sc.version
      np.testing.assert_allclose(a["scores"], want, rtol=1e-6, err_msg=case)
  finally:
    c.close()
