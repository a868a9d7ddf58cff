"""The synthetic generator's ms per batch: this checkout's ``SyntheticData.batch`` against an older one.

    python experiments/bench_synthetic.py [--baseline_rev=REV] [--batch_size=4096] [--rounds=5] [--batches=20]
        [--config=default|drift|multi_hot] [--json_out=FILE]

Loads ``recsys_jax/data/synthetic.py`` as it was at git revision ``--baseline_rev`` beside the
current one, checks that both return the same batches bit for bit, and times them alternated in one
thread: ``--rounds`` rounds of ``--batches`` batches from the old generator, then the same from the
new (after 3 warm-up batches each). Prints the median ms per batch of each and their ratio; the last
stdout line is one JSON object.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types

import numpy as np
from absl import app, flags
from harness import outputs, stats

from recsys_jax.data import synthetic

_REV = flags.DEFINE_string("baseline_rev", "4983112", "Git revision whose synthetic.py is the baseline.")
_BATCH = flags.DEFINE_integer("batch_size", 4096, "Records per batch.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Alternated rounds (old, then new); the median is reported.")
_BATCHES = flags.DEFINE_integer("batches", 20, "Batches per round and generator.")
_CONFIG = flags.DEFINE_enum("config", "default", ["default", "drift", "multi_hot"], "The SyntheticConfig.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON result here.")

_CONFIGS = {
  "default": {},
  "drift": {"drift_records": 100_000},
  "multi_hot": {"multi_hot": (3,) * len(synthetic.DEFAULT_VOCAB)},
}


def _load_old(rev: str):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p = subprocess.run(["git", "show", f"{rev}:recsys_jax/data/synthetic.py"], cwd=root, capture_output=True, text=True)
  if p.returncode != 0:
    sys.exit(f"bench_synthetic: cannot read recsys_jax/data/synthetic.py at --baseline_rev={rev}: {p.stderr.strip()}")
  module = types.ModuleType("synthetic_baseline")
  sys.modules[module.__name__] = module  # dataclasses look their module up there
  exec(compile(p.stdout, f"{rev}:recsys_jax/data/synthetic.py", "exec"), module.__dict__)
  return module


def _same(a, b) -> bool:
  if isinstance(a, dict):
    return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
  return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def main(argv):
  del argv
  old_mod = _load_old(_REV.value)
  kw = _CONFIGS[_CONFIG.value]
  old = old_mod.SyntheticData(old_mod.SyntheticConfig(**kw))
  new = synthetic.SyntheticData(synthetic.SyntheticConfig(**kw))
  B, n = _BATCH.value, _BATCHES.value
  for i in range(3):
    if not _same(old.batch(synthetic.TRAIN, i, B), new.batch(synthetic.TRAIN, i, B)):
      sys.exit(f"bench_synthetic: batch {i} differs between {_REV.value} and this checkout")
  ms = {"old": [], "new": []}
  for r in range(_ROUNDS.value):
    for name, gen in (("old", old), ("new", new)):
      t = time.perf_counter()
      for i in range(n):
        gen.batch(synthetic.TRAIN, 100 + r * n + i, B)
      ms[name].append((time.perf_counter() - t) / n * 1e3)
  out = {
    "config": _CONFIG.value,
    "batch_size": B,
    "baseline_rev": _REV.value,
    "old_ms_per_batch": stats.median(ms["old"]),
    "new_ms_per_batch": stats.median(ms["new"]),
    "old_rounds_ms": ms["old"],
    "new_rounds_ms": ms["new"],
  }
  out["speedup"] = out["old_ms_per_batch"] / out["new_ms_per_batch"]
  print(
    f"{_CONFIG.value}, batch {B}: {_REV.value} {out['old_ms_per_batch']:.2f} ms, this checkout "
    f"{out['new_ms_per_batch']:.2f} ms per batch (median of {_ROUNDS.value} rounds of {n}): {out['speedup']:.2f}x"
  )
  print(json.dumps(out))
  if _JSON_OUT.value:
    outputs.write_json(_JSON_OUT.value, out)


if __name__ == "__main__":
  app.run(main)
