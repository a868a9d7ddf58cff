"""Serving (issue 16): request records encoded exactly as the readers read files, and every bad
record refused with a RequestError naming the record and the field."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from recsys_jax.data import base
from recsys_jax.data.avazu import HEADER, AvazuFormat
from recsys_jax.data.tabular import TabularFormat
from recsys_jax.serving.api import RequestError
from recsys_jax.serving.encode import Encoder

_M = (1 << 64) - 1


def _splitmix(x: int) -> int:
  """splitmix64 in plain Python integers: a reference independent of the numpy code."""
  z = (x + 0x9E3779B97F4A7C15) & _M
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
  return z ^ (z >> 31)


def _field_id(value: int, field: str) -> int:
  """Criteo's id of an integer value: splitmix64(value ^ seed of the field), per its docstring."""
  seed = _splitmix((zlib.crc32(field.encode()) << 32) & _M)
  return _splitmix((value & _M) ^ seed)


def _criteo(**over):
  r = {f"I{j}": str(j * 3 - 5) for j in range(1, 14)}
  r.update({f"C{j}": f"{j * 2654435761 % 2**32:08x}" for j in range(1, 27)})
  r.update(over)
  return r


CRITEO = {"name": "criteo"}
SYNTH = {"name": "synthetic", "num_dense": 2, "vocab_sizes": (10, 10, 10), "multi_hot": (1, 3, 1)}


def test_criteo_records_are_hashed_and_log1p_as_the_reader_does():
  enc = Encoder(CRITEO)
  r = _criteo(I2="", I3=-7, I4=12, C5="", C6="0A0b0C0d")
  cols = enc.encode([r, _criteo()])
  for j in range(1, 14):
    raw = r[f"I{j}"]
    x = 0 if raw == "" else max(int(raw), 0)
    assert cols["dense"][0, j - 1] == np.float32(math.log1p(x))  # missing and negative: 0
  for j in range(1, 27):
    v = r[f"C{j}"]
    want = _field_id(-1 if v == "" else int(v, 16), f"C{j}")
    assert int(cols["sparse"][f"C{j}"][0, 0]) == want, j
  assert int(cols["sparse"]["C6"][0, 0]) == _field_id(0x0A0B0C0D, "C6")  # case does not matter


def test_avazu_and_tabular_records_equal_the_readers_columns(tmp_path):
  # Avazu: a record against the reader over a file holding the same line.
  rec = {c: f"v{i}" for i, c in enumerate(HEADER) if c not in ("id", "click")}
  rec["hour"], rec["C1"] = "14102213", 1005
  line = ",".join({"id": "7", "click": "1", **{k: str(v) for k, v in rec.items()}}[c] for c in HEADER)
  (tmp_path / "a.csv").write_text(",".join(HEADER) + "\n" + line + "\n")
  want = base.read_all(AvazuFormat(), str(tmp_path / "a.csv"))
  got = Encoder({"name": "avazu"}).encode([rec])
  for k, v in want["sparse"].items():
    np.testing.assert_array_equal(got["sparse"][k], v, err_msg=k)
  # CSV with dense (log1p), categorical, a multi-hot bag and a sequence.
  data = {
    "name": "csv",
    "label": "y",
    "dense": ("a", "b"),
    "dense_transform": "log1p",
    "categorical": ("u", "v"),
    "multi_hot": (("tags", "|", 3),),
    "sequence": (("hist", " ", 2),),
  }
  (tmp_path / "t.csv").write_text("y,a,b,u,v,tags,hist\n1,2.5,,x,17,p|q|r|s,h1 h2 h3\n0,-1,1e3,,0,,h9\n")
  fmt = TabularFormat(
    file_type="csv",
    label="y",
    dense=("a", "b"),
    dense_transform="log1p",
    categorical=("u", "v"),
    multi_hot=(("tags", "|", 3),),
    sequence=(("hist", " ", 2),),
  )
  want = base.read_all(fmt, str(tmp_path / "t.csv"))
  recs = [
    {"a": 2.5, "b": None, "u": "x", "v": 17, "tags": ["p", "q", "r", "s"], "hist": "h1 h2 h3"},
    {"a": "-1", "b": 1000, "u": "", "v": "0", "tags": [], "hist": ["h9"]},
  ]
  got = Encoder(data).encode(recs)
  np.testing.assert_array_equal(got["dense"], want["dense"])
  for k in want["sparse"]:
    np.testing.assert_array_equal(got["sparse"][k], want["sparse"][k], err_msg=k)
  for k in want["sparse_weights"]:
    np.testing.assert_array_equal(got["sparse_weights"][k], want["sparse_weights"][k], err_msg=k)


