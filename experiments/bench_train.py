"""Training throughput: the parameter-server path against an on-device-embedding baseline, and the
PS path with hot rows on the device against the same path without them.

    python experiments/bench_train.py --config=configs/dlrm.py [--steps=200] [--warmup=5] [--repeats=3]
        [--log_every=N] [--workdir=DIR] [--json_out=FILE] [--config.FIELD=VALUE ...]

Run from the repository root. On the same synthetic batches, ``--repeats`` rounds (every other one
reversed, so that a shared machine's drift falls on all; figures are medians over rounds) of:

- the PS path (``train_and_evaluate``) with the config's hot rows and without: the job's own
  ``samples_per_sec``, and from its train records (every ``--log_every`` steps) each host stage's ms
  per step and, from the hot set's first choice on, PS rows and host -> device bytes a step;
- the on-device baseline ``EmbeddedDLRM``: one ``nn.Embed`` per feature, ids hashed to rows on the
  host (id % vocab), tables trained with dense ``optax.adagrad``. One-hot features only.

Then the floor, with hot rows and without: the jitted step alone (its FLOPs from XLA's cost
analysis, against a measured f32 matmul peak) and each host stage of a step alone.

Last on stdout, one JSON line: ``samples_per_sec_ps`` (hot rows), ``samples_per_sec_device``,
``ratio`` (ps / device), ``ratio_nohot``, the same against each round's own baseline
(``ratio_rounds``, ``ratio_nohot_rounds``; medians ``ratio_paired_median``,
``ratio_nohot_paired_median``), sizes, the floor (``floor_nohot``: without hot rows), hot against
no hot (``*_hot``, ``*_nohot``, ``hot_sps_ratio``, ``ps_rows_ratio``: to set against
``one_minus_hit_rate`` and ``one_minus_row_hit_rate``, ``h2d_row_bytes_ratio``, ``h2d_bytes_ratio``),
``hot_hit_rate``, and ``hot_vs_nohot``: every run's figures.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

import jax
import numpy as np
import optax
from absl import app, flags, logging
from flax.training import train_state
from harness import jobs, outputs, stats
from ml_collections import config_flags

from recsys_jax import train
from recsys_jax.data import synthetic
from recsys_jax.models.dlrm import EmbeddedDLRM
from recsys_jax.parallel import mesh as mesh_lib
from recsys_jax.training.pipeline import Prefetcher, StalenessGate
from recsys_jax.training.stage_times import STAGES

_CONFIG = config_flags.DEFINE_config_file("config", "configs/dlrm.py", "The main job's ml_collections config file.")
_STEPS = flags.DEFINE_integer("steps", 200, "Timed training steps of each path.")
_WARMUP = flags.DEFINE_integer("warmup", 5, "Untimed steps before the timed ones (the first one compiles).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Scratch directory for the PS run (default: a temp dir, removed).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON result to this file.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "PS-path runs with hot rows and as many without, alternated.")
_LOG_EVERY = flags.DEFINE_integer(
  "log_every", 0, "Steps between the PS runs' records (0: the config's log_every, the job's own cost of logging)."
)


def run_figures(summary: Dict[str, Any], recs: List[Dict[str, Any]], first: int) -> Dict[str, Any]:
  """One PS run's figures from its summary and train records; per-step counts from step ``first`` on."""
  every, after = stats.intervals(recs), stats.intervals(recs, after=first) or stats.intervals(recs)
  out: Dict[str, Any] = {f"{stage}_ms": stats.per_step(every, f"host_{stage}_ms", 0.0) for stage in STAGES}
  rows, row_bytes, batch_bytes = (
    stats.per_step(after, f"{k}_per_step", 0.0) for k in ("rows", "place_row_bytes", "place_batch_bytes")
  )
  steps = max(1, recs[-1]["step"] if recs else 0)
  hot = summary.get("hot") or {}
  hot_rows, cold_rows = float(hot.get("hot_rows_per_step", 0.0)), float(hot.get("cold_rows_per_step", 0.0))
  out.update(
    ps_rows_per_step=rows,
    h2d_row_bytes_per_step=row_bytes,
    h2d_bytes_per_step=row_bytes + batch_bytes,
    hot_hit_rate=float(hot.get("hot_hit_rate", 0.0)),
    hot_rows_per_step=hot_rows,
    row_hit_rate=hot_rows / (hot_rows + cold_rows) if hot_rows + cold_rows else 0.0,
    hot_split_ms=float(hot.get("split_ms_per_step", 0.0)),
    hot_count_ms=float(hot.get("count_ms_per_step", 0.0)),
    rechoose_ms=1e3 * float(hot.get("rechoose_s", 0.0)) / steps,
    recompile_ms=1e3 * float(summary.get("recompile_s") or 0.0) / steps,
  )
  # The PS's part of a lookup: its resolve (before the staleness gate, which holds the split) and its read.
  out["ps_lookup_ms"] = out["resolve_ms"] + out["lookup_ms"] - out["hot_split_ms"]
  out["steady_samples_per_sec"] = stats.median(r["samples_per_sec"] for r in recs[1:])  # the first: the compile
  out["rechoose_at"] = [c["step"] for c in hot.get("choices", [])]
  return out


