"""Generic CSV and Parquet reader: values against hand-computed ones, CSV == Parquet, bad records, chunking."""

import csv
import gzip
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_jax.data import base, tabular

HEADER = ["label", "clicks", "price", "city", "item", "tags", "hist"]
# Good records: empty values, a quoted delimiter and quotes, a negative dense value, long bags.
GOOD = [
  ["1", "3", "2.5", "New York, NY", "17", "a|b", "x;y;z;w"],
  ["0", "", "-4", "", "42", "", ""],
  ["1", "0", "10", "Paris", "7", "a|b|c|d", "x"],
  ["0", "100", "0.5", 'Quote "Town"', "17", "c||d|", "y;x"],
  ["1.0", "1e2", "3", "Paris", "123456789012", "b", "p;q;r;s;t;u"],
]
# Malformed lines, each with the field its error must name.
BAD = {
  "short": ("1,3,2.5,Rome", "<line>"),
  "no_label": (",1,1,Rome,1,a,x", "label"),
  "text_label": ("yes,1,1,Rome,1,a,x", "label"),
  "label_2": ("2,1,1,Rome,1,a,x", "label"),
  "text_dense": ("1,abc,1,Rome,1,a,x", "clicks"),
  "nan_dense": ("1,1,nan,Rome,1,a,x", "price"),
  # Closed at the end of the line it would have 7 fields: it must still be bad, wherever chunks end.
  "open_quote": ('1,1,1,Rome,1,a,"x', "<line>"),
}


def make_format(file_type="csv", **kw):
  args = dict(
    file_type=file_type,
    label="label",
    dense=["clicks", "price"],
    categorical=["city", "item"],
    multi_hot=[("tags", "|", 3)],
    sequence=[("hist", ";", 3)],
  )
  args.update(kw)
  return tabular.TabularFormat(**args)


def csv_line(row):
  out = []
  csv.writer(_Sink(out)).writerow(row)
  return out[0].rstrip("\r\n")


class _Sink:
  def __init__(self, out):
    self.out = out

  def write(self, s):
    self.out.append(s)


def write_csv(path, lines, header=HEADER):
  with open(path, "w") as f:
    f.write(",".join(header) + "\n")
    for line in lines:
      f.write(line + "\n")
  return str(path)


def read_all(fmt, path, chunk_records=1000, bad=None):
  bad = bad or base.BadRecords("error")
  parts = [fmt.parse(c, bad) for c in fmt.chunks(path, chunk_records)]
  return base.concat_columns(parts) if parts else base.empty_columns(fmt.schema)


def assert_columns_equal(a, b):
  np.testing.assert_array_equal(a["label"], b["label"])
  np.testing.assert_array_equal(a["dense"], b["dense"])
  assert a["label"].dtype == np.float32 and a["dense"].dtype == np.float32
  assert a["sparse"].keys() == b["sparse"].keys()
  for f in a["sparse"]:
    assert a["sparse"][f].dtype == np.uint64
    np.testing.assert_array_equal(a["sparse"][f], b["sparse"][f])
  assert a["sparse_weights"].keys() == b["sparse_weights"].keys()
  for f in a["sparse_weights"]:
    np.testing.assert_array_equal(a["sparse_weights"][f], b["sparse_weights"][f])


def h(values, field):
  return base.hash_strings(values, field)


def bag(tokens, field, max_len):
  """Hand-built padded bag: hashes of ``tokens`` then zeros, and weights 1 then 0."""
  ids = np.zeros(max_len, np.uint64)
  w = np.zeros(max_len, np.float32)
  if tokens:
    ids[: len(tokens)] = h(tokens, field)
    w[: len(tokens)] = 1
  return ids, w


@pytest.fixture
def good_csv(tmp_path):
  return write_csv(tmp_path / "good.csv", [csv_line(r) for r in GOOD])


