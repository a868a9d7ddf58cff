"""The disk tier's read rate by file layout, against a floor of the same bytes read with os.preadv, in one run.

    python experiments/bench_tier_layout.py [--rows=100000] [--read_rows=1000] [--rounds=7]
        [--chunk_rows=1024,256,64,16,4] [--shard_rows=4096,16384,65536] [--inner_rows=1,4,16]
        [--inflight=1,2,4,8] [--cold_rounds=1] [--append_rows=1024] [--dir=DIR] [--json_out=FILE]

One table of ``--rows`` rows of ``--dim`` float32 weights and one Adagrad slot of ``--slot_width``
(512 bytes a row at the defaults), random non-zero values, written in each layout of
``tier_files.py`` under a temporary folder (or ``--dir``): ``separate`` (one zarr3 array per field,
as ``TierStore`` stores them) and ``combined`` (the fields side by side in one array) for each
``--chunk_rows``, and ``sharded`` (the combined array, zarr3 ``sharding_indexed``) for each
``--shard_rows`` x ``--inner_rows``. Every file is uncompressed.

A read is what the tier does on a step's misses: ``--read_rows`` distinct random rows, sorted, one
tensorstore index-array read per array (``arr[rows].read()``), TierStore's context (no chunk cache,
no fsync). Each configuration issues Q such reads at once (``--inflight``: Q futures, then waits
for all), each of other rows, with or without one ``ts.Batch`` around the Q (``batch``; Q > 1);
a sharded layout also runs with its shard indexes cached (``index-cached``: the arrays'
``metadata_cache_pool``, which holds the shard indexes and not the data, given 1.25x the bytes of
every index plus 256 KiB, while the data's ``cache_pool`` stays 0).

The floor (``tier_files.FloorReader``) reads the same rows from the same files in the same order
with one ``os.preadv`` per row (per inner chunk when sharded) into preallocated buffers, one thread, the Q reads one after the other: the bytes the read must fetch and nothing
else, with the files it needs opened beforehand (untimed; a plain-file store would hold them
open). Two more ways, reported beside it: each file opened and closed around its rows (``open``,
as tensorstore's file kvstore opens a file per read), and the Q reads at once, one thread each,
files held (``threads``). Every read of them all is checked against the data written.

Rounds: every configuration and every layout's floor once per round, in a new random order each
round (so load drift hits all alike), after one untimed round; figures are medians over
``--rounds``. Bytes read and read syscalls are this process's ``/proc/self/io`` counters (``rchar``,
``syscr``) around the reads: ``amplification`` = bytes read / the rows' bytes. All of this is
warm: the files were just written and are in the page cache (so this measures the software, not
the disk).

Writes (one pass per layout, not alternated): the first ``--write_rows`` rows appended to a fresh
copy ``--append_rows`` at a time (TierStore appends whole chunks), each write waited for; a
sharded layout also as its first shard in one write (an append smaller than a shard rewrites the
shard). Rows/s, bytes written and read per row (``wchar``, ``rchar``).

``--cold_rounds`` then drops each layout's files from the page cache
(``posix_fadvise(DONTNEED)``) before each of these reads: tensorstore with Q=1, and with Q=max in
one batch; the floor of the Q=max rows (one thread; ``threads``; and ``threads random``, each file
advised ``POSIX_FADV_RANDOM`` so that the kernel reads no more than asked) and reports those
rates and the bytes the disk delivered (``read_bytes``).

The last stdout line is one JSON object: per configuration (``configs``: its name -> rows/s,
useful MB/s, bytes read per row, amplification, syscalls per row, its layout's floor rows/s and
``of_floor`` = rows/s / floor rows/s), per layout (``floors``), ``writes``, ``cold``, and the summary:
``best`` (the fastest configuration) with ``best_rows_per_s`` and ``best_of_floor``,
``current`` (``separate c<--current_chunk_rows> q1``, what the tier does today) with
``current_rows_per_s``, ``best_over_current``, and ``floor_best_over_best`` (the fastest floor's
rows/s over the fastest tensorstore configuration's: how much a plain-file path would gain).
"""

