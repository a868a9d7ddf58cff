"""The Criteo TSV reader: values against hand-computed expectations, bad records, chunking, gzip."""

import gzip
import os
import random
import re

import numpy as np
import pytest

from recsys_jax.data import base
from recsys_jax.data.criteo import CriteoFormat

FMT = CriteoFormat()
DENSE = [f"I{i}" for i in range(1, 14)]
CATS = [f"C{j}" for j in range(1, 27)]


def line(label="0", dense=None, cats=None):
  """One record as published: label, 13 integers, 26 hex strings, tab-separated."""
  dense = dense if dense is not None else [""] * 13
  cats = cats if cats is not None else [""] * 26
  return "\t".join([label, *dense, *cats])


def write(path, lines, gz=False):
  data = "".join(f"{x}\n" for x in lines).encode()
  with (gzip.open if gz else open)(path, "wb") as f:
    f.write(data)
  return str(path)


def read(path, policy="error", chunk_records=1000):
  bad = base.BadRecords(policy)
  return base.read_all(FMT, path, bad, chunk_records), bad


def cat_id(value, field):
  """The documented id: hash_ints of the hex value, or of -1 when the field is empty."""
  return base.hash_ints(np.array([int(value, 16) if value else -1]), field)[0]


def expected_dense(values):
  return np.array([np.log1p(max(int(v), 0)) if v else 0.0 for v in values], np.float32)


# Three records with empty, negative, zero, large and signed values, repeated and missing ids.
REC1 = (
  "1",
  ["5", "", "-3", "0", "12345678", "123456789012", "+7", "-0", "1", "", "", "2", "999"],
  ["68fd1e64", "", "68fd1e64", "05db9164", "ABCDEF01", "abcdef01", "0", "a"] + ["80e26c9b"] * 18,
)
REC2 = (
  "0",
  [""] * 13,
  ["68fd1e64", "0c0567c2", "", "", "ffffffff", "00000000", "00000000", "A"] + [""] * 18,
)
REC3 = (
  "1",
  ["-1"] * 13,
  ["05db9164", ""] + ["1"] * 24,
)


def test_values_match_hand_computed_expectations(tmp_path):
  path = write(tmp_path / "day_0", [line(*r) for r in (REC1, REC2, REC3)])
  cols, bad = read(path)
  assert bad.count == 0
  np.testing.assert_array_equal(cols["label"], np.float32([1, 0, 1]))
  assert cols["dense"].dtype == np.float32 and cols["dense"].shape == (3, 13)
  # By hand for REC1: I1=5, I2 missing, I3=-3, I4=0, I5=12345678, I6=123456789012, I7=+7, I8=-0.
  np.testing.assert_allclose(
    cols["dense"][0, :8],
    np.float32([np.log1p(5), 0, 0, 0, np.log1p(12345678), np.log1p(123456789012), np.log1p(7), 0]),
    rtol=1e-6,
  )
  for i, rec in enumerate((REC1, REC2, REC3)):
    np.testing.assert_allclose(cols["dense"][i], expected_dense(rec[1]), rtol=1e-6)
  assert set(cols["sparse"]) == set(CATS)
  for i, rec in enumerate((REC1, REC2, REC3)):
    for j, name in enumerate(CATS):
      ids = cols["sparse"][name]
      assert ids.dtype == np.uint64 and ids.shape == (3, 1)
      assert ids[i, 0] == cat_id(rec[2][j], name), (i, name)
  assert not cols.get("sparse_weights")  # one-hot features: no weights


