"""The scoring half every scorer shares: encoded records -> padded buckets -> rows -> forward.

A batch of n records is padded to the next power of two (1, 2, 4, ... ``max_batch``; longer
batches are scored ``max_batch`` records at a time) with copies of its first record, and each
row-width group's distinct rows to the next power of two (at least 16), so the jitted forward
is compiled once per (batch bucket, rows bucket) and never per request. The forward reads
only rows of real ids and each record's score depends on that record alone (the models here
have no batch statistics at inference), so the padding changes no score; the tests check it.

The dedup is the trainer's (``recsys_jax.embeddings.dedup.dedup``), so the rows array and
inverse index have the layout the training eval step reads.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from recsys_jax.data import base
from recsys_jax.embeddings import dedup as dedup_lib
from recsys_jax.embeddings.specs import FeatureSpec, TableSpec
from recsys_jax.serving.api import RequestError
from recsys_jax.serving.encode import Encoder

MIN_ROWS_BUCKET = 16


def pow2(n: int, least: int = 1) -> int:
  """The smallest power of two >= max(n, least)."""
  n = max(int(n), least)
  return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class _Dim:
  dim: int
  weighted: bool  # some feature of the group has more than one id: pooling weights are always passed


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
  """A checkpoint of a training run, loaded for serving (``scorer.load_scorer``): what the
  ``BatchScorer`` built from it receives, for what comes after the load (exporting an
  artifact, following published deltas, reporting)."""

  workdir: str
  """The run's directory (absolute)."""
  step: int
  """The checkpoint's step: the version of its rows and of its dense parameters."""
  chain: Tuple[str, ...]
  """The PS snapshot chain its rows come from, oldest first, in the workdir."""
  params: Any
  """The dense parameters (host arrays)."""
  config: Any
  """The run's config (``run_config.load``: an older run's lacks nothing)."""
  schema: Any
  """The reader's schema (the records' fields)."""
  table_specs: Tuple[TableSpec, ...]
  """The tables, as the trainer built them."""
  model: Any
  """The flax model."""
  eval_step: Callable[..., Dict[str, Any]]
  """``(params, rows, batch) -> {"logits", ...}``, the trainer's evaluation step (not jitted)."""
  step_fn: Callable[..., Dict[str, Any]]
  """``eval_step`` jitted: what the scorer's forward calls."""
  encoder_data: Dict[str, Any]
  """The config's data section as plain JSON types (what an artifact's encoder is built from)."""
  load_s: float
  """Seconds the load took."""


@dataclasses.dataclass
class Encoded:
  """Checked, parsed records (``Scorer.encode``): the reader's columns."""

  cols: base.Columns

  def __len__(self) -> int:
    return int(self.cols["dense"].shape[0])


