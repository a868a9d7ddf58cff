"""Throughput of the Criteo and Avazu readers: records/s and MB/s of ``chunks`` + ``parse``.

    python experiments/bench_readers.py [--lines=200000] [--chunk_records=8192] [--transfer] [--json_out=FILE]

Writes a Criteo TSV and an Avazu CSV file of ``--lines`` records (``harness.data``), plain and gzipped
(level 6), and times over each, best of ``--repeats``: ``chunks`` alone (decompressing and cutting
lines), and ``chunks`` + ``parse`` (what an input pipeline pays). MB/s counts the uncompressed text;
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
from recsys_jax.data.avazu import AvazuFormat
from recsys_jax.data.criteo import CriteoFormat

_LINES = flags.DEFINE_integer("lines", 200_000, "Records per generated file.")
_CHUNK = flags.DEFINE_integer("chunk_records", 8192, "Records per chunk (the default of data/stream.py).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed passes per file; the best is kept.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generated data.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON result here.")
_TRANSFER = flags.DEFINE_bool("transfer", False, "Also time parsing in worker processes against threads.")


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


def _parse_chunk(chunk):
  return CriteoFormat().parse(chunk, base.BadRecords())


def compare_parse(name: str, fmt, chunks: List[base.RawChunk], repeats: int, processes: bool) -> Dict[str, float]:
  """``parse`` (compiled) against ``parse_numpy`` on the same chunks, interleaved, medians: thread CPU
  a record on this thread, and records/s on 2 threads (what host workers get). ``processes`` (Criteo):
  also on 2 spawned processes (chunks sent, columns sent back, as ``concurrent.futures`` does it):
  ``transfer_parse_{inline,threads_2,processes_2}_{wall,trainer_cpu}_us``, us a record."""
  n = sum(len(c) for c in chunks)
  spawn = multiprocessing.get_context("spawn")
  procs = concurrent.futures.ProcessPoolExecutor(2, mp_context=spawn) if processes else None
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    ways = {}
    for way, parse in (("compiled", fmt.parse), ("numpy", fmt.parse_numpy)):
      ways[way] = lambda parse=parse: [parse(c, base.BadRecords()) for c in chunks]
      ways[f"{way}_2"] = lambda parse=parse: list(pool.map(lambda c: parse(c, base.BadRecords()), chunks))
    if procs is not None:
      list(procs.map(_parse_chunk, chunks[:2]))  # start them
      ways["processes_2"] = lambda: list(procs.map(_parse_chunk, chunks))
    t = interleaved(ways, max(repeats, 5))
  out = {}
  for way in ("compiled", "numpy"):
    out[f"{name}_{way}_parse_cpu_us_per_record"] = round(1e6 * t[way]["thread"] / n, 3)
    out[f"{name}_{way}_parse_2_threads_records_per_s"] = round(n / t[f"{way}_2"]["wall"], 1)
  if procs is not None:
    procs.shutdown()
    for k, way in (("inline", "compiled"), ("threads_2", "compiled_2"), ("processes_2", "processes_2")):
      out[f"transfer_parse_{k}_wall_us"] = round(1e6 * t[way]["wall"] / n, 3)
      out[f"transfer_parse_{k}_trainer_cpu_us"] = round(1e6 * t[way]["process"] / n, 3)
  return out


def transfer_costs(fmt, chunks: List[base.RawChunk]) -> Dict[str, float]:
  """This thread's CPU a record (us, best of 3) moving parsed columns between processes by pickling (as
  multiprocessing queues do) or through shared memory, and pickling the raw lines."""
  n = sum(len(c) for c in chunks)
  cols = [fmt.parse(c, base.BadRecords()) for c in chunks]
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
      "pickle_us": lambda: [pickle.dumps(c, protocol=5) for c in cols],
      "unpickle_us": lambda: [pickle.loads(b) for b in blobs],
      "shm_in_us": into_shm,
      "shm_out_us": lambda: [np.array(v) for v in views],
      "pickle_raw_lines_us": lambda: [pickle.dumps(c.payload, protocol=5) for c in chunks],
    }
    out = {f"transfer_{k}": round(1e6 * best_of(fn, 3, time.thread_time) / n, 3) for k, fn in ways.items()}
    out["transfer_bytes_per_record"] = round(sum(len(b) for b in blobs) / n, 1)
    views.clear()  # the views pin shm.buf: drop them before closing it
  finally:
    shm.close()
    shm.unlink()
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
      ("avazu", AvazuFormat(), data.avazu_text, "train"),
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
      processes = name == "criteo" and _TRANSFER.value
      result.update(compare_parse(name, fmt, list(fmt.chunks(plain, chunk)), repeats, processes))
      if processes:
        result.update(transfer_costs(fmt, list(fmt.chunks(plain, chunk))))
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
  outputs.emit(result, _JSON_OUT.value, sort_keys=True)


if __name__ == "__main__":
  app.run(main)