def run_ps(config, warmup: int, steps: int, workdir: str, log_every: int) -> Dict[str, Any]:
  """The main job through the parameter server: its summary, with its records' ``figures``."""
  c = jobs.job_config(config, num_steps=warmup + steps, eval_samples=config.eval_batch_size, log_every=log_every)
  ps_dir = tempfile.mkdtemp(prefix="ps_", dir=workdir)  # fresh: never resumes
  s = train.train_and_evaluate(c, ps_dir)
  s["figures"] = run_figures(s, train.read_metrics(ps_dir, "train"), first=int(c.hot_warmup_steps))
  return s


def run_rounds(configs: Dict[str, Any], warmup: int, steps: int, workdir: str, repeats: int, log_every: int):
  """Each variant's runs (the PS path with ``configs`` "hot" and "nohot", on-device), rounds alternated."""
  runs: Dict[str, List[Dict]] = {"hot": [], "nohot": [], "device": []}
  for i in range(repeats):
    for name in ("hot", "nohot", "device") if i % 2 == 0 else ("device", "nohot", "hot"):
      print(f"{name}, run {i + 1} of {repeats}: {warmup} + {steps} steps ...", file=sys.stderr)
      load0 = os.getloadavg()[0]
      if name == "device":
        r = run_device(configs["hot"], warmup, steps)
      else:
        r = run_ps(configs[name], warmup, steps, workdir, log_every)
      r["load_avg"] = [load0, os.getloadavg()[0]]
      print(f"  {r['samples_per_sec']:,.0f} samples/s, load {load0:.1f}-{r['load_avg'][1]:.1f}", file=sys.stderr)
      runs[name].append(r)
  return runs


def run_device(config, warmup: int, steps: int) -> Dict[str, Any]:
  """The same model with nn.Embed tables on the device; returns samples/s and sizes."""
  reader = synthetic.build({k: v for k, v in dict(config.data).items() if k in synthetic.FIELDS})
  names = reader.feature_names
  vocab = tuple(int(v) for v in config.data.vocab_sizes)
  model = EmbeddedDLRM(vocab_sizes=vocab, dim=int(config.embeddings.dim), features=names, **config.model.kwargs)
  mesh = mesh_lib.make_mesh(config.mesh.replica, config.mesh.fsdp)
  data_sharding, repl = mesh_lib.data_sharding(mesh), mesh_lib.replicated(mesh)
  B = config.batch_size

  def host_batch(split: int, index: int, batch_size: int) -> Dict[str, np.ndarray]:
    b = reader.batch(split, index, batch_size)
    ids = np.stack([b["sparse"][n][:, 0] % np.uint64(m) for n, m in zip(names, vocab)], axis=1).astype(np.int32)
    return {"dense": b["dense"], "ids": ids, "label": b["label"]}

  example = host_batch(synthetic.TRAIN, 0, 2)
  # Jitted: one program, not the ~85 eager ops an unjitted init compiles one by one (4 s on tiny.py)
  params = jax.jit(model.init)(jax.random.PRNGKey(config.seed), example["dense"], example["ids"])["params"]
  labels = {k: ("tables" if k.startswith("embed_") else "dense") for k in params}
  tables = optax.adagrad(config.embeddings.learning_rate)
  tx = optax.multi_transform({"dense": train.dense_optimizer(config), "tables": tables}, labels)
  state = jax.device_put(train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx), repl)
  table_bytes = sum(x.nbytes for k, v in params.items() if labels[k] == "tables" for x in jax.tree.leaves(v))

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
    "dense_bytes": sum(x.nbytes for x in jax.tree.leaves(params)) - table_bytes,
    "opt_state_bytes": sum(x.nbytes for x in jax.tree.leaves(state.opt_state)),
  }


