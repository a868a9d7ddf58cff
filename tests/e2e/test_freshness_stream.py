"""Fresh rows reach the real server's scores exactly when they should, with every part a real process.

``experiments/bench_freshness.py --stream`` runs the trainer on a stream a writer fills, the model
server applying its row deltas, a client process and a prober; its JSON lists per event (a new id, or
a known id with its label turned over, written into the stream) the first answer scored with rows of
the step that trained the event and the first answer whose score for that id moved. Here, for a
short run, each event's score must move at exactly that answer (not before its rows came: the score
would move for another reason; not after or never: the rows came and changed nothing), no request
may fail and no answer's dense or row version may be older than an earlier one's.

Slow (about a minute: four processes start, the trainer compiles): ``pytest -m slow tests/e2e/test_freshness_stream.py``.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_stream_events_move_scores_with_their_rows(tmp_path):
  out = tmp_path / "fresh_stream.json"
  args = ["--stream", "--duration_s=6", "--ratio_pairs=0", "--clients=1", "--rate=20", "--event_every_s=0.3"]
  args += ["--publish_every_s=0.1", "--publish_dense_every_s=1", "--set=hot_rows_bytes=0"]
  args += [f"--workdir={tmp_path / 'work'}", f"--json_out={out}"]  # the run's logs and stream stay for a look
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TMPDIR=str(tmp_path))
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "bench_freshness.py"), *args]
  p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
  rec = json.loads(out.read_text())
  main = rec["main"]
  each = main["each"]  # [kind, id, step that trains it, first answer with its rows, first answer with its score moved]
  assert {e[0] for e in each} == {"new", "flip"}, each
  before = [e for e in each if e[4] is not None and (e[3] is None or e[4] < e[3])]
  after = [e for e in each if e[3] is not None and (e[4] is None or e[4] > e[3])]
  no_rows = [e for e in each if e[3] is None and e[4] is None]
  assert not before, f"scores that moved before their rows were served: {before}"
  assert not after, f"rows served that did not move their score at once (or ever): {after}"
  assert not no_rows, f"events whose rows no answer was scored with: {no_rows}"
  assert rec["failed"] == main["probe_failed"] == 0, (rec["failed"], main.get("examples"))
  assert rec["versions_backwards"] == 0, main.get("examples")
  assert main["requests"] > 0 and main["steps"] > 0, main
  assert 0 < rec["freshness_p50_s"] <= rec["freshness_max_s"], rec
