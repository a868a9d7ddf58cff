"""``python -m recsys_jax.predict``, the command-line client, against a real server process (the
test model of ``tests.helpers.serve_fakes``): its scores are the server's, over HTTP and gRPC, and
bad input is one ``error:`` line naming what is wrong."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from recsys_jax.predict import read_records
from tests.helpers import serve_fakes as F
from tests.serving.test_serve import ROOT, start_server, stop_server


def _predict(*args, stdin=None):
  return subprocess.run(
    [sys.executable, "-m", "recsys_jax.predict", *args],
    input=stdin,
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=120,
  )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  w = tmp_path_factory.mktemp("served")
  F.publish(str(w), 42)
  p, hp, gp, _ = start_server(str(w))
  yield hp, gp
  stop_server(p)


def test_scores_records_over_http_and_grpc_as_the_model_does(server, tmp_path):
  hp, gp = server
  recs = F.records(5, seed=3)
  path = tmp_path / "records.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in recs))
  for side in (f"--http=127.0.0.1:{hp}", f"--grpc=127.0.0.1:{gp}"):
    for args, stdin in (([f"--records={path}"], None), (["--records=-"], json.dumps({"records": recs}))):
      out = _predict(side, *args, stdin=stdin)
      assert out.returncode == 0, out.stderr
      answer = json.loads(out.stdout.strip().splitlines()[-1])
      assert answer["version"] == "step-42"
      assert answer["scores"] == pytest.approx([F.reference(42, r) for r in recs], rel=1e-6)
  model = _predict(f"--http=127.0.0.1:{hp}", "--model")
  assert model.returncode == 0 and set(json.loads(model.stdout)["fields"]) == set(recs[0])


def test_bad_input_is_one_error_line(server, tmp_path):
  hp, _ = server
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"i0": 1.0}\nnot json\n')
  for args, code, words in (
    ([f"--records={bad}"], 2, ["--http=HOST:PORT or --grpc=HOST:PORT"]),
    ([f"--http=127.0.0.1:{hp}", f"--records={bad}"], 2, [f"{bad}:2", "not JSON"]),
    ([f"--http=127.0.0.1:{hp}", f"--records={tmp_path}/none.jsonl"], 2, ["--records=", "No such file"]),
    (["--http=localhost", "--model"], 2, ["expected HOST:PORT"]),
  ):
    out = _predict(*args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code and len(lines) == 1 and lines[0].startswith("error:"), (args, out.stderr)
    assert all(w in lines[0] for w in words), (words, lines[0])
  rec = F.records(1)[0]
  missing = dict(rec)
  name = sorted(missing)[0]
  del missing[name]
  out = _predict(f"--http=127.0.0.1:{hp}", "--records=-", stdin=json.dumps(missing))
  assert out.returncode == 1 and out.stderr.startswith("error: the server refused the request (400"), out.stderr
  assert repr(name) in out.stderr and "record 0" in out.stderr


def test_records_come_as_json_lines_a_list_or_a_request():
  recs = [{"a": 1}, {"a": 2}]
  for text in ("\n".join(json.dumps(r) for r in recs) + "\n", json.dumps(recs), json.dumps({"records": recs})):
    assert read_records(text, "f") == recs
  for text, words in (("", "empty"), ("[1, 2]", "record 0 is not a JSON object"), ('{"a": 1}\n[3]\n', "f:2")):
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
      read_records(text, "f")