def _synth(**over):
  r = {"dense_00": 0.5, "dense_01": 2, "cat_00": 3, "cat_01": [1, 2], "cat_02": 2**64 - 1}
  r.update(over)
  return r


@pytest.mark.parametrize(
  "data, records, field, record, why",
  [
    (SYNTH, [_synth(), {k: v for k, v in _synth().items() if k != "cat_00"}], "cat_00", 1, "missing feature"),
    (SYNTH, [_synth(extra=1)], "extra", 0, "unknown feature"),
    (SYNTH, [_synth(dense_00="0.5")], "dense_00", 0, "expected a number"),
    (SYNTH, [_synth(dense_00=True)], "dense_00", 0, "expected a number"),
    (SYNTH, [_synth(dense_01=float("nan"))], "dense_01", 0, "not a finite number"),
    (SYNTH, [_synth(dense_01=float("inf"))], "dense_01", 0, "not a finite number"),
    (SYNTH, [_synth(dense_01=1e39)], "dense_01", 0, "float32"),
    (SYNTH, [_synth(cat_00=[3])], "cat_00", 0, "integer id"),
    (SYNTH, [_synth(cat_00=-1)], "cat_00", 0, "integer id"),
    (SYNTH, [_synth(cat_00=2**64)], "cat_00", 0, "integer id"),
    (SYNTH, [_synth(cat_00=1.0)], "cat_00", 0, "integer id"),
    (SYNTH, [_synth(cat_01=[])], "cat_01", 0, "empty list"),
    (SYNTH, [_synth(cat_01=[1, 2, 3, 4])], "cat_01", 0, "1 to 3 ids"),
    (SYNTH, [_synth(cat_01=5)], "cat_01", 0, "list"),
    (SYNTH, [_synth(), "not an object"], None, 1, "object"),
    (SYNTH, [], None, None, "no records"),
    (CRITEO, [_criteo(), _criteo(C3=["0a"])], "C3", 1, "expected a string"),
    (CRITEO, [_criteo(C3=True)], "C3", 0, "expected a string"),
    (CRITEO, [_criteo(C3="zz")], "C3", 0, "hex"),
    (CRITEO, [_criteo(C3="123456789")], "C3", 0, "hex"),
    (CRITEO, [_criteo(C3="0a\t1")], "C3", 0, "cannot occur"),
    (CRITEO, [_criteo(I5="1.5")], "I5", 0, "integer"),
    (CRITEO, [_criteo(I5=1.5)], "I5", 0, "expected a string"),
    (CRITEO, [_criteo(I5=[1])], "I5", 0, "expected a string"),
    (CRITEO, [_criteo(), _criteo(), _criteo(I1="x")], "I1", 2, "integer"),
  ],
)
def test_bad_records_raise_request_error_naming_record_and_field(data, records, field, record, why):
  with pytest.raises(RequestError, match=why) as e:
    Encoder(data).encode(records)
  assert (e.value.field, e.value.record) == (field, record)


TABULAR = {
  "name": "csv",
  "label": "y",
  "dense": ("a",),
  "dense_transform": "log1p",
  "categorical": ("u",),
  "multi_hot": (("tags", "|", 3),),
  "sequence": (),
}


