"""The Avazu CSV reader: header check, hour -> hour_of_day/weekday, hashing, bad records, chunking."""

import datetime
import random
import re
import string

import numpy as np
import pytest

from recsys_jax.data import base
from recsys_jax.data.avazu import HASHED_COLUMNS, HEADER, AvazuFormat, HeaderError
from tests.data.test_criteo import write as write_lines

FMT = AvazuFormat()
HEADER_LINE = (
  "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,app_category,"
  "device_id,device_ip,device_model,device_type,device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21"
)
# The first record of the published train file.
FIRST = (
  "1000009418151094273,0,14102100,1005,0,1fbe01fe,f3845767,28905ebd,ecad2386,7801e8d9,07d7df22,"
  "a99f214a,ddd2926e,44956a24,1,2,15706,320,50,1722,0,35,-1,79"
)


def rec(**values):
  """A record: the first published one with some columns replaced."""
  row = dict(zip(HEADER, FIRST.split(",")))
  row.update(values)
  return ",".join(row[c] for c in HEADER)


def write(path, records, gz=False, header=HEADER_LINE):
  return write_lines(path, ([header] if header is not None else []) + records, gz)


def read(path, policy="error", chunk_records=1000):
  bad = base.BadRecords(policy)
  return base.read_all(FMT, path, bad, chunk_records), bad


def assert_same(a, b):
  np.testing.assert_array_equal(a["label"], b["label"])
  assert a["dense"].shape == b["dense"].shape
  assert a["sparse"].keys() == b["sparse"].keys()
  for name in a["sparse"]:
    np.testing.assert_array_equal(a["sparse"][name], b["sparse"][name])


def test_header_is_the_published_one():
  assert HEADER_LINE.split(",") == list(HEADER)


@pytest.mark.parametrize(
  "header,message",
  [
    (HEADER_LINE.replace("click", "clicks"), "header column 2 is 'clicks', expected 'click'"),
    # The Kaggle test file has no click column.
    (HEADER_LINE.replace("click,", ""), "header column 2 is 'hour', expected 'click'"),
    (HEADER_LINE.replace("device_ip", "device_IP"), "header column 13 is 'device_IP', expected 'device_ip'"),
    (HEADER_LINE.replace(",C21", ""), "header has 23 columns; column 24 should be 'C21'"),
    (HEADER_LINE + ",C22", "header has an extra column 25, 'C22'"),
    (FIRST, "header column 1 is '1000009418151094273', expected 'id'"),  # no header at all
    (HEADER_LINE.replace(",", "\t"), "header column 1 is"),
  ],
)
def test_a_different_header_names_file_and_column(tmp_path, header, message):
  for gz in (False, True):
    path = write(tmp_path / f"train{'.gz' if gz else ''}", [FIRST], gz=gz, header=header)
    with pytest.raises(HeaderError) as err:
      list(FMT.chunks(path, 10))
    assert str(err.value).startswith(f"{path}: "), str(err.value)
    assert message in str(err.value), str(err.value)
    # A file-level error, whatever the bad-record policy.
    with pytest.raises(HeaderError):
      read(path, "skip")


def test_empty_file_has_no_header(tmp_path):
  path = write(tmp_path / "train", [], header=None)
  with pytest.raises(HeaderError, match="empty file"):
    list(FMT.chunks(path, 10))


def test_header_only_file_has_no_records(tmp_path):
  path = write(tmp_path / "train", [])
  assert list(FMT.chunks(path, 10)) == []


def test_schema():
  names = [f.name for f in FMT.schema.features]
  assert names[:2] == ["hour_of_day", "weekday"]
  assert names[2:] == list(HEADER[3:])  # C1 .. C21: every column but id, click and hour
  assert "id" not in names and "hour" not in names and "click" not in names
  assert FMT.schema.num_dense == 0
  assert all(f.max_len == 1 for f in FMT.schema.features)


# (hour, hour of day, weekday by hand with Monday = 0)
HOURS = [
  ("14102100", 0, 1),  # 2014-10-21 was a Tuesday
  ("14102623", 23, 6),  # 2014-10-26, Sunday
  ("14123117", 17, 2),  # 2014-12-31, Wednesday
  ("15022812", 12, 5),  # 2015-02-28, Saturday
  ("16022901", 1, 0),  # 2016-02-29 (leap day), Monday
  ("00010109", 9, 5),  # 2000-01-01, Saturday
]