def test_id_properties(tmp_path):
  path = write(tmp_path / "day_0", [line(*r) for r in (REC1, REC2, REC3)])
  cols, _ = read(path)
  sp = {name: v[:, 0] for name, v in cols["sparse"].items()}
  # Equal values in one field: equal ids (C1 of records 1 and 2).
  assert sp["C1"][0] == sp["C1"][1]
  # The same value in two fields: different ids (C1 and C3 of record 1 are both 68fd1e64).
  assert sp["C1"][0] != sp["C3"][0]
  # Hex is read as a number: case and leading zeros do not matter (C5 vs C6, C7 of records 1, 2).
  assert cols["sparse"]["C5"][0, 0] == base.hash_ints(np.array([0xABCDEF01]), "C5")[0]
  assert sp["C6"][0] == base.hash_ints(np.array([0xABCDEF01]), "C6")[0]
  assert sp["C7"][0] == sp["C7"][1] == base.hash_ints(np.array([0]), "C7")[0]
  assert sp["C8"][0] == sp["C8"][1]  # 'a' and 'A'
  # Missing: one stable id per field (C3, C4 of records 2; C2 of records 1 and 3), distinct
  # from the present values and from the missing id of other fields.
  assert sp["C2"][0] == sp["C2"][2] == base.hash_ints(np.array([-1]), "C2")[0]
  assert sp["C2"][0] != sp["C2"][1]
  assert sp["C3"][1] == base.hash_ints(np.array([-1]), "C3")[0] != sp["C3"][0]
  assert sp["C3"][1] != sp["C2"][0]
  # 0 and ffffffff are ordinary values, not the missing one.
  assert sp["C5"][1] != base.hash_ints(np.array([-1]), "C5")[0]
  assert sp["C6"][1] != base.hash_ints(np.array([-1]), "C6")[0]


# (bad line, field named in the error)
BAD_LINES = [
  ("\t".join(["1"] + ["1"] * 13 + ["68fd1e64"] * 25), "num_fields"),  # one field short
  ("\t".join(["1"] + ["1"] * 13 + ["68fd1e64"] * 27), "num_fields"),  # one field too many
  ("", "num_fields"),  # an empty line inside the file
  ("1 2 3", "num_fields"),  # spaces, not tabs
  (line("2", ["1"] * 13, ["68fd1e64"] * 26), "label"),
  (line("", ["1"] * 13, ["68fd1e64"] * 26), "label"),
  (line("01", ["1"] * 13, ["68fd1e64"] * 26), "label"),
  (line("1", ["1"] * 4 + ["1.5"] + ["1"] * 8, ["68fd1e64"] * 26), "I5"),
  (line("1", ["1"] * 4 + ["abc"] + ["1"] * 8, ["68fd1e64"] * 26), "I5"),
  (line("1", ["-"] + ["1"] * 12, ["68fd1e64"] * 26), "I1"),
  (line("1", ["1"] * 12 + ["5-"], ["68fd1e64"] * 26), "I13"),
  (line("1", ["1"] * 12 + [" 5"], ["68fd1e64"] * 26), "I13"),
  (line("1", ["1"] * 12 + ["1" * 33], ["68fd1e64"] * 26), "I13"),  # longer than 32 characters
  (line("1", ["1"] * 12 + ["12345678901x"], ["68fd1e64"] * 26), "I13"),  # long, read one by one
  (line("1", ["1"] * 13, ["68fd1e64"] * 6 + ["68fd1g64"] + ["68fd1e64"] * 19), "C7"),
  (line("1", ["1"] * 13, ["68fd1e64"] * 6 + ["0x1e64"] + ["68fd1e64"] * 19), "C7"),
  (line("1", ["1"] * 13, ["68fd1e64"] * 6 + ["68fd1e64a"] + ["68fd1e64"] * 19), "C7"),  # 9 digits
  (line("1", ["1"] * 13, ["68fd1e64"] * 25 + ["68fd1é"]), "C26"),  # non-ASCII byte
  (line("1", ["1"] * 13, ["68fd1e64"] * 25 + ["-1"]), "C26"),
  # Several faults: the first in column order is named.
  (line("1", ["x"] + ["1"] * 12, ["zz"] * 26), "I1"),
]
GOOD = [line(*REC1), line(*REC2), line(*REC3), line("0", ["3"] * 13, ["deadbeef"] * 26)]


@pytest.mark.parametrize("bad_line,field", BAD_LINES)
def test_error_names_file_line_and_field(tmp_path, bad_line, field):
  path = write(tmp_path / "day_3", GOOD[:2] + [bad_line] + GOOD[2:])
  with pytest.raises(base.BadRecordError) as err:
    read(path)
  msg = str(err.value)
  assert f"{path}:3:" in msg, msg
  assert f"field {field!r}" in msg, msg


