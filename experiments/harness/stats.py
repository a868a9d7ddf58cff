"""Summary statistics over repeated runs: medians that skip missing figures, best-of timing, quantiles."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

import numpy as np


def median(xs: Iterable[Optional[float]]) -> float:
  """The median of the figures that are there (``None`` and NaN skipped); NaN when none is."""
  vals = [float(x) for x in xs if x is not None and not np.isnan(x)]
  return float(np.median(vals)) if vals else float("nan")


def median_of(runs: Sequence[Mapping[str, Any]], key: str) -> float:
  """The median over runs of one figure (see :func:`median`); a run without ``key`` counts as missing."""
  return median(r.get(key) for r in runs)


def medians(runs: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
  """The last run with each float figure replaced by its median over all runs (lists and counters: the last run's)."""
  out = dict(runs[-1])
  for k, v in runs[-1].items():
    if isinstance(v, float):
      out[k] = median_of(runs, k)
  return out


def best_of(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
  """The shortest time of ``repeats`` calls of ``fn``, in seconds: the run least disturbed by the machine.
  ``clock``: wall time by default; ``time.thread_time`` counts this thread's CPU."""
  times = []
  for _ in range(repeats):
    t0 = clock()
    fn()
    times.append(clock() - t0)
  return min(times)


def interleaved(ways: Mapping[str, Callable[[], object]], repeats: int) -> Dict[str, Dict[str, float]]:
  """Calls each of ``ways`` in turn, ``repeats`` rounds, so that a changing load falls on all alike: per
  way, the median seconds of wall time (``wall``), this thread's CPU (``thread``) and the process's (``process``)."""
  runs: Dict[str, List[Dict[str, float]]] = {k: [] for k in ways}
  clocks = {"wall": time.perf_counter, "thread": time.thread_time, "process": time.process_time}
  for _ in range(repeats):
    for k, fn in ways.items():
      t0 = {c: clock() for c, clock in clocks.items()}
      fn()
      runs[k].append({c: clock() - t0[c] for c, clock in clocks.items()})
  return {k: {c: median_of(v, c) for c in clocks} for k, v in runs.items()}


def quantiles(xs: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> Dict[str, float]:
  """``{"p50": .., "p95": .., "p99": .., "max": ..}`` of ``xs`` (NaN each when empty)."""
  a = np.asarray(xs, np.float64)
  out = {f"p{q:g}": float(np.percentile(a, q)) if a.size else float("nan") for q in qs}
  out["max"] = float(a.max()) if a.size else float("nan")
  return out


def intervals(records: Sequence[Mapping[str, Any]], after: int = 0, upto: float = float("inf")) -> List[tuple]:
  """(steps, record) of a run's train records (``train.read_metrics``) whose interval, the steps since
  the record before, lies in (``after``, ``upto``]: each record's figures are over its interval."""
  out, prev = [], 0
  for r in records:
    if after <= prev and r["step"] <= upto:
      out.append((r["step"] - prev, r))
    prev = r["step"]
  return out


def per_step(ivs: Sequence[tuple], key: str, missing: float = float("nan")) -> float:
  """``key`` of :func:`intervals`' records averaged per step, each record weighed by its steps
  (``missing`` where one lacks it: NaN, or 0 for a count a record leaves out when it is 0)."""
  return sum(k * r.get(key, missing) for k, r in ivs) / max(1, sum(k for k, _ in ivs))


def fmt(x: Optional[float], spec: str, none: str = "-") -> str:
  """``format(x, spec)``, or ``none`` for a missing figure."""
  return none if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, spec)


__all__: List[str] = [
  "best_of",
  "fmt",
  "interleaved",
  "intervals",
  "median",
  "median_of",
  "medians",
  "per_step",
  "quantiles",
]
