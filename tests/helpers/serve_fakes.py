"""A small model for testing the serving front: a logistic model over dense floats and hashed strings.

``LinearScorer`` keeps the ``serving.api.Scorer`` contract (validation with ``RequestError``
naming record and field, encode/concat/predict) and its weights are drawn from its step, so
each version scores differently and ``reference`` (a plain float64 loop) says what a given
version must answer for a record: a response whose scores do not all match the version it
names mixed versions.

A "workdir" of this model holds files ``ckpt-<step>`` (JSON options: ``broken``: the load
fails; ``delay_s``: predict sleeps that long; ``load_s``: loading takes that long).
``load_scorer``/``newest_step`` here have the signatures of ``recsys_jax.serving.scorer``'s, so
``python -m recsys_jax.serve --model_module=tests.helpers.serve_fakes`` serves it.
"""

from __future__ import annotations

import json
import math
import os
import time
import zlib
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from recsys_jax.serving.api import RequestError

DENSE = ("i1", "i2", "i3")
CATS = ("c1", "c2")
BUCKETS = 1000


def _names(n_dense: int, n_cat: int):
  return tuple(f"i{k + 1}" for k in range(n_dense)), tuple(f"c{k + 1}" for k in range(n_cat))


def _weights(step: int, n_dense: int = len(DENSE), n_cat: int = len(CATS)):
  rng = np.random.default_rng(step)
  return rng.standard_normal(n_dense) * 0.5, rng.standard_normal((n_cat, BUCKETS)), float(rng.standard_normal())


def _bucket(s: str) -> int:
  return zlib.crc32(s.encode("utf-8")) % BUCKETS


class LinearScorer:
  """Fields ``i1..i<n_dense>`` (floats) and ``c1..c<n_cat>`` (strings); 3 and 2 unless told."""

  def __init__(self, step: int, delay_s: float = 0.0, n_dense: int = len(DENSE), n_cat: int = len(CATS)):
    self.step, self.version, self.delay_s = step, f"step-{step}", delay_s
    self._wd, self._wc, self._b = _weights(step, n_dense, n_cat)
    self._dense, self._cats = _names(n_dense, n_cat)
    self.predict_calls = 0
    self.predicted = []  # records of each predict call

  def fields(self) -> Dict[str, str]:
    return {**{f: "float" for f in self._dense}, **{f: "string" for f in self._cats}}

  def encode(self, records: Sequence[Mapping[str, Any]]):
    DENSE, CATS = self._dense, self._cats  # noqa: N806 - as the module's defaults
    known = set(DENSE) | set(CATS)
    dense = np.zeros((len(records), len(DENSE)))
    cats = np.zeros((len(records), len(CATS)), np.int64)
    for i, r in enumerate(records):
      for k in r:
        if k not in known:
          raise RequestError("unknown feature", field=k, record=i)
      for j, f in enumerate(DENSE):
        if f not in r:
          raise RequestError("missing feature", field=f, record=i)
        v = r[f]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
          raise RequestError(f"must be a finite number, got {type(v).__name__}", field=f, record=i)
        dense[i, j] = v
      for j, f in enumerate(CATS):
        if f not in r:
          raise RequestError("missing feature", field=f, record=i)
        if not isinstance(r[f], str):
          raise RequestError(f"must be a string, got {type(r[f]).__name__}", field=f, record=i)
        cats[i, j] = _bucket(r[f])
    return dense, cats

  def concat(self, encoded: Sequence[Any]):
    return np.concatenate([e[0] for e in encoded]), np.concatenate([e[1] for e in encoded])

  def predict(self, encoded) -> np.ndarray:
    if isinstance(encoded, list):  # raw records, as the Scorer protocol allows
      encoded = self.encode(encoded)
    self.predict_calls += 1
    self.predicted.append(len(encoded[0]))
    if self.delay_s:
      time.sleep(self.delay_s)
    dense, cats = encoded
    logit = dense @ self._wd + self._b + sum(self._wc[j, cats[:, j]] for j in range(len(self._cats)))
    return (1.0 / (1.0 + np.exp(-logit))).astype(np.float32)


def reference(step: int, record: Mapping[str, Any]) -> float:
  """What version ``step`` must answer for ``record``: a plain float64 loop."""
  dense, cats = _names(sum(k[0] == "i" for k in record), sum(k[0] == "c" for k in record))
  wd, wc, b = _weights(step, len(dense), len(cats))
  z = b
  for j, f in enumerate(dense):
    z += float(record[f]) * wd[j]
  for j, f in enumerate(cats):
    z += wc[j, _bucket(record[f])]
  return 1.0 / (1.0 + math.exp(-z))


def records(n: int, seed: int = 0, n_dense: int = len(DENSE), n_cat: int = len(CATS)) -> List[Dict[str, Any]]:
  dense, cats = _names(n_dense, n_cat)
  rng = np.random.default_rng(seed)
  return [
    {**{f: float(np.round(rng.standard_normal(), 3)) for f in dense}, **{f: f"v{rng.integers(50)}" for f in cats}}
    for _ in range(n)
  ]


def publish(workdir: str, step: int, **options: Any) -> None:
  """Writes checkpoint ``step`` (atomically: a reader never sees half a file)."""
  tmp = os.path.join(workdir, f".tmp-{step}")
  with open(tmp, "w") as f:
    json.dump(options, f)
  os.replace(tmp, os.path.join(workdir, f"ckpt-{step}"))


def newest_step(workdir: str) -> Optional[int]:
  steps = [int(n[5:]) for n in os.listdir(workdir) if n.startswith("ckpt-")]
  return max(steps) if steps else None


def complete_steps(workdir: str) -> List[int]:
  return sorted((int(n[5:]) for n in os.listdir(workdir) if n.startswith("ckpt-")), reverse=True)


def step_signature(workdir: str, step: int):
  st = os.stat(os.path.join(workdir, f"ckpt-{step}"))
  return st.st_size, st.st_mtime_ns, st.st_ino


def load_scorer(workdir: str, step: Optional[int] = None) -> LinearScorer:
  step = newest_step(workdir) if step is None else step
  with open(os.path.join(workdir, f"ckpt-{step}")) as f:
    options = json.load(f)
  if options.get("broken"):
    raise ValueError(f"checkpoint {step} is broken")
  time.sleep(options.get("load_s", 0.0))
  return LinearScorer(
    step, options.get("delay_s", 0.0), options.get("n_dense", len(DENSE)), options.get("n_cat", len(CATS))
  )


def main(argv: Sequence[str]) -> None:
  """A trainer's stand-in: ``python tests/helpers/serve_fakes.py WORKDIR EVERY_S COUNT [N_DENSE N_CAT]`` publishes
  COUNT new checkpoints, one every EVERY_S seconds, after the newest one there."""
  workdir, every_s, count = argv[0], float(argv[1]), int(argv[2])
  shape = {"n_dense": int(argv[3]), "n_cat": int(argv[4])} if len(argv) > 3 else {}
  for _ in range(count):
    time.sleep(every_s)
    publish(workdir, (newest_step(workdir) or 0) + 100, **shape)


if __name__ == "__main__":
  import sys

  main(sys.argv[1:])