def measure_floor(config, n: int = 20) -> Dict[str, float]:
  """What a step must cost, part by part, each measured alone, after the hot set's first choice. At
  k = 0 the push and the next rows' read wait on the step: the serial estimate is device + lookup +
  place + push (the resolve overlaps the step before; the hot count runs on its own thread)."""
  job = train.build_job(config)
  train_step, hot_rows, host = job.train_step, job.hot, job.host
  B = config.batch_size
  skip = max(2, int(config.hot_warmup_steps) + 2) if hot_rows.enabled else 2
  hot_rows.resume(0, None, job.ps)  # a fresh set: its first choice after the warm-up
  placed, split0, hot0, times = None, {}, {}, host.times
  for i in range(n + skip):
    if i == skip:  # what the pipeline and the hot rows recorded so far is the warm-up's: left out
      hot_rows.counted()
      host.times.take(1)
      split0, hot0 = dict(hot_rows.seconds), dict(hot_rows.totals)
    if hot_rows.boundary(i):
      hot_rows.rechoose(i, job.ps)
    with times.time("prepare"):  # the read and the dedup
      p = host.prepare(i, job.reader.data.batch(synthetic.TRAIN, i, B))
    with times.time("resolve"):  # with hot rows, the split first (the count goes to its own thread)
      host.resolve(p)
    with times.time("lookup"):  # the rows' read, all that waits for the step before
      host.lookup(p, create=True)
    with times.time("place"):
      placed = jax.block_until_ready(host.place(p))
    zeros = {str(d): np.zeros_like(r) for d, r in p.rows.items()}  # apply costs the same for any values
    with times.time("push"):
      host.push(p.groups, zeros)
  hot_rows.counted()
  took = times.take(n)
  stages = {"read_dedup": "prepare", "resolve": "resolve", "lookup": "lookup", "place": "place", "push": "push"}
  t = {k: took[f"host_{stage}_ms"] / 1e3 for k, stage in stages.items()}
  for k in ("count", "split"):  # HotRows's own times; the count on its thread, beside the others
    t[k] = (hot_rows.seconds[k] - split0.get(k, 0.0)) / n
  hot_rows.close()
  ps_rows = took["rows_per_step"]
  hot_per_step = (hot_rows.totals["hot_rows"] - hot0.get("hot_rows", 0)) / n
  _, rows, batch = placed
  cost = train_step.lower(job.state, hot_rows.tables, rows, batch).compile().cost_analysis()
  flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost).get("flops", float("nan")))
  carry = [job.state, hot_rows.tables]  # the steps donate them: hot_rows is not used after this

  def step():
    carry[0], carry[1], g, _ = train_step(carry[0], carry[1], rows, batch)
    jax.block_until_ready(g)

  device_s = stats.median([stats.best_of(step, 1) for _ in range(n + 3)][3:])  # one call each, after 3
  a = jax.device_put(np.random.default_rng(0).standard_normal((2048, 2048), np.float32))
  mm = jax.jit(lambda x: x @ x)
  mm_s = stats.median([stats.best_of(lambda: jax.block_until_ready(mm(a)), 1) for _ in range(11)][1:])
  peak = 2 * 2048**3 / mm_s  # this device's f32 matmul FLOP/s
  out = {
    "step_flops": flops,
    "device_step_ms": 1e3 * device_s,
    "device_gflops": flops / device_s / 1e9,
    "peak_matmul_gflops": peak / 1e9,
    "compute_fraction": flops / device_s / peak,
  }
  out.update({f"host_{k}_ms": 1e3 * v for k, v in t.items()})
  out.update(
    unique_rows_per_step=ps_rows + hot_per_step,
    ps_rows_per_step=ps_rows,
    floor_samples_per_sec=B / device_s,
    k0_serial_samples_per_sec=B / (device_s + t["lookup"] + t["place"] + t["push"]),
  )
  return out


def _mib(n: float) -> str:
  return f"{n / 2**20:,.1f} MiB"


