"""Table and feature specs: which tables exist and which sparse features read them."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence, Tuple

import ml_dtypes
import numpy as np

_NUMPY_DTYPES = {
  "float32": np.dtype(np.float32),
  "bfloat16": np.dtype(ml_dtypes.bfloat16),
  "float16": np.dtype(np.float16),
}
STORAGE_DTYPES = tuple(_NUMPY_DTYPES)
"""Row storage dtypes a table may use (optimizer state is always float32)."""


def storage_numpy_dtype(name: str) -> np.dtype:
  """The numpy dtype of the row storage dtype ``name`` (one of ``STORAGE_DTYPES``)."""
  if name not in _NUMPY_DTYPES:
    raise ValueError(f"row storage dtype {name!r}: use one of {STORAGE_DTYPES}")
  return _NUMPY_DTYPES[name]


class SpecError(ValueError):
  """A spec field with a wrong value; ``field`` names it (callers map it to their config)."""

  def __init__(self, spec: str, field: str, value: Any, why: str):
    super().__init__(f"{spec}: {field} = {value!r}: {why}")
    self.field, self.value, self.why = field, value, why


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec:
  """One embedding table held by the parameter server."""

  name: str
  """Unique table name; also seeds the row initialiser."""
  dim: int
  """Row width."""
  optimizer: str = "adagrad"
  """Row optimizer name (``async_ps.optimizers.make``)."""
  optimizer_kwargs: Tuple[Tuple[str, Any], ...] = (("learning_rate", 0.05),)
  """Hyper-parameters of the row optimizer, as (name, value) pairs (hashable)."""
  initializer: str = "uniform"
  """'uniform', 'normal' or 'zeros'; drawn from (table, id, seed)."""
  init_scale: float = 0.05
  """Half-width (uniform) or std (normal) of the initial rows."""
  storage_dtype: str = "float32"
  """Row storage: 'float32', 'bfloat16' or 'float16' (optimizer slots stay float32)."""
  capacity: int = 0
  """Rows held in RAM over all shards (0: unbounded). Beyond it rows are evicted: spilled
  to the disk tier if there is one, dropped otherwise."""
  eviction: str = "lru"
  """'lru' (least recently looked up) or 'lfu' (fewest lookups, ties by recency)."""
  expire_after: int = 0
  """Drop rows not looked up for this many steps (0: never)."""
  admit_after: int = 1
  """Create a row only once its id has been seen this many times (1: at once; at most 255)."""
  admit_probability: float = 1.0
  """Create a row for an unseen id with this probability per lookup."""
  admission_sketch_width: int = 1 << 16
  """Columns of the count-min sketch (4 rows of uint8) that counts ids for ``admit_after``."""

  def __post_init__(self):
    def bad(field, why):
      raise SpecError(f"TableSpec {self.name!r}", field, getattr(self, field), why)

    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"TableSpec.name must be a non-empty string, got {self.name!r}")
    # Types first (a spec may come from a remote client's JSON): then the comparisons below are defined.
    for field in ("dim", "capacity", "expire_after", "admit_after", "admission_sketch_width"):
      v = getattr(self, field)
      if not isinstance(v, int) or isinstance(v, bool):
        bad(field, "must be an integer")
    for field in ("init_scale", "admit_probability"):
      v = getattr(self, field)
      if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        bad(field, "must be a finite number")
    for field in ("optimizer", "initializer", "storage_dtype", "eviction"):
      if not isinstance(getattr(self, field), str):
        bad(field, "must be a string")
    if self.dim <= 0:
      bad("dim", "must be positive")
    if self.storage_dtype not in STORAGE_DTYPES:
      bad("storage_dtype", f"must be one of {STORAGE_DTYPES}")
    if self.capacity < 0:
      bad("capacity", "must be >= 0")
    if self.eviction not in ("lru", "lfu"):
      bad("eviction", "must be 'lru' or 'lfu'")
    if self.expire_after < 0:
      bad("expire_after", "must be >= 0")
    if not 1 <= self.admit_after <= 255:
      bad("admit_after", "must be in [1, 255]")
    if not 0.0 < self.admit_probability <= 1.0:
      bad("admit_probability", "must be in (0, 1]")
    if self.admission_sketch_width < 1:
      bad("admission_sketch_width", "must be positive")

  @property
  def numpy_dtype(self) -> np.dtype:
    """The rows' storage as a numpy dtype (``storage_dtype``)."""
    return _NUMPY_DTYPES[self.storage_dtype]

  @property
  def admits_selectively(self) -> bool:
    """Whether an unseen id may be refused a row: only after ``admit_after`` sightings, or with
    ``admit_probability`` < 1."""
    return self.admit_after > 1 or self.admit_probability < 1.0

  @property
  def bounded(self) -> bool:
    """Whether the table has bounds: a capacity, an expiry, or selective admission. Its bounds
    decide from every lookup of its rows (last-seen step, use count, the admission sketch)."""
    return bool(self.capacity or self.expire_after or self.admits_selectively)


COMBINERS = ("sum", "mean", "sqrtn")
KINDS = ("pooled", "sequence")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSpec:
  """One sparse input feature: up to ``max_len`` ids looked up in ``table``.

  A 'pooled' feature is a bag: the model gets one [B, D] vector, the combination of its rows
  weighted by the per-id weights (1 unless the reader gives them). A 'sequence' feature keeps
  its order: the model gets [B, max_len, D] rows and a [B, max_len] mask (padding False).
  """

  name: str
  """Name of the feature in the batch's ``sparse`` dict."""
  table: str
  """Name of the table it reads (tables may be shared by several features)."""
  max_len: int = 1
  """Ids per example (1: one-hot; more: multi-hot or sequence, padded with weight 0)."""
  combiner: str = "sum"
  """How a bag is pooled: 'sum', 'mean' (weights / their sum) or 'sqrtn' (weights / the
  root of their sum of squares); unused for sequences."""
  kind: str = "pooled"
  """'pooled' or 'sequence'."""

  def __post_init__(self):
    def bad(field, why):
      raise SpecError(f"FeatureSpec {self.name!r}", field, getattr(self, field), why)

    if self.max_len <= 0:
      bad("max_len", "must be positive")
    if self.combiner not in COMBINERS:
      bad("combiner", f"must be one of {COMBINERS}")
    if self.kind not in KINDS:
      bad("kind", f"must be one of {KINDS}")


def check_specs(tables: Sequence[TableSpec], features: Sequence[FeatureSpec]) -> Mapping[str, TableSpec]:
  """Validates that names are unique and every feature's table exists; returns tables by name."""
  by_name = {}
  for t in tables:
    if t.name in by_name:
      raise ValueError(f"table {t.name!r} is declared twice")
    by_name[t.name] = t
  seen = set()
  for f in features:
    if f.name in seen:
      raise ValueError(f"feature {f.name!r} is declared twice")
    seen.add(f.name)
    if f.table not in by_name:
      raise ValueError(f"feature {f.name!r} reads table {f.table!r}, which is not declared")
  return by_name
