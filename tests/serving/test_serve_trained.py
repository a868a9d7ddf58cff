"""``python -m recsys_jax.serve`` on a real training run: the answers are the model's own scores.

A tiny DLRM run (``configs/tiny.py``) is trained with checkpoints, served in a subprocess with
the default model module (``recsys_jax.serving.scorer``), and asked over HTTP and gRPC; each
answer must equal what ``load_scorer`` of the step the answer names scores in this process.
Then the run is resumed for more steps while the server serves: the server must pick up the
newer checkpoint by itself, and its answers must match that step's scores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from recsys_jax.serving import scorer as scorer_lib
from recsys_jax.serving.client import GrpcClient, HttpClient, ServeError
from tests.serving.test_serve import ROOT, start_server, stop_server


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
        pytest.fail(f"this test draws floats and ints only; field {f} holds {kind}")
    out.append(r)
  return out


def _expected(workdir, step, recs):
  sc = scorer_lib.load_scorer(workdir, step)
  return np.asarray(sc.predict(sc.encode(recs)), np.float64)


@pytest.mark.slow  # two training runs and a server: about 40 s on 2 shared cores
def test_serves_a_run_and_picks_up_its_new_checkpoints(tmp_path):
  w = str(tmp_path / "run")
  _train(w, 20)
  p, hp, gp, version = start_server(w, "--reload_every_s=0.5", model_module=None)
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
    stop_server(p)


def test_the_readmes_curl_example_works_as_written(tmp_path):
  """The serving page's commands (docs/serving.md), run as written but for the workdir, a short run and free ports."""
  import re
  import shlex

  text = open(os.path.join(ROOT, "docs", "serving.md")).read()
  block = text[text.index("# Serving") :]
  block = block[block.index("```bash") + len("```bash") : block.index("```", block.index("```bash") + 7)]
  lines = [ln.split("#")[0].strip() for ln in block.strip().splitlines()]
  train_cmd, serve_cmd = lines[0], lines[1]
  curl = " ".join(lines[3:])  # the predict call continues over several lines
  assert (
    train_cmd.startswith("python -m recsys_jax.main --config=configs/dlrm.py") and "--workdir=runs/serving" in train_cmd
  )
  assert serve_cmd.startswith("python -m recsys_jax.serve --workdir=runs/serving")
  w = str(tmp_path / "dlrm")
  args = shlex.split(train_cmd.replace("runs/serving", w))[1:]
  args = [a for a in args if not a.startswith(("--config.num_steps", "--config.checkpoint_every"))]
  subprocess.run(
    [sys.executable, *args, "--config.num_steps=2", "--config.eval_samples=16384", "--config.progress_bar=False"],
    check=True,
    cwd=ROOT,
    capture_output=True,
    timeout=600,
  )
  p, hp, _, version = start_server(w, model_module=None)
  try:
    assert version == "step-2"
    argv = shlex.split(curl.replace("localhost:8501", f"localhost:{hp}"))
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout
    answer = json.loads(out)
    assert answer["version"] == "step-2" and len(answer["scores"]) == 1 and 0 < answer["scores"][0] < 1, out
    model = json.loads(subprocess.run(shlex.split(lines[2].replace("8501", str(hp))), capture_output=True).stdout)
    assert model["version"] == "step-2"
    sent = json.loads(re.search(r"-d '(.*)'", curl).group(1))["records"][0]
    assert sorted(sent) == sorted(model["fields"]), "the serving page's record must name every field of the model"
  finally:
    stop_server(p)