def test_skip_drops_bad_lines_and_keeps_good_ones_in_order(tmp_path):
  bad_lines = [b for b, _ in BAD_LINES]
  # Interleave: good, bad, bad, good, bad, ... so every bad kind sits between good lines.
  lines, good_index = [], []
  for k, b in enumerate(bad_lines):
    if k % 2 == 0:
      good_index.append(len(good_index) % len(GOOD))
      lines.append(GOOD[good_index[-1]])
    lines.append(b)
  good_index.append(3)
  lines.append(GOOD[3])
  path = write(tmp_path / "day_1", lines)
  for chunk_records in (1000, 3):
    cols, bad = read(path, "skip", chunk_records)
    assert bad.count == len(bad_lines)
    want, _ = read(write(tmp_path / "good", [GOOD[i] for i in good_index]))
    assert base.num_records(cols) == len(good_index)
    np.testing.assert_array_equal(cols["label"], want["label"])
    np.testing.assert_array_equal(cols["dense"], want["dense"])
    for name in CATS:
      np.testing.assert_array_equal(cols["sparse"][name], want["sparse"][name])
  # The first skipped records are logged with their line numbers.
  assert bad.examples[0].startswith(f"{path}:2: field 'num_fields'")


def test_only_bad_lines_give_empty_columns(tmp_path):
  path = write(tmp_path / "day_2", ["1\t2", "x"])
  cols, bad = read(path, "skip")
  assert bad.count == 2 and base.num_records(cols) == 0
  assert cols["dense"].shape == (0, 13) and cols["sparse"]["C1"].shape == (0, 1)


@pytest.mark.parametrize(
  "dense,cat,field",
  [
    (b"\xb5", b"1", "I1"),  # 0xb5 & 0x7f is '5'
    (b"1\xb0", b"1", "I1"),
    (b"1", b"\xc1", "C1"),  # 0xc1 & 0x7f is 'A'
    (b"1", b"ab\xe3", "C1"),  # 0xe3 | 0x20 & 0x7f is 'c'
    (b"1", b"\x00", "C1"),
  ],
)
def test_bytes_outside_ascii_are_not_digits(dense, cat, field):
  raw = b"\t".join([b"1"] + [dense] + [b"2"] * 12 + [cat] + [b"3"] * 25)
  chunk = base.RawChunk("mem", 7, [line("1", ["1"] * 13, ["1"] * 26).encode(), raw])
  with pytest.raises(base.BadRecordError, match=re.escape(f"mem:8: field '{field}'")):
    FMT.parse(chunk, base.BadRecords())


def random_lines(n, seed=0):
  """Well-formed records with random values: missing, negative, long, upper- and lower-case hex."""
  rng = random.Random(seed)

  def dense():
    r = rng.random()
    if r < 0.2:
      return ""
    if r < 0.3:
      return str(-rng.randrange(1, 100))
    if r < 0.35:
      return str(rng.randrange(10**8, 10**15))
    return str(rng.randrange(0, 10 ** rng.randrange(1, 8)))

  def cat():
    if rng.random() < 0.15:
      return ""
    v = f"{rng.randrange(0, 2**32):08x}"[: rng.choice([8, 8, 8, 1, 3, 6])]
    return v.upper() if rng.random() < 0.2 else v

  return [line(rng.choice("01"), [dense() for _ in range(13)], [cat() for _ in range(26)]) for _ in range(n)]


def reference_parse(lines):
  """A line-by-line parse following the documented rules (slow, obviously right)."""
  label, dense, sparse = [], [], {name: [] for name in CATS}
  for text in lines:
    f = text.split("\t")
    label.append(float(f[0]))
    dense.append(expected_dense(f[1:14]))
    for j, name in enumerate(CATS):
      sparse[name].append(cat_id(f[14 + j], name))
  return np.float32(label), np.stack(dense), {k: np.uint64(v)[:, None] for k, v in sparse.items()}


