"""The parameter-server benchmarks' workload: Adagrad tables, a prefilled PS, the bytes a row moves,
gradients, a process's memory, and the memcpy bandwidth their figures are fractions of. Nothing here
imports ``recsys_jax`` at import time (ps_lockstep.py runs it beside another checkout's)."""

from __future__ import annotations

import threading
import time
from typing import List, Sequence, Tuple

import numpy as np

from harness import data

LEARNING_RATE = (("learning_rate", 0.05),)


def adagrad_specs(names: Sequence[str], dim: int, **kw) -> List:
  """One Adagrad table (learning rate 0.05) of width ``dim`` per name; ``kw`` goes to every ``TableSpec``."""
  from recsys_jax.embeddings.specs import TableSpec

  return [TableSpec(name=t, dim=dim, optimizer="adagrad", optimizer_kwargs=LEARNING_RATE, **kw) for t in names]


def row_bytes(dim: int) -> Tuple[int, int, int]:
  """Bytes a float32 row of width ``dim`` moves, read plus written, in (lookup: the row read and written
  out; apply: the gradient read, the row and its Adagrad slot read and written; create: both written)."""
  row = 4 * dim
  return 2 * row, row + 2 * (row + row), row + row


def grads(rows: int, dim: int) -> np.ndarray:
  """Small random float32 gradients for up to ``rows`` rows (seed 1)."""
  return np.random.default_rng(1).standard_normal((rows, dim)).astype(np.float32) * 1e-3


def prefill(ps, tables: Sequence[str], vocab: int, chunk: int = 1 << 14) -> int:
  """Creates ids 0..vocab-1 (hashed as :func:`harness.data.hashed`, table ``f`` of ``tables``) untimed,
  as a long-running PS would hold them. Rarest first, one step per chunk, so a bounded (LRU) table
  ends with its most frequent ids in RAM, as traffic would have left it. Returns the next free step."""
  step = 0
  for a in range(vocab, 0, -chunk):
    step += 1
    ids = {t: data.hashed(np.arange(max(0, a - chunk), a), f) for f, t in enumerate(tables)}
    ps.lookup_many(ids, create=True, step=step)
  return step + 1


def proc_bytes(key: str, path: str = "/proc/self/status") -> int:
  """A memory field of a /proc file (``VmRSS``, ``VmHWM``; ``MemAvailable`` of /proc/meminfo) in bytes."""
  with open(path) as f:
    for line in f:
      if line.startswith(key + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(key)


class Memcpy:
  """``threads`` threads each copying its own ``nbytes`` buffer, both ends written once first (no page
  faults in the timed copies). Copied between a benchmark's batches, it measures the reference under
  the same load as the code measured: on a shared machine the load moves both by the second."""

  def __init__(self, threads: int, nbytes: int = 256 << 20):
    self.srcs = [np.ones(nbytes // 8, np.float64) for _ in range(threads)]
    self.dsts = [np.zeros_like(s) for s in self.srcs]

  def copy(self) -> Tuple[int, float]:
    """One concurrent copy per thread: (bytes read + written, seconds)."""
    ts = [threading.Thread(target=np.copyto, args=(d, s)) for d, s in zip(self.dsts, self.srcs)]
    t0 = time.perf_counter()
    for t in ts:
      t.start()
    for t in ts:
      t.join()
    return 2 * sum(s.nbytes for s in self.srcs), time.perf_counter() - t0

  def best(self, repeats: int = 5) -> float:
    """Bytes read + written per second: the best of ``repeats`` copies."""
    return max(b / s for b, s in (self.copy() for _ in range(repeats)))
