"""Online training on a stream (``config.data.stream_dir``, ``num_steps=-1``).

The reference is one uninterrupted run over a stream whose files are all in place; every other
run reads the same records and must end, at staleness k = 0, with the same dense weights and the
same PS rows (values and optimizer slots), bit for bit: a run stopped mid-stream and restarted, a
run whose files arrive while it trains, a run stopped by a malformed record and resumed, and a
``python -m recsys_jax.main`` stopped by SIGTERM (which exits 0 with its final checkpoint).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from recsys_jax import train
from recsys_jax.data import base
from tests.helpers.run_outcome import checkpoint_contents

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = (("a.csv", 300, None), ("b.csv", 250, 40), ("c.csv", 200, None))  # (name, records, bad line)
B = 64
STEPS = (300 + 249 + 200) // B  # 11: the 45 records left over wait for more data
BAD = "b.csv:40: field 'd1'"


def _write(directory, name, n, bad_line, seed, mtime=None):
  """A CSV file written under a temporary name and renamed into place, as a pipeline writes one."""
  rng = np.random.default_rng(seed)
  tmp = os.path.join(directory, f".{name}.inprogress")
  with open(tmp, "w") as f:
    f.write("label,d1,c1,c2,rid\n")
    for i in range(n):
      c1, c2 = int(rng.zipf(1.3)) % 300, rng.integers(0, 30)
      y = int(rng.random() < 1 / (1 + np.exp(-(c1 % 3 - 1 + (c2 > 15)))))
      d1 = "x" if i + 2 == bad_line else rng.poisson(3)  # +2: 1-based, after the header
      f.write(f"{y},{d1},u{c1},v{c2},{seed}-{i}\n")
  if mtime is not None:
    os.utime(tmp, (mtime, mtime))
  os.rename(tmp, os.path.join(directory, name))


def _write_stream(directory, arrive=None):
  """The stream's files, all at once, or (``arrive``: seconds apart) from a writer thread."""
  os.makedirs(directory, exist_ok=True)
  if arrive is None:
    for k, (name, n, bad) in enumerate(FILES):
      _write(directory, name, n, bad, seed=k, mtime=1000 * (k + 1))
    return None

  def writer():
    for k, (name, n, bad) in enumerate(FILES):
      if k:
        time.sleep(arrive)
      _write(directory, name, n, bad, seed=k)

  t = threading.Thread(target=writer)
  t.start()
  return t


def _eval_file(directory):
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "eval.csv")
  if not os.path.exists(path):
    _write(directory, "eval.csv", 256, None, seed=99)
  return path


def stream_config(stream_dir, eval_path):
  from configs import tiny

  c = tiny.get_config()
  c.num_steps = -1  # until the stream ends
  c.batch_size = B
  c.log_every = 1
  c.checkpoint_every = 4
  c.max_checkpoints = 10
  c.eval_samples = 0
  c.eval_batch_size = 128
  c.host_workers = 1
  c.hot_warmup_steps = 2  # hot rows chosen before the stops below
  c.hot_every = 3
  c.hot_min_count = 1
  # Admission counts every lookup: a lookup made past a stop's cut would be counted twice.
  c.embeddings.admit_after = 2
  c.data.name = "csv"
  c.data.stream_dir = str(stream_dir)
  c.data.stream_poll_s = 0.05
  c.data.stream_idle_exit_s = 0.6
  c.data.eval_files = (str(eval_path),)
  c.data.dense = ("d1",)
  c.data.categorical = ("c1", "c2", "rid")
  c.data.chunk_records = 50  # the stops fall mid-chunk and mid-file
  c.data.on_bad_record = "skip"
  return c


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """(config, workdir, summary) of the uninterrupted run over the whole stream."""
  root = tmp_path_factory.mktemp("stream_ref")
  _write_stream(root / "stream")
  c = stream_config(root / "stream", _eval_file(root / "eval"))
  s = train.train_and_evaluate(c, str(root / "run"))
  assert s["steps"] == STEPS and s["bad_records_skipped"] == 1, s
  return c, str(root / "run"), s


def _assert_same_model(c, workdir, ref_workdir, step):
  want_params, want_rows = checkpoint_contents(c, ref_workdir, step)
  got_params, got_rows = checkpoint_contents(c, workdir, step)
  assert sorted(got_params) == sorted(want_params) and sorted(got_rows) == sorted(want_rows)
  for k in want_params:
    np.testing.assert_array_equal(got_params[k], want_params[k], err_msg=k)
  for t in want_rows:
    assert sorted(got_rows[t]) == sorted(want_rows[t]), t
    for k in want_rows[t]:
      np.testing.assert_array_equal(got_rows[t][k], want_rows[t][k], err_msg=f"{t}/{k}")


