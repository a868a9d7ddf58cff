"""Capacity planner: the cluster a Persia-style hybrid job needs, or what a given cluster can do.

    python -m recsys_jax.plan [--params=1e14] [--samples_per_sec=1.9e6] ...
    python -m recsys_jax.plan --ps_hosts=30 --gpus=64        # evaluate a given cluster

Embeddings live on parameter-server (PS) hosts in RAM; dense towers train synchronously on
accelerators. The model is back-of-the-envelope arithmetic, every term printed; the formulas are
in ``recsys_jax/plan/capacity.py``.

With ``--ps_hosts`` and ``--gpus`` the planner instead computes the samples/s each resource allows
and names the smallest as the bottleneck (PS RAM when the tables do not fit at all).

The defaults describe Persia's 100-trillion-parameter run (Lian et al., KDD 2022, and Google
Cloud's write-up of it); see ``PERSIA`` for the published figures and how sure we are of each.
The last stdout line is one JSON object.

This module is the printed report and the command line; the sizing model (``Inputs``, ``plan``,
``evaluate``, ...) is ``recsys_jax/plan/capacity.py``, re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from absl import app, flags

from recsys_jax.plan.capacity import (
  GB,
  PERSIA,
  PERSIA_CONFIDENCE,
  TB,
  Inputs,
  evaluate,
  memory,
  plan,
  ps_bytes_per_sample,
  row_bytes,
  storage_alternatives,
  trainer_bytes_per_sample,
  validate,
)


def _fmt(x: float) -> str:
  """Readable number: 1.9M, 781G, 12.3, 7."""
  if isinstance(x, bool):
    return str(x)
  for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.3g}{unit}"
  return f"{x:.3g}" if isinstance(x, float) else str(x)


MODEL_GAPS = (
  "Where this model and a real deployment differ (none of these is modelled):",
  "  - stragglers and synchronisation stalls in the dense all-reduce; load imbalance across PS shards (hot ids)",
  "  - cross-rack / cross-zone topology and oversubscribed switches: every host is assumed to get its NIC rate",
  "  - network protocol overhead beyond the flat --nic_efficiency factor (RPC framing, serialisation, TCP)",
  "  - embedding caches and hit rates on the trainer side (they cut PS traffic) and in-batch dedup beyond",
  "    --ids_per_sample (which is taken as already deduplicated)",
  "  - Persia's middle tier of CPU 'embedding workers' (~3,000 cores): they pool/shard lookups between PS and",
  "    GPUs; here PS traffic goes straight to trainer hosts and the tier's CPUs are not sized",
  "  - lazily created rows and LRU eviction: the planner sizes every one of params/embedding_dim rows as resident",
  "  - hash-table load factor, allocator fragmentation and OS memory: all lumped into --ps_ram_headroom",
  "  - data loading, CPU feature processing and checkpoint traffic",
  "  - GPU throughput is a single number (--gpu_samples_per_sec), not derived from the dense model's FLOPs",
)


def report(inp: Inputs) -> tuple[str, dict[str, Any]]:
  """The full human-readable report and the JSON record.

  Args:
    inp: planner inputs.

  Returns:
    (text without the JSON line, JSON-serialisable record).
  """
  validate(inp)
  lines = []
  add = lines.append
  add("=== Inputs ===")
  for f in dataclasses.fields(inp):
    add(f"  {f.name:<24} {getattr(inp, f.name)}")

  mem = memory(inp)
  add("")
  add("=== PS memory ===")
  add(f"  rows = params / embedding_dim = {_fmt(inp.params)} / {inp.embedding_dim} = {_fmt(mem['rows'])}")
  add(
    f"  row bytes = {inp.embedding_dim} x {inp.bytes_per_param} B x (1 + {inp.optimizer_slots} slots)"
    f" + {inp.row_state_bytes} B row state + {inp.row_overhead_bytes} B id-map overhead = {row_bytes(inp):.1f} B"
  )
  add(f"  weights          {mem['weights_bytes'] / TB:10.1f} TB")
  add(f"  optimizer slots  {mem['slots_bytes'] / TB:10.1f} TB")
  add(f"  per-row state    {mem['row_state_bytes'] / TB:10.1f} TB")
  add(f"  id-map overhead  {mem['overhead_bytes'] / TB:10.1f} TB")
  add(f"  total            {mem['total_bytes'] / TB:10.1f} TB")
  add(
    f"  usable per host = {inp.ps_host_ram_gb:g} GB x {inp.ps_ram_headroom} = {mem['usable_bytes_per_host'] / TB:.2f} TB"
  )
  add("  storage alternatives (same rows, other choices):")
  for label, tb, h in storage_alternatives(inp):
    add(f"    {label:<50} {tb:8.1f} TB -> {h:4d} PS hosts")
  persia_tb = PERSIA["ps_hosts"] * PERSIA["ps_host_ram_gb"] * GB / TB
  add(
    f"  Persia had {PERSIA['ps_hosts']} x {PERSIA['ps_host_ram_gb'] / 1000:g} TB = {persia_tb:.0f} TB in all;"
    f" 100T fp32 weights alone are {100e12 * 4 / TB:.0f} TB, so 100T resident"
  )
  add("  parameters only fit with 2-byte storage and per-row (not per-element) optimizer state, or with")
  add("  rows created lazily / evicted (the 100T being table capacity, not resident rows). Persia's Adagrad")
  add("  has a 'vectorwise_shared' (one accumulator per row) mode; the defaults assume that plus fp16 storage.")

  p = plan(inp)
  add("")
  add(f"=== Plan for {_fmt(inp.samples_per_sec)} samples/s ===")
  add(f"  PS bytes/sample = {inp.ids_per_sample:g} ids x (2 x {inp.embedding_dim} x {inp.wire_bytes:g} B")
  add(f"                    + 2 x {inp.key_bytes:g} B keys) = {ps_bytes_per_sample(inp):.0f} B")
  add(f"  trainer embedding bytes/sample = {trainer_bytes_per_sample(inp):.0f} B;")
  add(f"  dense all-reduce {_fmt(inp.dense_params)} params x {inp.wire_bytes:g} B per step of {inp.batch_per_gpu}/GPU")
  add(f"  usable NIC per host = {inp.nic_gbps:g} Gbps x {inp.nic_efficiency} = {p['nic_usable_gbps']:.1f} Gbps")
  add(f"  {'PS hosts by RAM':<28} {p['ps_hosts_by_ram']:>8}")
  add(f"  {'PS hosts by network':<28} {p['ps_hosts_by_network']:>8}")
  add(f"  {'PS hosts (max)':<28} {p['ps_hosts']:>8}")
  add(f"  {'network per PS host':<28} {p['ps_gbps_per_host']:>8.1f} Gbps")
  add(f"  {'accelerators':<28} {p['gpus']:>8}   ({_fmt(inp.gpu_samples_per_sec)} samples/s each)")
  add(f"  {'trainer hosts':<28} {p['trainer_hosts']:>8}")
  add(f"  {'network per trainer host':<28} {p['trainer_gbps_per_host']:>8.1f} Gbps")
  if p["trainer_nic_overflow"]:
    add("  WARNING: trainer NICs overflow even with one GPU per host (dense all-reduce too large)")

  # Evaluate either the cluster asked for or, by default, Persia's own.
  if inp.ps_hosts > 0:
    ev_hosts, ev_gpus, ev_name = inp.ps_hosts, inp.gpus, "the given cluster"
  else:
    ev_hosts, ev_gpus, ev_name = PERSIA["ps_hosts"], PERSIA["gpus"], "Persia's cluster"
  ev = evaluate(inp, ev_hosts, ev_gpus)
  add("")
  add(f"=== Evaluate {ev_name}: {ev_hosts} PS hosts, {ev_gpus} GPUs ({ev['trainer_hosts']} trainer hosts) ===")
  add(
    f"  PS RAM used: {ev['ps_ram_used_fraction']:.0%} of usable ({'fits' if ev['ps_fits_in_ram'] else 'DOES NOT FIT'})"
  )
  for k, v in ev["limits_samples_per_sec"].items():
    add(f"  {k + ' allows':<28} {_fmt(v):>8} samples/s")
  add(f"  bottleneck: {ev['bottleneck']}; achievable {_fmt(ev['achievable_samples_per_sec'])} samples/s")
  add(
    f"  at that rate: {ev['ps_gbps_per_host']:.1f} Gbps per PS host, {ev['trainer_gbps_per_host']:.1f} Gbps per trainer host"
  )

  add("")
  add("=== Planner vs Persia's published 100T deployment ===")
  add(f"  {'':<18} {'planner':>10} {'Persia':>10}   confidence in Persia's figure")
  rows = [
    ("PS hosts", p["ps_hosts"], PERSIA["ps_hosts"], "ps_hosts"),
    ("GPUs", p["gpus"], PERSIA["gpus"], "gpus"),
    ("trainer hosts", p["trainer_hosts"], PERSIA["trainer_hosts"], "trainer_hosts"),
    ("samples/s on", ev["achievable_samples_per_sec"], PERSIA["samples_per_sec"], "samples_per_sec"),
  ]
  for name, mine, theirs, key in rows:
    add(f"  {name:<18} {_fmt(mine):>10} {_fmt(theirs):>10}   {PERSIA_CONFIDENCE[key]}")
  add("  ('samples/s on' = what the planner says Persia's 30 PS hosts + 64 GPUs achieve.)")
  add("  Differences, and what the match rests on:")
  add("  - PS hosts: matches only under the stated storage assumption (fp16 rows, per-row optimizer state,")
  add(
    f"    {inp.row_overhead_bytes:g} B/row id-map overhead, {inp.ps_ram_headroom:.0%} of RAM usable); Persia's exact storage"
  )
  add("    format and headroom are not published in what we could check. fp32 + Adagrad would need ~3x the hosts.")
  add("  - GPUs and samples/s: --gpu_samples_per_sec defaults to ~1.9M / 64 rounded, i.e. it is calibrated on")
  add("    Persia's own figure, not an independent A100 measurement; their agreement is consistency, not a test.")
  add(
    f"  - ids_per_sample={inp.ids_per_sample:g}, dense_params={_fmt(inp.dense_params)}, batch_per_gpu={inp.batch_per_gpu}"
  )
  add("    are assumptions (the 100T benchmark's feature counts are not in what we could check); above the")
  add(f"    break-even of ~{_breakeven_ids(inp):.0f} unique ids/sample the network, not GPUs, limits Persia's cluster.")
  add("")
  lines.extend(MODEL_GAPS)

  record = {
    "inputs": dataclasses.asdict(inp),
    "plan": p,
    "evaluate": ev,
    "persia": PERSIA,
  }
  return "\n".join(lines), record


def _breakeven_ids(inp: Inputs) -> float:
  """Unique ids per sample at which Persia's cluster stops being GPU-bound (network takes over)."""
  lo, hi = 0.0, 1e6
  for _ in range(60):
    mid = (lo + hi) / 2
    ev = evaluate(dataclasses.replace(inp, ids_per_sample=max(mid, 1e-9)), PERSIA["ps_hosts"], PERSIA["gpus"])
    lo, hi = (mid, hi) if ev["bottleneck"] in ("gpu_compute", "ps_ram") else (lo, mid)
  return lo


