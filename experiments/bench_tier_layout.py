"""The disk tier's read rate by file layout, against a floor of the same bytes read with os.preadv, in one run.

    python experiments/bench_tier_layout.py [--rows=100000] [--read_rows=1000] [--rounds=7]
        [--chunk_rows=1024,256,64,16,4] [--shard_rows=4096,16384,65536] [--inner_rows=1,4,16]
        [--inflight=1,2,4,8] [--cold_rounds=1] [--append_rows=1024] [--dir=DIR] [--json_out=FILE]

One table of ``--rows`` rows (``--dim`` float32 weights and an Adagrad slot of ``--slot_width``),
written uncompressed in each layout of ``harness/tier_files.py``: ``separate`` (one zarr3 array per
field, as ``TierStore`` stores them) and ``combined`` (one array) for each ``--chunk_rows``;
``sharded`` (combined, zarr3 ``sharding_indexed``) for each ``--shard_rows`` x ``--inner_rows``.

A read is what the tier does on a step's misses: ``--read_rows`` distinct random rows, sorted, one
tensorstore index-array read per array. A configuration issues Q such reads at once (``--inflight``),
with or without one ``ts.Batch`` around them; a sharded layout also with its shard indexes cached
(``index-cached``). The floor (``tier_files.FloorReader``) reads the same rows' bytes with one
``os.preadv`` per row (per inner chunk when sharded), one thread, files opened beforehand; beside it,
each file opened per read (``open``) and the Q reads in Q threads (``threads``). Every read is
checked against the data written. Each round runs everything once in a new random order (after an
untimed round); figures are medians over ``--rounds``, warm (the files were just written). Bytes
read and syscalls are ``/proc/self/io``'s: ``amplification`` = bytes read / the rows' bytes. Then
writes (``--write_rows`` rows appended ``--append_rows`` at a time; a shard also whole) and, with
``--cold_rounds``, reads after ``posix_fadvise(DONTNEED)`` (Q=1, Q=max in a batch, the floors).

The last stdout line is one JSON object: per configuration (``configs``: rows/s, useful MB/s, bytes
and syscalls per row, amplification, ``of_floor`` = rows/s / its layout's floor), ``floors``,
``writes``, ``cold``; ``best`` (the fastest configuration), ``best_rows_per_s``, ``best_of_floor``,
``current`` (``separate c<--current_chunk_rows> q1``, the tier today), ``current_rows_per_s``,
``best_over_current``, and ``floor_best_over_best`` (the fastest floor over the fastest
configuration: what a plain-file path would gain).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np
import tensorstore as ts
from absl import app, flags
from harness import outputs, stats, tier_files

_ROWS = flags.DEFINE_integer("rows", 100_000, "Rows of the table.")
_DIM = flags.DEFINE_integer("dim", 64, "Weights per row (float32).")
_SLOT = flags.DEFINE_integer("slot_width", 64, "Adagrad slot width per row (float32).")
_READ = flags.DEFINE_integer("read_rows", 1000, "Distinct random rows per read.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Timed rounds (each runs every configuration once); medians reported.")
_CHUNKS = flags.DEFINE_list("chunk_rows", ["1024", "256", "64", "16", "4"], "Chunk rows of the chunked layouts.")
_SHARDS = flags.DEFINE_list("shard_rows", ["4096", "16384", "65536"], "Shard rows of the sharded layouts.")
_INNER = flags.DEFINE_list("inner_rows", ["1", "4", "16"], "Inner-chunk rows of the sharded layouts.")
_INFLIGHT = flags.DEFINE_list("inflight", ["1", "2", "4", "8"], "Reads in flight (Q) to compare.")
_COLD = flags.DEFINE_integer("cold_rounds", 1, "Rounds of reads after dropping the files from the page cache.")
_CURRENT = flags.DEFINE_integer("current_chunk_rows", 1024, "TierStore's chunk_rows today (the 'current' figure).")
_DIR = flags.DEFINE_string("dir", None, "Folder for the files (default: a temporary folder, removed after).")
_APPEND = flags.DEFINE_integer("append_rows", 1024, "Rows per append in the write figures (TierStore appends chunks).")
_WRITE_ROWS = flags.DEFINE_integer("write_rows", 16384, "Rows appended per layout for the write figures.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON result here.")


class Config:
  """One way to read: a layout, its shard index cached or not, Q reads in flight, in one ts.Batch or not."""

  def __init__(self, layout: tier_files.Layout, arrays, cached: bool, batch: bool, q: int):
    self.layout, self.arrays, self.cached, self.batch, self.q = layout, arrays, cached, batch, q
    index = ("index-cached" if cached else "uncached") if layout.kind == "sharded" else ""
    self.name = " ".join(p for p in (layout.name, index, "batch" if batch else "", f"q{q}") if p)
    self.runs: List[Dict[str, float]] = []

  def read(self, sets: List[np.ndarray]) -> List[Dict[str, np.ndarray]]:
    with ts.Batch() if self.batch else contextlib.nullcontext() as b:
      futures = [tier_files.read_ts(self.arrays, rows, b) for rows in sets]
    return [{f: x.result() for f, x in fu.items()} for fu in futures]


def _check(layout: tier_files.Layout, truth: Dict[str, np.ndarray], sets: List[np.ndarray], outs, what: str) -> None:
  """Every read of ``outs`` (one per row set of ``sets``) returned exactly the bytes written."""
  for rows, got in zip(sets, outs):
    for f, a in got.items():
      if not np.array_equal(a.view(np.uint32), truth[f][rows].view(np.uint32)):
        raise AssertionError(f"{what} of {layout.name}, field {f}: not the bytes written")


def _figures(rows: int, row_bytes: int, seconds: float, io: Dict[str, int]) -> Dict[str, float]:
  return {
    "seconds": seconds,
    "rows_per_s": rows / seconds,
    "bytes_read_per_row": io["rchar"] / rows,
    "amplification": io["rchar"] / (rows * row_bytes),
    "syscalls_per_row": io["syscr"] / rows,
    "disk_bytes_per_row": io["read_bytes"] / rows,
  }


def _measure(fn, arg):
  """``fn(arg)``: its result, its wall time and the change of this process's io counters."""
  io0, t0 = tier_files.io_counters(), time.perf_counter()
  out = fn(arg)
  dt = time.perf_counter() - t0
  return out, dt, tier_files.io_delta(io0, tier_files.io_counters())