def assert_same(a, b):
  np.testing.assert_array_equal(a["label"], b["label"])
  np.testing.assert_array_equal(a["dense"], b["dense"])
  assert a["sparse"].keys() == b["sparse"].keys()
  for name in a["sparse"]:
    np.testing.assert_array_equal(a["sparse"][name], b["sparse"][name])


def test_random_records_match_line_by_line_reference(tmp_path):
  lines = random_lines(300)
  cols, _ = read(write(tmp_path / "day_0", lines))
  label, dense, sparse = reference_parse(lines)
  np.testing.assert_array_equal(cols["label"], label)
  np.testing.assert_allclose(cols["dense"], dense, rtol=1e-6)
  for name in CATS:
    np.testing.assert_array_equal(cols["sparse"][name], sparse[name])


def test_random_garbage_is_flagged_exactly_where_the_rules_say(tmp_path):
  rng = random.Random(1)
  alphabet = "0123456789abcdefABCDEFgxz+- .é"

  def field(good):
    # Mostly well-formed values, sometimes a random string of the alphabet (which may be valid).
    if rng.random() < 0.03:
      return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
    return good

  lines, want_bad = [], []
  for text in random_lines(400, seed=1):
    f = text.split("\t")
    dense = [field(d) for d in f[1:14]]
    cats = [field(c) for c in f[14:]]
    ok = all(d == "" or (re.fullmatch(r"[+-]?[0-9]+", d) and len(d) <= 32) for d in dense)
    ok = ok and all(re.fullmatch(r"[0-9a-fA-F]{1,8}", c) or c == "" for c in cats)
    lines.append(line(f[0], dense, cats))
    want_bad.append(not ok)
  assert 0.2 < sum(want_bad) / len(lines) < 0.9
  path = write(tmp_path / "day_0", lines)
  cols, bad = read(path, "skip", chunk_records=64)
  assert bad.count == sum(want_bad)
  assert base.num_records(cols) == len(lines) - sum(want_bad)
  good = [t for t, b in zip(lines, want_bad) if not b]
  label, dense, sparse = reference_parse(good)
  np.testing.assert_array_equal(cols["label"], label)
  np.testing.assert_allclose(cols["dense"], dense, rtol=1e-6)
  for name in CATS:
    np.testing.assert_array_equal(cols["sparse"][name], sparse[name])


def test_chunks_concatenate_to_the_whole_file(tmp_path):
  lines = random_lines(50, seed=2)
  path = write(tmp_path / "day_0", lines)
  whole, _ = read(path, chunk_records=1000)
  chunks = list(FMT.chunks(path, 7))
  assert [c.first_line for c in chunks] == list(range(1, 51, 7))
  assert [len(c) for c in chunks] == [7] * 7 + [1]
  parts = [FMT.parse(c, base.BadRecords()) for c in chunks]
  assert_same(base.concat_columns(parts), whole)


@pytest.mark.parametrize("block", [1, 3, 64, 1 << 22])
@pytest.mark.parametrize("header_lines", [0, 2])
@pytest.mark.parametrize("gz", [False, True])
def test_text_chunks_equal_cutting_line_by_line(tmp_path, monkeypatch, block, header_lines, gz):
  """Blocks of any size, cut at newlines: the same lines and line numbers as iterating the file
  line by line, with CRLF, lone CRs, empty lines and no final newline on random bytes."""
  monkeypatch.setattr(base, "_BLOCK", block)
  rng = random.Random(block * 4 + header_lines * 2 + gz)
  pieces = [b"a", b"bc", b"\t", b"\r", b"\n", b"\r\n", b"\n\n", b"12345678", b"\r\r\n"]
  for case in range(20):
    data = b"".join(rng.choice(pieces) for _ in range(rng.randrange(0, 200)))
    path = str(tmp_path / f"f{case}{'.gz' if gz else ''}")
    with (gzip.open if gz else open)(path, "wb") as f:
      f.write(data)
    with (gzip.open if gz else open)(path, "rb") as f:  # the reference: the lines of a file object
      for _ in range(header_lines):
        f.readline()
      want = [raw.rstrip(b"\r\n") for raw in f]
    for records in (1, 4, 1000):
      chunks = list(base.text_chunks(path, records, header_lines))
      assert [x for c in chunks for x in c.payload] == want, (case, records)
      assert all(len(c.payload) == records for c in chunks[:-1])
      assert [c.first_line for c in chunks] == [header_lines + 1 + i * records for i in range(len(chunks))]


