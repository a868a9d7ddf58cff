"""Throughput of the Criteo and Avazu readers: records/s and MB/s of ``chunks`` + ``parse``.

    python experiments/bench_readers.py [--lines=200000] [--chunk_records=8192] [--transfer] [--json_out=FILE]

Writes a Criteo TSV file (``harness.data.criteo_text``) and an Avazu CSV file (the published header,
values shaped like the published ones) of ``--lines`` records, plain and gzipped (level 6), and
times over each, best of ``--repeats``: ``chunks`` alone (decompressing and cutting lines), and
``chunks`` + ``parse`` (what an input pipeline pays). MB/s counts the uncompressed text;
``gz_mb_per_s`` the compressed file. ``naive`` is a line-by-line Python parse of the Criteo chunks,
for scale. Then the compiled ``parse`` against ``parse_numpy`` on the same chunks, interleaved,
median of at least 5: thread CPU a record, and records/s on 2 threads. ``--transfer``: what parsing
Criteo chunks in worker processes would cost against threads (``transfer_*``, us a record).

The last stdout line is one JSON object: ``{format}_{plain|gz}_records_per_s``, ``..._mb_per_s``,
``..._parse_records_per_s`` (parse alone), the comparisons and the parameters.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import itertools
import json
import multiprocessing
import os
import pickle
import platform
import tempfile
import time
from multiprocessing import shared_memory
from typing import Dict, List

import numpy as np
from absl import app, flags
from harness import data, outputs
from harness.stats import best_of, interleaved

from recsys_jax.data import base
from recsys_jax.data.avazu import HEADER, AvazuFormat
from recsys_jax.data.criteo import CriteoFormat

_LINES = flags.DEFINE_integer("lines", 200_000, "Records per generated file.")
_CHUNK = flags.DEFINE_integer("chunk_records", 8192, "Records per chunk (the default of data/stream.py).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed passes per file; the best is kept.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generated data.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON result here.")
_TRANSFER = flags.DEFINE_bool("transfer", False, "Also time parsing in worker processes against threads.")


def avazu_text(n: int, rng: np.random.Generator) -> bytes:
  """A header and ``n`` Avazu records shaped like the published ones."""

  def hex_ids(vocab: int) -> np.ndarray:
    return np.char.mod("%08x", rng.integers(0, 2**32, vocab)[rng.integers(0, vocab, n)])

  def ints(lo: int, hi: int) -> np.ndarray:
    return rng.integers(lo, hi, n).astype(str)

  hours = np.char.mod("1410%d", 2100 + 100 * rng.integers(0, 10, n) + rng.integers(0, 24, n))
  cols = [
    rng.integers(10**18, 10**19, n, dtype=np.uint64).astype(str),  # id
    np.where(rng.random(n) < 0.17, "1", "0"),  # click
    hours,  # hour: 14102100 .. 14103023
    ints(1001, 1013),  # C1
    ints(0, 8),  # banner_pos
  ]
  cols += [hex_ids(v) for v in (4_000, 7_000, 26, 8_000, 500, 36, 200_000, 1_000_000, 8_000)]
  cols += [ints(0, 6), ints(0, 6), ints(375, 24_050), ints(120, 1_025), ints(20, 1_025)]
  cols += [ints(112, 2_758), ints(0, 4), ints(33, 1_960), np.where(rng.random(n) < 0.5, "-1", ints(100_000, 100_250))]
  cols += [ints(1, 256)]
  return (",".join(HEADER) + "\n").encode() + data.join_rows(cols, ",")


def naive_criteo(lines: List[bytes]) -> base.Columns:
  """The line-by-line parse the vectorised one replaces (no bad-record checks beyond Python's)."""
  label, dense, cats = [], [], []
  for text in lines:
    f = text.split(b"\t")
    label.append(int(f[0]))
    dense.append([int(x) if x else 0 for x in f[1:14]])
    cats.append([int(x, 16) if x else -1 for x in f[14:]])
  c = np.asarray(cats, np.int64)
  return {
    "label": np.asarray(label, np.float32),
    "dense": base.log1p_dense(np.asarray(dense, np.int64)),
    "sparse": {f"C{j + 1}": base.hash_ints(c[:, j], f"C{j + 1}")[:, None] for j in range(26)},
  }


def bench_file(fmt, path: str, text_bytes: int, n: int, chunk: int, repeats: int) -> Dict[str, float]:
  """Times ``chunks`` alone, ``chunks`` + ``parse``, and ``parse`` alone over one file."""

  def read_only():
    for _ in fmt.chunks(path, chunk):
      pass

  def read_and_parse():
    bad = base.BadRecords("error")
    got = sum(base.num_records(fmt.parse(c, bad)) for c in fmt.chunks(path, chunk))
    assert got == n, (got, n)

  chunks = list(fmt.chunks(path, chunk))
  t_read = best_of(read_only, repeats)
  t_total = best_of(read_and_parse, repeats)
  t_parse = best_of(lambda: [fmt.parse(c, base.BadRecords()) for c in chunks], repeats)
  return {
    "records_per_s": n / t_total,
    "mb_per_s": text_bytes / t_total / 1e6,
    "gz_mb_per_s": os.path.getsize(path) / t_total / 1e6,
    "read_records_per_s": n / t_read,
    "parse_records_per_s": n / t_parse,
  }


def compare_parse(name: str, fmt, chunks: List[base.RawChunk], repeats: int) -> Dict[str, float]:
  """``parse`` (compiled) against ``parse_numpy`` on the same chunks, interleaved, medians: thread CPU
  a record on this thread, and records/s on 2 threads (what host workers get)."""
  n = sum(len(c) for c in chunks)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    ways = {}
    for way, parse in (("compiled", fmt.parse), ("numpy", fmt.parse_numpy)):
      ways[way] = lambda parse=parse: [parse(c, base.BadRecords()) for c in chunks]
      ways[f"{way}_2"] = lambda parse=parse: list(pool.map(lambda c: parse(c, base.BadRecords()), chunks))
    t = interleaved(ways, max(repeats, 5))
  out = {}
  for way in ("compiled", "numpy"):
    out[f"{name}_{way}_parse_cpu_us_per_record"] = round(1e6 * t[way]["thread"] / n, 3)
    out[f"{name}_{way}_parse_2_threads_records_per_s"] = round(n / t[f"{way}_2"]["wall"], 1)
  return out


def _parse_chunk(chunk):
  return CriteoFormat().parse(chunk, base.BadRecords())


def transfer_costs(path: str, chunk: int, chunks: int = 8) -> Dict[str, float]:
  """Microseconds a record of the first ``chunks`` chunks of ``path``: this thread's CPU (best of 3)
  parsing them, moving their columns between processes by pickling (as multiprocessing queues do)
  or through shared memory, and pickling the raw lines; then wall and this process's CPU (medians
  of 5, interleaved) parsing inline, on 2 threads and on 2 spawned processes (chunks sent, columns
  sent back, as ``concurrent.futures`` does it)."""
  fmt = CriteoFormat()
  raw = list(itertools.islice(fmt.chunks(path, chunk), chunks))
  n = sum(len(c) for c in raw)
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

    ways = {
      "parse_us": lambda: [fmt.parse(c, base.BadRecords()) for c in raw],
      "pickle_us": lambda: [pickle.dumps(c, protocol=5) for c in cols],
      "unpickle_us": lambda: [pickle.loads(b) for b in blobs],
      "shm_in_us": into_shm,
      "shm_out_us": lambda: [np.array(v) for v in views],
      "pickle_raw_lines_us": lambda: [pickle.dumps(c.payload, protocol=5) for c in raw],
    }
    out = {k: 1e6 * best_of(fn, 3, time.thread_time) / n for k, fn in ways.items()}
    out["bytes_per_record"] = sum(len(b) for b in blobs) / n
    views.clear()  # the views pin shm.buf: drop them before closing it
  finally:
    shm.close()
    shm.unlink()
  with (
    concurrent.futures.ThreadPoolExecutor(2) as threads,
    concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as procs,
  ):
    list(procs.map(_parse_chunk, raw[:2]))  # start them
    ways = {"inline": lambda: [_parse_chunk(c) for c in raw]}
    ways["threads_2"] = lambda: list(threads.map(_parse_chunk, raw))
    ways["processes_2"] = lambda: list(procs.map(_parse_chunk, raw))
    for k, t in interleaved(ways, 5).items():
      out[f"parse_{k}_wall_us"] = 1e6 * t["wall"] / n
      out[f"parse_{k}_trainer_cpu_us"] = 1e6 * t["process"] / n
  return out


def main(argv):
  del argv
  n, chunk, repeats = _LINES.value, _CHUNK.value, _REPEATS.value
  rng = np.random.default_rng(_SEED.value)
  result: Dict[str, object] = {"lines": n, "chunk_records": chunk, "repeats": repeats}
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for name, fmt, make, file_name in (
      ("criteo", CriteoFormat(), data.criteo_text, "day_0"),
      ("avazu", AvazuFormat(), avazu_text, "train"),
    ):
      text = make(n, rng)
      plain = os.path.join(tmp, file_name)
      with open(plain, "wb") as f:
        f.write(text)
      with gzip.open(plain + ".gz", "wb", compresslevel=6) as f:
        f.write(text)
      for kind, path in (("plain", plain), ("gz", plain + ".gz")):
        r = bench_file(fmt, path, len(text), n, chunk, repeats)
        rows.append((name, kind, len(text) / n, os.path.getsize(path) / 1e6, r))
        for key, value in r.items():
          if kind == "plain" and key == "gz_mb_per_s":
            continue
          result[f"{name}_{kind}_{key}"] = round(value, 1)
      if name == "criteo":
        chunks = list(fmt.chunks(plain, chunk))
        t = best_of(lambda chunks=chunks: [naive_criteo(c.payload) for c in chunks], repeats)
        result["criteo_naive_parse_records_per_s"] = round(n / t, 1)
      result.update(compare_parse(name, fmt, list(fmt.chunks(plain, chunk)), repeats))
      if name == "criteo" and _TRANSFER.value:
        result.update({f"transfer_{k}": round(v, 3) for k, v in transfer_costs(plain, chunk).items()})
  result["cpu_count"] = os.cpu_count()
  result["machine"] = platform.processor() or platform.machine()

  print(f"{n} records per file, chunks of {chunk}, best of {repeats}")
  print(
    f"{'format':8} {'file':6} {'B/rec':>6} {'file MB':>8} {'rec/s':>10} {'MB/s':>7} {'gz MB/s':>8} {'read rec/s':>11} {'parse rec/s':>12}"
  )
  for name, kind, per_rec, size, r in rows:
    gz_rate = f"{r['gz_mb_per_s']:8.1f}" if kind == "gz" else f"{'':8}"
    print(
      f"{name:8} {kind:6} {per_rec:6.0f} {size:8.1f} {r['records_per_s']:10.0f} {r['mb_per_s']:7.1f} {gz_rate}"
      f" {r['read_records_per_s']:11.0f} {r['parse_records_per_s']:12.0f}"
    )
  print(f"criteo naive line-by-line parse: {result['criteo_naive_parse_records_per_s']:.0f} rec/s")
  for name, way in itertools.product(("criteo", "avazu"), ("numpy", "compiled")):
    cpu, wall2 = result[f"{name}_{way}_parse_cpu_us_per_record"], result[f"{name}_{way}_parse_2_threads_records_per_s"]
    print(f"{name} parse, {way:8}: {cpu:.3f} us of CPU a record on 1 thread; {wall2:.0f} rec/s on 2 threads")
  if _TRANSFER.value:
    print("criteo, us a record:", ", ".join(f"{k[9:]} {v:.2f}" for k, v in result.items() if k.startswith("transfer_")))
  print(f"load average after the run: {os.getloadavg()}")
  line = json.dumps(result, sort_keys=True)
  if _JSON_OUT.value:
    outputs.write_text(_JSON_OUT.value, line + "\n")
  print(line)


if __name__ == "__main__":
  app.run(main)