from __future__ import annotations

import concurrent.futures
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
from harness import outputs, tier_files

_ROWS = flags.DEFINE_integer("rows", 100_000, "Rows of the table.")
_DIM = flags.DEFINE_integer("dim", 64, "Weights per row (float32).")
_SLOT = flags.DEFINE_integer("slot_width", 64, "Adagrad slot width per row (float32).")
_READ = flags.DEFINE_integer("read_rows", 1000, "Distinct random rows per read.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Timed rounds (each runs every configuration once); medians reported.")
_CHUNKS = flags.DEFINE_list("chunk_rows", ["1024", "256", "64", "16", "4"], "Chunk rows of the chunked layouts.")
_SHARDS = flags.DEFINE_list("shard_rows", ["4096", "16384", "65536"], "Shard rows of the sharded layouts.")
_INNER = flags.DEFINE_list("inner_rows", ["1", "4", "16"], "Inner-chunk rows of the sharded layouts.")
_INFLIGHT = flags.DEFINE_list("inflight", ["1", "2", "4", "8"], "Reads in flight (Q) to compare.")
_COLD = flags.DEFINE_integer(
  "cold_rounds", 1, "Rounds of reads after dropping the files from the page cache (0: none)."
)
_CURRENT = flags.DEFINE_integer("current_chunk_rows", 1024, "TierStore's chunk_rows today (the 'current' figure).")
_DIR = flags.DEFINE_string("dir", None, "Folder for the files (default: a temporary folder, removed after).")
_APPEND = flags.DEFINE_integer("append_rows", 1024, "Rows per append in the write figures (TierStore appends chunks).")
_WRITE_ROWS = flags.DEFINE_integer("write_rows", 16384, "Rows appended per layout for the write figures.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON result here.")


def _median(xs: List[float]) -> float:
  return float(np.median(xs)) if xs else float("nan")


class Config:
  """One way to read: a layout, its shard index cached or not, Q reads in flight, in one ts.Batch or not."""

  def __init__(self, layout: tier_files.Layout, arrays, cached: bool, batch: bool, q: int):
    self.layout, self.arrays, self.cached, self.batch, self.q = layout, arrays, cached, batch, q
    parts = [layout.name]
    if layout.kind == "sharded":
      parts.append("index-cached" if cached else "uncached")
    if batch:
      parts.append("batch")
    self.name = " ".join(parts + [f"q{q}"])
    self.runs: List[Dict[str, float]] = []

  def read(self, sets: List[np.ndarray]) -> List[Dict[str, np.ndarray]]:
    if self.batch:
      with ts.Batch() as b:
        futures = [tier_files.read_ts(self.arrays, rows, b) for rows in sets]
    else:
      futures = [tier_files.read_ts(self.arrays, rows) for rows in sets]
    return [{f: x.result() for f, x in fu.items()} for fu in futures]


def _check(layout: tier_files.Layout, truth: Dict[str, np.ndarray], rows: np.ndarray, got, what: str) -> None:
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


def _timed(fn, arg, rows: int, row_bytes: int) -> Dict[str, float]:
  """Calls ``fn(arg)``: its result (``out``) and figures (module docstring)."""
  io0 = tier_files.io_counters()
  t0 = time.perf_counter()
  out = fn(arg)
  dt = time.perf_counter() - t0
  io1 = tier_files.io_counters()
  return {"out": out, **_figures(rows, row_bytes, dt, tier_files.io_delta(io0, io1))}


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
    io0 = tier_files.io_counters()
    t0 = time.perf_counter()
    out.append(fl.read(rows))
    dt += time.perf_counter() - t0
    io1 = tier_files.io_counters()
    fl.close()
    io = {k: io.get(k, 0) + v for k, v in tier_files.io_delta(io0, io1).items()}
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
    io0 = tier_files.io_counters()
    t0 = time.perf_counter()
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
  s = {k: _median([r[k] for r in runs]) for k in keys}
  s["useful_mb_per_s"] = s["rows_per_s"] * row_bytes / 1e6
  s["rows_per_s_runs"] = sorted(r["rows_per_s"] for r in runs)
  return s


