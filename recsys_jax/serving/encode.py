"""Raw request records -> the reader's columns, exactly as training read them.

A request record is a JSON object in the training data's schema: field name -> raw value. The
records are checked (every field present, no unknown field, each value of the type the format
holds, finite numbers) and then handed to the reader's own parser, so the hashing, log1p and
multi-hot padding cannot drift from what the model was trained on:

A JSON ``null`` is a missing value, for every field of a format whose files can leave one empty: it
is scored exactly as the reader scores the empty field (``tests/serving/test_encode.py`` compares
the two record by record).

- ``criteo``: ``I1``..``I13`` an int or a decimal string, ``C1``..``C26`` a hex string (``""`` or
  null: missing); each record becomes one TSV line (label 0) parsed by
  ``recsys_jax.data.criteo.CriteoFormat``.
- ``avazu``: every column of the file but ``id`` and ``click``, strings (ints accepted and
  written in decimal; null: the empty field); one CSV line each, parsed by
  ``recsys_jax.data.avazu.AvazuFormat``.
- ``csv`` / ``parquet``: the declared dense columns (number, numeric string, or null), categorical
  columns (string or int, or null) and bag columns (a list of strings/ints, or one string holding
  the separator as in the CSV, or null: an empty bag); the records become an Arrow table parsed by the same
  ``recsys_jax.data.tabular.TabularFormat`` (its Parquet path: a CSV value and the same value
  in Parquet give one id, so both file types are served the same way).
- ``synthetic``: ``dense_00``.. floats (the model's inputs as the generator makes them) and
  ``cat_00``.. uint64 ids (an int, or a list of 1..max_len ints for a multi-hot field); the
  generator has no missing values, so null is refused naming the field.
- ``movielens`` is refused: its features (the user's earlier ratings) are built from the
  whole ratings history, not from one record.

A record the parser rejects raises ``RequestError`` with the parser's reason and field.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from recsys_jax.data import base, csv_lines
from recsys_jax.serving.api import RequestError

FORMATS = ("synthetic", "criteo", "avazu", "csv", "parquet")
_UINT64_MAX = (1 << 64) - 1
_F32_MAX = float(np.finfo(np.float32).max)


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any, name: str, i: int) -> float:
  if v is None:
    raise RequestError("null: this format has no missing values for this field", name, i)
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise RequestError(f"expected a number, got {type(v).__name__} {v!r:.40}", name, i)
  try:
    x = float(v)
  except OverflowError:  # an int beyond any float
    x = math.inf
  if not math.isfinite(x):
    raise RequestError(f"{v!r:.40} is not a finite number", name, i)
  return x


def _text(v: Any, name: str, i: int, ints: bool, forbidden: str) -> str:
  """A string value (an int written in decimal where ``ints``; null: the empty field), free of the
  line format's separators."""
  if v is None:
    return ""
  if _is_int(v) and ints:
    return str(v)
  if not isinstance(v, str):
    raise RequestError(f"expected a string, got {type(v).__name__} {v!r:.40}", name, i)
  bad = [c for c in forbidden if c in v]
  if bad:
    raise RequestError(f"{bad[0]!r} cannot occur in a value of this field", name, i)
  return v


