"""Parameter-server throughput on a Zipf workload, against this machine's memcpy bandwidth.

    python experiments/bench_ps.py [--batches=20] [--num_shards=1] [--ps_threads=1,2] [--vocab=100000] [--json_out=FILE]
        [--tier_fraction=0.125] [--tier_rounds=3] [--read_ahead=4]

Workload: batches of 4096 samples x 26 features (one table each, dim 64, Adagrad), ids drawn
from a Zipf(1.1) law over ``--vocab`` ids per table and deduplicated per table as the
trainer does. Per batch it times one ``lookup_many`` (create=True) and one ``apply_many``
with random gradients.

Three configurations, in one run:
  ram:   RAM only, every id of the vocabulary created first (untimed): serving cost.
  cold:  RAM only, starting empty: the Zipf tail keeps creating rows (about 1 id in 8 at
         the default vocabulary), whose initial values and pages are part of the cost.
  tier:  like ram, but each table's RAM capacity is ``--tier_fraction`` (1/8) of its rows;
         the rest lives in the disk tier in a temporary directory. Three tiered PSs
         (``tier``: plain files with ``--read_ahead`` batches read ahead; ``tier_no_read_ahead``;
         ``tier_tensorstore``: zarr3 through tensorstore, no read-ahead, the tier before issue 28)
         run in ``--tier_rounds`` rounds alternating with a RAM-only PS, each round on fresh
         batches; ``tier_vs_ram`` is the median over rounds of tier rows/s (lookup + apply, the
         read-ahead calls timed with the lookups) over the same round's RAM-only rows/s. The
         read-ahead works on a reader thread, also while the timed thread copies the memcpy
         reference after a batch (as a trainer's device step would leave it time):
         ``tier_back_to_back`` is ``tier`` against ``ram`` on other batches with no copies between
         them. The floor: the bytes ``tier_no_read_ahead``'s lookups read from the tier's files
         (round 1), read again in the same order with ``os.preadv``; ``tier_floor_ratio`` =
         those seconds over the seconds ``tier`` added to the RAM-only run.

Bytes counted (rows and state read and written, the traffic the work cannot avoid):
  lookup: read the row (dim x 4), write it to the output (dim x 4);
  apply:  read the gradient (dim x 4), read and write the row and its Adagrad slot;
  create: write the new row and its slot (cold and tier only).
``--ps_threads``: the PS's thread counts (``ParameterServer(threads=)``); the ram configuration
runs once per count, on its own PS, the repeats of all counts in turn; cold and tier run with
the last count. ``memcpy_gb_per_s`` is measured in the same run, with as many threads as the
PS (``memcpy_1thread_gb_per_s``: with one), each copying its own 256 MiB buffer (written once first: no page faults in the timed copies), and
counts bytes read plus bytes written, like the PS figures. One copy follows every timed batch,
so the reference sees the same load as the PS: the machine these figures come from is shared,
and a reference taken once before the run (the best of 5 copies, as this script did until
issue 14) let the fraction of the same code go from 0.17 to 0.24 between runs minutes apart.
``fraction_of_memcpy`` = PS bytes per second / memcpy bytes per second (as many threads as the
PS), both over the same interval, ``fraction_of_memcpy_1thread`` against one memcpy thread;
``fraction_of_best_memcpy`` is against the old reference. The ram configuration runs
``--ram_repeats`` times over the same tables and the median run is reported.

The last stdout line is one JSON object: ``lookup_rows_per_s``, ``apply_rows_per_s``,
``memcpy_gb_per_s``, ``fraction_of_memcpy``, ``memcpy_1thread_gb_per_s``,
``fraction_of_memcpy_1thread``, ``memcpy_best_gb_per_s`` and ``fraction_of_best_memcpy`` of the
ram configuration with the last thread count (``ram_by_threads``: per count, and
``ram_speedup_vs_first``: its rows per second over the first count's), the load average at the
start and end, then the same rates and fraction with ``cold_``, ``tier_``, ``tier_no_read_ahead_``,
``tier_tensorstore_`` and ``tier_back_to_back_`` prefixes (``hit_rate``: the RAM cache's own, rows a
read-ahead brought not counted; ``lookup_tier_wait_s``: the seconds the timed lookups read from the
tier themselves, of the median round), and ``tier_vs_ram`` (the ``tier`` configuration's, with read-ahead),
``tier_floor_ratio``, ``tier_no_read_ahead_floor_ratio``, ``tier_floor_rows_per_s``,
``tier_read_rows_per_s``, ``tier_cache_fraction``, ``read_ahead``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from typing import Dict, Optional

import numpy as np
from absl import app, flags
from harness import outputs

from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec

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


def memcpy_bandwidth(threads: int, nbytes: int = 256 << 20, repeats: int = 5) -> float:
  """Bytes read + written per second by ``threads`` threads each copying its own buffer: the best of ``repeats``."""
  m = Memcpy(threads, nbytes)
  return max(b / s for b, s in (m.copy() for _ in range(repeats)))


class Memcpy:
  """``threads`` threads each copying its own ``nbytes`` buffer, both ends written once first (no page faults
  in the timed copies). ``run`` calls ``copy`` after every batch, so the reference bandwidth is measured
  under the same load as the PS: on a shared machine the load moves both by the second."""

  def __init__(self, threads: int, nbytes: int = 256 << 20):
    self.srcs = [np.ones(nbytes // 8, np.float64) for _ in range(threads)]
    self.dsts = [np.zeros_like(s) for s in self.srcs]

  def copy(self):
    """One concurrent copy per thread: (bytes read + written, seconds)."""
    ts = [threading.Thread(target=np.copyto, args=(d, s)) for d, s in zip(self.dsts, self.srcs)]
    t0 = time.perf_counter()
    for t in ts:
      t.start()
    for t in ts:
      t.join()
    return 2 * sum(s.nbytes for s in self.srcs), time.perf_counter() - t0


def _id(rank: np.ndarray, f: int) -> np.ndarray:
  return rank.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(f)


def zipf_batches(n: int, vocab: int, alpha: float, batch: int, features: int, seed: int = 0):
  """Per batch, per table: the distinct uint64 ids (hashed ranks) of a Zipf sample."""
  p = np.arange(1, vocab + 1, dtype=np.float64) ** -alpha
  cdf = np.cumsum(p)
  cdf /= cdf[-1]
  out = []
  for b in range(n):
    rng = np.random.default_rng([seed, b])
    out.append(
      {
        f"t{f:02d}": np.unique(_id(np.minimum(np.searchsorted(cdf, rng.random(batch)), vocab - 1), f))
        for f in range(features)
      }
    )
  return out


def prefill(ps: ParameterServer, tables, vocab: int, chunk: int = 1 << 14) -> int:
  """Creates every id of every table (untimed), as a long-running PS would hold them.

  Rarest first, one step per chunk, so a bounded (LRU) table ends with its most frequent
  ids in RAM, as traffic would have left it. Returns the next free step.
  """
  step = 0
  for a in range(vocab, 0, -chunk):
    step += 1
    ps.lookup_many({t: _id(np.arange(max(0, a - chunk), a), f) for f, t in enumerate(tables)}, create=True, step=step)
  return step + 1


def run(
  ps: ParameterServer,
  batches,
  warmup: int,
  dim: int,
  bytes_lookup: int,
  bytes_apply: int,
  bytes_create: int,
  first_step: int = 1,
  mem: Optional[Memcpy] = None,
  mem1: Optional[Memcpy] = None,
  ahead: int = 0,
  trace: Optional[list] = None,
) -> Dict:
  """Times lookup_many + apply_many per batch, and after each timed batch one ``mem.copy()`` (and
  ``mem1.copy()``, one thread); bytes per the module docstring.

  ``ahead``: before batch i's lookup, ``read_ahead_many`` of batch i + ahead (timed with the lookup).
  ``trace``: gets, per timed batch, the tier files and disk rows its lookup will read (untimed).
  """
  rng = np.random.default_rng(1)
  biggest = max(len(v) for b in batches for v in b.values())
  grads = rng.standard_normal((biggest, dim)).astype(np.float32) * 1e-3
  t_lookup = t_apply = t_copy = t_copy1 = 0.0
  rows = created = copied = copied1 = 0
  hits0 = lookups0 = ahead0 = wait0 = None
  for i, b in enumerate(batches):
    st = ps.stats() if i >= warmup else {}
    before = sum(s["created"] + s["tier_reads"] for s in st.values())
    if i == warmup:
      hits0, lookups0 = sum(s["hits"] for s in st.values()), sum(s["lookups"] for s in st.values())
      ahead0 = sum(s.get("read_ahead_rows", 0) for s in st.values())
      wait0 = sum(s.get("tier_wait_s", 0.0) for s in st.values())
    if trace is not None and i >= warmup:
      trace.append(tier_reads(ps, b))
    t0 = time.perf_counter()
    if ahead:
      for j in range(i + 1 if i == 0 else i + ahead, min(i + ahead, len(batches) - 1) + 1):
        ps.read_ahead_many(batches[j], step=first_step + j)
    ps.lookup_many(b, create=True, step=first_step + i)
    t1 = time.perf_counter()
    ps.apply_many({t: (ids, grads[: len(ids)]) for t, ids in b.items()}, step=first_step + i)
    t2 = time.perf_counter()
    if i >= warmup:
      t_lookup += t1 - t0
      t_apply += t2 - t1
      rows += sum(len(v) for v in b.values())
      created += sum(s["created"] + s["tier_reads"] for s in ps.stats().values()) - before
      if mem is not None:
        nbytes, secs = mem.copy()
        copied, t_copy = copied + nbytes, t_copy + secs
      if mem1 is not None:
        nbytes, secs = mem1.copy()
        copied1, t_copy1 = copied1 + nbytes, t_copy1 + secs
  total = rows * (bytes_lookup + bytes_apply) + created * bytes_create
  if ahead:
    ps.wait_read_ahead()  # untimed: none runs into the next configuration's time
  st = ps.stats()
  hits = sum(s["hits"] for s in st.values()) - hits0
  # The cache's own: rows a read-ahead brought from the tier are hits of their lookup, not of the cache.
  hits -= sum(s.get("read_ahead_rows", 0) for s in st.values()) - ahead0
  out = {
    "hit_rate": hits / (sum(s["lookups"] for s in st.values()) - lookups0),
    # The seconds the timed lookups spent reading from the tier themselves (read-ahead's reads not counted).
    "lookup_tier_wait_s": sum(s.get("tier_wait_s", 0.0) for s in st.values()) - wait0,
    "rows": rows,
    "created_or_read_back": created,
    "lookup_rows_per_s": rows / t_lookup,
    "apply_rows_per_s": rows / t_apply,
    "bytes_per_s": total / (t_lookup + t_apply),
  }
  if mem is not None:
    out["memcpy_bytes_per_s"] = copied / t_copy
    out["fraction_of_memcpy"] = out["bytes_per_s"] / out["memcpy_bytes_per_s"]
  if mem1 is not None:
    out["memcpy_1thread_bytes_per_s"] = copied1 / t_copy1
    out["fraction_of_memcpy_1thread"] = out["bytes_per_s"] / out["memcpy_1thread_bytes_per_s"]
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
      miss = mine[~table.in_ram(mine)]
      rows = table.tier.locate(miss)
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


def tier_rounds(specs, names, batches, vocab, shards, threads, dim, nbytes, mem, mem1) -> Dict:
  """RAM only against tiered PSs, each table ``--tier_fraction`` in RAM, in alternating rounds.

  Configurations: ``tier`` (file backend, read-ahead of ``--read_ahead`` batches),
  ``tier_no_read_ahead`` (file backend) and ``tier_tensorstore`` (zarr3 arrays through
  tensorstore, no read-ahead: the tier as it was before issue 28), with ``ram`` before them
  in every round; each tiered figure is reported as the median over
  rounds of its rows/s (lookup + apply) over the same round's ram rows/s.

  The read-ahead runs on a reader thread, which works while the timed thread copies the
  memcpy reference after every batch, as it would while a trainer's device step runs. So
  each round also runs ``ram`` and ``tier`` on other fresh batches with no copies between them
  (``tier_back_to_back``: batches back to back, no time but the PS's own for the reader thread).

  The floor: the bytes the ``tier_no_read_ahead`` lookups read from the tier's files (round 1;
  the read-ahead reads as many, on its thread), read again in the same order with ``os.preadv``
  (``floor_read``); ``tier_floor_ratio`` = those seconds / the seconds ``tier`` added to the
  ram run's (above 1: the timed thread spends less than reading the bytes would take), and
  ``tier_no_read_ahead_floor_ratio`` the same for the tier without read-ahead (1.0: it costs what
  reading its bytes costs, no more).
  """
  kw = (("learning_rate", 0.05),)
  cap = max(1, int(vocab * _TIER_FRACTION.value))
  tiered = [TableSpec(name=t, dim=dim, optimizer="adagrad", optimizer_kwargs=kw, capacity=cap) for t in names]
  out: Dict = {"tier_cache_fraction": cap / vocab}
  with tempfile.TemporaryDirectory(prefix="bench_ps_tier_") as d:
    pss = {"ram": ParameterServer(specs, num_shards=shards, threads=threads)}
    for name, backend in (("tier", "file"), ("tier_no_read_ahead", "file"), ("tier_tensorstore", "tensorstore")):
      spec = {"driver": "file", "path": os.path.join(d, name)}
      pss[name] = ParameterServer(tiered, num_shards=shards, tier=spec, threads=threads, tier_backend=backend)
    step = {name: prefill(ps, names, vocab) for name, ps in pss.items()}
    runs: Dict[str, list] = {name: [] for name in list(pss) + ["ram_back_to_back", "tier_back_to_back"]}
    trace: list = []
    for r in range(_TIER_ROUNDS.value):
      # Fresh batches every round (the same for every configuration of the round): batches seen
      # before would find their rows in every cache.
      batches = zipf_batches(len(batches), vocab, _ALPHA.value, _BATCH.value, _FEATURES.value, seed=r + 1)
      more = zipf_batches(len(batches), vocab, _ALPHA.value, _BATCH.value, _FEATURES.value, seed=r + 1001)
      order = [(name, name, batches, mem, mem1) for name in pss]
      order += [("ram_back_to_back", "ram", more, None, None), ("tier_back_to_back", "tier", more, None, None)]
      for name, ps_name, bs, m, m1 in order:
        ahead = _AHEAD.value if ps_name == "tier" else 0
        res = run(
          pss[ps_name], bs, _WARMUP.value, dim, *nbytes, step[ps_name], m, m1, ahead=ahead,
          trace=trace if (name == "tier_no_read_ahead" and r == 0) else None,
        )  # fmt: skip
        step[ps_name] += len(bs)
        res["seconds"] = res["rows"] / res["lookup_rows_per_s"] + res["rows"] / res["apply_rows_per_s"]
        runs[name].append(res)
    stats = {name: ps.stats() for name, ps in pss.items()}
    floor_s = floor_read([x for batch in trace for x in batch])
    for ps in pss.values():
      ps.close()
  for name in ("tier", "tier_no_read_ahead", "tier_tensorstore", "tier_back_to_back"):
    ram = runs["ram_back_to_back" if name == "tier_back_to_back" else "ram"]
    rows_ratio = sorted(y["seconds"] / x["seconds"] for x, y in zip(runs[name], ram))
    best = sorted(runs[name], key=lambda x: x["seconds"])[len(runs[name]) // 2]
    st = stats["tier" if name == "tier_back_to_back" else name]
    out[name] = dict(
      best,
      tier_vs_ram=rows_ratio[len(rows_ratio) // 2],
      tier_vs_ram_rounds=rows_ratio,
      ram_rows=int(sum(s["rows"] for s in st.values())),
      tier_rows=int(sum(s["tier_rows"] for s in st.values())),
      **{
        k: int(sum(s[k] for s in st.values()))
        for k in ("read_ahead_rows", "read_ahead_hits", "read_ahead_skipped", "read_ahead_late")
      },
      tier_wait_s=float(sum(s["tier_wait_s"] for s in st.values())),  # since the PS was made, prefill included
    )
    if "bytes_per_s" in best and "fraction_of_memcpy" in best:
      out[name]["bytes_ratio_rounds"] = sorted(x["bytes_per_s"] / y["bytes_per_s"] for x, y in zip(runs[name], ram))
  read_bytes = sum(n for batch in trace for _, _, n in batch)
  read_rows = read_bytes / (dim * 4 + dim * 4)
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


def main(argv):
  del argv
  dim, shards, vocab = _DIM.value, _SHARDS.value, _VOCAB.value
  print(
    f"workload: {_BATCH.value} x {_FEATURES.value} ids per batch, Zipf({_ALPHA.value}) over "
    f"{vocab:,} ids per table, dim {dim}, {shards} shard(s)",
    file=sys.stderr,
  )
  batches = zipf_batches(_WARMUP.value + _BATCHES.value, vocab, _ALPHA.value, _BATCH.value, _FEATURES.value)
  uniq = float(np.mean([sum(len(v) for v in b.values()) for b in batches]))
  names = list(batches[0])
  kw = (("learning_rate", 0.05),)
  row = dim * 4
  b_lookup, b_apply, b_create = 2 * row, row + 2 * (row + row), row + row
  counts = [int(t) for t in _THREADS.value]
  mems = {n: Memcpy(n) for n in sorted(set(counts) | {1})}
  threads = counts[-1]
  mem, mem1 = mems[threads], mems[1]
  best = max(b / s for b, s in (mem.copy() for _ in range(5)))  # the reference before the run (see the docstring)
  results = {
    "memcpy_best_gb_per_s": best / 1e9,
    "load_average_start": os.getloadavg()[0],
    "distinct_rows_per_batch": uniq,
    "num_shards": shards,
    "ps_threads": counts,
    "dim": dim,
    "vocab": vocab,
  }

  def report(name, r, extra=""):
    r["fraction_of_best_memcpy"] = r["bytes_per_s"] / best
    results[name] = r
    print(
      f"{name:5s} lookup {r['lookup_rows_per_s'] / 1e6:6.2f}M rows/s, apply {r['apply_rows_per_s'] / 1e6:6.2f}M "
      f"rows/s, {r['bytes_per_s'] / 1e9:5.2f} GB/s = {r['fraction_of_memcpy']:.3f} of memcpy at "
      f"{r['memcpy_bytes_per_s'] / 1e9:.1f} GB/s, {r['fraction_of_memcpy_1thread']:.3f} of 1-thread memcpy at "
      f"{r['memcpy_1thread_bytes_per_s'] / 1e9:.1f} GB/s ({r['fraction_of_best_memcpy']:.3f} of the best, "
      f"{best / 1e9:.1f} GB/s){extra}",
      file=sys.stderr,
    )

  specs = [TableSpec(name=t, dim=dim, optimizer="adagrad", optimizer_kwargs=kw) for t in names]
  pss = [ParameterServer(specs, num_shards=shards, threads=n) for n in counts]
  first = [prefill(ps, names, vocab) for ps in pss][0]
  reps = [[] for _ in counts]
  for k in range(_REPEATS.value):  # the same tables and batches again: the repeats differ by the load only
    for j, (n, ps) in enumerate(zip(counts, pss)):  # every thread count in turn, so all see the same load
      step = first + k * len(batches)
      reps[j].append(run(ps, batches, _WARMUP.value, dim, b_lookup, b_apply, b_create, step, mems[n], mem1))
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
    report(
      "ram",
      r,
      f" [{n} thread(s); median of {len(fr)}: {', '.join(f'{x:.3f}' for x in fr)}; "
      f"{r['speedup_vs_first']:.2f}x the rows/s of {counts[0]} thread(s), median of paired repeats]",
    )
    by_threads[n] = r
  results["ram"] = by_threads[threads]
  results["ram_by_threads"] = by_threads

  ps = ParameterServer(specs, num_shards=shards, threads=threads)
  r = run(ps, batches, _WARMUP.value, dim, b_lookup, b_apply, b_create, mem=mem, mem1=mem1)
  ps.close()
  del ps
  report("cold", r, f" ({r['created_or_read_back'] / r['rows']:.0%} of looked-up rows created)")

  if _TIER.value:
    results.update(
      tier_rounds(specs, names, batches, vocab, shards, threads, dim, (b_lookup, b_apply, b_create), mem, mem1)
    )
    for name in ("tier", "tier_no_read_ahead", "tier_tensorstore"):
      r = results[name]
      report(
        name,
        r,
        f" (hit rate {r['hit_rate']:.3f}; {r['tier_vs_ram']:.3f} of ram's rows/s, paired rounds; "
        f"lookups waited {r['lookup_tier_wait_s']:.3f} s on the tier)",
      )
    r = results["tier_back_to_back"]
    print(
      f"tier_back_to_back (no memcpy between batches): lookup {r['lookup_rows_per_s'] / 1e6:6.2f}M rows/s, apply "
      f"{r['apply_rows_per_s'] / 1e6:6.2f}M rows/s (hit rate {r['hit_rate']:.3f}; {r['tier_vs_ram']:.3f} of ram's "
      "rows/s back to back, paired rounds)",
      file=sys.stderr,
    )

  flat = {k: results["ram"][k] for k in ("lookup_rows_per_s", "apply_rows_per_s")}
  flat["memcpy_gb_per_s"] = results["ram"]["memcpy_bytes_per_s"] / 1e9
  flat["fraction_of_memcpy"] = results["ram"]["fraction_of_memcpy"]
  flat["memcpy_1thread_gb_per_s"] = results["ram"]["memcpy_1thread_bytes_per_s"] / 1e9
  flat["fraction_of_memcpy_1thread"] = results["ram"]["fraction_of_memcpy_1thread"]
  flat["ram_by_threads"] = {
    n: {k: r[k] for k in ("fraction_of_memcpy", "fraction_of_memcpy_1thread", "bytes_per_s", "speedup_vs_first")}
    for n, r in by_threads.items()
  }
  flat["memcpy_best_gb_per_s"] = best / 1e9
  flat["fraction_of_best_memcpy"] = results["ram"]["fraction_of_best_memcpy"]
  flat["load_average_start"] = results["load_average_start"]
  flat["load_average_end"] = results["load_average_end"] = os.getloadavg()[0]
  for name in ("cold", "tier", "tier_no_read_ahead", "tier_tensorstore", "tier_back_to_back"):
    for k in (
      "lookup_rows_per_s",
      "apply_rows_per_s",
      "fraction_of_memcpy",
      "hit_rate",
      "tier_vs_ram",
      "lookup_tier_wait_s",
    ):
      if name in results and k in results[name]:
        flat[f"{name}_{k}"] = results[name][k]
  if "tier" in results:
    flat["tier_vs_ram"] = results["tier"]["tier_vs_ram"]
    for k in ("tier_floor_ratio", "tier_no_read_ahead_floor_ratio", "tier_floor_rows_per_s", "tier_read_rows_per_s"):
      flat[k] = results[k]
    flat["tier_cache_fraction"] = results["tier_cache_fraction"]
    flat["read_ahead"] = _AHEAD.value
  flat.update(distinct_rows_per_batch=uniq, num_shards=shards, ps_threads=counts, dim=dim, vocab=vocab)
  if _JSON_OUT.value:
    outputs.write_json(_JSON_OUT.value, results, indent=2)
  print(json.dumps(flat))


if __name__ == "__main__":
  app.run(main)