def _timed(fn, arg, rows: int, row_bytes: int) -> Dict[str, float]:
  """Calls ``fn(arg)``: its result (``out``) and figures (module docstring)."""
  out, dt, io = _measure(fn, arg)
  return {"out": out, **_figures(rows, row_bytes, dt, io)}


# The floor's ways to read (module docstring); the cold reads add "threads random".
FLOORS = ("held", "open", "threads")


def _floor(fl: tier_files.FloorReader, sets: List[np.ndarray], mode: str, row_bytes: int, pool) -> Dict[str, float]:
  """The floor's reads of ``sets``: "held", one after the other, each read's files opened before it (untimed);
  "open", each file opened and closed around its rows; "threads", all at once, one thread per read (``pool``)."""
  if mode.startswith("threads"):
    fl.open_files(np.concatenate(sets), random=mode.endswith("random"))
    r = _timed(lambda sets: list(pool.map(fl.read, sets)), sets, sum(len(x) for x in sets), row_bytes)
    fl.close()
    return r
  out, dt, io = [], 0.0, {}
  for rows in sets:
    if mode == "held":
      fl.open_files(rows)
    got, t, delta = _measure(fl.read, rows)
    fl.close()
    out.append(got)
    dt, io = dt + t, {k: io.get(k, 0) + v for k, v in delta.items()}
  return {"out": out, **_figures(sum(len(r) for r in sets), row_bytes, dt, io)}


