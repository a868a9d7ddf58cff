"""Synthetic workloads: Zipf-distributed ids hashed as a reader hashes them, and Criteo- and Avazu-shaped text."""

from __future__ import annotations

from typing import Dict, List

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # spreads consecutive ranks over the id space, as a feature hash does


def hashed(rank: np.ndarray, table: int) -> np.ndarray:
  """uint64 ids of ``rank`` in table ``table`` (distinct ranks stay distinct; tables do not share ids)."""
  return rank.astype(np.uint64) * GOLDEN + np.uint64(table)


def zipf_cdf(vocab: int, alpha: float) -> np.ndarray:
  """The cumulative law of ranks 0..vocab-1 under Zipf(``alpha``)."""
  cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -alpha)
  return cdf / cdf[-1]


def zipf_ranks(cdf: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
  """``n`` ranks drawn from ``cdf`` (:func:`zipf_cdf`)."""
  return np.minimum(np.searchsorted(cdf, rng.random(n)), cdf.shape[0] - 1)


def zipf_batches(
  n: int, vocab: int, alpha: float, batch: int, features: int, seed: int = 0
) -> List[Dict[str, np.ndarray]]:
  """``n`` batches; per batch, per table ``tNN``: the distinct ids of ``batch`` Zipf draws (deterministic in seed)."""
  cdf = zipf_cdf(vocab, alpha)
  out = []
  for b in range(n):
    rng = np.random.default_rng([seed, b])
    out.append({f"t{f:02d}": np.unique(hashed(zipf_ranks(cdf, batch, rng), f)) for f in range(features)})
  return out


def join_rows(columns: List[np.ndarray], sep: str) -> bytes:
  """Joins string columns (equal length) into lines of text, one record a line."""
  rows = zip(*(c.tolist() for c in columns))
  return "".join(sep.join(r) + "\n" for r in rows).encode()


def criteo_text(n: int, rng: np.random.Generator) -> bytes:
  """``n`` Criteo records: label, 13 integers, 26 hex ids; some values missing or negative."""
  cols = [np.where(rng.random(n) < 0.25, "1", "0")]
  for _ in range(13):
    v = (rng.pareto(1.0, n) * 3).astype(np.int64)
    v = np.where(rng.random(n) < 0.05, -rng.integers(1, 4, n), v)
    cols.append(np.where(rng.random(n) < 0.2, "", v.astype(str)))
  for _ in range(26):
    vocab = rng.integers(0, 2**32, 50_000)
    ids = np.char.mod("%08x", vocab[np.minimum(rng.zipf(1.2, n), vocab.shape[0]) - 1])
    cols.append(np.where(rng.random(n) < 0.1, "", ids))
  return join_rows(cols, "\t")


def avazu_text(n: int, rng: np.random.Generator) -> bytes:
  """A header and ``n`` Avazu records shaped like the published ones (``recsys_jax.data.avazu.HEADER``)."""
  from recsys_jax.data.avazu import HEADER

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
  return (",".join(HEADER) + "\n").encode() + join_rows(cols, ",")