def test_csv_values_match_hand_computed(good_csv):
  fmt = make_format()
  assert fmt.schema == base.Schema(
    2,
    (
      base.FeatureInfo("city", 1, "pooled"),
      base.FeatureInfo("item", 1, "pooled"),
      base.FeatureInfo("tags", 3, "pooled"),
      base.FeatureInfo("hist", 3, "sequence"),
    ),
  )
  cols = read_all(fmt, good_csv)
  np.testing.assert_array_equal(cols["label"], [1, 0, 1, 0, 1])
  # log(1 + max(x, 0)); an empty value is 0 and -4 is clamped to 0.
  expect_dense = [[math.log(4), math.log(3.5)], [0, 0], [0, math.log(11)], [math.log(101), math.log(1.5)]]
  expect_dense.append([math.log(101), math.log(4)])
  np.testing.assert_allclose(cols["dense"], np.array(expect_dense, np.float32), rtol=1e-6)
  cities = ["New York, NY", "", "Paris", 'Quote "Town"', "Paris"]
  np.testing.assert_array_equal(cols["sparse"]["city"][:, 0], h(cities, "city"))
  assert cols["sparse"]["city"][1, 0] == h([""], "city")[0]  # the field's missing id
  assert cols["sparse"]["city"][1, 0] != h([""], "item")[0]
  np.testing.assert_array_equal(cols["sparse"]["item"][:, 0], h(["17", "42", "7", "17", "123456789012"], "item"))
  # Multi-hot bags keep their first 3 tokens; empty tokens are dropped.
  tags = [["a", "b"], [], ["a", "b", "c"], ["c", "d"], ["b"]]
  # Sequences keep their last 3 tokens, in order, padded at the end.
  hist = [["y", "z", "w"], [], ["x"], ["y", "x"], ["s", "t", "u"]]
  for i in range(5):
    ids, w = bag(tags[i], "tags", 3)
    np.testing.assert_array_equal(cols["sparse"]["tags"][i], ids)
    np.testing.assert_array_equal(cols["sparse_weights"]["tags"][i], w)
    ids, w = bag(hist[i], "hist", 3)
    np.testing.assert_array_equal(cols["sparse"]["hist"][i], ids)
    np.testing.assert_array_equal(cols["sparse_weights"]["hist"][i], w)
  # The same as base.multi_hot of the truncated tokens.
  ids, w = base.multi_hot([t[-3:] for t in [["x", "y", "z", "w"], [], ["x"], ["y", "x"], list("pqrstu")]], "hist", 3)
  np.testing.assert_array_equal(cols["sparse"]["hist"], ids)


def test_label_threshold_and_raw_dense(good_csv):
  fmt = make_format(label="price", label_threshold=2.5, dense=["clicks", "label"], dense_transform="none")
  cols = read_all(fmt, good_csv)
  np.testing.assert_array_equal(cols["label"], [1, 0, 1, 0, 1])  # price 2.5, -4, 10, 0.5, 3
  np.testing.assert_array_equal(cols["dense"], np.array([[3, 1], [0, 0], [0, 1], [100, 0], [100, 1]], np.float32))


def test_gzip_and_tsv(tmp_path, good_csv):
  gz = tmp_path / "good.csv.gz"
  with gzip.open(gz, "wb") as f, open(good_csv, "rb") as g:
    f.write(g.read())
  tsv = tmp_path / "good.tsv"
  with open(tsv, "w", newline="") as f:
    w = csv.writer(f, delimiter="\t", lineterminator="\n")
    w.writerow(HEADER)
    w.writerows(GOOD)
  ref = read_all(make_format(), good_csv)
  assert_columns_equal(read_all(make_format(), str(gz)), ref)
  assert_columns_equal(read_all(make_format(delimiter="\t"), str(tsv)), ref)