def _writes(lay: tier_files.Layout, data, append: int, rows: int, row_bytes: int) -> Dict[str, Dict[str, float]]:
  """Writes the first ``rows`` rows of ``data`` into a fresh copy of ``lay``, ``append`` rows at a time, each
  write waited for; a sharded layout also in whole shards (its first shard, at once). Rows/s and bytes written
  and read per row."""
  out = {}
  modes = {f"append {append}": (append, min(rows, lay.rows))}
  if lay.kind == "sharded":
    modes["whole shard"] = (lay.chunk_rows, min(lay.chunk_rows, lay.rows))
  for mode, (step, n) in modes.items():
    scratch = lay.like(os.path.join(lay.root, "writes"))
    arrays = scratch.open(ts.Context(tier_files.CONTEXT), create=True)
    src = scratch.split(data)
    io0, t0 = tier_files.io_counters(), time.perf_counter()
    for a in range(0, n, step):
      for f in [arrays[f][a : min(a + step, n)].write(x[a : min(a + step, n)]) for f, x in src.items()]:
        f.result()
    dt = time.perf_counter() - t0
    io = tier_files.io_delta(io0, tier_files.io_counters())
    shutil.rmtree(scratch.root)
    out[mode] = {
      "rows": n,
      "rows_per_s": n / dt,
      "bytes_written_per_row": io["wchar"] / n,
      "write_amplification": io["wchar"] / (n * row_bytes),
      "bytes_read_per_row": io["rchar"] / n,
    }
  return out