class Encoder:
  """Checks and parses records of one data format (see the module docstring).

  Args:
    data: ``config.data`` as a plain dict (an exported artifact stores it).
    schema: the reader's schema; None: derived from ``data`` (the format's own schema).
  """

  def __init__(self, data: Mapping[str, Any], schema: Optional[base.Schema] = None):
    self.name = str(data["name"])
    if self.name == "movielens":
      raise ValueError(
        "serving MovieLens models is not supported: their features (the user's earlier ratings, "
        "the movie's genres) are built from the whole ratings files, not from one request record"
      )
    if self.name not in FORMATS:
      raise ValueError(f"data {self.name!r} cannot be served; choose one of {FORMATS}")
    self.fmt: Any  # the format that parses a request (criteo, avazu, tabular); synthetic has none
    if self.name == "synthetic":
      if schema is None:
        n = len(data["vocab_sizes"])
        lens = tuple(data.get("multi_hot") or ()) or (1,) * n
        schema = base.Schema(
          int(data["num_dense"]), tuple(base.FeatureInfo(f"cat_{i:02d}", int(m)) for i, m in enumerate(lens))
        )
      self.dense_names = tuple(f"dense_{j:02d}" for j in range(schema.num_dense))
      self.kinds = {**{n: "float" for n in self.dense_names}}
      self.kinds.update({f.name: "list" if f.max_len > 1 else "int" for f in schema.features})
    elif self.name == "criteo":
      from recsys_jax.data.criteo import CriteoFormat

      self.fmt = CriteoFormat()  # the reader builds it so (13 dense, 26 categorical)
      self.kinds = {**{n: "int" for n in self.fmt.dense_names}, **{n: "string" for n in self.fmt.cat_names}}
      schema = self.fmt.schema
    elif self.name == "avazu":
      from recsys_jax.data import avazu

      self.fmt = avazu.AvazuFormat()
      self.columns = tuple(c for c in avazu.HEADER if c not in ("id", "click"))
      self.kinds = {c: "string" for c in self.columns}
      schema = self.fmt.schema
    else:
      from recsys_jax.data.tabular import TabularFormat

      self.fmt = TabularFormat(
        file_type="parquet",  # the Arrow path: requests carry values, not CSV lines
        label=data["label"],
        label_threshold=None,
        dense=tuple(data["dense"]),
        dense_transform=data["dense_transform"],
        categorical=tuple(data["categorical"]),
        multi_hot=tuple(tuple(x) for x in data["multi_hot"]),
        sequence=tuple(tuple(x) for x in data["sequence"]),
      )
      self.kinds = {c: "float" for c in self.fmt.dense}
      self.kinds.update({c: "string" for c in self.fmt.categorical})
      self.kinds.update({b.column: "list" for b in self.fmt.bags})
      schema = self.fmt.schema
    self.schema = schema

  def fields(self) -> Dict[str, str]:
    return dict(self.kinds)

  def _check_keys(self, records: Sequence[Mapping[str, Any]]) -> None:
    if not isinstance(records, (list, tuple)):
      raise RequestError(f"records must be a list of objects, got {type(records).__name__}")
    if not records:
      raise RequestError("the request holds no records (an empty list)")
    for i, r in enumerate(records):
      if not isinstance(r, Mapping):
        raise RequestError(f"a record must be an object of field -> value, got {type(r).__name__}", record=i)
      for k in r:
        if k not in self.kinds:
          raise RequestError(f"unknown feature; this model reads {sorted(self.kinds)}", str(k), i)
      for k in self.kinds:
        if k not in r:
          raise RequestError("missing feature", k, i)

  def encode(self, records: Sequence[Mapping[str, Any]]) -> base.Columns:
    """The reader's columns (``dense``, ``sparse``, ``sparse_weights``) of ``records``, in order."""
    self._check_keys(records)
    if self.name == "synthetic":
      return self._synthetic(records)
    if self.name == "criteo":
      lines = [self._criteo_line(r, i) for i, r in enumerate(records)]
    elif self.name == "avazu":
      lines = [self._avazu_line(r, i) for i, r in enumerate(records)]
    else:
      return self._parse(records, self._arrow(records))
    return self._parse(records, lines)

  def _parse(self, records, payload) -> base.Columns:
    rec = base.Recorder()
    cols = self.fmt.parse(base.RawChunk("<request>", 1, payload), rec)
    if rec.faults:
      line, field, why = rec.faults[0]
      raise RequestError(why, field, line - 1)
    if base.num_records(cols) != len(records):  # every fault is recorded; this would be a parser's bug
      raise RequestError(f"{len(records) - base.num_records(cols)} record(s) could not be parsed")
    return {k: cols[k] for k in ("dense", "sparse", "sparse_weights") if k in cols}

  # -- formats ----------------------------------------------------------------------------

  def _synthetic(self, records) -> base.Columns:
    """Column by column when every value is of its field's plain type (one pass of cheap checks a
    column, then numpy); otherwise record by record (``_synthetic_checked``), which names the bad
    value. Both give the same columns for any records the fast pass takes."""
    return self._synthetic_fast(records) or self._synthetic_checked(records)

  def _synthetic_fast(self, records) -> Optional[base.Columns]:
    """None if a value needs the record-by-record checks (a wrong type, out of range, multi-hot)."""
    n = len(records)
    if any(f.max_len > 1 for f in self.schema.features):
      return None
    dense = np.empty((n, len(self.dense_names)), np.float32)
    sparse: Dict[str, np.ndarray] = {}
    try:
      for j, name in enumerate(self.dense_names):
        col = [r[name] for r in records]
        if not all(type(v) is float or type(v) is int for v in col):  # noqa: E721 - bool is refused
          return None
        x = np.asarray(col, np.float64)
        if not np.all(np.abs(x) <= _F32_MAX):  # NaN compares False: refused too
          return None
        dense[:, j] = x
      for f in self.schema.features:
        col = [r[f.name] for r in records]
        if not all(type(v) is int for v in col):  # noqa: E721 - bool is refused
          return None
        sparse[f.name] = np.asarray(col, np.uint64).reshape(n, 1)  # OverflowError: < 0 or >= 2**64
    except OverflowError:
      return None
    return {"dense": dense, "sparse": sparse, "sparse_weights": {}}

  def _synthetic_checked(self, records) -> base.Columns:
    n = len(records)
    dense = np.zeros((n, len(self.dense_names)), np.float32)
    sparse: Dict[str, np.ndarray] = {}
    weights: Dict[str, np.ndarray] = {}
    for f in self.schema.features:
      sparse[f.name] = np.zeros((n, f.max_len), np.uint64)
      if f.max_len > 1:
        weights[f.name] = np.zeros((n, f.max_len), np.float32)
    for i, r in enumerate(records):
      for j, name in enumerate(self.dense_names):
        x = _number(r[name], name, i)
        if abs(x) > _F32_MAX:
          raise RequestError(f"{x!r} is not a finite float32 number", name, i)
        dense[i, j] = x
      for f in self.schema.features:
        ids = self._ids(r[f.name], f.name, f.max_len, i)
        sparse[f.name][i, : len(ids)] = ids
        if f.max_len > 1:
          weights[f.name][i, : len(ids)] = 1.0
    return {"dense": dense, "sparse": sparse, "sparse_weights": weights}

  @staticmethod
  def _ids(v: Any, name: str, max_len: int, i: int) -> List[int]:
    if max_len > 1:
      if not isinstance(v, list):
        raise RequestError(f"expected a list of 1 to {max_len} ids, got {type(v).__name__} {v!r:.40}", name, i)
      if not 1 <= len(v) <= max_len:
        raise RequestError(f"expected a list of 1 to {max_len} ids, got {len(v)} (an empty list holds none)", name, i)
      vals = v
    else:
      vals = [v]
    if v is None:
      raise RequestError("null: the synthetic generator has no missing values", name, i)
    for x in vals:
      if not _is_int(x) or not 0 <= x <= _UINT64_MAX:
        raise RequestError(f"expected an integer id in [0, 2**64), got {type(x).__name__} {x!r:.40}", name, i)
    return vals

  def _criteo_line(self, r: Mapping[str, Any], i: int) -> bytes:
    parts = ["0"]
    for name in self.fmt.dense_names:
      v = r[name]
      parts.append("" if v is None else _text(v, name, i, ints=True, forbidden="\t\r\n"))
    for name in self.fmt.cat_names:
      parts.append(_text(r[name], name, i, ints=False, forbidden="\t\r\n"))
    return "\t".join(parts).encode()

  def _avazu_line(self, r: Mapping[str, Any], i: int) -> bytes:
    from recsys_jax.data import avazu

    vals = {"id": "0", "click": "0"}
    for c in self.columns:
      vals[c] = _text(r[c], c, i, ints=True, forbidden=",\r\n")
    return ",".join(vals[c] for c in avazu.HEADER).encode()

  def _arrow(self, records):
    import pyarrow as pa

    fmt = self.fmt
    cols: Dict[str, Any] = {fmt.label: pa.array(np.zeros(len(records)), pa.float64())}
    for c in fmt.dense:
      vals: List[Any] = []
      for i, r in enumerate(records):
        v = r[c]
        if v is None:
          vals.append(None)  # missing counts as 0, as in the files
        elif isinstance(v, str):
          x, empty, invalid = csv_lines.floats([v])  # the CSV reader's own parse of a number
          if invalid:
            raise RequestError(invalid[0][1], c, i)
          vals.append(None if empty[0] else _number(float(x[0]), c, i))
        else:
          vals.append(_number(v, c, i))
      cols[c] = pa.array(vals, pa.float64())
    for c in fmt.categorical:
      cols[c] = pa.array([_text(r[c], c, i, ints=True, forbidden="") for i, r in enumerate(records)], pa.string())
    for b in fmt.bags:
      bags = []
      for i, r in enumerate(records):
        v = r[b.column]
        if v is None:  # the empty field: an empty bag
          v = []
        if isinstance(v, str):
          v = v.split(b.separator)
        elif not isinstance(v, list):
          raise RequestError(f"expected a list of strings (or one {b.separator!r}-separated string)", b.column, i)
        for t in v:
          if t is None:  # null is a missing field, not a missing token within one
            raise RequestError("expected a string in the list, got null", b.column, i)
        bags.append([_text(t, b.column, i, ints=True, forbidden="") for t in v])
      cols[b.column] = pa.array(bags, pa.list_(pa.string()))
    return pa.table(cols)


def schema_to_json(schema: base.Schema) -> Dict[str, Any]:
  return {"num_dense": schema.num_dense, "features": [vars(f).copy() for f in schema.features]}


def schema_from_json(d: Mapping[str, Any]) -> base.Schema:
  return base.Schema(int(d["num_dense"]), tuple(base.FeatureInfo(**f) for f in d["features"]))
