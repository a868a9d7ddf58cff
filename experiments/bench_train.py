"""Training throughput: the parameter-server path against an on-device-embedding baseline.

    .venv/bin/python experiments/bench_train.py --config=configs/dlrm.py [--steps=200] [--warmup=5]
        [--workdir=DIR] [--json_out=FILE] [--config.batch_size=...]

Run from the repository root. Measures, in one process, the training samples/s of the main
job's configuration (read from ``--config`` at run time; ``--config.FIELD=VALUE`` overrides
a field) through two paths, on the same synthetic batches (train batches 0 .. warmup+steps-1):

1. PS path: ``recsys_jax.train.train_and_evaluate`` in a fresh workdir with
   num_steps = warmup + steps, no intermediate checkpoints or evals, and a final eval of one
   eval batch. The figure is the job's own ``samples_per_sec``: every step after the first
   (compile-heavy) one, i.e. warmup + steps - 1 steps, including host reading, dedup, PS
   lookups and pushes (the job overlaps them with the device step).
2. On-device baseline: ``EmbeddedDLRM`` with one ``nn.Embed`` of ``config.data.vocab_sizes[i]``
   rows and ``config.embeddings.dim`` columns per feature, and the same bottom/top MLP. Ids are
   mapped to table rows on the host with the hashing trick, row = id % vocab, as on-device
   baselines do (distinct ids may share a row; the PS path never conflates them). The dense
   part is optimised with the config's dense optimizer and the tables with
   ``optax.adagrad(config.embeddings.learning_rate)`` (dense Adagrad over whole tables), in a
   jitted train step with donated state. Batches are read, mapped and ``device_put`` on a
   background thread (the library's Prefetcher, ``config.prefetch_depth`` deep), so reading
   overlaps the step. The figure is ``steps`` steps timed after ``warmup`` steps, blocking on
   the final state.

Prints a short table, then, last on stdout, one JSON line: samples_per_sec_ps,
samples_per_sec_device, ratio (= ps / device; above 1 means the PS path is faster), batch_size,
steps, warmup, device (device kind), embedding_rows (rows of the on-device tables = sum of
vocab sizes), ps_rows (rows the PS created in the run), and the parameter bytes of both.
The baseline supports one-hot features only (``config.data.multi_hot`` empty).
"""

# ruff: noqa: E402

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)  # `configs` and `recsys_jax` when run as experiments/bench_train.py

import jax
import numpy as np
import optax
from absl import app, flags, logging
from flax.training import train_state
from ml_collections import config_flags

from recsys_jax import train
from recsys_jax.async_ps.pipeline import Prefetcher, StalenessGate
from recsys_jax.data import synthetic
from recsys_jax.models import EmbeddedDLRM
from recsys_jax.parallel import mesh as mesh_lib

_CONFIG = config_flags.DEFINE_config_file("config", "configs/dlrm.py", "The main job's ml_collections config file.")
_STEPS = flags.DEFINE_integer("steps", 200, "Timed training steps of each path.")
_WARMUP = flags.DEFINE_integer("warmup", 5, "Untimed steps before the timed ones (the first one compiles).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Scratch directory for the PS run (default: a temp dir, removed).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON result to this file.")


