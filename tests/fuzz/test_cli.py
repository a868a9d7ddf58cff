"""``python -m tests.fuzz`` runs as a user runs it: a fresh process, a tiny run of one target.

What is checked is what a run promises (exit 0, its last JSON line parses, with the totals'
keys, and a ``wrote <absolute path>`` line for each file it writes), never what it finds:
two inputs find nothing. The long run is tests/test_bad_inputs.py's slow test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL_KEYS = {"target", "tried", "clear", "accepted", "crashes", "hangs", "wall_s", "seed", "budget_s"}


def test_a_tiny_fuzz_run_exits_0_and_writes_its_json(tmp_path):
  out = tmp_path / "fuzz.json"
  cmd = [sys.executable, "-m", "tests.fuzz", "--examples=2", "--targets=config"]
  cmd += [f"--crash_dir={tmp_path / 'crashes'}", f"--json_out={out}"]
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TMPDIR=str(tmp_path))
  p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
  assert p.returncode == 0, f"exit {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
  lines = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
  assert [x["target"] for x in lines] == ["config", "total"], p.stdout
  total = lines[-1]
  assert TOTAL_KEYS <= set(total), sorted(total)
  assert total["tried"] > 0 and total["crashes"] == 0 and total["hangs"] == 0, total
  wrote = [ln[len("wrote ") :] for ln in p.stdout.splitlines() if ln.startswith("wrote ")]
  assert wrote == [str(out)], p.stdout
  assert [json.loads(ln) for ln in out.read_text().splitlines()] == lines
