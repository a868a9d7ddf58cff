"""Parameter-server throughput on a Zipf workload, as a fraction of memcpy bandwidth measured in the same run.

    python experiments/bench_ps.py [--ps_threads=1,2] [--ram_repeats=3] [--num_shards=1] [--vocab=100000]
        [--tier_fraction=0.125] [--tier_rounds=3] [--read_ahead=4] [--notier] [--json_out=FILE]

Per batch (Zipf(1.1) ids, one Adagrad table per feature) one ``lookup_many`` and one ``apply_many``;
bytes as ``harness.ps.row_bytes`` counts them; a memcpy after every timed batch gives
``fraction_of_memcpy`` under the same load (``fraction_of_best_memcpy``: against the best copy before
the run). Configurations: ``ram`` (every id created first; per ``--ps_threads`` count, the median of
``--ram_repeats``), ``cold`` (starting empty), and each table's RAM cache ``--tier_fraction`` of it
over the disk tier: ``tier`` (with ``--read_ahead``), ``tier_no_read_ahead``, ``tier_tensorstore``
and ``tier_back_to_back`` (no memcpy between batches), each against a RAM-only run on the same fresh
batches (``tier_vs_ram``, median of ``--tier_rounds``), and the floor (``tier_floor_ratio``: the
seconds ``os.preadv`` takes to re-read the bytes the tier read, over the seconds the tier added).
The last stdout line is one JSON object of the headline figures; ``--json_out`` gets every figure.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Dict, Optional

import numpy as np
from absl import app, flags
from harness import data, outputs
from harness.ps import Memcpy, adagrad_specs, grads, prefill, row_bytes

from recsys_jax.async_ps.store.ps import ParameterServer

_BATCHES = flags.DEFINE_integer("batches", 20, "Timed batches per configuration.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed batches first.")
_SHARDS = flags.DEFINE_integer("num_shards", 1, "PS shards.")
_THREADS = flags.DEFINE_list("ps_threads", ["1"], "PS thread counts (ParameterServer(threads=)) to compare.")
_VOCAB = flags.DEFINE_integer("vocab", 100_000, "Distinct ids per table.")
_DIM = flags.DEFINE_integer("dim", 64, "Row width.")
_BATCH = flags.DEFINE_integer("batch_size", 4096, "Samples per batch.")
_FEATURES = flags.DEFINE_integer("features", 26, "Sparse features (one table each).")
_ALPHA = flags.DEFINE_float("zipf_alpha", 1.1, "Zipf exponent of id frequencies.")
_REPEATS = flags.DEFINE_integer("ram_repeats", 3, "Runs of the ram configuration; the median one is reported.")
_TIER = flags.DEFINE_bool("tier", True, "Also run with the disk tier (RAM only against tiered, alternating).")
_TIER_FRACTION = flags.DEFINE_float("tier_fraction", 1 / 8, "Fraction of each table in RAM in the tier runs.")
_TIER_ROUNDS = flags.DEFINE_integer("tier_rounds", 3, "Alternating rounds of ram and the tier configurations.")
_AHEAD = flags.DEFINE_integer("read_ahead", 4, "Batches whose tier misses are read ahead (tier runs).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON result here.")


TIERED = ("tier", "tier_no_read_ahead", "tier_tensorstore")
# The figures of each configuration in the last stdout line, prefixed with its name.
PER_CONFIG = (
  "lookup_rows_per_s",
  "apply_rows_per_s",
  "fraction_of_memcpy",
  "hit_rate",
  "tier_vs_ram",
  "lookup_tier_wait_s",
)


def _sum(st: Dict, key: str):
  """``key`` of ``ps.stats()`` summed over the tables (0 where the PS does not count it)."""
  return sum(s.get(key, 0) for s in st.values())


def batches(n: int, seed: int = 0):
  return data.zipf_batches(n, _VOCAB.value, _ALPHA.value, _BATCH.value, _FEATURES.value, seed=seed)


def run(
  ps: ParameterServer,
  bs,
  first_step: int = 1,
  mem: Optional[Memcpy] = None,
  mem1: Optional[Memcpy] = None,
  ahead: int = 0,
  trace: Optional[list] = None,
) -> Dict:
  """Times lookup_many + apply_many per batch after ``--warmup``, and after each timed batch one copy
  of ``mem`` (as many threads as the PS) and ``mem1`` (one thread).

  ``ahead``: before batch i's lookup, ``read_ahead_many`` of batch i + ahead (timed with the lookup).
  ``trace``: gets, per timed batch, the tier reads its lookup will make (untimed).
  """
  warmup = _WARMUP.value
  g = grads(max(len(v) for b in bs for v in b.values()), _DIM.value)
  b_lookup, b_apply, b_create = row_bytes(_DIM.value)
  copies = {k: m for k, m in (("", mem), ("_1thread", mem1)) if m is not None}
  copied, t_copy = dict.fromkeys(copies, 0), dict.fromkeys(copies, 0.0)
  t_lookup = t_apply = 0.0
  rows = created = 0
  for i, b in enumerate(bs):
    if i >= warmup:
      st = ps.stats()
      if i == warmup:
        st0 = st
      before = _sum(st, "created") + _sum(st, "tier_reads")
      if trace is not None:
        trace.append(tier_reads(ps, b))
    t0 = time.perf_counter()
    if ahead:
      for j in range(i + 1 if i == 0 else i + ahead, min(i + ahead, len(bs) - 1) + 1):
        ps.read_ahead_many(bs[j], step=first_step + j)
    ps.lookup_many(b, create=True, step=first_step + i)
    t1 = time.perf_counter()
    ps.apply_many({t: (ids, g[: len(ids)]) for t, ids in b.items()}, step=first_step + i)
    t2 = time.perf_counter()
    if i >= warmup:
      t_lookup += t1 - t0
      t_apply += t2 - t1
      rows += sum(len(v) for v in b.values())
      st = ps.stats()
      created += _sum(st, "created") + _sum(st, "tier_reads") - before
      for k, m in copies.items():
        nbytes, secs = m.copy()
        copied[k], t_copy[k] = copied[k] + nbytes, t_copy[k] + secs
  if ahead:
    ps.wait_read_ahead()  # untimed: none runs into the next configuration's time
  st = ps.stats()
  # The cache's own hits: rows a read-ahead brought from the tier are hits of their lookup, not of the cache.
  hits = _sum(st, "hits") - _sum(st0, "hits") - (_sum(st, "read_ahead_rows") - _sum(st0, "read_ahead_rows"))
  out = {
    "hit_rate": hits / (_sum(st, "lookups") - _sum(st0, "lookups")),
    "lookup_tier_wait_s": _sum(st, "tier_wait_s") - _sum(st0, "tier_wait_s"),  # read-ahead's reads not counted
    "rows": rows,
    "created_or_read_back": created,
    "lookup_rows_per_s": rows / t_lookup,
    "apply_rows_per_s": rows / t_apply,
    "bytes_per_s": (rows * (b_lookup + b_apply) + created * b_create) / (t_lookup + t_apply),
  }
  for k in copies:
    out[f"memcpy{k}_bytes_per_s"] = copied[k] / t_copy[k]
    out[f"fraction_of_memcpy{k}"] = out["bytes_per_s"] / out[f"memcpy{k}_bytes_per_s"]
  return out


def tier_reads(ps: ParameterServer, batch) -> list:
  """The (file, offset, length) reads the lookup of ``batch`` will make from the tier's files,
  in the order it makes them: per table shard, per field, the rows of the ids not in RAM."""
  out = []
  for t, ids in batch.items():
    shard = ps.shard_of(t, ids)
    for s in range(ps.num_shards):
      table = ps.shards[s][t]
      mine = ids[shard == s]
      rows = table.tier.locate(mine[~table.in_ram(mine)])
      rows = rows[rows >= 0]
      for path, width in table.tier.files():
        out.extend((path, int(r) * width, width) for r in rows)
  return out


def floor_read(reads: list) -> float:
  """Seconds to read the same bytes from the same files in the same order with ``os.preadv``."""
  fds, buf = {}, bytearray(max((n for _, _, n in reads), default=1))
  view = memoryview(buf)
  t0 = time.perf_counter()
  for path, off, n in reads:
    fd = fds.get(path)
    if fd is None:
      fd = fds[path] = os.open(path, os.O_RDONLY)
    os.preadv(fd, [view[:n]], off)
  took = time.perf_counter() - t0
  for fd in fds.values():
    os.close(fd)
  return took


def tier_rounds(names, n: int, threads: int, mem, mem1) -> Dict:
  """RAM only against the tiered PSs (module docstring), ``--tier_rounds`` rounds of ``n`` fresh batches."""
  vocab, shards, dim = _VOCAB.value, _SHARDS.value, _DIM.value
  cap = max(1, int(vocab * _TIER_FRACTION.value))
  out: Dict = {"tier_cache_fraction": cap / vocab}
  with tempfile.TemporaryDirectory(prefix="bench_ps_tier_") as d:
    pss = {"ram": ParameterServer(adagrad_specs(names, dim), num_shards=shards, threads=threads)}
    for name, backend in zip(TIERED, ("file", "file", "tensorstore")):
      spec = {"driver": "file", "path": os.path.join(d, name)}
      tiered = adagrad_specs(names, dim, capacity=cap)
      pss[name] = ParameterServer(tiered, num_shards=shards, tier=spec, threads=threads, tier_backend=backend)
    step = {name: prefill(ps, names, vocab) for name, ps in pss.items()}
    runs: Dict[str, list] = {name: [] for name in list(pss) + ["ram_back_to_back", "tier_back_to_back"]}
    trace: list = []
    for r in range(_TIER_ROUNDS.value):
      # Fresh batches every round (the same for every configuration of the round): batches seen
      # before would find their rows in every cache.
      bs, more = batches(n, seed=r + 1), batches(n, seed=r + 1001)
      order = [(name, name, bs, mem, mem1) for name in pss]
      order += [("ram_back_to_back", "ram", more, None, None), ("tier_back_to_back", "tier", more, None, None)]
      for name, ps_name, these, m, m1 in order:
        ahead = _AHEAD.value if ps_name == "tier" else 0
        tr = trace if (name == "tier_no_read_ahead" and r == 0) else None
        res = run(pss[ps_name], these, step[ps_name], m, m1, ahead=ahead, trace=tr)
        step[ps_name] += len(these)
        res["seconds"] = res["rows"] / res["lookup_rows_per_s"] + res["rows"] / res["apply_rows_per_s"]
        runs[name].append(res)
    stats = {name: ps.stats() for name, ps in pss.items()}
    floor_s = floor_read([x for batch in trace for x in batch])
    for ps in pss.values():
      ps.close()
  for name in TIERED + ("tier_back_to_back",):
    ram = runs["ram_back_to_back" if name == "tier_back_to_back" else "ram"]
    rows_ratio = sorted(y["seconds"] / x["seconds"] for x, y in zip(runs[name], ram))
    st = stats["tier" if name == "tier_back_to_back" else name]
    out[name] = dict(
      sorted(runs[name], key=lambda x: x["seconds"])[len(runs[name]) // 2],
      tier_vs_ram=rows_ratio[len(rows_ratio) // 2],
      tier_vs_ram_rounds=rows_ratio,
      ram_rows=int(_sum(st, "rows")),
      tier_rows=int(_sum(st, "tier_rows")),
      **{k: int(_sum(st, k)) for k in ("read_ahead_rows", "read_ahead_hits", "read_ahead_skipped", "read_ahead_late")},
      tier_wait_s=float(_sum(st, "tier_wait_s")),  # since the PS was made, prefill included
    )
    if "fraction_of_memcpy" in out[name]:
      out[name]["bytes_ratio_rounds"] = sorted(x["bytes_per_s"] / y["bytes_per_s"] for x, y in zip(runs[name], ram))
  read_rows = sum(n for batch in trace for _, _, n in batch) / (dim * 4 + dim * 4)
  out["tier_floor_rows_per_s"] = read_rows / max(floor_s, 1e-9)
  for name, key in (("tier", "tier_floor_ratio"), ("tier_no_read_ahead", "tier_no_read_ahead_floor_ratio")):
    added = max(runs[name][0]["seconds"] - runs["ram"][0]["seconds"], 1e-9)
    out[key] = floor_s / added
    if name == "tier":
      out["tier_read_rows_per_s"] = read_rows / added
    print(
      f"tier floor: the {read_rows:,.0f} rows tier_no_read_ahead's lookups read (round 1), read again with "
      f"os.preadv: {floor_s:.3f} s ({out['tier_floor_rows_per_s'] / 1e6:.2f}M rows/s); {name} added {added:.3f} s "
      f"to ram's time: floor ratio {out[key]:.3f}",
      file=sys.stderr,
    )
  return out


def report(name: str, r: Dict, best: float, extra: str = "") -> None:
  """Prints a configuration's rates (stderr), and sets its ``fraction_of_best_memcpy`` where memcpy was copied."""
  line = (
    f"{name:5s} lookup {r['lookup_rows_per_s'] / 1e6:6.2f}M rows/s, apply {r['apply_rows_per_s'] / 1e6:6.2f}M rows/s"
  )
  if "memcpy_bytes_per_s" in r:
    r["fraction_of_best_memcpy"] = r["bytes_per_s"] / best
    line += f", {r['bytes_per_s'] / 1e9:5.2f} GB/s = {r['fraction_of_memcpy']:.3f} of memcpy at "
    line += f"{r['memcpy_bytes_per_s'] / 1e9:.1f} GB/s, {r['fraction_of_memcpy_1thread']:.3f} of 1-thread memcpy at "
    line += f"{r['memcpy_1thread_bytes_per_s'] / 1e9:.1f} GB/s ({r['fraction_of_best_memcpy']:.3f} of the best, {best / 1e9:.1f} GB/s)"
  print(line + extra, file=sys.stderr)