@pytest.mark.parametrize("ending", ["lf_no_final", "crlf", "crlf_no_final"])
@pytest.mark.parametrize("last", ["hist", "item"])
def test_csv_line_ends_and_a_last_line_without_newline(tmp_path, good_csv, ending, last):
  """The CSV reader itself (not only the Criteo reader sharing its chunker): Windows line ends
  (the header's too) and a last line without a newline give the same records as the plain file,
  for any chunk size; the last record is read whole and no ``\\r`` stays in the last column (a
  sequence keeps its last tokens, a categorical value is hashed as text: either would change)."""
  order = [c for c in HEADER if c != last] + [last]
  lines = [",".join(order)] + [csv_line([r[HEADER.index(c)] for c in order]) for r in GOOD]
  sep = "\n" if ending.startswith("lf") else "\r\n"
  text = sep.join(lines) + ("" if ending.endswith("no_final") else sep)
  path = tmp_path / "ends.csv"
  path.write_bytes(text.encode())
  ref = read_all(make_format(), good_csv)
  for chunk_records in (1, 2, 4, 1000):
    cols = read_all(make_format(), str(path), chunk_records)
    assert base.num_records(cols) == len(GOOD)
    assert_columns_equal(cols, ref)
  assert cols["sparse"]["item"][-1, 0] == h(["123456789012"], "item")[0]
  np.testing.assert_array_equal(cols["sparse"]["hist"][-1], bag(["s", "t", "u"], "hist", 3)[0])
  chunks = list(make_format().chunks(str(path), 2))
  assert [c.first_line for c in chunks] == [2, 4, 6]  # line numbers after the header, exact
  assert all(not line.endswith((b"\r", b"\n")) for c in chunks for line in c.payload)


def parquet_table(tags_as_list=True):
  def num(v):
    return float(v) if v else None

  tags = [r[5].split("|") if r[5] else [] for r in GOOD]  # with the empty tokens: the reader drops them
  return pa.table(
    {
      "hist": pa.array([r[6] for r in GOOD], pa.string()),  # columns in another order than the CSV
      "label": pa.array([int(float(r[0])) for r in GOOD], pa.int64()),
      "clicks": pa.array([num(r[1]) for r in GOOD], pa.float64()),
      "price": pa.array([num(r[2]) for r in GOOD], pa.float32()),
      "city": pa.array([r[3] or None for r in GOOD], pa.string()),
      "item": pa.array([int(r[4]) for r in GOOD], pa.int64()),
      "tags": pa.array(tags, pa.list_(pa.string())) if tags_as_list else pa.array([r[5] for r in GOOD]),
      "unused": pa.array(range(len(GOOD)), pa.int32()),
    }
  )


@pytest.mark.parametrize("tags_as_list", [True, False])
def test_parquet_equals_csv(tmp_path, good_csv, tags_as_list):
  path = str(tmp_path / "good.parquet")
  pq.write_table(parquet_table(tags_as_list), path, row_group_size=2)
  ref = read_all(make_format(), good_csv)
  for chunk_records in (1, 3, 100):
    assert_columns_equal(read_all(make_format("parquet"), path, chunk_records), ref)
  # Integer ids hash through their decimal text, as the CSV holds them.
  assert ref["sparse"]["item"][4, 0] == h(["123456789012"], "item")[0]


def test_parquet_chunks_regroup_row_groups(tmp_path):
  path = str(tmp_path / "rg.parquet")
  n = 23
  pq.write_table(pa.table({"label": np.arange(n) % 2, "item": np.arange(n)}), path, row_group_size=5)
  fmt = tabular.TabularFormat(file_type="parquet", label="label", categorical=["item"])
  chunks = list(fmt.chunks(path, 7))
  assert [len(c) for c in chunks] == [7, 7, 7, 2]
  assert [c.first_line for c in chunks] == [1, 8, 15, 22]
  cols = base.concat_columns([fmt.parse(c, base.BadRecords()) for c in chunks])
  np.testing.assert_array_equal(cols["sparse"]["item"][:, 0], h([str(i) for i in range(n)], "item"))