@pytest.mark.parametrize(
  "over, field, why",
  [
    ({"a": "abc"}, "a", "not a number"),
    ({"a": "nan"}, "a", "not a finite number"),
    ({"a": [1]}, "a", "expected a number"),
    ({"a": False}, "a", "expected a number"),
    ({"u": ["x"]}, "u", "expected a string"),
    ({"u": 1.5}, "u", "expected a string"),
    ({"tags": 3}, "tags", "expected a list"),
    ({"tags": ["p", None]}, "tags", "expected a string"),
    ({"a": True}, "a", "expected a number"),
  ],
)
def test_bad_tabular_records_name_the_field(over, field, why):
  with pytest.raises(RequestError, match=why) as e:
    Encoder(TABULAR).encode([{"a": 1, "u": "x", "tags": ["p"]}, {"a": 1, "u": "x", "tags": ["p"], **over}])
  assert (e.value.field, e.value.record) == (field, 1)


def test_movielens_is_refused_with_a_reason():
  with pytest.raises(ValueError, match="MovieLens"):
    Encoder({"name": "movielens"})


def test_fields_name_every_feature_and_its_kind():
  assert Encoder(SYNTH).fields() == {
    "dense_00": "float",
    "dense_01": "float",
    "cat_00": "int",
    "cat_01": "list",
    "cat_02": "int",
  }
  f = Encoder(CRITEO).fields()
  assert len(f) == 39 and f["I1"] == "int" and f["C26"] == "string"


SYNTH1 = {"name": "synthetic", "num_dense": 2, "vocab_sizes": (10, 10, 10)}  # one-hot: the column-wise path


def _synth1(**over):
  r = {"dense_00": 0.5, "dense_01": 2, "cat_00": 3, "cat_01": 0, "cat_02": 2**64 - 1}
  r.update(over)
  return r


def test_column_wise_synthetic_encoding_equals_the_record_by_record_one():
  enc = Encoder(SYNTH1)
  rng = np.random.default_rng(0)
  recs = []
  for _ in range(300):
    r = {"dense_00": float(rng.standard_normal() * 10.0 ** rng.integers(-30, 30)), "dense_01": int(rng.integers(-9, 9))}
    r.update({f"cat_{j:02d}": int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2)) for j in range(3)})
    recs.append(r)
  recs[5]["cat_01"], recs[6]["dense_00"] = 2**64 - 1, 3.4028234663852886e38  # the largest of each
  fast = enc._synthetic_fast(recs)
  assert fast is not None
  want = enc._synthetic_checked(recs)
  np.testing.assert_array_equal(fast["dense"], want["dense"])
  assert fast["dense"].dtype == want["dense"].dtype == np.float32
  for k in want["sparse"]:
    np.testing.assert_array_equal(fast["sparse"][k], want["sparse"][k], err_msg=k)
    assert fast["sparse"][k].dtype == np.uint64
  assert fast["sparse_weights"] == want["sparse_weights"] == {}


@pytest.mark.parametrize(
  "over, field, why",
  [
    ({"dense_00": "0.5"}, "dense_00", "expected a number"),
    ({"dense_00": True}, "dense_00", "expected a number"),
    ({"dense_00": None}, "dense_00", "no missing values"),
    ({"cat_00": None}, "cat_00", "no missing values"),
    ({"dense_01": float("nan")}, "dense_01", "not a finite number"),
    ({"dense_01": float("-inf")}, "dense_01", "not a finite number"),
    ({"dense_01": -1e39}, "dense_01", "float32"),
    ({"dense_01": 10**400}, "dense_01", "float32|finite"),
    ({"cat_00": [3]}, "cat_00", "integer id"),
    ({"cat_00": -1}, "cat_00", "integer id"),
    ({"cat_00": 2**64}, "cat_00", "integer id"),
    ({"cat_00": 1.0}, "cat_00", "integer id"),
    ({"cat_00": False}, "cat_00", "integer id"),
    ({"cat_00": "3"}, "cat_00", "integer id"),
  ],
)
def test_bad_one_hot_synthetic_records_are_named_by_the_checked_path(over, field, why):
  enc = Encoder(SYNTH1)
  recs = [_synth1(), _synth1(), _synth1(**over)]
  assert enc._synthetic_fast(recs) is None
  with pytest.raises(RequestError, match=why) as e:
    enc.encode(recs)
  assert (e.value.field, e.value.record) == (field, 2)