# --- command line -------------------------------------------------------------------------------------------------

_D = Inputs()
flags.DEFINE_float("params", _D.params, "Total embedding parameters. Persia: 100 trillion (paper title, KDD 2022).")
flags.DEFINE_integer(
  "embedding_dim",
  _D.embedding_dim,
  "Values per embedding row. Persia's 100T table width is not in what we could check; 128 is a common"
  " production width and the planner's assumption.",
)
flags.DEFINE_float(
  "dense_params",
  _D.dense_params,
  "Dense-tower parameters (all-reduced every step). Assumed 1e8: Persia's dense part is small next to 100T.",
)
flags.DEFINE_float(
  "bytes_per_param",
  _D.bytes_per_param,
  "Bytes per stored embedding value. 2 (fp16): the only width at which 100T values fit Persia's 360 TB"
  " (30 x 12 TB, GCP blog); 4 for fp32.",
)
flags.DEFINE_float(
  "optimizer_slots",
  _D.optimizer_slots,
  "Per-element optimizer slots of the same width as the weights (Adagrad: 1, Adam: 2). Default 0: Persia's"
  " Adagrad 'vectorwise_shared' mode keeps one accumulator per row instead (see --row_state_bytes).",
)
flags.DEFINE_float(
  "row_state_bytes", _D.row_state_bytes, "Per-row optimizer state in bytes (vectorwise-shared Adagrad: one fp32 = 4)."
)
flags.DEFINE_float(
  "row_overhead_bytes",
  _D.row_overhead_bytes,
  "Id-map overhead per row in bytes: 8 B id key + hash-slot/pointer + LRU links (~32 B, an estimate).",
)
flags.DEFINE_float("key_bytes", _D.key_bytes, "Bytes per id on the wire (u64 = 8).")
flags.DEFINE_float(
  "samples_per_sec",
  _D.samples_per_sec,
  "Target training samples/s. Default ~1.9M: Persia's largest-benchmark throughput, approximately"
  " (approximate; not verified against the paper).",
)
flags.DEFINE_float(
  "ids_per_sample",
  _D.ids_per_sample,
  "Unique ids looked up per sample after in-batch dedup. Assumed 50 (Criteo has 26 sparse fields; production"
  " models have more, dedup removes hot ids); Persia's 100T figure is not published in what we could check.",
)
flags.DEFINE_float(
  "pooled_per_sample",
  _D.pooled_per_sample,
  "Vectors per sample a trainer host receives after pooling (Persia's embedding workers sum multi-id features)."
  " 0 means no pooling: same as --ids_per_sample.",
)
flags.DEFINE_float(
  "ps_host_ram_gb", _D.ps_host_ram_gb, "RAM per PS host in GB. Persia: 12 TB (GCP high-memory VMs, GCP blog)."
)
flags.DEFINE_float(
  "ps_ram_headroom",
  _D.ps_ram_headroom,
  "Fraction of PS RAM usable for tables (the rest: OS, hash-table load factor, fragmentation, buffers). 0.7 assumed.",
)
flags.DEFINE_float("nic_gbps", _D.nic_gbps, "NIC line rate per host in Gbps. 100 assumed (A2 VMs advertise 100 Gbps).")
flags.DEFINE_float(
  "nic_efficiency", _D.nic_efficiency, "Fraction of line rate achieved by RPC traffic (protocol, framing). 0.7 assumed."
)
flags.DEFINE_float(
  "gpu_samples_per_sec",
  _D.gpu_samples_per_sec,
  "Dense-tower training samples/s per accelerator. Default 30k: Persia's ~1.9M samples/s over 64 A100s (~29.7k),"
  " i.e. calibrated on Persia itself, not an independent A100 benchmark; measure yours with experiments/bench_train.py.",
)
flags.DEFINE_integer("gpus_per_trainer_host", _D.gpus_per_trainer_host, "Accelerators per trainer host (A2: 8 A100).")
flags.DEFINE_float("wire_bytes", _D.wire_bytes, "Bytes per value on the wire for rows/grads (fp32 4, fp16/bf16 2).")
flags.DEFINE_integer(
  "batch_per_gpu", _D.batch_per_gpu, "Samples per accelerator per step (sets dense all-reduce frequency). 8192 assumed."
)
flags.DEFINE_integer(
  "ps_hosts", _D.ps_hosts, "Evaluate a given cluster: PS hosts (needs --gpus). 0: plan for --samples_per_sec."
)
flags.DEFINE_integer("gpus", _D.gpus, "Evaluate a given cluster: accelerators (needs --ps_hosts).")


def inputs_from_flags() -> Inputs:
  """Inputs built from the parsed absl flags."""
  return Inputs(**{f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(Inputs)})


def main(argv: list[str]) -> None:
  """Prints the report, then the JSON record as the last line."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    text, record = report(inputs_from_flags())
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  print(text)
  print(json.dumps(record, sort_keys=True))
  sys.stdout.flush()