def test_parquet_bad_dense_names_row_and_column(tmp_path):
  path = str(tmp_path / "bad.parquet")
  table = pa.table({"label": [1, 0, None, 1], "clicks": ["1", "2", "3", "x"], "item": [1, 2, 3, 4]})
  pq.write_table(table, path)
  fmt = tabular.TabularFormat(file_type="parquet", label="label", dense=["clicks"], categorical=["item"])
  with pytest.raises(base.BadRecordError, match=rf"{path}:3: field 'label': missing label"):
    read_all(fmt, path)
  bad = base.BadRecords("skip")
  cols = read_all(fmt, path, 2, bad)
  assert bad.count == 2 and bad.examples[1].startswith(f"{path}:4: field 'clicks'")
  np.testing.assert_array_equal(cols["sparse"]["item"][:, 0], h(["1", "2"], "item"))


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_record_error_names_file_line_and_field(tmp_path, kind):
  line, field = BAD[kind]
  path = write_csv(tmp_path / "bad.csv", [csv_line(GOOD[0]), line, csv_line(GOOD[1])])
  for chunk_records in (1, 2, 100):
    with pytest.raises(base.BadRecordError, match=rf"bad record {path}:3: field '{field}'"):
      read_all(make_format(), path, chunk_records)


def test_skip_drops_exactly_the_bad_lines(tmp_path, good_csv):
  lines, bad_lines = [], []
  for i, (row, (bad_line, _)) in enumerate(zip(GOOD + GOOD[:2], BAD.values())):
    lines += [csv_line(row), bad_line]
    bad_lines.append(2 * i + 3)  # header, then good and bad lines alternate
  lines.append("")  # blank lines are skipped, not bad
  lines.append(csv_line(GOOD[2]))
  path = write_csv(tmp_path / "mixed.csv", lines)
  ref = read_all(make_format(), write_csv(tmp_path / "ref.csv", [csv_line(r) for r in GOOD + GOOD[:3]]))
  for chunk_records in (1, 2, 5, 1000):
    bad = base.BadRecords("skip", log_first=100)
    cols = read_all(make_format(), path, chunk_records, bad)
    assert bad.count == len(BAD)
    assert [int(e.split(":")[1]) for e in bad.examples] == bad_lines
    assert_columns_equal(cols, ref)


def test_open_quote_line_is_bad_and_next_line_is_its_own_record(tmp_path):
  # The open quote would swallow the next line with csv.reader; here it stays one bad line.
  path = write_csv(tmp_path / "q.csv", ['1,1,1,"Rome,1,a,x', csv_line(GOOD[0]), '0,1,1,"Oslo', csv_line(GOOD[2])])
  bad = base.BadRecords("skip", log_first=10)
  cols = read_all(make_format(), path, 1000, bad)
  assert [e.split(":")[1] for e in bad.examples] == ["2", "4"]
  assert_columns_equal(
    cols, read_all(make_format(), write_csv(tmp_path / "r.csv", [csv_line(GOOD[0]), csv_line(GOOD[2])]))
  )


def test_chunking_invariance(tmp_path):
  rng = np.random.default_rng(0)
  rows = [GOOD[i] for i in rng.integers(0, len(GOOD), 60)]
  lines = [csv_line(r) for r in rows]
  for at in (0, 13, 14, 40, 61):  # bad lines at chunk edges too
    lines.insert(at, BAD["open_quote"][0] if at % 2 else BAD["text_dense"][0])
  path = write_csv(tmp_path / "many.csv", lines)
  whole = read_all(make_format(), path, 10_000, base.BadRecords("skip"))
  assert len(whole["label"]) == 60
  for chunk_records in (1, 2, 7, 13, 64):
    chunks = list(make_format().chunks(path, chunk_records))
    assert all(len(c) == chunk_records for c in chunks[:-1])
    assert [c.first_line for c in chunks] == list(range(2, len(lines) + 2, chunk_records))
    assert_columns_equal(read_all(make_format(), path, chunk_records, base.BadRecords("skip")), whole)