def _stop_after(step, stop):
  """An ``on_metrics`` that requests a stop once the train record of ``step`` is written."""

  def on_metrics(at, kind, values):
    if kind == "train" and at >= step:
      stop.set()

  return on_metrics


def _checkpoint_steps(workdir):
  return sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())


@pytest.mark.parametrize("when", ["between_steps", "during_a_step"])
def test_a_restart_mid_stream_equals_the_uninterrupted_run(reference, tmp_path, monkeypatch, when):
  """Stopped (the SIGTERM path, in process) mid-file and mid-chunk, then restarted: the restart
  continues at the next record, and the end is the uninterrupted run's, every row and weight. The
  stop arrives after step 5's metrics are written (the loop is between steps; the lookup of step 5
  may have been made, and it is then trained first) or while step 5 trains (no lookup of step 6
  may enter the checkpoint)."""
  ref_c, ref_dir, ref = reference
  c = ref_c.copy_and_resolve_references()
  workdir = str(tmp_path / "run")
  stop = threading.Event()
  on_metrics = None
  if when == "between_steps":
    on_metrics = _stop_after(5, stop)
  else:
    real = train._train_step

    def train_step(job, progress, t, *args):
      out = real(job, progress, t, *args)
      if t == 5:
        stop.set()
      return out

    monkeypatch.setattr(train, "_train_step", train_step)
  first = train.train_and_evaluate(c, workdir, on_metrics=on_metrics, stop=stop)
  monkeypatch.undo()
  stopped_at = first["steps"]
  assert stopped_at in ((5, 6) if when == "between_steps" else (6,)), stopped_at  # 5 * 64: in b.csv, mid-chunk
  assert _checkpoint_steps(workdir)[-1] == stopped_at
  second = train.train_and_evaluate(c, workdir)
  assert second["resumed_from"] == stopped_at and second["steps"] == STEPS
  assert second["bad_records_skipped"] == ref["bad_records_skipped"] == 1
  _assert_same_model(c, workdir, ref_dir, STEPS)


def test_files_arriving_while_the_trainer_runs_are_trained_in_order(reference, tmp_path):
  """The files are renamed into the directory one by one while the trainer runs (it waits for
  each): the run ends where the run over the files all in place ends, bit for bit."""
  ref_c, ref_dir, _ = reference
  c = ref_c.copy_and_resolve_references()
  c.data.stream_dir = str(tmp_path / "stream")
  c.data.stream_idle_exit_s = 2.5
  writer = _write_stream(tmp_path / "stream", arrive=1.0)
  try:
    s = train.train_and_evaluate(c, str(tmp_path / "run"))
  finally:
    writer.join()
  assert s["steps"] == STEPS and s["bad_records_skipped"] == 1
  _assert_same_model(c, str(tmp_path / "run"), ref_dir, STEPS)


def test_a_malformed_record_mid_stream_is_named_and_nothing_trained_is_lost(reference, tmp_path):
  """Under on_bad_record='error' the run stops at the first batch that reads the chunk holding
  b.csv's line 40 (chunks are parsed whole), naming the line, with a checkpoint of the steps before
  that batch (none was due: checkpoint_every=0); resumed under 'skip', it ends as the reference."""
  ref_c, ref_dir, _ = reference
  c = ref_c.copy_and_resolve_references()
  c.data.on_bad_record = "error"
  c.checkpoint_every = 0
  workdir = str(tmp_path / "run")
  reached = 300 // B  # 4: step 4's batch ends a.csv and starts b.csv's first chunk (lines 2-51)
  with pytest.raises(base.BadRecordError, match=rf"{BAD}.*training stopped before step {reached}; checkpoint at step"):
    train.train_and_evaluate(c, workdir)
  assert _checkpoint_steps(workdir) == [reached]
  c.data.on_bad_record = "skip"
  s = train.train_and_evaluate(c, workdir)
  assert s["resumed_from"] == reached and s["steps"] == STEPS
  _assert_same_model(c, workdir, ref_dir, STEPS)