# Hot against no hot: (figure, the key of its hot / no-hot ratio, label); also ``<figure>_hot`` and ``_nohot``.
COMPARED = (
  ("samples_per_sec_ps", "hot_sps_ratio", "samples/s (job)"),
  ("steady_samples_per_sec", "hot_steady_sps_ratio", "samples/s (median step)"),
  ("ps_rows_per_step", "ps_rows_ratio", "PS rows per step"),
  ("h2d_row_bytes_per_step", "h2d_row_bytes_ratio", "h2d row bytes per step"),
  ("h2d_bytes_per_step", "h2d_bytes_ratio", "h2d bytes per step (+ batch)"),
)
JOB_STAGES = "hot_count hot_split ps_lookup resolve lookup place get push wait recompile rechoose".split()
FLOOR_STAGES = "device_step host_read_dedup host_count host_split host_resolve host_lookup host_place host_push".split()


def print_hot_table(cmp: Dict[str, Any], hv: Dict[str, Dict], f, f0) -> None:
  """The PS path with hot rows against without: medians of the alternated runs, and the floor's parts."""
  print(
    f"PS path with hot rows ({_mib(cmp['hot_rows_bytes'])}, {cmp['hot_rows_held']:,.0f} rows held) and without, "
    f"medians of {cmp['repeats']} alternated runs each; rows and bytes a step from the first choice on"
  )
  print(f"{'':30}{'hot':>14}{'no hot':>14}{'hot / no hot':>14}")
  for key, ratio_key, label in COMPARED:
    print(f"{label:30}{cmp[key + '_hot']:>14,.0f}{cmp[key + '_nohot']:>14,.0f}{cmp[ratio_key]:>14.3f}")
  print(
    f"hot hit rate {cmp['hot_hit_rate']:.4f} of id lookups (1 - hit = {cmp['one_minus_hit_rate']:.4f}), "
    f"{cmp['row_hit_rate']:.4f} of distinct rows (1 - that = {cmp['one_minus_row_hit_rate']:.4f})"
  )
  print(f"{'ms per step in the job (median of runs)':42}" + "".join(f"{s:>12}" for s in JOB_STAGES))
  for v in ("hot", "nohot"):
    print(f"  {v:40}" + "".join(f"{hv[v].get(s + '_ms', 0.0):>12.2f}" for s in JOB_STAGES))
  print(f"{'alone (floor), ms':42}" + "".join(f"{k:>16}" for k in FLOOR_STAGES))
  for v, fl in (("hot", f), ("nohot", f0)):
    print(f"  {v:40}" + "".join(f"{fl[k + '_ms']:>16.2f}" for k in FLOOR_STAGES))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  warmup, steps, repeats = _WARMUP.value, _STEPS.value, _REPEATS.value
  if warmup < 1 or steps < 1 or repeats < 1:
    raise app.UsageError("--warmup, --steps and --repeats must be >= 1 (the first step compiles)")
  config = _CONFIG.value
  if config.model.name != "dlrm" or any(int(n) > 1 for n in config.data.multi_hot):
    raise app.UsageError("the on-device baseline is EmbeddedDLRM: config.model.name 'dlrm', one-hot features only")
  if int(config.hot_rows_bytes) <= 0:
    raise app.UsageError("config.hot_rows_bytes: the PS path runs with hot rows and without; give it a budget > 0")
  device, B = jax.devices()[0].device_kind, config.batch_size
  print(f"config {flags.FLAGS['config'].config_filename}: batch {B}, {jax.device_count()} x {device}", file=sys.stderr)
  if _WORKDIR.value:
    os.makedirs(_WORKDIR.value, exist_ok=True)
  log_every = _LOG_EVERY.value or int(config.log_every)
  nohot = copy.deepcopy(config)
  nohot.hot_rows_bytes = 0
  with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
    runs = run_rounds({"hot": config, "nohot": nohot}, warmup, steps, _WORKDIR.value or tmp, repeats, log_every)
  if any(r["hot"] is None for r in runs["hot"]):
    raise app.UsageError(f"config.hot_rows_bytes = {config.hot_rows_bytes} buys no hot row: raise it")
  s = runs["hot"][0]  # sizes (rows, bytes) are the same in every run
  devices = runs.pop("device")
  d = sorted(devices, key=lambda r: r["samples_per_sec"])[len(devices) // 2]  # the median run (even: the faster)

  print("floor: device step and host stages alone, with hot rows and without ...", file=sys.stderr)
  f = measure_floor(config)
  f0 = measure_floor(nohot)

  ps_table_bytes = s["ps_rows"] * int(config.embeddings.dim) * 4  # rows only; ps_bytes adds slots and ids
  ps_param_bytes = ps_table_bytes + d["dense_bytes"]  # same dense model on the device
  dev_param_bytes = d["table_bytes"] + d["dense_bytes"]
  sps = {v: stats.median_of(runs[v], "samples_per_sec") for v in runs}
  # Each round's PS runs against that round's baseline, run beside them: the ratios the load moves least.
  rounds = {v: [r["samples_per_sec"] / b["samples_per_sec"] for r, b in zip(runs[v], devices)] for v in runs}
  figures = {v: [r["figures"] for r in runs[v]] for v in runs}
  hv = {v: {k: stats.median_of(figures[v], k) for k in figures[v][0] if k != "rechoose_at"} for v in runs}
  cmp: Dict[str, Any] = {"hot_rows_bytes": int(config.hot_rows_bytes), "repeats": repeats}
  for key, ratio_key, _ in COMPARED:
    a, b = (sps[v] if key == "samples_per_sec_ps" else hv[v][key] for v in ("hot", "nohot"))
    cmp.update({f"{key}_hot": a, f"{key}_nohot": b, ratio_key: a / b})
  hit, row_hit = hv["hot"]["hot_hit_rate"], hv["hot"]["row_hit_rate"]
  cmp.update(hot_hit_rate=hit, row_hit_rate=row_hit, one_minus_hit_rate=1.0 - hit, one_minus_row_hit_rate=1.0 - row_hit)
  cmp["hot_rows_held"] = stats.median(r["hot"]["hot_rows_held"] for r in runs["hot"])
  run_keys = ("samples_per_sec", "train_step_traces", "auc", "load_avg", "hot", "recompiles")
  result = {
    "samples_per_sec_ps": sps["hot"],
    "samples_per_sec_device": d["samples_per_sec"],
    "ratio": sps["hot"] / d["samples_per_sec"],
    "ratio_nohot": sps["nohot"] / d["samples_per_sec"],
    "ratio_rounds": rounds["hot"],
    "ratio_nohot_rounds": rounds["nohot"],
    "ratio_paired_median": stats.median(rounds["hot"]),
    "ratio_nohot_paired_median": stats.median(rounds["nohot"]),
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
    "ps_eval_auc": stats.median(r["auc"] for r in runs["hot"]),
    "device_train_loss": d["train_loss"],
    "config": flags.FLAGS["config"].config_filename,
    **f,
    "ps_fraction_of_floor": sps["hot"] / f["floor_samples_per_sec"],
    **cmp,
    "floor_nohot": f0,
    "hot_vs_nohot": {
      v: {"median": hv[v], "runs": [{**{k: r[k] for k in run_keys}, **r["figures"]} for r in runs[v]]} for v in runs
    },
  }

  print(
    f"\n{device} x {jax.device_count()}, batch {B}, k={config.staleness}: PS path {sps['hot']:,.0f} samples/s "
    f"({s['ps_rows']:,} rows created, {_mib(ps_param_bytes)} of parameters), on-device {d['samples_per_sec']:,.0f} "
    f"({d['rows']:,} rows, {_mib(dev_param_bytes)}): ratio {result['ratio']:.3f} with hot rows, "
    f"{result['ratio_nohot']:.3f} without; by round {', '.join(f'{x:.3f}' for x in rounds['hot'])} with, "
    f"{', '.join(f'{x:.3f}' for x in rounds['nohot'])} without"
  )
  print(
    f"floor: the jitted step alone {f['device_step_ms']:.1f} ms = {f['floor_samples_per_sec']:,.0f} samples/s "
    f"({f['step_flops'] / 1e9:.2f} GFLOP at {f['device_gflops']:.1f} GFLOP/s, {f['compute_fraction']:.0%} of the "
    f"{f['peak_matmul_gflops']:.0f} GFLOP/s f32 matmul peak); PS path {result['ps_fraction_of_floor']:.0%} of it; "
    f"k=0 serial estimate (step + lookup + place + push) {f['k0_serial_samples_per_sec']:,.0f} samples/s\n"
  )
  print_hot_table(cmp, hv, f, f0)

  outputs.emit(result, _JSON_OUT.value)


if __name__ == "__main__":
  app.run(main)