def test_missing_declared_column(tmp_path, good_csv):
  fmt = make_format(categorical=["city", "country"])
  with pytest.raises(ValueError, match=r"good\.csv: declared column\(s\) \['country'\].*available.*'hist'"):
    list(fmt.chunks(good_csv, 10))
  path = str(tmp_path / "p.parquet")
  pq.write_table(parquet_table(), path)
  with pytest.raises(ValueError, match=r"p\.parquet: declared column\(s\) \['country'\].*available.*'unused'"):
    list(make_format("parquet", categorical=["city", "country"]).chunks(path, 10))


def test_bad_configuration():
  with pytest.raises(ValueError, match="file_type"):
    make_format("json")
  with pytest.raises(ValueError, match="more than once"):
    make_format(categorical=["city", "clicks"])
  with pytest.raises(ValueError, match="max_len"):
    make_format(sequence=[("hist", ";", 1)])


def test_shared_table_hashes_like_that_field(tmp_path):
  path = write_csv(tmp_path / "s.csv", ["1,7,3;7"], header=["label", "item", "history"])
  fmt = tabular.TabularFormat(label="label", categorical=["item"], sequence=[("history", ";", 4, "item")])
  assert fmt.schema.features[1] == base.FeatureInfo("history", 4, "sequence", "item")
  cols = read_all(fmt, path)
  assert cols["sparse"]["history"][0, 1] == cols["sparse"]["item"][0, 0]


def test_number_parsing_matches_python_float():
  values = ["1.5", " 2", "1e3", "-0", ".5", "5.", "+.5", "1_0", "inf", "-Infinity", "nan", "", "0x10", "1,5", "1.5f"]
  x, empty, invalid = tabular._floats(values)
  bad = dict(invalid)
  for i, v in enumerate(values):
    if v == "":
      assert empty[i] and x[i] == 0
      continue
    try:
      ref = float(v)
    except ValueError:
      assert i in bad
      continue
    assert i not in bad and (x[i] == ref or (math.isnan(ref) and math.isnan(x[i])))
  assert tabular._floats(["1", "2.25"])[0].tolist() == [1.0, 2.25]


def test_string_hash_paths_agree_with_a_python_reference():
  """base.hash_strings: the ASCII fast path, the bytes path and a per-value Python FNV-1a agree."""
  from recsys_jax.hashing import name_seed, splitmix64

  def ref(v, field):
    h = int(name_seed(field))
    for byte in v.encode():
      h = ((h ^ byte) * 0x100000001B3) % 2**64
    return int(splitmix64(np.uint64(h)))

  values = ["", "a", "Paris", "New York, NY", "123456789012", "Zürich", "a" * 40, "東京"]
  want = [ref(v, "city") for v in values]
  assert base.hash_strings(values, "city").tolist() == want  # non-ASCII: the bytes path
  assert base.hash_strings([v.encode() for v in values], "city").tolist() == want
  ascii_values = [v for v in values if v.isascii()]
  assert base.hash_strings(ascii_values, "city").tolist() == [ref(v, "city") for v in ascii_values]
  assert base.hash_strings(np.array(ascii_values), "x").tolist() == [ref(v, "x") for v in ascii_values]
  assert base.hash_strings([], "x").shape == (0,)
  assert len(set(base.hash_strings(ascii_values, "city").tolist())) == len(ascii_values)


def test_record_with_several_faults_counts_once_and_names_the_first_column(tmp_path):
  path = write_csv(tmp_path / "two.csv", [csv_line(GOOD[0]), "1,abc,nan,Rome,1,a,x"])
  bad = base.BadRecords("skip")
  assert len(read_all(make_format(), path, bad=bad)["label"]) == 1
  assert bad.count == 1 and bad.examples == [f"{path}:3: field 'clicks': not a number: 'abc'"]