def _tree_bytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def run_ps(config, warmup: int, steps: int, workdir: str) -> Dict[str, Any]:
  """The main job through the parameter server; returns its summary dict."""
  c = copy.deepcopy(config)
  c.num_steps = warmup + steps
  c.checkpoint_every = 0
  c.eval_every = 0
  c.eval_samples = c.eval_batch_size
  c.progress_bar = False
  ps_dir = tempfile.mkdtemp(prefix="ps_", dir=workdir)  # fresh: never resumes
  return train.train_and_evaluate(c, ps_dir)


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
  params = model.init(jax.random.PRNGKey(config.seed), example["dense"], example["ids"])["params"]
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
  the lookup and push of a step cannot overlap the device step (they wait on it), so the
  synchronous estimate is device + lookup + place + push.
  """
  job = train.build_job(config)
  B = config.batch_size
  t = {"read_dedup": 0.0, "lookup": 0.0, "place": 0.0, "push": 0.0}
  placed = None
  for i in range(n + 2):
    t0 = time.perf_counter()
    p = job.host.prepare(i, job.reader.data.batch(synthetic.TRAIN, i, B))
    t1 = time.perf_counter()
    job.host.lookup(p, create=True)
    t2 = time.perf_counter()
    placed = job.host.place(p)
    jax.block_until_ready(placed[1:])
    t3 = time.perf_counter()
    zeros = {str(d): np.zeros_like(r) for d, r in p.rows.items()}  # apply costs the same for any values
    t4 = time.perf_counter()
    job.host.push(p.groups, zeros)
    t5 = time.perf_counter()
    if i >= 2:
      for k, v in zip(t, (t1 - t0, t2 - t1, t3 - t2, t5 - t4)):
        t[k] += v / n
  _, rows, batch = placed
  compiled = job.train_step.lower(job.state, job.hot_state, rows, batch).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flops = float(cost.get("flops", float("nan")))
  state, hot = job.state, job.hot_state
  for _ in range(3):
    state, hot, g, _m = job.train_step(state, hot, rows, batch)
  jax.block_until_ready(g)
  times = []
  for _ in range(n):
    t0 = time.perf_counter()
    state, hot, g, _m = job.train_step(state, hot, rows, batch)
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
    "host_lookup_ms": 1e3 * t["lookup"],
    "host_place_ms": 1e3 * t["place"],
    "host_push_ms": 1e3 * t["push"],
    "unique_rows_per_step": float(sum(g.num_rows for g in p.groups.values())),
    "floor_samples_per_sec": B / device_s,
    "k0_serial_samples_per_sec": B / serial,
  }


def _mib(n: float) -> str:
  return f"{n / 2**20:,.1f} MiB"


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

  try:
    print(f"PS path: {warmup} + {steps} steps ...", file=sys.stderr)
    s = run_ps(config, warmup, steps, workdir)
  finally:
    if own_workdir:
      shutil.rmtree(workdir, ignore_errors=True)
  print(f"on-device baseline: {warmup} + {steps} steps ...", file=sys.stderr)
  d = run_device(config, warmup, steps)

  print("floor: device step and host stages alone ...", file=sys.stderr)
  f = measure_floor(config)

  dim = int(config.embeddings.dim)
  ps_table_bytes = s["ps_rows"] * dim * 4  # rows only; ps_bytes adds Adagrad slots and ids
  ps_param_bytes = ps_table_bytes + d["dense_bytes"]  # same dense model on the device
  dev_param_bytes = d["table_bytes"] + d["dense_bytes"]
  ratio = s["samples_per_sec"] / d["samples_per_sec"]
  result = {
    "samples_per_sec_ps": s["samples_per_sec"],
    "samples_per_sec_device": d["samples_per_sec"],
    "ratio": ratio,
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
    "ps_eval_auc": s["auc"],
    "device_train_loss": d["train_loss"],
    "config": flags.FLAGS["config"].config_filename,
    **f,
    "ps_fraction_of_floor": s["samples_per_sec"] / f["floor_samples_per_sec"],
  }

  rows = [
    ("samples/s", f"{s['samples_per_sec']:,.0f}", f"{d['samples_per_sec']:,.0f}"),
    ("timed steps", f"{warmup + steps - 1}", f"{steps}"),
    ("embedding rows", f"{s['ps_rows']:,} created", f"{d['rows']:,}"),
    ("embedding bytes", _mib(ps_table_bytes) + " host", _mib(d["table_bytes"]) + " device"),
    ("dense param bytes", _mib(d["dense_bytes"]), _mib(d["dense_bytes"])),
    ("param bytes", _mib(ps_param_bytes), _mib(dev_param_bytes)),
    ("opt. state bytes", _mib(s["ps_bytes"] - ps_table_bytes) + " host+ids", _mib(d["opt_state_bytes"])),
  ]
  print(f"\ndevice {device} x {jax.device_count()}, batch {B}, staleness k={config.staleness}")
  print(f"{'':22}{'PS path':>22}{'on-device (id % vocab)':>26}")
  for name, a, b in rows:
    print(f"{name:22}{a:>22}{b:>26}")
  print(f"ratio PS / on-device: {ratio:.3f}\n")
  print(
    f"floor: the jitted step alone takes {f['device_step_ms']:.1f} ms = {f['floor_samples_per_sec']:,.0f} samples/s "
    f"({f['step_flops'] / 1e9:.2f} GFLOP, {f['device_gflops']:.1f} GFLOP/s = {f['compute_fraction']:.0%} of this "
    f"device's {f['peak_matmul_gflops']:.0f} GFLOP/s f32 matmul peak)"
  )
  print(
    f"host per step, alone: read+dedup {f['host_read_dedup_ms']:.1f} ms (overlapped), lookup "
    f"{f['host_lookup_ms']:.1f} ms, place {f['host_place_ms']:.1f} ms, push {f['host_push_ms']:.1f} ms "
    f"({f['unique_rows_per_step']:,.0f} distinct rows)"
  )
  print(
    f"PS path = {result['ps_fraction_of_floor']:.0%} of the device-step floor; the k=0 serial estimate "
    f"(step + lookup + place + push) is {f['k0_serial_samples_per_sec']:,.0f} samples/s\n"
  )

  line = json.dumps(result)
  if _JSON_OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_JSON_OUT.value)), exist_ok=True)
    with open(_JSON_OUT.value, "w") as f:
      f.write(line + "\n")
  print(line, flush=True)


if __name__ == "__main__":
  app.run(main)
