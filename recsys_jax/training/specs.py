"""Table and feature specs from the reader's schema and ``config.embeddings``."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

from recsys_jax.async_ps.optim import optimizers
from recsys_jax.data.base import Schema
from recsys_jax.embeddings.specs import FeatureSpec, SpecError, TableSpec, check_specs
from recsys_jax.models.layers import LINEAR_SUFFIX

_FEATURE_OVERRIDES = ("table", "dim", "combiner", "kind")
_OVERRIDE_TYPES = {
  "table": (lambda v: isinstance(v, str) and v != "", "a non-empty table name"),
  "dim": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**31, "a positive integer"),
  "combiner": (lambda v: isinstance(v, str), "a string"),
  "kind": (lambda v: isinstance(v, str), "a string"),
}


def build_specs(config, schema: Schema, linear_terms: bool = False) -> Tuple[List[TableSpec], List[FeatureSpec], Dict]:
  """Table and feature specs from the reader's schema and ``config.embeddings``.

  Each feature reads its own table (or the one the reader names, e.g. a history of movies
  reads 'movie'), at ``embeddings.dim``, unless ``config.embeddings.features[name]`` overrides
  table, dim, combiner or kind. With ``linear_terms`` (models with first-order terms), every
  pooled feature ``f`` of table ``t`` also gets a feature ``f + LINEAR_SUFFIX`` of width 1 in
  table ``t + LINEAR_SUFFIX``, fed with the same ids.

  Returns:
    ``(tables, features, aliases)``; ``aliases`` maps each linear feature to the feature whose
    ids it reads.
  """
  e = config.embeddings
  if e.optimizer not in optimizers.NAMES:
    raise ValueError(f"config.embeddings.optimizer = {e.optimizer!r}: choose one of {list(optimizers.NAMES)}")
  accepted = optimizers.hyperparameters(e.optimizer)
  opt_kwargs = {"learning_rate": float(e.learning_rate)}
  if "initial_accumulator_value" in accepted:
    opt_kwargs["initial_accumulator_value"] = float(e.initial_accumulator_value)
  if e.clip:
    opt_kwargs["clip"] = float(e.clip)
  known = {f.name for f in schema.features}
  overrides = {}
  for name, o in dict(e.features).items():
    if name not in known:
      raise ValueError(f"config.embeddings.features.{name}: the data has no such feature; it has {sorted(known)}")
    if not hasattr(o, "items"):
      raise ValueError(f"config.embeddings.features.{name} = {o!r}: must be a dict of {_FEATURE_OVERRIDES}")
    overrides[name] = o = dict(o)
    for k, v in o.items():
      if k not in _FEATURE_OVERRIDES:
        raise ValueError(f"config.embeddings.features.{name}.{k}: unknown; choose from {_FEATURE_OVERRIDES}")
      ok, what = _OVERRIDE_TYPES[k]
      if not ok(v):
        raise ValueError(f"config.embeddings.features.{name}.{k} = {v!r}: must be {what}")
  features: List[FeatureSpec] = []
  dims: Dict[str, Tuple[int, str]] = {}
  aliases: Dict[str, str] = {}
  # The specs validate their fields (named as in config.embeddings); errors name the config field.
  try:
    for info in schema.features:
      o = overrides.get(info.name, {})
      table = o.get("table", info.table or info.name)
      dim = int(o.get("dim", e.dim))
      if dims.setdefault(table, (dim, info.name))[0] != dim:
        raise ValueError(
          f"config.embeddings.features: table {table!r} is read at dim {dims[table][0]} by feature "
          f"{dims[table][1]!r} and at dim {dim} by {info.name!r}"
        )
      try:
        f = FeatureSpec(
          name=info.name,
          table=table,
          max_len=info.max_len,
          combiner=o.get("combiner", e.combiner),
          kind=o.get("kind", info.kind),
        )
      except SpecError as err:
        if err.field in o:  # the per-feature override is at fault, not the default
          raise ValueError(f"config.embeddings.features.{info.name}.{err.field} = {err.value!r}: {err.why}") from None
        raise
      features.append(f)
    if linear_terms:
      for f in list(features):
        if f.kind == "pooled":
          lin = dataclasses.replace(f, name=f.name + LINEAR_SUFFIX, table=f.table + LINEAR_SUFFIX)
          dims.setdefault(lin.table, (1, lin.name))
          features.append(lin)
          aliases[lin.name] = f.name
    tables = [_table_spec(name, dim, e, opt_kwargs) for name, (dim, _) in dims.items()]
  except SpecError as err:
    raise ValueError(f"config.embeddings.{err.field} = {err.value!r}: {err.why}") from None
  check_specs(tables, features)
  return tables, features, aliases


def _table_spec(name: str, dim: int, e, opt_kwargs) -> TableSpec:
  return TableSpec(
    name=name,
    dim=dim,
    optimizer=e.optimizer,
    optimizer_kwargs=tuple(sorted(opt_kwargs.items())),
    initializer=e.initializer,
    init_scale=float(e.init_scale),
    storage_dtype=e.storage_dtype,
    capacity=int(e.capacity),
    eviction=e.eviction,
    expire_after=int(e.expire_after),
    admit_after=int(e.admit_after),
    admit_probability=float(e.admit_probability),
  )
