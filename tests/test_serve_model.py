"""``python -m recsys_jax.serve`` on a real training run: the answers are the model's own scores.

A tiny DLRM run (``configs/tiny.py``) is trained with checkpoints, served in a subprocess with
the default model module (``recsys_jax.serving.scorer``), and asked over HTTP and gRPC; each
answer must equal what ``load_scorer`` of the step the answer names scores in this process.
Then the run is resumed for more steps while the server serves: the server must pick up the
newer checkpoint by itself, and its answers must match that step's scores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from test_serve_process import ROOT, _start, _stop

scorer_lib = pytest.importorskip(
  "recsys_jax.serving.scorer", reason="the model side of serving is not in this checkout"
)

from recsys_jax.serving.client import GrpcClient, HttpClient, ServeError  # noqa: E402


def _train(workdir, steps):
  cmd = [sys.executable, "-m", "recsys_jax.main", "--config=configs/tiny.py", f"--workdir={workdir}"]
  cmd += [f"--config.num_steps={steps}", "--config.checkpoint_every=10", "--config.eval_samples=4096"]
  subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=600)


def _records(fields, n, seed):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    r = {}
    for f, kind in fields.items():
      if kind == "float":
        r[f] = float(np.round(rng.exponential(1.0), 3))
      elif kind == "int":
        r[f] = int(rng.integers(0, 50))
      else:
        pytest.skip(f"this test draws floats and ints only; field {f} holds {kind}")
    out.append(r)
  return out


def _expected(workdir, step, recs):
  sc = scorer_lib.load_scorer(workdir, step)
  return np.asarray(sc.predict(sc.encode(recs)), np.float64)


@pytest.mark.slow  # two training runs and a server: about 40 s on 2 shared cores
def test_serves_a_run_and_picks_up_its_new_checkpoints(tmp_path):
  w = str(tmp_path / "run")
  _train(w, 20)
  p, hp, gp, version = _start(w, "--reload_every_s=0.5", model_module=None)
  try:
    assert version == "step-20"
    h, g = HttpClient("127.0.0.1", hp), GrpcClient(f"127.0.0.1:{gp}")
    fields = h.model()["fields"]
    recs = _records(fields, 37, seed=0)
    want = _expected(w, 20, recs)
    for c in (h, g):
      a = c.predict(recs)
      assert a["version"] == "step-20"
      np.testing.assert_allclose(a["scores"], want, rtol=1e-5, atol=1e-6)
    missing = dict(recs[0])
    name = sorted(missing)[0]
    del missing[name]
    with pytest.raises(ServeError) as e:
      h.predict([recs[1], missing])
    assert e.value.status == 400 and e.value.field == name and e.value.record == 1
    _train(w, 40)  # resumes from step 20 while the server serves
    deadline = time.monotonic() + 120
    while h.predict(recs[:1])["version"] != "step-40":
      assert time.monotonic() < deadline, h.model()
      time.sleep(0.2)
    a = g.predict(recs)
    assert a["version"] == "step-40"
    np.testing.assert_allclose(a["scores"], _expected(w, 40, recs), rtol=1e-5, atol=1e-6)
    assert not np.allclose(a["scores"], want)  # training moved the model: the test sees a reload
    assert os.path.isdir(w)
  finally:
    _stop(p)