def test_error_line_numbers_in_later_chunks(tmp_path):
  lines = random_lines(40, seed=3)
  lines[32] = lines[32].replace("\t", "\t\t", 1)  # line 33: one field too many
  path = write(tmp_path / "day_0", lines)
  with pytest.raises(base.BadRecordError, match=re.escape(f"{path}:33: field 'num_fields'")):
    read(path, chunk_records=7)  # line 33 is the 5th line of the 5th chunk
  lines[32] = line("1", ["1"] * 13, ["1"] * 20 + ["nothex"] + ["1"] * 5)
  path = write(tmp_path / "day_1", lines)
  with pytest.raises(base.BadRecordError, match=re.escape(f"{path}:33: field 'C21'")):
    read(path, chunk_records=7)


def test_gzip_gives_the_same_columns_as_plain(tmp_path):
  lines = random_lines(60, seed=4)
  plain = write(tmp_path / "day_0", lines)
  gz = write(tmp_path / "day_0.gz", lines, gz=True)
  with open(gz, "rb") as f:
    assert f.read(2) == b"\x1f\x8b"
  a, _ = read(plain, chunk_records=16)
  b, _ = read(gz, chunk_records=16)
  assert_same(a, b)
  # Line numbers of errors are those of the decompressed file.
  lines[20] = line("7", ["1"] * 13, ["1"] * 26)
  gz = write(tmp_path / "day_1.gz", lines, gz=True)
  with pytest.raises(base.BadRecordError, match=re.escape(f"{gz}:21: field 'label'")):
    read(gz, chunk_records=16)


def test_several_files_each_with_its_own_line_numbers(tmp_path):
  days = [random_lines(10, seed=s) for s in range(3)]
  days[2][4] = line("1", ["1"] * 2 + ["1e3"] + ["1"] * 10, ["1"] * 26)
  paths = [
    write(tmp_path / "day_0", days[0]),
    write(tmp_path / "day_1.gz", days[1], gz=True),
    write(tmp_path / "day_2", days[2]),
  ]
  bad = base.BadRecords("skip")
  parts = [FMT.parse(c, bad) for p in paths for c in FMT.chunks(p, 4)]
  cols = base.concat_columns(parts)
  assert bad.count == 1 and bad.examples == [
    f"{paths[2]}:5: field 'I3': not an integer of at most 32 characters: b'1e3'"
  ]
  label, dense, sparse = reference_parse(days[0] + days[1] + days[2][:4] + days[2][5:])
  np.testing.assert_array_equal(cols["label"], label)
  np.testing.assert_allclose(cols["dense"], dense, rtol=1e-6)
  np.testing.assert_array_equal(cols["sparse"]["C26"], sparse["C26"])


def test_crlf_and_missing_final_newline(tmp_path):
  lines = random_lines(5, seed=5)
  path = str(tmp_path / "day_0")
  with open(path, "wb") as f:
    f.write("\r\n".join(lines).encode())  # Windows line ends, no final newline
  a, _ = read(path)
  b, _ = read(write(tmp_path / "day_1", lines))
  assert_same(a, b)


def test_schema():
  assert FMT.schema.num_dense == 13
  assert [f.name for f in FMT.schema.features] == CATS
  assert all(f.max_len == 1 and f.kind == "pooled" for f in FMT.schema.features)
  small = CriteoFormat(num_dense=2, num_categorical=3)
  chunk = base.RawChunk("mem", 1, [b"1\t4\t\tab\t\t0"])
  cols = small.parse(chunk, base.BadRecords())
  np.testing.assert_allclose(cols["dense"], [[np.log1p(4), 0.0]])
  assert cols["sparse"]["C3"][0, 0] == cat_id("0", "C3")


def test_empty_file(tmp_path):
  path = write(tmp_path / "day_0", [])
  assert os.path.getsize(path) == 0
  assert list(FMT.chunks(path, 10)) == []
