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


def best_of(fn: Callable[[], object], repeats: int) -> float:
  """The shortest wall time of ``repeats`` calls of ``fn``, in seconds: the run least disturbed by the machine."""
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times)


def quantiles(xs: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> Dict[str, float]:
  """``{"p50": .., "p95": .., "p99": .., "max": ..}`` of ``xs`` (NaN each when empty)."""
  a = np.asarray(xs, np.float64)
  out = {f"p{q:g}": float(np.percentile(a, q)) if a.size else float("nan") for q in qs}
  out["max"] = float(a.max()) if a.size else float("nan")
  return out


def fmt(x: Optional[float], spec: str, none: str = "-") -> str:
  """``format(x, spec)``, or ``none`` for a missing figure."""
  return none if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, spec)


__all__: List[str] = ["best_of", "fmt", "median", "median_of", "medians", "quantiles"]
