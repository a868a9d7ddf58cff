"""Training throughput: the parameter-server path against an on-device-embedding baseline,
and the PS path with hot rows on the device against the same path without them.

    .venv/bin/python experiments/bench_train.py --config=configs/dlrm.py [--steps=200] [--warmup=5]
        [--repeats=3] [--log_every=N] [--workdir=DIR] [--json_out=FILE] [--config.batch_size=...]

Run from the repository root. Measures, in one process, the training samples/s of the main
job's configuration (read from ``--config`` at run time; ``--config.FIELD=VALUE`` overrides
a field) through two paths, on the same synthetic batches (train batches 0 .. warmup+steps-1):

1. PS path: ``recsys_jax.train.train_and_evaluate`` in a fresh workdir with
   num_steps = warmup + steps, no intermediate checkpoints or evals, and a final eval of one
   eval batch. The figure is the job's own ``samples_per_sec``: every step after the first
   (compile-heavy) one, i.e. warmup + steps - 1 steps, including host reading, dedup, PS
   lookups and pushes (the job overlaps them with the device step), and with hot rows the
   counting, the split and the re-choices (every ``hot_every`` steps, the first after
   ``hot_warmup_steps``), but not the step's recompiles when the hot set changes its shapes
   (the job leaves their time out and reports it: ``recompile_s``).
   It runs ``--repeats`` times with the config's hot-row budget (``hot_rows_bytes``, 4 MiB by
   default: "hot") and as many times with ``hot_rows_bytes = 0`` ("no hot"), alternated
   hot, no hot, no hot, hot, hot, no hot, ... so that drift of a shared machine falls on both;
   every figure of a variant is the median over its runs, and only in-run ratios mean much.
   Per run it reads what the job records itself, never replacing a function of it: the train
   records of its ``metrics.jsonl`` (``train.read_metrics``; one every ``--log_every`` steps,
   by default the config's ``hot_warmup_steps``, so that a record starts at the hot set's first
   choice) and its summary. From the records: per-stage wall times of the host pipeline
   (``host_<stage>_ms``: read, parse, prepare (dedup), lookup, place, wait (the loop waiting for
   its next batch), get (the pusher waiting for a step's row gradients), push), ms per step over
   the run; and, over the records from the first choice on, the distinct rows the PS looks up
   (``rows_per_step``) and the host -> device bytes the placement copies, rows and hot slots
   (``place_row_bytes_per_step``) and the rest of the batch (``place_batch_bytes_per_step``).
   ``steady_samples_per_sec`` is the median of the records' samples/s after the first record
   (which holds the first compile): the job's rate without most of its outliers. From the
   summary: ``samples_per_sec`` (compiles after the first step left out), ``recompiles`` and
   ``recompile_s``, and ``hot`` (``HotRows.metrics``): the hot hit rate of id lookups, hot and cold
   distinct rows a step (so the hot share of distinct rows), and the hot rows' own times, which
   they record themselves: the split of a step's ids (``hot_split``, inside the resolve stage, which
   runs before the staleness gate; resolve and lookup less it is ``ps_lookup``), the counting on its
   own thread (``hot_count``) and the
   re-choices (``rechoose``, with their steps). The hit rates are since the start of the run
   (the warm-up's steps, before any row is hot, included), as the library reports them.
   Figures the script gave before it stopped wrapping the job's methods (issue 24) and that the
   library does not record, dropped: the loop's dispatch time of the jitted step and the first
   step's compile (later compiles: ``recompile``), the wait of a boundary for the earlier pushes
   (``before_step`` less the re-choice), a lookup's wait for a re-choice (``before_lookup``; it is
   in ``lookup``, and so in ``ps_lookup``, as are the warm-up's synchronous waits), ``HotSet.split``
   alone (in ``hot_split``) and the per-step push times behind the old median-step rate.
2. On-device baseline (run in every round, beside the PS runs: hot, no hot, on-device, then
   on-device, no hot, hot, ...; its figure is the median run's): ``EmbeddedDLRM`` with one ``nn.Embed`` of ``config.data.vocab_sizes[i]``
   rows and ``config.embeddings.dim`` columns per feature, and the same bottom/top MLP. Ids are
   mapped to table rows on the host with the hashing trick, row = id % vocab, as on-device
   baselines do (distinct ids may share a row; the PS path never conflates them). The dense
   part is optimised with the config's dense optimizer and the tables with
   ``optax.adagrad(config.embeddings.learning_rate)`` (dense Adagrad over whole tables), in a
   jitted train step with donated state. Batches are read, mapped and ``device_put`` on a
   background thread (the library's Prefetcher, ``config.prefetch_depth`` deep), so reading
   overlaps the step. The figure is ``steps`` steps timed after ``warmup`` steps, blocking on
   the final state.

Then the floor, each part alone, for the config (hot) and without hot rows: the jitted step on
one placed batch and the host stages of a step (read + dedup, count, split, PS lookup, place,
push), after the first choice.

Prints a short table, then, last on stdout, one JSON line: samples_per_sec_ps (the config's
runs, with hot rows), samples_per_sec_device, ratio (= ps / device; above 1 means the PS path
is faster) and ratio_nohot (the PS path without hot rows / device), the same per round
(ratio_rounds, ratio_nohot_rounds: each round's runs against its own baseline) and their
medians (ratio_paired_median, ratio_nohot_paired_median), batch_size, steps, warmup, device (device kind), embedding_rows (rows of the
on-device tables = sum of vocab sizes), ps_rows (rows the PS created in the run), the
parameter bytes of both, the floor's figures, and the hot / no-hot comparison:
samples_per_sec_ps_hot and _nohot, hot_sps_ratio (hot / no hot), ps_rows_per_step_hot and
_nohot, ps_rows_ratio (hot / no hot; to set against one_minus_hit_rate and
one_minus_row_hit_rate), h2d_row_bytes_per_step_hot and _nohot, h2d_row_bytes_ratio,
h2d_bytes_per_step_hot and _nohot (rows and batch), hot_hit_rate, and ``hot_vs_nohot`` with
every run's figures and per-stage times (ms per step). The floor's host stages are the
script's own ``perf_counter`` around its calls of the pipeline's functions, its split and count
times ``HotRows``'s own (``HotRows.seconds``), its rows the pipeline's counts; its hot set is
chosen as a run chooses it (``HotRows.resume`` from nothing, then ``rechoose`` at the boundary).
The baseline supports one-hot features only (``config.data.multi_hot`` empty).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List

import jax
import numpy as np
import optax
from absl import app, flags, logging
from flax.training import train_state
from harness import outputs
from ml_collections import config_flags

from recsys_jax import train
from recsys_jax.data import synthetic
from recsys_jax.models.dlrm import EmbeddedDLRM
from recsys_jax.parallel import mesh as mesh_lib
from recsys_jax.training.pipeline import Prefetcher, StalenessGate

_CONFIG = config_flags.DEFINE_config_file("config", "configs/dlrm.py", "The main job's ml_collections config file.")
_STEPS = flags.DEFINE_integer("steps", 200, "Timed training steps of each path.")
_WARMUP = flags.DEFINE_integer("warmup", 5, "Untimed steps before the timed ones (the first one compiles).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Scratch directory for the PS run (default: a temp dir, removed).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON result to this file.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "PS-path runs with hot rows and as many without, alternated.")
_LOG_EVERY = flags.DEFINE_integer(
  "log_every",
  0,
  "Steps between the PS runs' train records, whose figures the script reads (0: the config's hot_warmup_steps, "
  "so that a record starts at the first choice of the hot set).",
)


def _tree_bytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


# Host stages the pipeline times itself (recsys_jax/training/stage_times.py: ``host_<stage>_ms`` of
# every train record), the ones this script reports.
STAGES = ("read", "parse", "prepare", "resolve", "lookup", "place", "wait", "get", "push")


def _intervals(recs: List[Dict[str, Any]]) -> List[tuple]:
  """(first step, steps, record) of each train record: a record holds the steps since the last one."""
  out, last = [], 0
  for r in recs:
    out.append((last, r["step"] - last, r))
    last = r["step"]
  return out


def run_figures(summary: Dict[str, Any], recs: List[Dict[str, Any]], first: int) -> Dict[str, Any]:
  """The figures of one PS run, from what the job recorded itself.

  ``recs``: its train records (metrics.jsonl). Stage times (``<stage>_ms``) are ms per step over
  the whole run, each record weighed by its steps; the per-step counts (PS rows, host -> device
  bytes of rows and of the rest of the batch) are over the records from step ``first`` (the first
  choice of the hot set) on; ``steady_samples_per_sec`` is the median of the records' samples/s
  after the first record (which holds the first step's compile). With hot rows, the hot set's own
  times and hit rates come from ``summary["hot"]`` (``HotRows.metrics``: since the start).
  """
  ivs = _intervals(recs)
  n = sum(k for _, k, _ in ivs)
  out: Dict[str, Any] = {}
  for stage in STAGES:
    out[f"{stage}_ms"] = sum(k * r.get(f"host_{stage}_ms", 0.0) for _, k, r in ivs) / max(1, n)
  later = [(k, r) for t, k, r in ivs if t >= first and k > 0] or [(k, r) for _, k, r in ivs]
  m = sum(k for k, _ in later)

  def mean(key: str) -> float:
    return sum(k * r.get(key, float("nan")) for k, r in later) / m

  rows, row_bytes = mean("rows_per_step"), mean("place_row_bytes_per_step")
  hot = summary.get("hot") or {}
  hot_rows = float(hot.get("hot_rows_per_step", 0.0))
  cold_since_start = float(hot.get("cold_rows_per_step", 0.0))
  out.update(
    ps_rows_per_step=rows,
    h2d_row_bytes_per_step=row_bytes,
    h2d_bytes_per_step=row_bytes + mean("place_batch_bytes_per_step"),
    hot_hit_rate=float(hot.get("hot_hit_rate", 0.0)),
    hot_rows_per_step=hot_rows,
    row_hit_rate=hot_rows / (hot_rows + cold_since_start) if hot_rows + cold_since_start else 0.0,
    per_step_from=later[0][1]["step"] - later[0][0],
    hot_split_ms=float(hot.get("split_ms_per_step", 0.0)),
    hot_count_ms=float(hot.get("count_ms_per_step", 0.0)),
    rechoose_ms=1e3 * float(hot.get("rechoose_s", 0.0)) / max(1, n),
    recompile_ms=1e3 * float(summary.get("recompile_s") or 0.0) / max(1, n),
  )
  # The PS's part of a lookup: its resolve (before the staleness gate, which holds the split) and its read.
  out["ps_lookup_ms"] = out["resolve_ms"] + out["lookup_ms"] - out["hot_split_ms"]
  sps = [r["samples_per_sec"] for _, _, r in ivs[1:]]
  out["steady_samples_per_sec"] = float(np.median(sps)) if sps else float("nan")
  out["rechoose_at"] = [c["step"] for c in hot.get("choices", [])]
  return out


def run_ps(config, warmup: int, steps: int, workdir: str, log_every: int) -> Dict[str, Any]:
  """The main job through the parameter server; returns its summary dict, with the figures of its
  train records (``figures``)."""
  c = copy.deepcopy(config)
  c.num_steps = warmup + steps
  c.checkpoint_every = 0
  c.eval_every = 0
  c.eval_samples = c.eval_batch_size
  c.progress_bar = False
  c.log_every = log_every
  ps_dir = tempfile.mkdtemp(prefix="ps_", dir=workdir)  # fresh: never resumes
  load0 = os.getloadavg()[0]
  s = train.train_and_evaluate(c, ps_dir)
  s["figures"] = run_figures(s, train.read_metrics(ps_dir, "train"), first=int(c.hot_warmup_steps))
  s["load_avg"] = [load0, os.getloadavg()[0]]
  return s


def run_rounds(config, warmup: int, steps: int, workdir: str, repeats: int, log_every: int):
  """``repeats`` rounds of three runs: the PS path with the config's hot rows, without, and the
  on-device baseline, in the order A B C, C B A, A B C, ... so that a shared machine's drift falls
  on all three; returns each variant's runs, in round order."""
  nohot = copy.deepcopy(config)
  nohot.hot_rows_bytes = 0
  runs: Dict[str, List[Dict]] = {"hot": [], "nohot": [], "device": []}
  order = [("hot", "nohot", "device") if i % 2 == 0 else ("device", "nohot", "hot") for i in range(repeats)]
  for i, names in enumerate(order):
    for name in names:
      if name == "device":
        print(f"on-device baseline, run {i + 1} of {repeats}: {warmup} + {steps} steps ...", file=sys.stderr)
        load0 = os.getloadavg()[0]
        d = run_device(config, warmup, steps)
        d["load_avg"] = [load0, os.getloadavg()[0]]
        print(
          f"  {d['samples_per_sec']:,.0f} samples/s, load {d['load_avg'][0]:.1f}-{d['load_avg'][1]:.1f}",
          file=sys.stderr,
        )
        runs[name].append(d)
        continue
      print(f"PS path, {name}, run {i + 1} of {repeats}: {warmup} + {steps} steps ...", file=sys.stderr)
      s = run_ps(config if name == "hot" else nohot, warmup, steps, workdir, log_every)
      print(
        f"  {s['samples_per_sec']:,.0f} samples/s, steady {s['figures'].get('steady_samples_per_sec', 0):,.0f}, "
        f"{s['train_step_traces']} traces, load {s['load_avg'][0]:.1f}-{s['load_avg'][1]:.1f}",
        file=sys.stderr,
      )
      runs[name].append(s)
  return runs


def _median(runs: List[Dict], key: str) -> float:
  """Median over runs of a summary field, or of a run's figure (``figures.KEY``)."""
  vals = [r["figures"].get(key[8:], float("nan")) if key.startswith("figures.") else r[key] for r in runs]
  return float(np.median(np.asarray(vals, float)))


def run_device(config, warmup: int, steps: int) -> Dict[str, Any]:
  """The same model with nn.Embed tables on the device; returns samples/s and sizes."""
  reader = synthetic.build({k: v for k, v in dict(config.data).items() if k in synthetic.FIELDS})
  if any(n > 1 for n in reader.max_len):
    raise ValueError(f"config.data.multi_hot = {config.data.multi_hot!r}: the on-device baseline is one-hot only")
  names = reader.feature_names
  vocab = tuple(int(v) for v in config.data.vocab_sizes)
  model = EmbeddedDLRM(vocab_sizes=vocab, dim=int(config.embeddings.dim), features=names, **config.model.kwargs)
  mesh = mesh_lib.make_mesh(config.mesh.replica, config.mesh.fsdp)
  data_sharding, repl = mesh_lib.data_sharding(mesh), mesh_lib.replicated(mesh)
  moduli = [np.uint64(v) for v in vocab]
  B = config.batch_size

  def host_batch(split: int, index: int, batch_size: int) -> Dict[str, np.ndarray]:
    b = reader.batch(split, index, batch_size)
    ids = np.stack([b["sparse"][n][:, 0] % m for n, m in zip(names, moduli)], axis=1).astype(np.int32)
    return {"dense": b["dense"], "ids": ids, "label": b["label"]}

  example = host_batch(synthetic.TRAIN, 0, 2)
  # Jitted: one program, not the ~85 eager ops an unjitted init compiles one by one (4 s on tiny.py)
  params = jax.jit(model.init)(jax.random.PRNGKey(config.seed), example["dense"], example["ids"])["params"]
  labels = {k: ("tables" if k.startswith("embed_") else "dense") for k in params}
  tx = optax.multi_transform(
    {
      "dense": train.dense_optimizer(config),
      "tables": optax.adagrad(config.embeddings.learning_rate),
    },
    labels,
  )
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  state = jax.device_put(state, repl)
  table_bytes = _tree_bytes({k: v for k, v in params.items() if labels[k] == "tables"})
  dense_bytes = _tree_bytes(params) - table_bytes
  opt_bytes = _tree_bytes(state.opt_state)

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["dense"], batch["ids"])
    return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean()

  def step_fn(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  train_step = jax.jit(step_fn, donate_argnums=(0,), out_shardings=(repl, repl))
  n = warmup + steps
  pre = Prefetcher(
    0,
    n,
    prepare=lambda t: host_batch(synthetic.TRAIN, t, B),
    lookup=lambda b: b,
    place=lambda b: jax.device_put(b, data_sharding),
    gate=StalenessGate(last_applied=n),  # nothing to wait for: no pushes
    staleness=0,
    depth=config.prefetch_depth,
  )
  losses = []
  try:
    for _ in range(warmup):
      state, loss = train_step(state, pre.get()[1])
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(steps):
      state, loss = train_step(state, pre.get()[1])
      losses.append(loss)
    jax.block_until_ready(state)
    elapsed = time.perf_counter() - t0
  finally:
    pre.close()
  return {
    "samples_per_sec": steps * B / elapsed,
    "elapsed_s": elapsed,
    "train_loss": float(np.mean(jax.device_get(losses))),
    "rows": int(sum(vocab)),
    "table_bytes": table_bytes,
    "dense_bytes": dense_bytes,
    "opt_state_bytes": opt_bytes,
  }


def measure_floor(config, n: int = 20) -> Dict[str, float]:
  """What a step must cost, part by part, each measured alone on this machine.

  The device step (the PS path's jitted train_step on one placed batch) bounds the PS path
  from above: no host work can make a step faster than it. Its FLOPs come from XLA's cost
  analysis of the compiled step, and the machine's peak from a large f32 matmul, so
  ``compute_fraction`` says how close the step itself is to the arithmetic floor. At k = 0
  the push of a step and the read of the next one's rows cannot overlap the device step (they
  wait on it), so the synchronous estimate is device + lookup (the read) + place + push; the
  resolve (the hot rows' split, the PS finding and creating rows) runs while the step before
  trains, and the hot count on its own thread. With hot rows the set is chosen at its first boundary, as the job does
  (every push before it is applied: the pushes here are synchronous), and the n timed steps
  come after it, so the step reads and updates hot rows.
  """
  job = train.build_job(config)
  train_step, hot_rows, host = job.train_step, job.hot, job.host
  B = config.batch_size
  skip = max(2, int(config.hot_warmup_steps) + 2) if hot_rows.enabled else 2
  t = {"read_dedup": 0.0, "resolve": 0.0, "lookup": 0.0, "place": 0.0, "push": 0.0}
  hot_rows.resume(0, None, job.ps)  # a fresh set: its first choice after the warm-up
  placed, split0, hot0 = None, {}, {}
  for i in range(n + skip):
    if i == skip:  # what the pipeline and the hot rows recorded so far is the warm-up's: left out
      hot_rows.counted()
      host.times.take(1)
      split0, hot0 = dict(hot_rows.seconds), dict(hot_rows.totals)
    if hot_rows.boundary(i):
      hot_rows.rechoose(i, job.ps)
    t0 = time.perf_counter()
    p = host.prepare(i, job.reader.data.batch(synthetic.TRAIN, i, B))
    t1 = time.perf_counter()
    host.resolve(p)  # with hot rows, the split first (the count goes to its own thread)
    t1r = time.perf_counter()
    host.lookup(p, create=True)  # the rows' read, all that waits for the step before
    t2 = time.perf_counter()
    placed = host.place(p)
    jax.block_until_ready(placed[1:])
    t3 = time.perf_counter()
    zeros = {str(d): np.zeros_like(r) for d, r in p.rows.items()}  # apply costs the same for any values
    t4 = time.perf_counter()
    host.push(p.groups, zeros)
    t5 = time.perf_counter()
    if i >= skip:
      for k, v in zip(t, (t1 - t0, t1r - t1, t2 - t1r, t3 - t2, t5 - t4)):
        t[k] += v / n
  hot_rows.counted()
  counts = host.times.take(n)
  t["count"] = (hot_rows.seconds["count"] - split0.get("count", 0.0)) / n  # the counting thread, beside the others
  t["split"] = (hot_rows.seconds["split"] - split0.get("split", 0.0)) / n
  hot_rows.close()
  stages = {
    "ps_rows_per_step": counts["rows_per_step"],
    "hot_rows_per_step": (hot_rows.totals["hot_rows"] - hot0.get("hot_rows", 0)) / n,
  }
  _, rows, batch = placed
  compiled = train_step.lower(job.state, hot_rows.tables, rows, batch).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flops = float(cost.get("flops", float("nan")))
  state, hot = job.state, hot_rows.tables  # the loop below donates them: hot_rows is not used after it
  for _ in range(3):
    state, hot, g, _m = train_step(state, hot, rows, batch)
  jax.block_until_ready(g)
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    state, hot, g, _m = train_step(state, hot, rows, batch)
    jax.block_until_ready(g)
    times.append(time.perf_counter() - t0)
  device_s = float(np.median(times))
  # Peak f32 matmul rate of this device (2048^3 x 2 FLOPs, median of 10).
  a = jax.device_put(np.random.default_rng(0).standard_normal((2048, 2048), np.float32))
  mm = jax.jit(lambda x: x @ x)
  jax.block_until_ready(mm(a))
  mm_t = []
  for _ in range(10):
    t0 = time.perf_counter()
    jax.block_until_ready(mm(a))
    mm_t.append(time.perf_counter() - t0)
  peak = 2 * 2048**3 / float(np.median(mm_t))
  serial = device_s + t["lookup"] + t["place"] + t["push"]
  return {
    "step_flops": flops,
    "device_step_ms": 1e3 * device_s,
    "device_gflops": flops / device_s / 1e9,
    "peak_matmul_gflops": peak / 1e9,
    "compute_fraction": flops / device_s / peak,
    "host_read_dedup_ms": 1e3 * t["read_dedup"],
    "host_resolve_ms": 1e3 * t["resolve"],
    "host_lookup_ms": 1e3 * t["lookup"],
    "host_place_ms": 1e3 * t["place"],
    "host_push_ms": 1e3 * t["push"],
    "host_count_ms": 1e3 * t["count"],
    "host_split_ms": 1e3 * t["split"],
    "unique_rows_per_step": stages["ps_rows_per_step"] + stages["hot_rows_per_step"],
    "ps_rows_per_step": stages["ps_rows_per_step"],
    "floor_samples_per_sec": B / device_s,
    "k0_serial_samples_per_sec": B / serial,
  }


def _mib(n: float) -> str:
  return f"{n / 2**20:,.1f} MiB"


def print_hot_table(cmp: Dict[str, Any], hv: Dict[str, Dict], runs: Dict[str, List], f, f0) -> None:
  """The PS path with hot rows against without: medians of the alternated runs, and the floor's parts."""
  print(
    f"PS path with hot rows ({_mib(cmp['hot_rows_bytes'])}, {cmp['hot_rows_held']:,.0f} rows held) and without, "
    f"medians of {cmp['repeats']} alternated runs each; per-step figures from step {hv['hot']['per_step_from']:.0f} on"
  )
  print(f"{'':30}{'hot':>14}{'no hot':>14}{'hot / no hot':>14}")
  lines = [
    ("samples/s (job)", "samples_per_sec_ps_hot", "samples_per_sec_ps_nohot", "{:,.0f}"),
    ("samples/s (median step)", "steady_samples_per_sec_hot", "steady_samples_per_sec_nohot", "{:,.0f}"),
    ("PS rows per step", "ps_rows_per_step_hot", "ps_rows_per_step_nohot", "{:,.0f}"),
    ("h2d row bytes per step", "h2d_row_bytes_per_step_hot", "h2d_row_bytes_per_step_nohot", "{:,.0f}"),
    ("h2d bytes per step (+ batch)", "h2d_bytes_per_step_hot", "h2d_bytes_per_step_nohot", "{:,.0f}"),
  ]
  for name, a, b, fmt in lines:
    print(f"{name:30}{fmt.format(cmp[a]):>14}{fmt.format(cmp[b]):>14}{cmp[a] / cmp[b]:>14.3f}")
  print(
    f"hot hit rate {cmp['hot_hit_rate']:.4f} of id lookups (1 - hit = {cmp['one_minus_hit_rate']:.4f}), "
    f"{cmp['row_hit_rate']:.4f} of distinct rows (1 - that = {cmp['one_minus_row_hit_rate']:.4f}); "
    f"PS rows hot / no hot {cmp['ps_rows_ratio']:.4f}"
  )
  print(
    "per run, samples/s (traces): "
    + "; ".join(
      f"{v} " + ", ".join(f"{r['samples_per_sec']:,.0f} ({r['train_step_traces']})" for r in runs[v]) for v in runs
    )
  )
  stages = (
    "hot_count",
    "hot_split",
    "ps_lookup",
    "resolve",
    "lookup",
    "place",
    "get",
    "push",
    "wait",
    "recompile",
    "rechoose",
  )
  print("ms per step in the job (median of runs)   " + "".join(f"{s:>12}" for s in stages))
  for v in ("hot", "nohot"):
    print(f"  {v:40}" + "".join(f"{hv[v].get(s + '_ms', 0.0):>12.2f}" for s in stages))
  keys = ("device_step_ms", "host_count_ms", "host_split_ms", "host_resolve_ms", "host_lookup_ms", "host_place_ms")
  keys += ("host_push_ms",)
  print("alone (floor), ms                         " + "".join(f"{k[:-3]:>16}" for k in keys))
  for v, fl in (("hot", f), ("nohot", f0)):
    print(f"  {v:40}" + "".join(f"{fl[k]:>16.2f}" for k in keys))
  print()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  warmup, steps = _WARMUP.value, _STEPS.value
  if warmup < 1 or steps < 1:
    raise app.UsageError("--warmup and --steps must be >= 1 (the first step compiles)")
  config = _CONFIG.value
  if config.model.name != "dlrm":
    raise app.UsageError(f"config.model.name = {config.model.name!r}: the baseline is EmbeddedDLRM (dlrm only)")
  if any(int(n) > 1 for n in config.data.multi_hot):
    raise app.UsageError(f"config.data.multi_hot = {config.data.multi_hot!r}: the baseline is one-hot only")
  own_workdir = _WORKDIR.value is None
  workdir = tempfile.mkdtemp(prefix="bench_train_") if own_workdir else _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  device = jax.devices()[0].device_kind
  B = config.batch_size
  print(f"config {flags.FLAGS['config'].config_filename}: batch {B}, {jax.device_count()} x {device}", file=sys.stderr)

  repeats = _REPEATS.value
  if repeats < 1:
    raise app.UsageError("--repeats must be >= 1")
  if int(config.hot_rows_bytes) <= 0:
    raise app.UsageError(
      f"config.hot_rows_bytes = {config.hot_rows_bytes}: the PS path is run with hot rows and without; "
      "give it a budget > 0 (the default is 4 MiB)"
    )
  try:
    log_every = _LOG_EVERY.value or max(1, int(config.hot_warmup_steps))
    runs = run_rounds(config, warmup, steps, workdir, repeats, log_every)
  finally:
    if own_workdir:
      shutil.rmtree(workdir, ignore_errors=True)
  if any(r["hot"] is None for r in runs["hot"]):
    raise app.UsageError(f"config.hot_rows_bytes = {config.hot_rows_bytes} buys no hot row: raise it")
  s = runs["hot"][0]  # sizes (rows, bytes) are the same in every run
  devices = runs.pop("device")
  # The median run (of an even count, the faster middle one).
  d = sorted(devices, key=lambda r: r["samples_per_sec"])[len(devices) // 2]

  print("floor: device step and host stages alone, with hot rows and without ...", file=sys.stderr)
  f = measure_floor(config)
  nohot_config = copy.deepcopy(config)
  nohot_config.hot_rows_bytes = 0
  f0 = measure_floor(nohot_config)

  dim = int(config.embeddings.dim)
  ps_table_bytes = s["ps_rows"] * dim * 4  # rows only; ps_bytes adds Adagrad slots and ids
  ps_param_bytes = ps_table_bytes + d["dense_bytes"]  # same dense model on the device
  dev_param_bytes = d["table_bytes"] + d["dense_bytes"]
  sps = {v: _median(runs[v], "samples_per_sec") for v in runs}
  ratio = sps["hot"] / d["samples_per_sec"]
  # Each round's PS runs against that round's baseline, run beside them: the ratios the load moves least.
  rounds = {
    v: [r["samples_per_sec"] / b["samples_per_sec"] for r, b in zip(runs[v], devices)] for v in ("hot", "nohot")
  }
  hv = {v: {k: _median(runs[v], "figures." + k) for k in runs[v][0]["figures"] if k != "rechoose_at"} for v in runs}
  cmp = {
    "samples_per_sec_ps_hot": sps["hot"],
    "samples_per_sec_ps_nohot": sps["nohot"],
    "hot_sps_ratio": sps["hot"] / sps["nohot"],
    "steady_samples_per_sec_hot": hv["hot"]["steady_samples_per_sec"],
    "steady_samples_per_sec_nohot": hv["nohot"]["steady_samples_per_sec"],
    "hot_steady_sps_ratio": hv["hot"]["steady_samples_per_sec"] / hv["nohot"]["steady_samples_per_sec"],
    "hot_hit_rate": hv["hot"]["hot_hit_rate"],
    "row_hit_rate": hv["hot"]["row_hit_rate"],
    "ps_rows_per_step_hot": hv["hot"]["ps_rows_per_step"],
    "ps_rows_per_step_nohot": hv["nohot"]["ps_rows_per_step"],
    "ps_rows_ratio": hv["hot"]["ps_rows_per_step"] / hv["nohot"]["ps_rows_per_step"],
    "one_minus_hit_rate": 1.0 - hv["hot"]["hot_hit_rate"],
    "one_minus_row_hit_rate": 1.0 - hv["hot"]["row_hit_rate"],
    "h2d_row_bytes_per_step_hot": hv["hot"]["h2d_row_bytes_per_step"],
    "h2d_row_bytes_per_step_nohot": hv["nohot"]["h2d_row_bytes_per_step"],
    "h2d_row_bytes_ratio": hv["hot"]["h2d_row_bytes_per_step"] / hv["nohot"]["h2d_row_bytes_per_step"],
    "h2d_bytes_per_step_hot": hv["hot"]["h2d_bytes_per_step"],
    "h2d_bytes_per_step_nohot": hv["nohot"]["h2d_bytes_per_step"],
    "h2d_bytes_ratio": hv["hot"]["h2d_bytes_per_step"] / hv["nohot"]["h2d_bytes_per_step"],
    "hot_rows_bytes": int(config.hot_rows_bytes),
    "hot_rows_held": float(np.median([r["hot"]["hot_rows_held"] for r in runs["hot"]])),
    "repeats": repeats,
  }
  result = {
    "samples_per_sec_ps": sps["hot"],
    "samples_per_sec_device": d["samples_per_sec"],
    "ratio": ratio,
    "ratio_nohot": sps["nohot"] / d["samples_per_sec"],
    "ratio_rounds": rounds["hot"],
    "ratio_nohot_rounds": rounds["nohot"],
    "ratio_paired_median": float(np.median(rounds["hot"])),
    "ratio_nohot_paired_median": float(np.median(rounds["nohot"])),
    "samples_per_sec_device_runs": [r["samples_per_sec"] for r in devices],
    "device_load_avg": [r["load_avg"] for r in devices],
    "batch_size": B,
    "steps": steps,
    "warmup": warmup,
    "ps_timed_steps": warmup + steps - 1,
    "device": device,
    "num_devices": jax.device_count(),
    "embedding_rows": d["rows"],
    "ps_rows": s["ps_rows"],
    "param_bytes_ps": ps_param_bytes,
    "param_bytes_device": dev_param_bytes,
    "ps_host_bytes": s["ps_bytes"],
    "device_opt_state_bytes": d["opt_state_bytes"],
    "staleness": config.staleness,
    "ps_eval_auc": float(np.median([r["auc"] for r in runs["hot"]])),
    "device_train_loss": d["train_loss"],
    "config": flags.FLAGS["config"].config_filename,
    **f,
    "ps_fraction_of_floor": sps["hot"] / f["floor_samples_per_sec"],
    **cmp,
    "floor_nohot": f0,
    "hot_vs_nohot": {
      v: {
        "median": hv[v],
        "runs": [
          {
            "samples_per_sec": r["samples_per_sec"],
            "train_step_traces": r["train_step_traces"],
            "auc": r["auc"],
            "load_avg": r["load_avg"],
            "hot": r["hot"],
            "recompiles": r["recompiles"],
            **r["figures"],
          }
          for r in runs[v]
        ],
      }
      for v in runs
    },
  }

  rows = [
    ("samples/s", f"{sps['hot']:,.0f}", f"{d['samples_per_sec']:,.0f}"),
    ("timed steps", f"{warmup + steps - 1}", f"{steps}"),
    ("embedding rows", f"{s['ps_rows']:,} created", f"{d['rows']:,}"),
    ("embedding bytes", _mib(ps_table_bytes) + " host", _mib(d["table_bytes"]) + " device"),
    ("dense param bytes", _mib(d["dense_bytes"]), _mib(d["dense_bytes"])),
    ("param bytes", _mib(ps_param_bytes), _mib(dev_param_bytes)),
    ("opt. state bytes", _mib(s["ps_bytes"] - ps_table_bytes) + " host+ids", _mib(d["opt_state_bytes"])),
  ]
  print(f"\ndevice {device} x {jax.device_count()}, batch {B}, staleness k={config.staleness}")
  print(f"{'':22}{'PS path (hot rows)':>22}{'on-device (id % vocab)':>26}")
  for name, a, b in rows:
    print(f"{name:22}{a:>22}{b:>26}")
  print(
    f"ratio PS / on-device: {ratio:.3f} with hot rows, {result['ratio_nohot']:.3f} without (medians of "
    f"{repeats} runs each); paired by round: {', '.join(f'{x:.3f}' for x in rounds['hot'])} with, "
    f"{', '.join(f'{x:.3f}' for x in rounds['nohot'])} without\n"
  )
  print(
    f"floor: the jitted step alone takes {f['device_step_ms']:.1f} ms = {f['floor_samples_per_sec']:,.0f} samples/s "
    f"({f['step_flops'] / 1e9:.2f} GFLOP, {f['device_gflops']:.1f} GFLOP/s = {f['compute_fraction']:.0%} of this "
    f"device's {f['peak_matmul_gflops']:.0f} GFLOP/s f32 matmul peak)"
  )
  print(
    f"host per step, alone: read+dedup {f['host_read_dedup_ms']:.1f} ms (overlapped), resolve "
    f"{f['host_resolve_ms']:.1f} ms (overlapped), lookup (the read) {f['host_lookup_ms']:.1f} ms, place "
    f"{f['host_place_ms']:.1f} ms, push {f['host_push_ms']:.1f} ms "
    f"({f['unique_rows_per_step']:,.0f} distinct rows)"
  )
  print(
    f"PS path = {result['ps_fraction_of_floor']:.0%} of the device-step floor; the k=0 serial estimate "
    f"(step + lookup + place + push) is {f['k0_serial_samples_per_sec']:,.0f} samples/s\n"
  )
  print_hot_table(cmp, hv, runs, f, f0)

  line = json.dumps(result)
  if _JSON_OUT.value:
    outputs.write_text(_JSON_OUT.value, line + "\n")
  print(line, flush=True)


if __name__ == "__main__":
  app.run(main)