def main(argv):
  del argv
  N, R = _ROWS.value, _READ.value
  qs = sorted({int(q) for q in _INFLIGHT.value})
  qmax = qs[-1]
  if R * qmax > N:
    raise app.UsageError(
      f"--read_rows={R} x the largest --inflight={qmax} exceeds --rows={N}: the reads could not differ"
    )
  fields = {"weights": _DIM.value, "slot_adagrad": _SLOT.value}
  rng = np.random.default_rng(0)
  # Non-zero everywhere (1 + |normal|): zarr3 does not store a chunk equal to the fill value (0).
  data = {f: (1 + np.abs(rng.standard_normal((N, w)))).astype(np.float32) for f, w in fields.items()}
  root = _DIR.value or tempfile.mkdtemp(prefix="bench_tier_layout_")
  os.makedirs(root, exist_ok=True)
  layouts = [
    tier_files.Layout(root, kind, fields, N, chunk_rows=int(c))
    for kind in ("separate", "combined")
    for c in _CHUNKS.value
  ]
  layouts += [
    tier_files.Layout(root, "sharded", fields, N, shard_rows=int(s), inner_rows=int(i))
    for s in _SHARDS.value
    for i in _INNER.value
  ]
  row_bytes = layouts[0].row_bytes
  load_start = os.getloadavg()[0]
  print(
    f"table: {N:,} rows x {row_bytes} B ({N * row_bytes / 1e6:.1f} MB) in {root}; reads of {R} distinct random rows, "
    f"sorted; Q in {qs}; {_ROUNDS.value} rounds; load {load_start:.2f}",
    file=sys.stderr,
  )
  try:
    t0 = time.perf_counter()
    truths, floors, configs = {}, {}, []
    for lay in layouts:
      lay.create(data)
      truths[lay.name] = lay.split(data)
      floors[lay.name] = tier_files.FloorReader(lay)
      for cached in (False, True) if lay.kind == "sharded" else (False,):
        arrays = lay.open(ts.Context(lay.index_cache_context() if cached else tier_files.CONTEXT), cache_index=cached)
        configs += [Config(lay, arrays, cached, False, q) for q in qs]
        configs += [Config(lay, arrays, cached, True, q) for q in qs if q > 1]
    print(f"wrote {len(layouts)} layouts in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    floor_runs: Dict[tuple, List[Dict[str, float]]] = {(lay.name, m): [] for lay in layouts for m in FLOORS}
    pool = concurrent.futures.ThreadPoolExecutor(qmax)
    t0 = time.perf_counter()
    for rnd in range(_ROUNDS.value + 1):  # round 0: untimed (first opens, first reads)
      sets = [np.sort(rng.choice(N, R, replace=False)) for _ in range(qmax)]
      jobs = [("config", c, None) for c in configs] + [("floor", lay, m) for lay in layouts for m in FLOORS]
      for k in rng.permutation(len(jobs)):
        what, x, mode = jobs[k]
        if what == "config":
          r = _timed(x.read, sets[: x.q], R * x.q, row_bytes)
          for rows, got in zip(sets, r.pop("out")):
            _check(x.layout, truths[x.layout.name], rows, got, x.name)
          if rnd:
            x.runs.append(r)
        else:
          r = _floor(floors[x.name], sets, mode, row_bytes, pool)
          for rows, got in zip(sets, r.pop("out")):
            _check(x, truths[x.name], rows, got, "floor")
          if rnd:
            floor_runs[(x.name, mode)].append(r)
    print(f"{_ROUNDS.value + 1} rounds in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    writes = {lay.name: _writes(lay, data, _APPEND.value, _WRITE_ROWS.value, row_bytes) for lay in layouts}

    cold = {}
    if _COLD.value:
      os.sync()  # dirty pages stay in the page cache through DONTNEED
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
          for rows, got in zip(sets, r.pop("out")):
            _check(lay, truths[lay.name], rows, got, f"cold {key}")
          runs[key].append(r)
      cold[lay.name] = {k: _summary(v, row_bytes) for k, v in runs.items()}
  finally:
    for fl in locals().get("floors", {}).values():
      fl.close()
    if "pool" in locals():
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

  # The table: one line per layout x cache x batch, rows/s by Q.
  print(
    f"\nwarm (every file in the page cache), medians of {_ROUNDS.value}; k rows/s by reads in flight, "
    "then at the best Q: bytes read / useful (amplification), read syscalls per row, the floor "
    "(preadv, 1 thread, k rows/s; its amplification), rows/s / floor, and the floor opening each file per read "
    f"and in {qmax} threads",
    file=sys.stderr,
  )
  head = f"{'layout':22}{'index':>9}{'batch':>6}" + "".join(f"{'Q=' + str(q):>8}" for q in qs)
  head += f"{'ampl':>8}{'sysc/r':>8}{'floor':>8}{'f.ampl':>7}{'/floor':>8}{'f.open':>8}{'f.thr':>8}"
  print(head, file=sys.stderr)
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
    print(line, file=sys.stderr)

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
  print(
    f"\nbest: {best}: {res[best]['rows_per_s'] / 1e3:.0f}k rows/s ({res[best]['useful_mb_per_s']:.0f} MB/s useful, "
    f"amplification {res[best]['amplification']:.1f}), {res[best]['of_floor']:.2f} of its floor"
    + (
      f"; {out['best_over_current']:.1f}x the current ({current}: {out['current_rows_per_s'] / 1e3:.0f}k rows/s, "
      f"{out['current_of_floor']:.3f} of its floor)"
      if current in res
      else ""
    )
    + f"\nfastest floor: {best_floor}: {out['best_floor_rows_per_s'] / 1e3:.0f}k rows/s = "
    f"{out['floor_best_over_best']:.2f}x the best tensorstore read",
    file=sys.stderr,
  )
  print(
    f"\nwrites (appends into a fresh copy, each waited for; {_WRITE_ROWS.value:,} rows, or a sharded layout's first "
    "shard whole): k rows/s, bytes written per row / row bytes (amplification), bytes read per row",
    file=sys.stderr,
  )
  for name, w in writes.items():
    line = "".join(
      f"   {m}: {v['rows_per_s'] / 1e3:7.0f}k {v['write_amplification']:5.1f}x {v['bytes_read_per_row']:6.0f}B"
      for m, v in w.items()
    )
    print(f"{name:22}{line}", file=sys.stderr)
  out["writes"] = writes
  if cold:
    print(
      f"\ncold (files dropped from the page cache before each read), medians of {_COLD.value}: k rows/s, and the "
      "bytes the disk delivered per row",
      file=sys.stderr,
    )
    keys = sorted(dict.fromkeys(k for c in cold.values() for k in c), key=lambda k: k.startswith("floor"))
    short = {k: k.replace("index-cached", "idx").replace("threads", "thr").replace("random", "rnd") for k in keys}
    print(f"{'layout':22}" + "".join(f"{short[k]:>17}" for k in keys), file=sys.stderr)
    for name, c in cold.items():
      cells = [
        f"{c[k]['rows_per_s'] / 1e3:8.1f}k {c[k]['disk_bytes_per_row']:6.0f}B" if k in c else f"{'':17}" for k in keys
      ]
      print(f"{name:22}" + "".join(cells), file=sys.stderr)
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