def _rounded(x):
  """``x`` with every float to 4 significant digits (the figures move more than that between runs)."""
  if isinstance(x, float):
    return float(f"{x:.4g}")
  if isinstance(x, dict):
    return {k: _rounded(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_rounded(v) for v in x]
  return x


def _summary(runs: List[Dict[str, float]], row_bytes: int) -> Dict[str, float]:
  keys = ("rows_per_s", "bytes_read_per_row", "amplification", "syscalls_per_row", "disk_bytes_per_row")
  s = {k: stats.median_of(runs, k) for k in keys}
  s["useful_mb_per_s"] = s["rows_per_s"] * row_bytes / 1e6
  s["rows_per_s_runs"] = sorted(r["rows_per_s"] for r in runs)
  return s


def main(argv):
  del argv
  N, R = _ROWS.value, _READ.value
  qs = sorted({int(q) for q in _INFLIGHT.value})
  qmax = qs[-1]
  if R * qmax > N:
    raise app.UsageError(f"--read_rows={R} x --inflight={qmax} exceeds --rows={N}: the reads could not differ")
  fields = {"weights": _DIM.value, "slot_adagrad": _SLOT.value}
  rng = np.random.default_rng(0)
  # Non-zero everywhere (1 + |normal|): zarr3 does not store a chunk equal to the fill value (0).
  data = {f: (1 + np.abs(rng.standard_normal((N, w)))).astype(np.float32) for f, w in fields.items()}
  root = _DIR.value or tempfile.mkdtemp(prefix="bench_tier_layout_")
  os.makedirs(root, exist_ok=True)
  chunked = [(kind, int(c)) for kind in ("separate", "combined") for c in _CHUNKS.value]
  sharded = [(int(s), int(i)) for s in _SHARDS.value for i in _INNER.value]
  layouts = [tier_files.Layout(root, kind, fields, N, chunk_rows=c) for kind, c in chunked]
  layouts += [tier_files.Layout(root, "sharded", fields, N, shard_rows=s, inner_rows=i) for s, i in sharded]
  row_bytes = layouts[0].row_bytes
  load_start = os.getloadavg()[0]
  log = functools.partial(print, file=sys.stderr)
  log(f"{N:,} rows x {row_bytes} B in {root}; reads of {R} rows, Q in {qs}; load {load_start:.2f}")
  truths, floors, configs, pool = {}, {}, [], concurrent.futures.ThreadPoolExecutor(qmax)
  try:
    t0 = time.perf_counter()
    for lay in layouts:
      lay.create(data)
      truths[lay.name] = lay.split(data)
      floors[lay.name] = tier_files.FloorReader(lay)
      for cached in (False, True) if lay.kind == "sharded" else (False,):
        arrays = lay.open(ts.Context(lay.index_cache_context() if cached else tier_files.CONTEXT), cache_index=cached)
        configs += [Config(lay, arrays, cached, False, q) for q in qs]
        configs += [Config(lay, arrays, cached, True, q) for q in qs if q > 1]
    log(f"wrote {len(layouts)} layouts in {time.perf_counter() - t0:.1f} s")

    floor_runs: Dict[tuple, List[Dict[str, float]]] = {(lay.name, m): [] for lay in layouts for m in FLOORS}
    t0 = time.perf_counter()
    for rnd in range(_ROUNDS.value + 1):  # round 0: untimed (first opens, first reads)
      sets = [np.sort(rng.choice(N, R, replace=False)) for _ in range(qmax)]
      jobs = [("config", c, None) for c in configs] + [("floor", lay, m) for lay in layouts for m in FLOORS]
      for k in rng.permutation(len(jobs)):
        what, x, mode = jobs[k]
        if what == "config":
          r = _timed(x.read, sets[: x.q], R * x.q, row_bytes)
          _check(x.layout, truths[x.layout.name], sets, r.pop("out"), x.name)
          if rnd:
            x.runs.append(r)
        else:
          r = _floor(floors[x.name], sets, mode, row_bytes, pool)
          _check(x, truths[x.name], sets, r.pop("out"), "floor")
          if rnd:
            floor_runs[(x.name, mode)].append(r)
    log(f"{_ROUNDS.value + 1} rounds in {time.perf_counter() - t0:.1f} s")

    writes = {lay.name: _writes(lay, data, _APPEND.value, _WRITE_ROWS.value, row_bytes) for lay in layouts}

    cold = {}
    os.sync()  # for the cold reads: dirty pages stay in the page cache through DONTNEED
    for lay in layouts if _COLD.value else []:
      reads = {}
      for cached in (False, True) if lay.kind == "sharded" else (False,):
        mine = [c for c in configs if c.layout is lay and c.cached == cached]
        tag = " index-cached" if cached else ""
        reads[f"q1{tag}"] = [c for c in mine if c.q == 1 and not c.batch][0]
        if qmax > 1:
          reads[f"q{qmax}{tag}"] = [c for c in mine if c.q == qmax and c.batch][0]
      runs = {k: [] for k in [*reads, "floor", "floor threads", "floor threads random"]}
      for _ in range(_COLD.value):
        sets = [np.sort(rng.choice(N, R, replace=False)) for _ in range(qmax)]
        for key in runs:
          lay.drop_from_page_cache()
          if key.startswith("floor"):
            r = _floor(floors[lay.name], sets, {"floor": "held"}.get(key, key[6:]), row_bytes, pool)
          else:
            r = _timed(reads[key].read, sets[: reads[key].q], R * reads[key].q, row_bytes)
          _check(lay, truths[lay.name], sets, r.pop("out"), f"cold {key}")
          runs[key].append(r)
      cold[lay.name] = {k: _summary(v, row_bytes) for k, v in runs.items()}
  finally:
    for fl in floors.values():
      fl.close()
    pool.shutdown()
    if not _DIR.value:
      shutil.rmtree(root, ignore_errors=True)

  fl_sum = {name: _summary(runs, row_bytes) for (name, mode), runs in floor_runs.items() if mode == "held"}
  for name, s in fl_sum.items():
    s["open_per_read"] = _summary(floor_runs[(name, "open")], row_bytes)
    s["threads"] = _summary(floor_runs[(name, "threads")], row_bytes)
  res = {}
  for c in configs:
    s = _summary(c.runs, row_bytes)
    s["floor_rows_per_s"] = fl_sum[c.layout.name]["rows_per_s"]
    s["of_floor"] = s["rows_per_s"] / s["floor_rows_per_s"]
    s["floor_open_rows_per_s"] = fl_sum[c.layout.name]["open_per_read"]["rows_per_s"]
    res[c.name] = s

  log(
    f"\nwarm, medians of {_ROUNDS.value}: k rows/s by Q; at the best Q: amplification, read syscalls a row, the floor's "
    f"k rows/s and amplification, rows/s / floor; the floor opening files per read and in {qmax} threads (k rows/s)"
  )
  head = f"{'layout':22}{'index':>9}{'batch':>6}" + "".join(f"{'Q=' + str(q):>8}" for q in qs)
  head += f"{'ampl':>8}{'sysc/r':>8}{'floor':>8}{'f.ampl':>7}{'/floor':>8}{'f.open':>8}{'f.thr':>8}"
  log(head)
  groups: Dict[tuple, List[Config]] = {}
  for c in configs:
    groups.setdefault((c.layout.name, c.cached, c.batch), []).append(c)
  for (name, cached, batch), cs in groups.items():
    lay = cs[0].layout
    by_q = {c.q: res[c.name] for c in cs}
    best = max(cs, key=lambda c: res[c.name]["rows_per_s"])
    b = res[best.name]
    line = (
      f"{name:22}{('cached' if cached else 'no') if lay.kind == 'sharded' else '-':>9}{'yes' if batch else 'no':>6}"
    )
    line += "".join(f"{by_q[q]['rows_per_s'] / 1e3:8.0f}" if q in by_q else f"{'':>8}" for q in qs)
    fs = fl_sum[name]
    line += f"{b['amplification']:8.1f}{b['syscalls_per_row']:8.2f}{fs['rows_per_s'] / 1e3:8.0f}"
    line += f"{fs['amplification']:7.1f}{b['of_floor']:8.2f}{fs['open_per_read']['rows_per_s'] / 1e3:8.0f}"
    line += f"{fs['threads']['rows_per_s'] / 1e3:8.0f}"
    log(line)

  best = max(res, key=lambda k: res[k]["rows_per_s"])
  current = f"separate c{_CURRENT.value} q1"
  best_floor = max(fl_sum, key=lambda k: fl_sum[k]["rows_per_s"])
  out = {
    "rows": N,
    "row_bytes": row_bytes,
    "read_rows": R,
    "rounds": _ROUNDS.value,
    "inflight": qs,
    "page_cache": "warm: every file was just written and is in the page cache; cold figures under 'cold'",
    "best": best,
    "best_rows_per_s": res[best]["rows_per_s"],
    "best_of_floor": res[best]["of_floor"],
    "best_amplification": res[best]["amplification"],
    "best_floor": best_floor,
    "best_floor_rows_per_s": fl_sum[best_floor]["rows_per_s"],
    "floor_best_over_best": fl_sum[best_floor]["rows_per_s"] / res[best]["rows_per_s"],
    "load_average_start": load_start,
    "load_average_end": os.getloadavg()[0],
  }
  if current in res:
    out.update(
      current=current,
      current_rows_per_s=res[current]["rows_per_s"],
      current_of_floor=res[current]["of_floor"],
      best_over_current=res[best]["rows_per_s"] / res[current]["rows_per_s"],
    )
  log(
    f"\nbest: {best}: {res[best]['rows_per_s'] / 1e3:.0f}k rows/s ({res[best]['useful_mb_per_s']:.0f} MB/s useful, "
    f"amplification {res[best]['amplification']:.1f}), {res[best]['of_floor']:.2f} of its floor"
    + (
      f"; {out['best_over_current']:.1f}x the current ({current}: {out['current_rows_per_s'] / 1e3:.0f}k rows/s, "
      f"{out['current_of_floor']:.3f} of its floor)"
      if current in res
      else ""
    )
    + f"\nfastest floor: {best_floor}: {out['best_floor_rows_per_s'] / 1e3:.0f}k rows/s = "
    f"{out['floor_best_over_best']:.2f}x the best tensorstore read"
  )
  log(f"\nwrites of {_WRITE_ROWS.value:,} rows (or a shard whole): k rows/s, write amplification, bytes read a row")
  for name, w in writes.items():
    line = "".join(
      f"   {m}: {v['rows_per_s'] / 1e3:7.0f}k {v['write_amplification']:5.1f}x {v['bytes_read_per_row']:6.0f}B"
      for m, v in w.items()
    )
    log(f"{name:22}{line}")
  out["writes"] = writes
  if cold:
    log(f"\ncold (files dropped from the page cache), medians of {_COLD.value}: k rows/s, disk bytes a row")
    keys = sorted(dict.fromkeys(k for c in cold.values() for k in c), key=lambda k: k.startswith("floor"))
    short = {k: k.replace("index-cached", "idx").replace("threads", "thr").replace("random", "rnd") for k in keys}
    log(f"{'layout':22}" + "".join(f"{short[k]:>17}" for k in keys))
    for name, c in cold.items():
      cells = [
        f"{c[k]['rows_per_s'] / 1e3:8.1f}k {c[k]['disk_bytes_per_row']:6.0f}B" if k in c else f"{'':17}" for k in keys
      ]
      log(f"{name:22}" + "".join(cells))
  out["cold"] = {
    n: {k: {m: v[m] for m in ("rows_per_s", "disk_bytes_per_row")} for k, v in c.items()} for n, c in cold.items()
  }
  out["floors"] = fl_sum
  out["configs"] = res
  out = _rounded(out)
  if _JSON_OUT.value:
    outputs.write_json(_JSON_OUT.value, out, indent=None)
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