def test_values_match_hand_computed_expectations(tmp_path):
  records = [
    rec(click="0"),
    rec(click="1", hour="14102623", site_id="85f751fd", C14="01005", C20=""),
    rec(id="3", click="1", hour="14123117", device_model="a" * 70, app_domain="x" * 13),
    rec(click="0", hour="15022812"),
    rec(click="1", hour="16022901", device_ip="ddd2926e"),
    rec(click="0", hour="00010109"),
  ]
  cols, bad = read(write(tmp_path / "train", records))
  assert bad.count == 0
  np.testing.assert_array_equal(cols["label"], np.float32([0, 1, 1, 0, 1, 0]))
  assert cols["dense"].shape == (6, 0) and cols["dense"].dtype == np.float32
  for i, (hour, hh, wd) in enumerate(HOURS):
    yy, mm, dd = (int(hour[k : k + 2]) for k in (0, 2, 4))
    assert datetime.date(2000 + yy, mm, dd).weekday() == wd  # the table above is right
    assert cols["sparse"]["hour_of_day"][i, 0] == base.hash_ints(np.array([hh]), "hour_of_day")[0]
    assert cols["sparse"]["weekday"][i, 0] == base.hash_ints(np.array([wd]), "weekday")[0]
  for i, text in enumerate(records):
    row = dict(zip(HEADER, text.split(",")))
    for name in HASHED_COLUMNS:
      ids = cols["sparse"][name]
      assert ids.dtype == np.uint64 and ids.shape == (6, 1)
      assert ids[i, 0] == base.hash_strings([row[name]], name)[0], (i, name)
  sp = {name: v[:, 0] for name, v in cols["sparse"].items()}
  # Equal values in a field: equal ids; the same value in two fields: different ids.
  assert sp["device_ip"][0] == sp["device_ip"][4]
  assert sp["C1"][0] == sp["C1"][1] and sp["C14"][0] != sp["C14"][1]  # '15706' vs '01005'
  assert sp["banner_pos"][0] != sp["C18"][0]  # both '0'
  assert sp["hour_of_day"][1] != sp["hour_of_day"][0] and sp["weekday"][3] != sp["weekday"][0]
  # An empty value is the empty string's hash: stable, and not that of another field.
  assert sp["C20"][1] == base.hash_strings([""], "C20")[0] != base.hash_strings([""], "C21")[0]


# (bad record, field named in the error)
BAD = [
  (FIRST + ",1", "num_fields"),
  (FIRST.rsplit(",", 1)[0], "num_fields"),
  (FIRST.replace(",", ";"), "num_fields"),
  ("", "num_fields"),
  (rec(click="2"), "click"),
  (rec(click=""), "click"),
  (rec(click="00"), "click"),
  (rec(hour="1410210"), "hour"),  # 7 digits
  (rec(hour="141021000"), "hour"),  # 9 digits
  (rec(hour="1410210a"), "hour"),
  (rec(hour="14102124"), "hour"),  # hour 24
  (rec(hour="14132100"), "hour"),  # month 13
  (rec(hour="14002100"), "hour"),  # month 0
  (rec(hour="14100000"), "hour"),  # day 0
  (rec(hour="14103200"), "hour"),  # day 32
  (rec(hour="14043100"), "hour"),  # April 31
  (rec(hour="14022900"), "hour"),  # 2014 is no leap year
  (rec(hour=""), "hour"),
  (rec(hour="+4102100"), "hour"),
  (rec(click="x", hour="x"), "click"),  # several faults: the first column is named
]


@pytest.mark.parametrize("bad_record,field", BAD)
def test_error_names_file_line_and_field(tmp_path, bad_record, field):
  path = write(tmp_path / "train", [rec(), rec(click="1"), bad_record, rec()])
  with pytest.raises(base.BadRecordError) as err:
    read(path)
  msg = str(err.value)
  assert f"{path}:4:" in msg, msg  # line 1 is the header
  assert f"field {field!r}" in msg, msg


def test_skip_drops_bad_lines_and_keeps_good_ones_in_order(tmp_path):
  good = [rec(click=str(k % 2), hour=f"141021{k % 24:02d}", C21=str(k)) for k in range(len(BAD) + 1)]
  records = []
  for k, (b, _) in enumerate(BAD):
    records += [good[k], b]
  records.append(good[-1])
  path = write(tmp_path / "train", records)
  want, _ = read(write(tmp_path / "good", good))
  for chunk_records in (1000, 4):
    cols, bad = read(path, "skip", chunk_records)
    assert bad.count == len(BAD)
    assert base.num_records(cols) == len(good)
    assert_same(cols, want)
  assert bad.examples[0].startswith(f"{path}:3: field 'num_fields'")


def random_records(n, seed=0):
  rng = random.Random(seed)
  chars = string.ascii_letters + string.digits + "-_."

  def value():
    length = rng.choice([0, 1, 4, 8, 8, 8, 9, 15, 16, 17, 30, 64, 65, 100])
    return "".join(rng.choice(chars) for _ in range(length))

  out = []
  for k in range(n):
    day = datetime.date(2014, 1, 1) + datetime.timedelta(days=rng.randrange(0, 3 * 365))
    hour = f"{day:%y%m%d}{rng.randrange(24):02d}"
    out.append(",".join([str(k), rng.choice("01"), hour] + [value() for _ in HASHED_COLUMNS]))
  return out