class BatchScorer:
  """A ``Scorer`` (``recsys_jax.serving.api``) from its parts; immutable once built.

  Args:
    version: e.g. ``"step-200"``.
    encoder: parses records.
    features: the feature specs in model order (linear-term features included).
    table_dims: table name -> row width.
    aliases: feature -> the feature whose ids it reads (models with first-order terms).
    rows: a ``recsys_jax.serving.rows.snapshot_rows.SnapshotRows`` (``lookup_many``).
    forward: ``(rows: {str(dim): [U, dim]}, batch: {"dense", "inverse", "weights"}) -> logits [B]``.
    max_batch: the most records one ``predict`` call pads to (a power of two); more are split.
    checkpoint: the training checkpoint it was loaded from (``scorer.load_scorer``); None for an
      exported artifact's.
    params: the dense parameters ``forward`` scores with (None: not known here).
    chain: the PS snapshot chain its rows come from.
    traces: compilations of its forward so far, by kind (``"eval"``), a dict the forward updates.

  A version derived from it (``derive``) may change these and what the fresh-rows follower keeps
  (``recsys_jax.serving.fresh``): ``base``, the checkpoint's scorer its rows build on, and
  ``last_seq``, the last delta applied.
  """

  def __init__(
    self,
    version: str,
    encoder: Encoder,
    features: Sequence[FeatureSpec],
    table_dims: Mapping[str, int],
    aliases: Mapping[str, str],
    rows,
    forward: Callable[[Dict[str, Any], Dict[str, Any]], Any],
    max_batch: int = 512,
    checkpoint: Optional[LoadedCheckpoint] = None,
    params: Any = None,
    chain: Sequence[str] = (),
    traces: Optional[Dict[str, int]] = None,
  ):
    if max_batch < 1 or max_batch & (max_batch - 1):
      raise ValueError(f"max_batch = {max_batch} must be a power of two")
    self.version = version
    self.dense_version: Optional[int] = None  # the step of the dense parameters (None: not known)
    self.row_version: Optional[int] = None  # the step of the rows (None: not known)
    self.encoder = encoder
    self.features = tuple(features)
    self.table_dims = dict(table_dims)
    self._tables: Dict[str, Any] = {t: types.SimpleNamespace(dim=d) for t, d in self.table_dims.items()}  # for dedup
    self.aliases = dict(aliases)
    self.rows = rows
    self.forward = forward
    self.max_batch = int(max_batch)
    self.checkpoint = checkpoint
    self.params = params
    self.chain = tuple(chain)
    self.traces: Dict[str, int] = {} if traces is None else traces
    self.base: Optional["BatchScorer"] = None
    self.last_seq: Optional[int] = None
    groups: Dict[int, _Dim] = {}
    for f in self.features:
      d = self.table_dims[f.table]
      groups[d] = _Dim(d, groups.get(d, _Dim(d, False)).weighted or f.max_len > 1)
    self.groups = groups

  def derive(self, version: str, rows=None, forward=None, **attrs) -> "BatchScorer":
    """A new version that shares everything with this one but ``rows`` and ``forward`` (when given)
    and the attributes ``attrs`` (declared ones only: a misspelt name is an error, not a new
    attribute): this one is not changed (a batch scoring with it goes on)."""
    unknown = sorted(k for k in attrs if not hasattr(self, k) or k.startswith("_"))
    if unknown:
      raise AttributeError(f"BatchScorer.derive: no attribute {unknown} to set")
    new = copy.copy(self)
    new.version = version
    if rows is not None:
      new.rows = rows
    if forward is not None:
      new.forward = forward
    for k, v in attrs.items():
      setattr(new, k, v)
    return new

  def fields(self) -> Dict[str, str]:
    return self.encoder.fields()

  def encode(self, records: Sequence[Mapping[str, Any]]) -> Encoded:
    if isinstance(records, (list, tuple)) and len(records) > self.max_batch:
      raise RequestError(f"{len(records)} records in one request; at most {self.max_batch} (max_batch)")
    return Encoded(self.encoder.encode(records))

  def concat(self, encoded: Sequence[Encoded]) -> Encoded:
    if not encoded:
      raise ValueError("nothing to concatenate")
    return Encoded(base.concat_columns([e.cols for e in encoded]))

  def predict(self, encoded: Union[Encoded, Sequence[Mapping[str, Any]]]) -> np.ndarray:
    if not isinstance(encoded, Encoded):  # raw records (a notebook's list of dicts): any number of them
      if not isinstance(encoded, (list, tuple)):
        raise TypeError(
          f"predict takes records (a list of dicts) or encode(records)'s result, not {type(encoded).__name__}"
        )
      parts = [self.encode(encoded[a : a + self.max_batch]) for a in range(0, len(encoded), self.max_batch)]
      if not parts:
        return np.zeros(0, np.float32)
      encoded = self.concat(parts)
    n = len(encoded)
    out = np.empty(n, np.float32)
    for a in range(0, n, self.max_batch):
      part = base.take_columns(encoded.cols, slice(a, a + self.max_batch))
      out[a : a + self.max_batch] = self._predict(part)
    return out

  def prepare(self, cols: base.Columns):
    """(rows, batch, n) for the forward: ``cols`` padded to its bucket, deduplicated, rows looked up."""
    n = int(cols["dense"].shape[0])
    size = pow2(n)
    if size != n:
      cols = base.take_columns(cols, np.concatenate([np.arange(n), np.zeros(size - n, np.int64)]))
    sparse, weights = dedup_lib.aliased(cols, self.aliases)
    groups = dedup_lib.dedup(sparse, self.features, self._tables, weights)
    wanted, into, rows = {}, {}, {}
    for dim, g in groups.items():
      r = np.zeros((pow2(g.num_rows, MIN_ROWS_BUCKET), dim), np.float32)
      for name, ids, off in g.tables:
        wanted[name], into[name] = ids, r[off : off + ids.shape[0]]
      rows[str(dim)] = r
    self.rows.lookup_many(wanted, out=into)
    batch: Dict[str, Any] = {
      "dense": np.asarray(cols["dense"], np.float32),
      "inverse": {str(d): g.inverse for d, g in groups.items()},
      "weights": {},
    }
    for d, g in groups.items():
      if self.groups[d].weighted:
        batch["weights"][str(d)] = g.weights if g.weights is not None else np.ones(g.inverse.shape, np.float32)
    return rows, batch, n

  def _predict(self, cols: base.Columns) -> np.ndarray:
    rows, batch, n = self.prepare(cols)
    logits = np.asarray(self.forward(rows, batch), np.float32)[:n]
    return (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)

  def cache_stats(self) -> Dict[str, int]:
    """Rows the row caches hold now and may hold, their bytes, and the index's bytes."""
    return {
      "held_rows": self.rows.held_rows(),
      "capacity_rows": self.rows.capacity_rows(),
      "held_bytes": self.rows.held_bytes(),
      "index_bytes": self.rows.index_bytes(),
    }