def test_sigterm_ends_an_endless_run_with_its_checkpoint_and_exit_0(reference, tmp_path):
  """``python -m recsys_jax.main`` with num_steps=-1 and no idle exit waits for files forever; SIGTERM
  ends it: exit 0, a final checkpoint at the step reached (the stream's last full batch), equal to
  the reference's."""
  ref_c, ref_dir, _ = reference
  cfg = tmp_path / "stream_config.py"
  cfg.write_text(
    "from tests.training import test_stream_training as t\n\n\ndef get_config():\n"
    f"  c = t.stream_config({ref_c.data.stream_dir!r}, {ref_c.data.eval_files[0]!r})\n"
    "  c.data.stream_idle_exit_s = 0.0\n  return c\n"
  )
  workdir = tmp_path / "run"
  p = subprocess.Popen(
    [sys.executable, "-m", "recsys_jax.main", f"--config={cfg}", f"--workdir={workdir}"],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None:
      try:
        with open(workdir / "metrics.jsonl") as f:
          steps = [r["step"] for r in map(json.loads, f) if r["kind"] == "train"]
      except (FileNotFoundError, json.JSONDecodeError):
        steps = []
      if steps and steps[-1] == STEPS:
        break
      time.sleep(0.2)
    time.sleep(0.5)  # it waits for a file that does not come
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  assert p.returncode == 0, err[-3000:]
  assert "SIGTERM: stopping" in err and f"stop requested: stopping at step {STEPS}" in err, err[-3000:]
  assert _checkpoint_steps(str(workdir))[-1] == STEPS
  with open(workdir / "summary.json") as f:
    assert json.load(f)["steps"] == STEPS
  _assert_same_model(ref_c, str(workdir), ref_dir, STEPS)


def test_progressive_metrics_per_stream_file(reference):
  """Each batch's progressive scores also count in the window of the file it ends in: every file
  gets records under its name, and their events add up to every trained event."""
  _, ref_dir, _ = reference
  with open(os.path.join(ref_dir, "metrics.jsonl")) as f:
    records = [r for r in map(json.loads, f) if r["kind"] == "progressive"]
  overall = [r for r in records if "source" not in r]
  assert overall and overall[-1]["events_seen"] == STEPS * B
  last = {}
  for r in records:
    if "source" in r:
      last[r["source"]] = r["events_seen"]
  assert set(last) == {name for name, _, _ in FILES}, last
  assert sum(last.values()) == STEPS * B, last


def test_the_console_follows_the_stream_and_an_empty_file_is_skipped(tmp_path):
  """``python -m recsys_jax.main`` on a stream (progress bar off) says each file it starts training,
  skips an empty file between two good ones under 'skip' (named in the summary's bad records), and a
  restart says where in the stream it goes on, not 'of -1'."""
  stream_dir, eval_path = tmp_path / "stream", _eval_file(tmp_path / "eval")
  stream_dir.mkdir()
  _write(stream_dir, "a.csv", 300, None, seed=0, mtime=1000)
  (stream_dir / "b.csv").write_bytes(b"")
  os.utime(stream_dir / "b.csv", (2000, 2000))
  _write(stream_dir, "c.csv", 200, None, seed=2, mtime=3000)
  cfg = tmp_path / "stream_config.py"
  cfg.write_text(
    "from tests.training import test_stream_training as t\n\n\ndef get_config():\n"
    f"  c = t.stream_config({str(stream_dir)!r}, {str(eval_path)!r})\n"
    "  c.progress_bar = False\n  c.log_every = 100\n  return c\n"
  )
  args = [sys.executable, "-m", "recsys_jax.main", f"--config={cfg}", f"--workdir={tmp_path / 'run'}"]
  r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  lines = r.stderr.splitlines()
  assert [x for x in lines if x.startswith("stream: ")] == [
    "stream: training a.csv (step 0, 0 file(s) read before it)",
    "stream: training c.csv (step 4, 2 file(s) read before it)",
  ], lines
  with open(tmp_path / "run" / "summary.json") as f:
    s = json.load(f)
  assert s["steps"] == 500 // B and s["bad_records_skipped"] == 1, s
  assert f"{stream_dir}/b.csv:0: field '<file>'" in s["bad_record_examples"][0] and "empty file" in r.stdout
  _write(stream_dir, "d.csv", 100, None, seed=3, mtime=4000)
  r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  resumed = [x for x in r.stderr.splitlines() if x.startswith("resumed from ")]
  assert resumed == [
    f"resumed from {tmp_path / 'run' / 'checkpoints'}/{500 // B} at step {500 // B} (num_steps=-1: until the "
    f"stream ends or the run is stopped), reading on at c.csv record {500 // B * B - 300} (2 file(s) read before it)"
  ], r.stderr[-3000:]
  # c.csv's last 52 records and d.csv's first 12 are step 7's batch, which ends in d.csv.
  assert [x for x in r.stderr.splitlines() if x.startswith("stream: ")] == [
    "stream: training d.csv (step 7, 3 file(s) read before it)"
  ]
  assert "bad records   1 skipped (counted by the run before the resume" in r.stdout