def main(argv):
  del argv
  dim, shards, vocab = _DIM.value, _SHARDS.value, _VOCAB.value
  print(
    f"workload: {_BATCH.value} x {_FEATURES.value} ids per batch, Zipf({_ALPHA.value}) over "
    f"{vocab:,} ids per table, dim {dim}, {shards} shard(s)",
    file=sys.stderr,
  )
  bs = batches(_WARMUP.value + _BATCHES.value)
  uniq = float(np.mean([sum(len(v) for v in b.values()) for b in bs]))
  names = list(bs[0])
  counts = [int(t) for t in _THREADS.value]
  mems = {n: Memcpy(n) for n in sorted(set(counts) | {1})}
  threads = counts[-1]
  mem, mem1 = mems[threads], mems[1]
  best = mem.best()  # the reference before the run: the load it met is not the run's
  params = dict(distinct_rows_per_batch=uniq, num_shards=shards, ps_threads=counts, dim=dim, vocab=vocab)
  results = {"memcpy_best_gb_per_s": best / 1e9, "load_average_start": os.getloadavg()[0], **params}

  specs = adagrad_specs(names, dim)
  pss = [ParameterServer(specs, num_shards=shards, threads=n) for n in counts]
  first = [prefill(ps, names, vocab) for ps in pss][0]
  reps = [[] for _ in counts]
  for k in range(_REPEATS.value):  # the same tables and batches again: the repeats differ by the load only
    for j, (n, ps) in enumerate(zip(counts, pss)):  # every thread count in turn, so all see the same load
      reps[j].append(run(ps, bs, first + k * len(bs), mems[n], mem1))
  for ps in pss:
    ps.close()
  del pss, ps
  by_threads = {}
  for j, n in enumerate(counts):
    fr = sorted(x["fraction_of_memcpy"] for x in reps[j])
    r = dict(sorted(reps[j], key=lambda x: x["fraction_of_memcpy"])[len(fr) // 2], repeats=fr)
    # Paired: repeat k of this count against repeat k of the first, run back to back.
    ratios = sorted(x["bytes_per_s"] / y["bytes_per_s"] for x, y in zip(reps[j], reps[0]))
    r["speedup_vs_first"] = ratios[len(ratios) // 2]
    extra = f" [{n} thread(s); median of {len(fr)}: {', '.join(f'{x:.3f}' for x in fr)}; "
    extra += f"{r['speedup_vs_first']:.2f}x the rows/s of {counts[0]} thread(s), median of paired repeats]"
    report("ram", r, best, extra)
    by_threads[n] = r
  results["ram"] = by_threads[threads]
  results["ram_by_threads"] = by_threads

  ps = ParameterServer(specs, num_shards=shards, threads=threads)
  r = results["cold"] = run(ps, bs, mem=mem, mem1=mem1)
  ps.close()
  del ps
  report("cold", r, best, f" ({r['created_or_read_back'] / r['rows']:.0%} of looked-up rows created)")

  if _TIER.value:
    results.update(tier_rounds(names, len(bs), threads, mem, mem1))
    for name in TIERED + ("tier_back_to_back",):  # back to back: no memcpy between batches
      r = results[name]
      extra = f" (hit rate {r['hit_rate']:.3f}; {r['tier_vs_ram']:.3f} of ram's rows/s, paired rounds; "
      report(name, r, best, extra + f"lookups waited {r['lookup_tier_wait_s']:.3f} s on the tier)")

  ram = results["ram"]
  flat = {k: ram[k] for k in ("lookup_rows_per_s", "apply_rows_per_s")}
  for k in ("", "_1thread"):
    flat[f"memcpy{k}_gb_per_s"] = ram[f"memcpy{k}_bytes_per_s"] / 1e9
    flat[f"fraction_of_memcpy{k}"] = ram[f"fraction_of_memcpy{k}"]
  keys = ("fraction_of_memcpy", "fraction_of_memcpy_1thread", "bytes_per_s", "speedup_vs_first")
  flat["ram_by_threads"] = {n: {k: r[k] for k in keys} for n, r in by_threads.items()}
  flat["memcpy_best_gb_per_s"] = best / 1e9
  flat["fraction_of_best_memcpy"] = ram["fraction_of_best_memcpy"]
  flat["load_average_start"] = results["load_average_start"]
  flat["load_average_end"] = results["load_average_end"] = os.getloadavg()[0]
  for name in ("cold",) + TIERED + ("tier_back_to_back",):
    flat.update({f"{name}_{k}": results[name][k] for k in PER_CONFIG if k in results.get(name, {})})
  if "tier" in results:
    flat["tier_vs_ram"] = results["tier"]["tier_vs_ram"]
    floors = ("tier_floor_ratio", "tier_no_read_ahead_floor_ratio", "tier_floor_rows_per_s", "tier_read_rows_per_s")
    flat.update({k: results[k] for k in floors + ("tier_cache_fraction",)})
    flat["read_ahead"] = _AHEAD.value
  flat.update(params)
  if _JSON_OUT.value:
    outputs.write_json(_JSON_OUT.value, results, indent=2)
  print(json.dumps(flat))


if __name__ == "__main__":
  app.run(main)
