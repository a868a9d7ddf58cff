"""The preprocessed cache (recsys_jax/data/cache.py): epochs from Criteo TSV against epochs from the cache.

    python experiments/bench_cache.py [--lines=100000] [--files=4] [--batch_size=8192] [--train] [--json_out=FILE]

On ``--files`` generated Criteo TSV files of ``--lines`` records: (1) one parsed chunk read back and
copied from the cache's chunk file, ``np.memmap``, Arrow IPC and ``.npy`` files, and the checksums
that could guard it, best of ``--repeats`` (``storage_*``); (2) epochs through ``readers.build_reader``
in samples/s (``read_*``): ``cold`` (parsing the TSV, writing the cache) and ``warm`` (the same
reader's second epoch), then fresh readers, interleaved, best of ``--epoch_repeats``: ``tsv`` (cache
off) and ``warm_new_run`` (also unverified and mapped); ``ratio`` = warm_new_run / tsv; (3)
``--train``: one epoch of ``configs/tiny.py``, cache off against warm (``train_*``). Prints a table,
then, last on stdout, one JSON line of every figure.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import platform
import tempfile
import time
import zlib
from typing import Callable, Dict

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
from absl import app, flags
from harness import outputs
from harness.data import criteo_text
from harness.stats import best_of

from configs import default, tiny
from recsys_jax.data import base, chunkfile, readers
from recsys_jax.data.criteo import CriteoFormat

_LINES = flags.DEFINE_integer("lines", 100_000, "Records per generated file.")
_CHUNK = flags.DEFINE_integer("chunk_records", 8192, "Records per chunk (the default of data/stream.py).")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed passes of each storage and checksum; the best is kept.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generated data.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON result here.")
_FILES = flags.DEFINE_integer("files", 4, "Generated TSV files (of --lines records each).")
_BATCH = flags.DEFINE_integer("batch_size", 8192, "Records per batch.")
_EPOCH_REPEATS = flags.DEFINE_integer("epoch_repeats", 3, "Passes of each later-run variant; the best is kept.")
_TRAIN = flags.DEFINE_boolean("train", False, "Also train configs/tiny.py for an epoch, cache off against warm.")


def storage(path: str, tmp: str, chunk_records: int, repeats: int) -> Dict[str, float]:
  """Read + copy times of one parsed chunk in each storage, and checksum speeds."""
  fmt = CriteoFormat()
  cols = fmt.parse(next(iter(fmt.chunks(path, chunk_records))), base.BadRecords("error"))
  arrays = [("label", cols["label"]), ("dense", cols["dense"])] + list(cols["sparse"].items())
  ours = os.path.join(tmp, "chunk.chunk")
  chunkfile.write_chunk(ours, cols, [], 0)
  raw, offsets, off = os.path.join(tmp, "chunk.raw"), [], 0
  with open(raw, "wb") as f:
    for _, a in arrays:
      f.write(np.ascontiguousarray(a).tobytes())
      offsets.append(off)
      off += a.nbytes
  npy = os.path.join(tmp, "npy")
  os.makedirs(npy, exist_ok=True)
  for name, a in arrays:
    np.save(os.path.join(npy, f"{name}.npy"), a)
  table = pa.table(
    {"label": cols["label"], **{f"I{i + 1}": cols["dense"][:, i] for i in range(13)}}
    | {name: a[:, 0] for name, a in cols["sparse"].items()}
  )
  arrow = os.path.join(tmp, "chunk.arrow")
  with ipc.new_file(arrow, table.schema) as w:
    w.write_table(table)

  def memmap():
    m = np.memmap(raw, np.uint8, "r")
    return [m[o : o + a.nbytes].view(a.dtype).reshape(a.shape) for o, (_, a) in zip(offsets, arrays)]

  def arrow_read(source):
    with source(arrow) as src:
      t = ipc.open_file(src).read_all()
    return [t.column(c).to_numpy() for c in t.column_names]

  def flat(c):
    return [c["label"], c["dense"], *c["sparse"].values()]

  readers_ = {
    "chunkfile": lambda: flat(chunkfile.read_chunk(ours, verify=False)[0]),
    "chunkfile_verified": lambda: flat(chunkfile.read_chunk(ours)[0]),
    "np_memmap": memmap,
    "arrow_ipc_memory_map": lambda: arrow_read(pa.memory_map),
    "arrow_ipc_osfile": lambda: arrow_read(pa.OSFile),
    "npy_per_array": lambda: [np.load(os.path.join(npy, f"{n}.npy")) for n, _ in arrays],
  }
  out: Dict[str, float] = {"chunk_bytes": float(os.path.getsize(ours))}
  for name, read in readers_.items():
    out[f"read_copy_ms_{name}"] = 1e3 * best_of(lambda read=read: [np.array(a) for a in read()], repeats)
  data = np.fromfile(ours, np.uint8)[-sum(-(-a.nbytes // 64) * 64 for _, a in arrays) :]  # the arrays, 64-aligned
  checks: Dict[str, Callable[[], object]] = {
    "sum64": lambda: chunkfile.sum64(data),
    "crc32": lambda: zlib.crc32(data),
    "adler32": lambda: zlib.adler32(data),
    "blake2b": lambda: hashlib.blake2b(data).digest(),
  }
  for name, fn in checks.items():
    out[f"checksum_gb_per_s_{name}"] = data.nbytes / best_of(fn, repeats) / 1e9
  return out


def data_config(pattern: str, cache_dir: str, batch_size: int, chunk_records: int):
  c = default.get_config()
  c.batch_size = batch_size
  c.data.name = "criteo"
  c.data.train_files = (pattern,)
  c.data.eval_files = (pattern,)
  c.data.chunk_records = chunk_records
  c.data.cache_dir = cache_dir
  return c


def time_batches(it, n: int, batch_size: int) -> float:
  """Samples/s of the next ``n`` batches of ``it``."""
  t0 = time.perf_counter()
  for _ in range(n):
    b, _ = next(it)
    assert base.num_records(b) == batch_size
  return n * batch_size / (time.perf_counter() - t0)


def epochs(pattern: str, tmp: str, records: int, batch_size: int, chunk_records: int, repeats: int) -> Dict[str, float]:
  n = records // batch_size
  cache_dir = os.path.join(tmp, "cache")

  def fresh(cache: str):
    return readers.build_reader(data_config(pattern, cache, batch_size, chunk_records), workdir=tmp).train()

  out = {"tsv_first": time_batches(fresh("none"), n, batch_size)}
  it = fresh(cache_dir)
  out["cold"] = time_batches(it, n, batch_size)
  out["warm"] = time_batches(it, n, batch_size)
  # Fresh readers (later runs), interleaved and best of `repeats`, as other processes share this
  # machine: from the TSV, and from the cache with chunk files read as the cache does, unverified,
  # or mapped.
  variants = {
    "tsv": ("none", {}),
    "warm_new_run": (cache_dir, {}),
    "warm_new_run_unverified": (cache_dir, {"verify": False}),
    "warm_new_run_mmap": (cache_dir, {"mmap": True}),
  }
  real = chunkfile.read_chunk
  out.update(dict.fromkeys(variants, 0.0))
  try:
    for _ in range(repeats):
      for k, (where, kw) in variants.items():
        chunkfile.read_chunk = functools.partial(real, **kw)
        out[k] = max(out[k], time_batches(fresh(where), n, batch_size))
  finally:
    chunkfile.read_chunk = real
  out["ratio"] = out["warm_new_run"] / out["tsv"]
  out["ratio_second_epoch"] = out["warm"] / out["cold"]
  out["cache_bytes"] = float(sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache_dir) for f in fs))
  return out


def training(pattern: str, tmp: str, records: int, batch_size: int, chunk_records: int) -> Dict[str, float]:
  from recsys_jax import train

  base_config = tiny.get_config()
  base_config.data = data_config(pattern, "", batch_size, chunk_records).data
  base_config.batch_size = base_config.eval_batch_size = base_config.eval_samples = batch_size
  base_config.num_steps = records // batch_size
  base_config.checkpoint_every = base_config.eval_every = 0
  out = {}
  shared = os.path.join(tmp, "train_cache")
  for name, cache in (("tsv", "none"), ("fill", shared), ("warm", shared)):
    c = copy.deepcopy(base_config)
    c.data.cache_dir = cache
    summary = train.train_and_evaluate(c, tempfile.mkdtemp(prefix=f"train_{name}_", dir=tmp))
    out[name] = float(summary["samples_per_sec"])
  out["ratio"] = out["warm"] / out["tsv"]
  return out


def main(argv):
  del argv
  files, chunk, batch = _FILES.value, _CHUNK.value, _BATCH.value
  n = _LINES.value * files
  rng = np.random.default_rng(_SEED.value)
  result: Dict[str, object] = {"lines": n, "files": files, "chunk_records": chunk, "batch_size": batch}
  with tempfile.TemporaryDirectory() as tmp:
    data = os.path.join(tmp, "data")
    os.makedirs(data)
    for i in range(files):
      with open(os.path.join(data, f"day_{i}"), "wb") as f:
        f.write(criteo_text(_LINES.value, rng))
    pattern = os.path.join(data, "day_*")
    st = storage(os.path.join(data, "day_0"), tmp, chunk, _REPEATS.value)
    ep = epochs(pattern, tmp, n, batch, chunk, _EPOCH_REPEATS.value)
    result.update({f"storage_{k}": round(v, 3) for k, v in st.items()})
    result.update({f"read_{k}": round(v, 3) for k, v in ep.items()})
    tr = training(pattern, tmp, n, batch, chunk) if _TRAIN.value else {}
    result.update({f"train_{k}": round(v, 3) for k, v in tr.items()})
  crc_ms = 1e3 * st["chunk_bytes"] / st["checksum_gb_per_s_crc32"] / 1e9
  result["crc32_share_of_warm_chunk"] = round(crc_ms / (1e3 * chunk / ep["warm_new_run"]), 3)
  result["cpu_count"] = os.cpu_count()
  result["machine"] = platform.processor() or platform.machine()

  print(f"one parsed chunk of {chunk} Criteo records, {st['chunk_bytes'] / 1e6:.2f} MB, best of {_REPEATS.value}:")
  for k, v in st.items():
    if k.startswith("read_copy_ms_"):
      print(f"  read + copy  {k[len('read_copy_ms_') :]:22} {v:7.3f} ms")
    elif k.startswith("checksum_"):
      print(f"  checksum     {k[len('checksum_gb_per_s_') :]:22} {v:7.2f} GB/s ({st['chunk_bytes'] / v / 1e6:.3f} ms)")
  print(f"epochs of {n} records in {files} files, batch {batch}, one process, samples/s:")
  for k in ("cold", "warm", "tsv", "warm_new_run", "warm_new_run_unverified", "warm_new_run_mmap"):
    print(f"  {k:24} {ep[k]:12,.0f}")
  print(f"  {'warm / cold':24} {ep['ratio_second_epoch']:12.2f}   (one pass each: the same reader's epochs 2 and 1)")
  print(f"  {'warm_new_run / tsv':24} {ep['ratio']:12.2f}   (cache {ep['cache_bytes'] / 1e6:.0f} MB)")
  per_chunk_ms = 1e3 * chunk / ep["warm_new_run"]
  print(
    f"  a warm chunk costs {per_chunk_ms:.2f} ms in the stream; crc32 of it would add {crc_ms:.2f} ms ({crc_ms / per_chunk_ms:.0%})"
  )
  if tr:
    print(f"training configs/tiny.py one epoch, samples/s: tsv {tr['tsv']:,.0f}, warm cache {tr['warm']:,.0f}")
    print(f"  (the run filling the cache: {tr['fill']:,.0f}); warm / tsv {tr['ratio']:.2f}")
  outputs.emit(result, _JSON_OUT.value, sort_keys=True)


if __name__ == "__main__":
  app.run(main)