def reference_parse(records):
  """A line-by-line parse following the documented rules, with datetime for the weekday."""
  label, sparse = [], {f.name: [] for f in FMT.schema.features}
  for text in records:
    row = dict(zip(HEADER, text.split(",")))
    label.append(float(row["click"]))
    h = row["hour"]
    day = datetime.date(2000 + int(h[:2]), int(h[2:4]), int(h[4:6]))
    sparse["hour_of_day"].append(base.hash_ints(np.array([int(h[6:])]), "hour_of_day")[0])
    sparse["weekday"].append(base.hash_ints(np.array([day.weekday()]), "weekday")[0])
    for name in HASHED_COLUMNS:
      sparse[name].append(base.hash_strings([row[name]], name)[0])
  return np.float32(label), {k: np.uint64(v)[:, None] for k, v in sparse.items()}


def test_random_records_match_line_by_line_reference(tmp_path):
  records = random_records(200)
  cols, _ = read(write(tmp_path / "train", records), chunk_records=64)
  label, sparse = reference_parse(records)
  np.testing.assert_array_equal(cols["label"], label)
  for name, ids in sparse.items():
    np.testing.assert_array_equal(cols["sparse"][name], ids, err_msg=name)


def test_random_hours_are_checked_like_datetime(tmp_path):
  rng = random.Random(3)
  hours = [
    f"{rng.randrange(100):02d}{rng.randrange(14):02d}{rng.randrange(33):02d}{rng.randrange(26):02d}" for _ in range(600)
  ]

  def valid(h):
    try:
      datetime.date(2000 + int(h[:2]), int(h[2:4]), int(h[4:6]))
    except ValueError:
      return False
    return int(h[6:]) < 24

  records = [rec(hour=h) for h in hours]
  cols, bad = read(write(tmp_path / "train", records), "skip", chunk_records=100)
  ok = [h for h in hours if valid(h)]
  assert bad.count == len(hours) - len(ok) > 50
  _, sparse = reference_parse([rec(hour=h) for h in ok])
  np.testing.assert_array_equal(cols["sparse"]["weekday"], sparse["weekday"])
  np.testing.assert_array_equal(cols["sparse"]["hour_of_day"], sparse["hour_of_day"])


def test_chunks_skip_the_header_and_concatenate_to_the_whole_file(tmp_path):
  records = random_records(40, seed=1)
  path = write(tmp_path / "train", records)
  whole, _ = read(path)
  chunks = list(FMT.chunks(path, 6))
  assert [c.first_line for c in chunks] == list(range(2, 42, 6))
  assert chunks[0].payload[0] == records[0].encode()
  parts = [FMT.parse(c, base.BadRecords()) for c in chunks]
  assert_same(base.concat_columns(parts), whole)


def test_error_line_numbers_in_later_chunks(tmp_path):
  records = random_records(40, seed=2)
  records[30] = records[30].replace(",", ",,", 1)  # file line 32 (after the header)
  path = write(tmp_path / "train", records)
  with pytest.raises(base.BadRecordError, match=re.escape(f"{path}:32: field 'num_fields'")):
    read(path, chunk_records=6)
  records[30] = rec(hour="14023112")
  path = write(tmp_path / "train2", records)
  with pytest.raises(base.BadRecordError, match=re.escape(f"{path}:32: field 'hour'")):
    read(path, chunk_records=6)


def test_gzip_gives_the_same_columns_as_plain(tmp_path):
  records = random_records(50, seed=4)
  a, _ = read(write(tmp_path / "train", records), chunk_records=16)
  gz = write(tmp_path / "train.gz", records, gz=True)
  b, _ = read(gz, chunk_records=16)
  assert_same(a, b)
  records[20] = rec(click="3")
  gz = write(tmp_path / "train2.gz", records, gz=True)
  with pytest.raises(base.BadRecordError, match=re.escape(f"{gz}:22: field 'click'")):
    read(gz, chunk_records=16)


def test_crlf_line_ends(tmp_path):
  records = random_records(5, seed=5)
  path = str(tmp_path / "train")
  with open(path, "wb") as f:
    f.write("\r\n".join([HEADER_LINE] + records).encode())
  a, _ = read(path)
  b, _ = read(write(tmp_path / "train2", records))
  assert_same(a, b)


def test_only_bad_lines_give_empty_columns(tmp_path):
  path = write(tmp_path / "train", [rec(click="5"), "1,2"])
  cols, bad = read(path, "skip")
  assert bad.count == 2 and base.num_records(cols) == 0
  assert cols["dense"].shape == (0, 0) and cols["sparse"]["weekday"].shape == (0, 1)
  assert set(cols["sparse"]) == {f.name for f in FMT.schema.features}
