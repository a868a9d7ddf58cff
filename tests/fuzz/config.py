"""Fuzz target 'config': ``validate_config`` and the builders it guards, on mutated ``configs/tiny.py``.

An input changes one or two fields of ``configs/tiny.py`` (any leaf, or a new key under
``model.kwargs`` or ``embeddings.features.<feature>``) to a value of the wrong type (None, a bool,
a string, a tuple, a dict), a negative, zero or huge number (2**31, 2**62, 10**30, inf, NaN), an
unknown name, or an empty tuple, assigned as a config file or a ``--config.x=`` override would
(ml_collections' own type check refuses some: a TypeError naming the field, counted as clear).

Correct: ``validate_config`` raises a ValueError whose message names a changed field, or
passes; then, for one input in ``BUILD_EVERY`` (the expensive part: a compile), the job is built
and trained for 1 step with 1 eval batch (``train_and_evaluate`` with ``num_steps=1`` and
``eval_samples = eval_batch_size``) in a fresh workdir, which must finish or raise a ValueError
naming a changed field. A traceback from inside jax, flax, numpy or the PS is a crash.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from typing import Any, List

from hypothesis import strategies as st

from .harness import Crash, Target, clear_error

BUILD_EVERY = 8
FEATURE_KEYS = ("table", "dim", "combiner", "kind", "bogus")

# One flat list, so that hypothesis draws each about as often (it favours a one_of's first branch).
VALUES = st.sampled_from(
  [0, -1, 1, 2, 3, 7, 64, 2**31, 2**62, 10**30, -(2**63), True, False, None]
  + [0.0, -1.0, 0.5, 1.5, 1e30, math.inf, -math.inf, math.nan]
  + ["", "nope", "1", "adam", "sgd", "lru", "sum", "mlp", "fsdp", "float16", "criteo", "pinned_host"]
  + [(), (0,), (-1,), (1, 2), (16, 8), (("mlp", "fsdp"),), (("mlp",),), ("a", "b"), ((1, 2, 3),)]
  + [{}, {"dim": 4}, {"nope": 1}]
)


def leaves(config, prefix: str = "") -> List[str]:
  """Dotted paths of every leaf of a ConfigDict (empty ConfigDicts count as leaves)."""
  out = []
  for k, v in config.items():
    path = f"{prefix}{k}"
    if hasattr(v, "items") and len(v):
      out += leaves(v, path + ".")
    else:
      out.append(path)
  return out


@st.composite
def mutation(draw, paths: List[str], features: List[str]):
  where = draw(st.integers(0, 9))
  if where == 0:
    path = f"model.kwargs.{draw(st.sampled_from(['bottom', 'top', 'bogus', 'low_rank']))}"
  elif where == 1:
    path = f"embeddings.features.{draw(st.sampled_from(features + ['nope']))}.{draw(st.sampled_from(FEATURE_KEYS))}"
  else:
    path = draw(st.sampled_from(paths))
  return [path, draw(VALUES)]


def assign(config, path: str, value: Any) -> None:
  """Sets a dotted path as a config file would (creating ConfigDicts under features/kwargs)."""
  import ml_collections

  parts = path.split(".")
  obj = config
  for p in parts[:-1]:
    if p not in obj:
      obj[p] = ml_collections.ConfigDict()
    obj = obj[p]
  obj[parts[-1]] = value


class ConfigTarget(Target):
  name = "config"
  deadline_s = 10.0
  memory_limit_gib = 10.0  # jax runs under it; a size that asks for more fails instead of swapping the host
  build_deadline_s = 300.0  # a build compiles the train and eval steps: ~30 s alone, far more on 2 loaded cores

  def setup(self, workdir: str) -> None:
    from configs import tiny
    from recsys_jax.data import readers
    from recsys_jax.training import validation  # noqa: F401 - imports jax once, outside any input

    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    config = tiny.get_config()
    self.paths = leaves(config)
    self.features = [f.name for f in readers.build_reader(config).schema.features]

  def strategy(self):
    return st.fixed_dictionaries(
      {
        "mutations": st.lists(mutation(self.paths, self.features), min_size=1, max_size=2),
        # Not x == 0: hypothesis draws 0, the simplest integer, far more often than 1 in BUILD_EVERY.
        "build": st.integers(0, 2**32).map(lambda x: x % BUILD_EVERY == BUILD_EVERY - 1),
      }
    )

  def deadline_for(self, case) -> float:
    return self.build_deadline_s if case["build"] else self.deadline_s

  def run(self, case) -> str:
    from configs import tiny
    from recsys_jax import train
    from recsys_jax.training.validation import validate_config

    config = tiny.get_config()
    names = []  # what an error may name: a changed field, or the dict it is in (an unknown feature)
    for path, value in case["mutations"]:
      parts = path.split(".")
      names += [parts[-1]] + [".".join(parts[:k]) for k in range(2, len(parts))]
      try:
        assign(config, path, value)
      except (TypeError, ValueError) as e:  # ml_collections' type check: the field is named
        return clear_error(e, [TypeError, ValueError], [path.split(".")[-1]], f"assigning {path}")
    where = f"config with {case['mutations']}"
    try:
      validate_config(config)
    except Exception as e:  # noqa: BLE001 - classified here
      clear_error(e, [ValueError], [f"{n}" for n in names], f"validate_config ({where})")
      if "config." not in str(e):
        raise Crash(f"validate_config ({where}): the message does not say config.<field>: {str(e)[:300]}") from None
      return "clear"
    if not case["build"]:
      return "accepted"
    config.num_steps = 1
    if config.data.name == "synthetic":
      config.eval_samples = config.eval_batch_size
    d = tempfile.mkdtemp(dir=self.workdir)
    self.note = "built"
    try:
      train.train_and_evaluate(config, d)
    except Exception as e:  # noqa: BLE001 - classified here
      clear_error(e, [ValueError], names, f"1-step job ({where})")
      return "clear"
    finally:
      shutil.rmtree(d, ignore_errors=True)
    return "accepted"
