"""The host half of the main job, fed to a no-op (or tiny) device step: how many samples/s it can feed.

    python experiments/bench_feed.py [--sources=tsv,cache,synthetic] [--batch_sizes=2048,8192,65536]
        [--workers=1,2] [--step=noop] [--step=tiny] [--records=400000] [--baseline=/path/to/checkout]
        [--json_out=FILE] [--smoke]

Run from the repository root. Every setting (source x batch x workers) is one run of the main job,
``recsys_jax.train.train_and_evaluate`` of ``configs/dlrm.py`` (Criteo's shape: 13 dense and 26
categorical fields, rows of dim 16, Adagrad rows, the in-process PS), in a fresh subprocess and a
fresh workdir (under ``--data_dir``, removed after it), set through the config's public fields:

- ``--step=noop``: ``config.device_step = 'none'``: the jitted step returns zero row gradients of
  the rows' shapes and the state unchanged, so the run measures only the host half: read -> parse
  -> dedup -> PS lookup -> placement on the device -> pull of the row gradients -> push (Adagrad
  on the PS). ``tiny`` keeps the real step, with bottom and top MLPs of width 16.
- ``config.final_checkpoint = False``: no PS snapshot at the end (written after the timed steps,
  it would only cost time and disk).
- ``config.log_every``: the train records of metrics.jsonl fall at the end of the warm-up and of
  the run; their figures are what this script reports.

Sources:

- ``tsv``: Criteo TSV files written by ``experiments/bench_readers.py``'s generator (``--records``
  records in files of 100k, kept under ``--data_dir``), read by the ``criteo`` reader.
- ``cache``: the same files through the preprocessed binary cache (``config.data.cache_dir``),
  warmed by one pass first; skipped, with the reason, where the checkout has no cache.
- ``synthetic``: the synthetic reader (``recsys_jax/data/synthetic.py``), each batch generated on
  the host workers as the run goes: no files or parsing, the generator in their place.

Samples/s counts the steps after one pass over the ``--records`` (at least ``--warmup_steps``:
compiles, worker start, first window) to the last: the train records' intervals (``train_s``,
timed by the loop once every push of the interval is in) after the warm-up. The first pass
creates every row of the PS (its lookups and pushes took about 3x the CPU of later passes' on
the TSV data at batch 8192: 20 ms a batch against 6), which a long run over far more data than
this does far less often; ``first_pass_samples_per_s`` reports that pass (after its first record,
which compiles). Per-stage times are milliseconds per batch, wall and CPU (``thread_time`` of the
thread doing the stage), recorded by the pipeline itself (``recsys_jax/training/stage_times.py``,
the train records' ``host_<stage>_ms``): ``read`` (the reader's iterator: with host workers, the
feeder thread cutting files, gathering batches and waiting for parses; without, the parsing too),
``parse`` (the format's parse of a chunk, or its read from the cache), ``prepare`` (dedup),
``resolve`` (the cold ids' rows found or created before the staleness gate, and the batch part
packed), ``lookup``, ``place``, ``get`` (the pull of the row gradients), ``push``, and ``wait`` (the
training loop waiting for its next batch: the time a device would sit idle). Stages overlap (they
run on different threads), so their sum exceeds the wall time per batch.

What the process spends per sample, over the timed steps (``--gil``, on by default; py-spy must
be able to attach, see ``experiments/gil_sampler.py``): ``gil_us_per_sample``, the microseconds
per sample some thread held the interpreter lock (py-spy's ``--gil`` sampling at 1,000 a second:
samples / rate / samples fed), the figure that bounds what more cores can give (at 0.3 us a
sample the lock alone allows 3.3M samples/s on any number of cores); ``gil_top``, the innermost
frames that held it most; ``process_cpu_us_per_sample``, the whole process's CPU (user + system,
every thread, XLA's and numba's too); ``thread_cpu_us_per_sample``, the same by thread name
(``host-worker``, ``prefetcher``, ``pusher``, ...); ``cpu_us_per_sample``, the stage threads' CPU
as the pipeline records it (the sum of the ``*_cpu_ms`` stages); ``minor_faults_per_step`` and
``gc_ms_per_step`` (page faults, and the cyclic collector's pauses, which hold the lock).
``--gil_raw_dir`` keeps py-spy's raw stacks; with ``--cpu_profile`` they are every running
thread's, native frames too (a CPU profile; ``gil_us_per_sample`` is then no lock figure).
``--png_out`` plots samples/s and each stage's time against the worker counts.

A setting that fails prints one line naming it and why (its whole output goes to a log file the
line names); the others still run and print, and the script exits 1. ``--smoke`` is the test
suite's tiny sweep (one cached file of 8192 records, batch 1024): it checks that the script runs
and measures nothing.

The floor: the bytes a batch must move, read plus written, at this machine's memcpy rate
(``bench_ps.memcpy_bandwidth``, one thread, measured in the same run): the source bytes read
and the parsed columns written, the ids read and inverse written by dedup, each distinct row
read from the PS and written to the step's buffer, the step's inputs copied to the device, the
row gradients copied back, and the push's gradients read with the rows and Adagrad
accumulators read and written. ``floor_ratio`` = measured samples/s / floor samples/s.

``--baseline=DIR`` runs each source x batch once more with the code of the checkout ``DIR``
(e.g. main) and one worker, interleaved with the settings of this checkout, so that both see
the same machine load; ``vs_baseline`` = samples/s / the baseline's.

With ``--repeats=N`` every setting runs N times, interleaved; the median run is reported (of an
even number, the faster of the middle two: with 2 runs, the faster run, for every code alike), with
all runs' samples/s (``runs_samples_per_s``).

With the tiny step, ``step_alone_ms`` is the jitted step alone on the run's last batch (a fresh
job, blocking on each step) and ``device_idle_fraction`` = 1 - steps x that / the run's time: the
share of the time the device would wait for the host. (``loop_wait_fraction``, the loop's own
wait for its next batch, also counts the step itself at k = 0, where the next lookup waits for
this step's push.)

Prints a table, then one JSON line per setting: ``feed_samples_per_s``, ``source``, ``batch``,
``workers``, ``cores``, ``step``, the per-stage ``*_ms`` (wall) and ``*_cpu_ms``,
``floor_samples_per_s``, ``floor_ratio``, ``load_avg``, and the lock and CPU figures above.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from absl import app, flags
from bench_ps import memcpy_bandwidth  # experiments/bench_ps.py (its flags too)
from harness import outputs
from harness.gil import GilSampler  # py-spy --gil attached to this process

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HERE = os.path.dirname(os.path.abspath(__file__))

_SOURCES = flags.DEFINE_list("sources", ["tsv", "cache", "synthetic"], "Sources: tsv, cache, synthetic.")
_BATCHES = flags.DEFINE_list("batch_sizes", ["2048", "8192", "65536"], "Batch sizes.")
_WORKERS = flags.DEFINE_list("workers", None, "Host worker counts (default: 1 and the core count).")
_STEP = flags.DEFINE_multi_enum(
  "step", ["noop"], ["noop", "tiny"], "Device steps (repeat the flag for both): none, or DLRM with MLPs of width 16."
)
_RECORDS = flags.DEFINE_integer("records", 400_000, "Records of the generated TSV files (one pass: the warm-up).")
_SAMPLES = flags.DEFINE_integer("samples", 2_000_000, "Samples per setting (at least --min_steps steps).")
_MIN_STEPS = flags.DEFINE_integer("min_steps", 12, "Steps per setting at least, warmup included.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 3, "Steps not timed.")
_DATA_DIR = flags.DEFINE_string(
  "data_dir", outputs.default("bench_feed_data"), "Where the generated files and the cache are kept."
)
_BASELINE = flags.DEFINE_string("baseline", None, "A checkout to run with one worker for comparison.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON lines to this file.", allow_override=True)
_PNG_OUT = flags.DEFINE_string(
  "png_out", None, "Plot samples/s and each stage's time against the worker counts, per source and batch (PNG)."
)
_TRANSFER = flags.DEFINE_bool(
  "transfer", False, "Only measure what handing parsed chunks back from worker processes would cost (no runs)."
)
_REPEATS = flags.DEFINE_integer("repeats", 1, "Runs of each setting (the median is reported; of 2, the faster).")
_SETTING = flags.DEFINE_string("setting", None, "(internal) run one setting, given as JSON, in this process.")
_GIL = flags.DEFINE_bool(
  "gil",
  True,
  "Sample the interpreter lock over the timed steps with py-spy (gil_us_per_sample; experiments/gil_sampler.py).",
)
_GIL_RAW = flags.DEFINE_string("gil_raw_dir", None, "Also keep py-spy's raw GIL stacks of each setting in this folder.")
_CPU_PROFILE = flags.DEFINE_bool(
  "cpu_profile",
  False,
  "With --gil_raw_dir: keep every running thread's stacks there, native frames too (a CPU profile, to find where "
  "time goes), instead of the lock holder's; gil_us_per_sample then counts every thread and is no lock figure.",
)
_SMOKE = flags.DEFINE_bool("smoke", False, "A tiny sweep that checks the script runs (the test suite's; no figure).")

SMOKE = {
  "sources": ["cache"],
  "batch_sizes": ["1024"],
  "workers": ["1"],
  "records": 8192,
  "samples": 8192,
  "min_steps": 4,
}

FILE_RECORDS = 100_000
EVAL_RECORDS = 4096


def cores() -> int:
  return len(os.sched_getaffinity(0))


# -- data -------------------------------------------------------------------------------------


def write_criteo(path: str, records: int, seed: List[int]) -> None:
  """Writes ``records`` Criteo TSV records with bench_readers' generator, in a child process
  (bench_readers and bench_ps both define a ``--json_out`` flag, so one process imports one)."""
  if os.path.exists(path):
    return
  code = (
    "import numpy as np; from bench_readers import criteo_text; "
    f"open({os.path.abspath(path) + '.tmp'!r}, 'wb').write(criteo_text({records}, np.random.default_rng({seed})))"
  )
  subprocess.run([sys.executable, "-c", code], check=True, cwd=_HERE)  # -c imports from its cwd: bench_readers
  os.replace(path + ".tmp", path)
  outputs.wrote(path)


def criteo_files(data_dir: str, records: int, seed: int = 0) -> Dict[str, Any]:
  """Criteo TSV files of ``records`` records in all, in files of FILE_RECORDS, written once and kept."""
  d = os.path.join(data_dir, f"criteo_{records}_{seed}")
  os.makedirs(d, exist_ok=True)
  train = []
  for i, a in enumerate(range(0, records, FILE_RECORDS)):
    train.append(os.path.join(d, f"day_{i}"))
    write_criteo(train[-1], min(FILE_RECORDS, records - a), [seed, i])
  ev = os.path.join(d, "eval")
  write_criteo(ev, EVAL_RECORDS, [seed, 999])
  return {"train": train, "eval": ev, "bytes_per_record": sum(os.path.getsize(p) for p in train) / records}


# -- one setting, in a child process -------------------------------------------------------------


def interval_steps(records: List[Dict[str, Any]], after: int, upto: int) -> List[Tuple[int, Dict[str, Any]]]:
  """(steps in the interval, record) of the train records whose interval lies in (after, upto]."""
  out, prev = [], 0
  for r in records:
    if after <= prev and r["step"] <= upto:
      out.append((r["step"] - prev, r))
    prev = r["step"]
  return out


def run_setting(s: Dict[str, Any]) -> Dict[str, Any]:
  """Runs the main job for one setting; returns its figures (see the module docstring)."""
  import jax
  from absl import logging

  # configs and recsys_jax of s["code_root"]: child() runs this process with PYTHONPATH set to it
  from configs import dlrm
  from recsys_jax import train
  from recsys_jax.data import readers
  from recsys_jax.training.pipeline import StalenessGate

  logging.set_verbosity(logging.WARNING)
  B, n, L = s["batch"], s["steps"], s["log_every"]
  c = dlrm.get_config()
  for field in ("device_step", "final_checkpoint"):
    if field not in c:
      raise ValueError(f"this checkout has no config.{field}: bench_feed measures through it")
  # Past the timed steps by more than the feed runs ahead of the loop (its workers + 2 queued,
  # the prefetcher's depth), so that every stage thread still runs when the window closes at
  # step n (a thread that ended has no CPU time left to read).
  c.batch_size, c.num_steps = B, n + -(-(s["workers"] + 8) // L) * L
  c.checkpoint_every = c.eval_every = 0
  c.final_checkpoint = False  # the PS snapshot would only cost time and disk
  c.log_every = L  # each train record times its interval and the host's stages in it
  c.progress_bar = False
  c.eval_batch_size = EVAL_RECORDS
  c.eval_samples = EVAL_RECORDS
  c.host_workers = s["workers"]
  c.device_step = "none" if s["step"] == "noop" else "model"
  if s["step"] == "tiny":
    c.model.kwargs.bottom, c.model.kwargs.top = (16,), (16,)
  if s["source"] in ("tsv", "cache"):
    c.data.name = "criteo"
    c.data.train_files, c.data.eval_files = tuple(s["files"]["train"]), (s["files"]["eval"],)
    c.data.cache_dir = s["cache_dir"] if s["source"] == "cache" else "none"
  workdir = s["workdir"]
  if s["source"] == "cache":  # warm the cache: one pass over every file (quick once an earlier setting did it)
    for _, pos in readers.build_reader(c, workdir=workdir).train():
      if pos["epoch"] >= 1:  # every file read to its end: its manifest and every chunk written
        break
  load0 = os.getloadavg()[0]
  sampler = GilSampler(raw_out=s.get("gil_raw"), native=False, gil_only=not s.get("cpu_profile"))
  window = SampledWindow(s["warmup"], n, sampler if s.get("gil") else None)
  try:
    summary = train.train_and_evaluate(c, workdir, on_metrics=window.on_metrics)
  except BaseException:
    window.abandon()  # the run's own error is the one to report
    raise
  gil = window.result()
  recs = train.read_metrics(workdir, "train")
  w, w0 = s["warmup"], s["first_timed"]
  timed = interval_steps(recs, w, n)  # warmup and n are multiples of L: whole intervals
  steps_timed = sum(k for k, _ in timed)
  if steps_timed != n - w:
    raise RuntimeError(f"train records cover {steps_timed} of the {n - w} timed steps: {[r['step'] for r in recs]}")
  elapsed = sum(r["train_s"] for _, r in timed)
  first = interval_steps(recs, w0, w)  # the first pass, after the interval that compiled
  first_pass = sum(k for k, _ in first) * B / sum(r["train_s"] for _, r in first) if first else float("nan")

  def mean(key: str) -> float:  # per step over the timed steps (NaN: the code records no such metric)
    return sum(k * r.get(key, float("nan")) for k, r in timed) / steps_timed

  tables, features, _ = train.build_specs(c, readers.build_reader(c, workdir=workdir).schema)
  dim, F = min(t.dim for t in tables), len(features)
  rows, bucket = mean("rows_per_step"), mean("bucket_rows_per_step")
  col_bytes = 4 + 4 * c.data.num_dense + 8 * F
  source_bytes = {"tsv": (s["files"] or {}).get("bytes_per_record"), "cache": col_bytes, "synthetic": 0.0}[s["source"]]
  row = 4 * dim
  per_batch = {
    "parse": B * (source_bytes + col_bytes),  # source read, columns written
    "dedup": B * F * (8 + 4) + rows * 8,  # ids read, inverse and distinct ids written
    "lookup": 2 * rows * row,  # rows read from the PS, written to the step's buffer
    "place": 2 * (bucket * row + B * (F * 4 + 4 * c.data.num_dense + 4)),  # host -> device copy
    "get": 2 * bucket * row,  # row gradients device -> host
    "push": rows * row * (1 + 2 + 2),  # gradients read; rows and Adagrad accumulators read + written
  }
  floor_s = sum(per_batch.values()) / s["memcpy_bytes_per_s"]
  sps = steps_timed * B / elapsed
  out = {
    "feed_samples_per_s": sps,
    "source": s["source"],
    "batch": B,
    "workers": s["workers"],
    "cores": cores(),
    "step": s["step"],
    "code": s["code_root"],
    "steps_timed": steps_timed,
    "first_pass_samples_per_s": first_pass,
    "job_samples_per_s": summary["samples_per_sec"],
    "distinct_rows_per_batch": rows,
    "bytes_per_batch": float(sum(per_batch.values())),
    "floor_samples_per_s": B / floor_s,
    "floor_ratio": sps / (B / floor_s),
    "loop_wait_fraction": mean("host_wait_ms") * steps_timed / 1e3 / elapsed,  # the loop waiting for its next batch
    "load_avg": [load0, os.getloadavg()[0]],
  }
  for stage in STAGES:
    out[f"{stage}_ms"] = mean(f"host_{stage}_ms")
    out[f"{stage}_cpu_ms"] = mean(f"host_{stage}_cpu_ms")
  # The stage threads' CPU, and the whole process's over the sampled window (every thread: XLA's,
  # the loop's, the feeder's), per sample; the lock-held time over the same window.
  out["cpu_us_per_sample"] = 1e3 * sum(out[f"{stage}_cpu_ms"] for stage in STAGES) / B
  out["gil_us_per_sample"] = out["process_cpu_us_per_sample"] = out["gil_fraction"] = None
  if gil is not None:
    per_sample = 1e6 / (gil["wall_s"] * sps)  # us per sample of each second of the window
    out["gil_us_per_sample"] = gil["gil_s"] * per_sample
    out["process_cpu_us_per_sample"] = gil["cpu_s"] * per_sample
    out["gil_fraction"] = gil["gil_fraction"]
    out["gil_window_s"] = gil["wall_s"]
    out["gil_top"], out["gil_top_threads"] = gil["top"], gil["top_threads"]
    out["thread_cpu_us_per_sample"] = {k: v * per_sample for k, v in gil["thread_cpu_s"].items()}
    out["minor_faults_per_step"] = gil["minor_faults"] * per_sample * B / 1e6
    out["gc_ms_per_step"] = 1e3 * sum(gil["gc_s"]) * per_sample * B / 1e6
    out["gc_full_collections"] = gil["gc_count"][2]
  if s["step"] == "tiny":  # the step alone on a batch of a fresh job: how long the device is busy
    fresh = train.build_job(c, os.path.join(workdir, "alone"), restore=False)
    pre = fresh.host.train_prefetcher(0, c, StalenessGate(last_applied=-1))
    try:
      _, (_, rows_in, batch) = pre.get()
    finally:
      pre.close()
    state, hot = fresh.state, fresh.hot.tables
    alone = []
    for _ in range(13):
      t0 = time.perf_counter()
      state, hot, g, _ = fresh.train_step(state, hot, rows_in, batch)
      jax.block_until_ready(g)
      alone.append(time.perf_counter() - t0)
    out["step_alone_ms"] = 1e3 * float(np.median(alone[3:]))
    out["device_idle_fraction"] = max(0.0, 1.0 - float(np.median(alone[3:])) * steps_timed / elapsed)
    fresh.ps.close()
  return out


class SampledWindow:
  """Samples the interpreter lock (``sampler``) from the train record of step ``first`` (the warm-up's
  end) to that of step ``last`` (the run's), on a thread of its own, so the loop that writes the
  records (``on_metrics``) is not held up while py-spy attaches or stops."""

  def __init__(self, first: int, last: int, sampler: Optional[GilSampler]):
    self.first, self.last, self.sampler = first, last, sampler
    self._events: "queue.Queue" = queue.Queue()
    self._out: Optional[Dict[str, Any]] = None
    self._error: Optional[BaseException] = None
    self._thread = threading.Thread(target=self._run, name="gil-window", daemon=True)
    if sampler is not None:
      self._thread.start()

  def on_metrics(self, step: int, kind: str, values: Dict[str, Any]) -> None:
    if kind == "train" and step in (self.first, self.last):
      self._events.put(step)

  def _run(self) -> None:
    started = False
    try:
      while True:
        step = self._events.get()
        if step == self.first and not started:
          self.sampler.start()
          started = True
        elif step is None or step == self.last:
          if started:
            self._out = self.sampler.stop()
          return
    except BaseException as e:  # noqa: BLE001 - re-raised by result()
      self._error = e

  def abandon(self) -> None:
    """Stops sampling, if it started, without a figure (the run failed)."""
    if self.sampler is not None:
      self._events.put(None)
      self._thread.join()

  def result(self) -> Optional[Dict[str, Any]]:
    """The sampler's figures (None without one); raises what sampling raised, or if the window never opened."""
    if self.sampler is None:
      return None
    self._events.put(None)  # the run ended: stop sampling if the last record never came
    self._thread.join()
    if self._error is not None:
      raise self._error
    if self._out is None:
      raise RuntimeError(f"the interpreter lock was not sampled: no train record at step {self.first} and {self.last}")
    return self._out


# -- threads or processes ------------------------------------------------------------------------


def _parse_chunk(chunk):
  from recsys_jax.data import base
  from recsys_jax.data.criteo import CriteoFormat

  return CriteoFormat().parse(chunk, base.BadRecords())


def pool_parse(raw: List[Any], n: int) -> Dict[str, float]:
  """Wall microseconds per record (median of 5) parsing ``raw`` chunks inline, on 2 threads and on 2
  spawned processes (chunks sent, columns sent back, as ``concurrent.futures`` does it), and the
  CPU the trainer's own process spends per record on each."""
  import concurrent.futures
  import multiprocessing

  out = {}
  with (
    concurrent.futures.ThreadPoolExecutor(2) as threads,
    concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as procs,
  ):
    list(procs.map(_parse_chunk, raw[:2]))  # start them
    ways = {"inline": lambda: [_parse_chunk(c) for c in raw]}
    ways["threads_2"] = lambda: list(threads.map(_parse_chunk, raw))
    ways["processes_2"] = lambda: list(procs.map(_parse_chunk, raw))
    times: Dict[str, List[Tuple[float, float]]] = {k: [] for k in ways}
    for _ in range(5):  # interleaved
      for k, fn in ways.items():
        w, c = time.perf_counter(), time.process_time()
        fn()
        times[k].append((time.perf_counter() - w, time.process_time() - c))
  for k, v in times.items():
    out[f"parse_{k}_wall_us"] = 1e6 * float(np.median([w for w, _ in v])) / n
    out[f"parse_{k}_trainer_cpu_us"] = 1e6 * float(np.median([c for _, c in v])) / n
  return out


def transfer_costs(path: str, chunks: int = 8) -> Dict[str, float]:
  """CPU microseconds per record (best of 3): parsing Criteo chunks, and moving their columns from
  a worker process to the trainer, by pickling (what multiprocessing queues do) or by a copy into
  shared memory and out; and pickling the raw lines, which workers that do not cut files would
  receive (threads hand both over for nothing); then ``pool_parse``."""
  import pickle
  from multiprocessing import shared_memory

  from recsys_jax.data import base
  from recsys_jax.data.criteo import CriteoFormat

  fmt = CriteoFormat()
  raw = list(itertools.islice(fmt.chunks(path, 8192), chunks))  # 8 chunks of 8192
  n = sum(len(c) for c in raw)

  def cpu(fn) -> float:
    best = float("inf")
    for _ in range(3):
      t = time.thread_time()
      fn()
      best = min(best, time.thread_time() - t)
    return 1e6 * best / n

  cols = [fmt.parse(c, base.BadRecords()) for c in raw]
  blobs = [pickle.dumps(c, protocol=5) for c in cols]
  arrays = [a for c in cols for a in [c["label"], c["dense"], *c["sparse"].values()]]
  shm = shared_memory.SharedMemory(create=True, size=sum(a.nbytes for a in arrays))
  try:
    views, at = [], 0
    for a in arrays:
      views.append(np.ndarray(a.shape, a.dtype, buffer=shm.buf, offset=at))
      at += a.nbytes

    def into_shm():
      for v, a in zip(views, arrays):
        v[...] = a

    out = {
      "parse_us": cpu(lambda: [fmt.parse(c, base.BadRecords()) for c in raw]),
      "pickle_us": cpu(lambda: [pickle.dumps(c, protocol=5) for c in cols]),
      "unpickle_us": cpu(lambda: [pickle.loads(b) for b in blobs]),
      "shm_in_us": cpu(into_shm),
      "shm_out_us": cpu(lambda: [np.array(v) for v in views]),
      "pickle_raw_lines_us": cpu(lambda: [pickle.dumps(c.payload, protocol=5) for c in raw]),
      "bytes_per_record": sum(len(b) for b in blobs) / n,
    }
    views.clear()  # the views pin shm.buf: drop them before closing it
  finally:
    shm.close()
    shm.unlink()
  out.update(pool_parse(raw, n))
  return out


# -- the sweep ---------------------------------------------------------------------------------


def setting_name(s: Dict[str, Any]) -> str:
  return f"{s['label']} {s['source']} batch {s['batch']} workers {s['workers']} step {s['step']} (run {s['rep'] + 1})"


def child(setting: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], str]:
  """Runs one setting in a fresh process (the code of ``setting['code_root']``), in its own
  workdir, removed after; -> (its figures, '') or (None, why it failed, in one line)."""
  # The setting's checkout first; what the environment adds (packages installed with --target) after it.
  path = os.pathsep.join(p for p in (setting["code_root"], os.environ.get("PYTHONPATH", "")) if p)
  env = dict(os.environ, PYTHONPATH=path, MALLOC_ARENA_MAX="2")
  cmd = [sys.executable, os.path.abspath(__file__), f"--setting={json.dumps(setting)}"]
  try:
    p = subprocess.run(cmd, env=env, cwd=setting["code_root"], capture_output=True, text=True)
  finally:
    shutil.rmtree(setting["workdir"], ignore_errors=True)
  if p.returncode == 0:
    try:
      return json.loads(p.stdout.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
      why = "printed no JSON line"
  else:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    why = f"exit {p.returncode}: {lines[-1].strip() if lines else 'no output'}"
  log = setting["workdir"] + ".log"  # the whole output, for the traceback
  outputs.write_text(log, f"$ {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
  return None, f"{why} (output: {log})"


def has_cache(code_root: str) -> bool:
  return os.path.exists(os.path.join(code_root, "recsys_jax", "data", "cache.py"))


STAGES = ("read", "parse", "prepare", "resolve", "lookup", "place", "get", "push", "wait")


def print_table(results: List[Dict[str, Any]]) -> None:
  head = f"{'source':9}{'batch':>7}{'wk':>4}{'step':>5}{'code':>6}{'samples/s':>11}{'(runs, k)':>16}{'vs base':>8}{'floor':>11}"
  head += f"{'ratio':>7}{'idle':>6}{'cpu us':>8}{'gil us':>8}"
  head += "".join(f"{s:>9}" for s in STAGES) + "   (ms per batch; CPU ms in brackets below)"
  print(head)
  for r in results:
    spread = "-".join(f"{x / 1e3:.0f}" for x in (r["runs_samples_per_s"][0], r["runs_samples_per_s"][-1]))
    line = (
      f"{r['source']:9}{r['batch']:>7}{r['workers']:>4}{r['step']:>5}{r['label']:>6}{r['feed_samples_per_s']:>11,.0f}"
    )
    line += f"{spread:>16}{r.get('vs_baseline', float('nan')):>8.2f}{r['floor_samples_per_s']:>11,.0f}"
    line += f"{r['floor_ratio']:>7.3f}{r.get('device_idle_fraction', 1.0):>6.2f}{r['cpu_us_per_sample']:>8.3f}"
    line += f"{r['gil_us_per_sample'] if r['gil_us_per_sample'] is not None else float('nan'):>8.3f}"
    line += "".join(f"{r.get(f'{s}_ms', float('nan')):>9.2f}" for s in STAGES)
    print(line)
    print(" " * 106 + "".join(f"{'(%.2f)' % r.get(f'{s}_cpu_ms', float('nan')):>9}" for s in STAGES))


def plot_workers(results: List[Dict[str, Any]], path: str) -> None:
  """Per (source, batch, step) of this checkout: samples/s against the host worker counts (left),
  and each stage's wall ms a batch beside the batch's own time (right): where samples/s stops
  growing, the stage whose line meets the batch's time is the one that bounds it."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  series: Dict[tuple, List[Dict[str, Any]]] = {}
  for r in results:
    if r["label"] == "new":
      series.setdefault((r["source"], r["batch"], r["step"]), []).append(r)
  fig, axes = plt.subplots(len(series), 2, figsize=(12, 4 * len(series)), squeeze=False)
  for (left, right), ((source, batch, step), rs) in zip(axes, sorted(series.items())):
    rs = sorted(rs, key=lambda r: r["workers"])
    w = [r["workers"] for r in rs]
    left.plot(w, [r["feed_samples_per_s"] / 1e6 for r in rs], "o-", label="samples/s")
    left.set(xlabel="host workers", ylabel="M samples/s", title=f"{source}, batch {batch}, step {step}")
    left.set_xticks(w)
    left.grid(alpha=0.3)
    right.plot(w, [1e3 * batch / r["feed_samples_per_s"] for r in rs], "k--", lw=2, label="a batch (1/throughput)")
    for stage in STAGES:
      ys = [r.get(f"{stage}_ms", float("nan")) for r in rs]
      if stage != "wait" and any(y > 0 for y in ys):
        right.plot(w, ys, "o-", label=stage)
    right.set(xlabel="host workers", ylabel="ms a batch (wall, on its thread)", title="where a batch's time goes")
    right.set_xticks(w)
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
  fig.tight_layout()
  outputs.save_figure(fig, path, dpi=110)


def schedule(records: int, batch: int, workers: int) -> Dict[str, int]:
  """Steps, warm-up and log interval of a setting: the warm-up is one pass over ``records`` (every
  row exists) and at least ``--warmup_steps``; both it and the run end on a train record (every
  ``log_every`` steps), whose intervals time the steps after it.

  The host workers prepare up to ``workers + 2`` batches ahead of the loop (``Feed``'s default),
  and fill that queue while the first step compiles: a window no longer than the queue would time
  batches prepared before it began (16 workers once read 0 ms of dedup a batch). So the warm-up
  also covers the queue, and the timed steps are at least three times its length, by which time
  what was queued before the window is a small part of what the window times."""
  queued = workers + 2
  one_pass = max(_WARMUP.value, -(-records // batch), queued)
  every = max(1, -(-one_pass // 2))  # two records a pass (few: each flushes the pushes); the first compiles, untimed
  warmup = -(-one_pass // every) * every
  timed = max(-(-_SAMPLES.value // batch), _MIN_STEPS.value - warmup, 3 * queued, 1)
  return {"warmup": warmup, "steps": warmup + -(-timed // every) * every, "log_every": every}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _SETTING.value:
    print(json.dumps(run_setting(json.loads(_SETTING.value))), flush=True)
    return
  if _SMOKE.value:  # a tiny sweep (the test suite's): flags given on the command line still win
    for name, value in SMOKE.items():
      if not flags.FLAGS[name].present:
        flags.FLAGS[name].value = value
  data_dir = os.path.abspath(_DATA_DIR.value)
  if _TRANSFER.value:
    files = criteo_files(data_dir, _RECORDS.value)
    costs = transfer_costs(files["train"][0])
    print(", ".join(f"{k} {v:.2f}" for k, v in costs.items()), f"(us per record; load {os.getloadavg()})")
    print(json.dumps({"transfer": costs, "cores": cores(), "load_avg": os.getloadavg()[0]}))
    return
  bw = memcpy_bandwidth(1)
  workers = [int(w) for w in (_WORKERS.value or sorted({1, cores()}))]
  files = criteo_files(data_dir, _RECORDS.value) if {"tsv", "cache"} & set(_SOURCES.value) else None
  codes = [("new", _ROOT)] + ([("base", os.path.abspath(_BASELINE.value))] if _BASELINE.value else [])
  print(f"{cores()} cores, memcpy {bw / 1e9:.1f} GB/s (read + written), load {os.getloadavg()}", file=sys.stderr)
  runs: Dict[tuple, List[Dict[str, Any]]] = {}
  failed: List[str] = []
  os.makedirs(data_dir, exist_ok=True)  # synthetic alone writes no files there, so nothing else made it
  work = tempfile.mkdtemp(prefix="work_", dir=data_dir)  # each setting's workdir, removed after it
  try:
    for source in _SOURCES.value:
      for batch in (int(b) for b in _BATCHES.value):
        for rep in range(_REPEATS.value):  # interleaved, so that every setting sees the same load over time
          for label, root in codes[::-1]:  # the baseline first, then this checkout's worker counts
            if source == "cache" and not has_cache(root):
              if rep == 0:
                print(f"source cache: skipped for {root}: no recsys_jax/data/cache.py there", file=sys.stderr)
              continue
            for w, step in itertools.product([1] if label == "base" else workers, _STEP.value):
              setting = {
                "label": label,
                "rep": rep,
                "source": source,
                "batch": batch,
                "workers": w,
                "step": step,
                **schedule(_RECORDS.value, batch, w),
                "first_timed": _WARMUP.value,
                "records": _RECORDS.value,
                "files": files,
                "cache_dir": os.path.join(data_dir, "cache"),
                "code_root": root,
                "memcpy_bytes_per_s": bw,
                "gil": _GIL.value,
              }
              setting["workdir"] = os.path.join(work, f"{len(failed) + sum(map(len, runs.values()))}")
              if _GIL_RAW.value:
                name = f"gil_{label}_{source}_{batch}_w{w}_{step}_r{rep}.txt"
                setting["gil_raw"] = os.path.abspath(os.path.join(_GIL_RAW.value, name))
                setting["cpu_profile"] = _CPU_PROFILE.value
              print(f"{setting_name(setting)} ...", file=sys.stderr, flush=True)
              r, why = child(setting)
              if setting.get("gil_raw") and os.path.exists(setting["gil_raw"]):
                outputs.wrote(setting["gil_raw"])
              if r is None:
                failed.append(f"setting {setting_name(setting)} failed: {why}")
                print(failed[-1], file=sys.stderr, flush=True)
                continue
              r["label"] = label
              runs.setdefault((source, batch, label, w, step), []).append(r)
  finally:
    if not os.listdir(work):  # logs of failed settings stay beside their names
      os.rmdir(work)
  results = []
  for (source, batch, label, _, step), rs in runs.items():
    rs = sorted(rs, key=lambda r: r["feed_samples_per_s"])
    r = dict(rs[len(rs) // 2])  # the median run, whole (of an even number, the faster middle one)
    r["runs_samples_per_s"] = [x["feed_samples_per_s"] for x in rs]
    base = runs.get((source, batch, "base", 1, step))
    if label == "new" and base:
      r["vs_baseline"] = r["feed_samples_per_s"] / sorted(x["feed_samples_per_s"] for x in base)[len(base) // 2]
    results.append(r)
  print()
  print_table(results)
  print(f"load average at the end: {os.getloadavg()}")
  print()
  lines = [json.dumps(r) for r in results]
  if _JSON_OUT.value:
    outputs.write_text(_JSON_OUT.value, "\n".join(lines) + "\n")
  if _PNG_OUT.value and results:
    plot_workers(results, _PNG_OUT.value)
  for line in lines:
    print(line)
  for line in failed:  # again at the end, where a reader of the table looks
    print(line)
  if failed:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