def _rows_equal(got, want, i, j):
  np.testing.assert_array_equal(got["dense"][i], want["dense"][j])
  for k in want["sparse"]:
    np.testing.assert_array_equal(got["sparse"][k][i], want["sparse"][k][j], err_msg=k)
  for k in want.get("sparse_weights", {}):
    np.testing.assert_array_equal(got["sparse_weights"][k][i], want["sparse_weights"][k][j], err_msg=k)


def test_null_is_scored_as_the_reader_scores_an_empty_field(tmp_path):
  """Issue 25: a JSON null for any field of Criteo, Avazu or CSV equals the empty field in a file,
  record by record against the training reader over the same records written as lines."""
  rng = np.random.default_rng(5)
  # Criteo: each line empties a different random subset of fields; the request sends null there.
  lines, recs = [], []
  for _ in range(40):
    r = {f"I{j}": int(rng.integers(-5, 500)) for j in range(1, 14)}
    r.update({f"C{j}": f"{int(rng.integers(0, 1 << 32)):08x}" for j in range(1, 27)})
    for k in rng.choice(sorted(r), size=int(rng.integers(1, 20)), replace=False):
      r[k] = None
    recs.append(r)
    vals = ["1"] + ["" if r[f"I{j}"] is None else str(r[f"I{j}"]) for j in range(1, 14)]
    lines.append("\t".join(vals + ["" if r[f"C{j}"] is None else r[f"C{j}"] for j in range(1, 27)]))
  (tmp_path / "c.tsv").write_text("\n".join(lines) + "\n")
  from recsys_jax.data.criteo import CriteoFormat

  want = base.read_all(CriteoFormat(), str(tmp_path / "c.tsv"))
  got = Encoder(CRITEO).encode(recs)
  for i in range(len(recs)):
    _rows_equal(got, want, i, i)
  # Avazu.
  cols = [c for c in HEADER if c not in ("id", "click")]
  lines, recs = [], []
  for n in range(20):
    r = {c: f"v{int(rng.integers(0, 9))}" for c in cols}
    r["hour"] = "14102213"  # a record's time: the reader refuses it empty, as the server does
    for k in rng.choice([c for c in cols if c != "hour"], size=int(rng.integers(1, 8)), replace=False):
      r[k] = None
    recs.append(r)
    full = {"id": str(n), "click": "0", **{c: "" if v is None else v for c, v in r.items()}}
    lines.append(",".join(full[c] for c in HEADER))
  (tmp_path / "a.csv").write_text(",".join(HEADER) + "\n" + "\n".join(lines) + "\n")
  want = base.read_all(AvazuFormat(), str(tmp_path / "a.csv"))
  got = Encoder({"name": "avazu"}).encode(recs)
  for i in range(len(recs)):
    _rows_equal(got, want, i, i)
  # CSV: dense, categorical and a bag, each null in turn.
  data = {
    "name": "csv",
    "label": "y",
    "dense": ("a",),
    "dense_transform": "log1p",
    "categorical": ("u", "v"),
    "multi_hot": (("tags", "|", 3),),
    "sequence": (),
  }
  fmt = TabularFormat(
    file_type="csv",
    label="y",
    dense=("a",),
    dense_transform="log1p",
    categorical=("u", "v"),
    multi_hot=(("tags", "|", 3),),
    sequence=(),
  )
  full = {"a": 3.0, "u": "x", "v": 17, "tags": ["p", "q"]}
  recs = [full] + [{**full, k: None} for k in full] + [{k: None for k in full}]
  text = "y,a,u,v,tags\n" + "".join(
    "0," + ",".join("" if r[k] is None else "|".join(r[k]) if k == "tags" else str(r[k]) for k in full) + "\n"
    for r in recs
  )
  (tmp_path / "t.csv").write_text(text)
  want = base.read_all(fmt, str(tmp_path / "t.csv"))
  got = Encoder(data).encode(recs)
  for i in range(len(recs)):
    _rows_equal(got, want, i, i)
