"""The compiled Criteo and Avazu parsers against the numpy ones: bit for bit on good chunks, same reports on bad ones.

``parse`` runs :mod:`recsys_jax.data.text_kernels` on a chunk whose lines are all well formed
and falls back to ``parse_numpy`` otherwise; ``parse_numpy`` is the reference here
(test_criteo.py and test_avazu.py check the readers' values against hand-computed ones).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from recsys_jax.data import base, text_kernels
from recsys_jax.data.avazu import HEADER, AvazuFormat
from recsys_jax.data.criteo import CriteoFormat

FMT = CriteoFormat()


def dense_value(rng: random.Random) -> str:
  """A valid dense field, edge cases over-represented."""
  sign = rng.choice(["", "", "", "-", "+"])
  r = rng.random()
  if r < 0.15:
    return ""
  if r < 0.25:
    return sign + "0" * rng.randrange(1, 12)  # -0, +00, -000000000 (9 characters: +0.0)
  if r < 0.35:
    return sign + "0" * rng.randrange(1, 4) + str(rng.randrange(1, 10**6))  # leading zeros
  if r < 0.45:
    return sign + str(rng.randrange(4090, 4100))  # either side of the log table's end
  if r < 0.6:  # 9 to 18 digits, rounding to float64 with and without a tie
    return sign + str(rng.choice([rng.randrange(10**8, 10**18), 2**53 + rng.randrange(0, 64), 10**18 - 1]))
  if r < 0.65:  # more than 18 digits, at most 32 characters: read by float(int(text))
    return sign + str(rng.randrange(10**18, 10 ** rng.randrange(19, 32)))
  if r < 0.7:
    return sign + "0" * 20 + "7"  # 22 digits, a small value
  return sign + str(rng.randrange(0, 10 ** rng.randrange(1, 8)))


def hex_value(rng: random.Random) -> str:
  if rng.random() < 0.12:
    return ""
  digits = f"{rng.randrange(0, 2**32):08x}"[: rng.randrange(1, 9)]
  return "".join(c.upper() if rng.random() < 0.3 else c for c in digits)


def good_line(rng: random.Random, fmt: CriteoFormat = FMT) -> bytes:
  fields = [rng.choice("01")]
  fields += [dense_value(rng) for _ in range(fmt.num_dense)]
  fields += [hex_value(rng) for _ in range(fmt.num_categorical)]
  return "\t".join(fields).encode()


def assert_bit_identical(a: base.Columns, b: base.Columns) -> None:
  for key in ("label", "dense"):
    assert a[key].dtype == b[key].dtype == np.float32 and a[key].shape == b[key].shape, key
    assert np.array_equal(a[key].view(np.uint32), b[key].view(np.uint32)), key  # -0.0 is not +0.0
  assert list(a["sparse"]) == list(b["sparse"])
  for name in a["sparse"]:
    x, y = a["sparse"][name], b["sparse"][name]
    assert x.dtype == y.dtype == np.uint64 and x.shape == y.shape and x.flags.c_contiguous, name
    assert np.array_equal(x, y), name
  assert a["sparse_weights"] == b["sparse_weights"] == {}


def fast(fmt: CriteoFormat, lines):
  return text_kernels.criteo_columns(b"\n".join(lines + [b""]), len(lines), fmt.num_dense, fmt._cat_seeds)


@pytest.mark.parametrize("seed", range(4))
def test_good_chunks_are_bit_identical_to_numpy(seed):
  rng = random.Random(seed)
  lines = [good_line(rng) for _ in range(rng.choice([1, 7, 500, 3000]))]
  assert fast(FMT, lines) is not None  # the kernel took the chunk: this compares the two paths
  chunk = base.RawChunk("mem", 1, lines)
  assert_bit_identical(FMT.parse(chunk, base.BadRecords()), FMT.parse_numpy(chunk, base.BadRecords()))


def test_each_edge_case_alone():
  """One value at a time in I3 and C5, so a mismatch names its value."""
  ints = ["", "0", "-0", "+0", "-00000000", "-000000000", "+7", "-7", "007", "4095", "4096", "-4096", "99999999"]
  ints += ["123456789", "-123456789", str(2**53 + 1), str(2**53 + 3), "999999999999999999", "-999999999999999999"]
  ints += ["1" * 19, "-" + "9" * 31, "0" * 31 + "5", "9" * 32]
  for value in ints:
    fields = ["1"] + ["1"] * 13 + ["a"] * 26
    fields[3] = value
    chunk = base.RawChunk("mem", 1, ["\t".join(fields).encode()])
    assert fast(FMT, chunk.payload) is not None, value
    assert_bit_identical(FMT.parse(chunk, base.BadRecords()), FMT.parse_numpy(chunk, base.BadRecords()))
  for value in ["", "0", "f", "F", "0a", "0A", "abcdef12", "ABCDEF12", "fFfFfFfF", "00000000", "7" * 7]:
    fields = ["0"] + [""] * 13 + ["1"] * 26
    fields[14 + 4] = value
    chunk = base.RawChunk("mem", 1, ["\t".join(fields).encode()])
    assert fast(FMT, chunk.payload) is not None, value
    assert_bit_identical(FMT.parse(chunk, base.BadRecords()), FMT.parse_numpy(chunk, base.BadRecords()))


@pytest.mark.parametrize("num_dense,num_categorical", [(0, 3), (2, 0), (0, 0), (1, 1)])
def test_other_column_counts(num_dense, num_categorical):
  fmt = CriteoFormat(num_dense, num_categorical)
  rng = random.Random(num_dense * 10 + num_categorical)
  lines = [good_line(rng, fmt) for _ in range(200)]
  assert fast(fmt, lines) is not None
  chunk = base.RawChunk("mem", 1, lines)
  assert_bit_identical(fmt.parse(chunk, base.BadRecords()), fmt.parse_numpy(chunk, base.BadRecords()))


def test_many_values_past_18_digits_agree():
  rng = random.Random(5)
  lines = [good_line(rng) for _ in range(400)]
  long_value = ("1" * 25).encode()
  lines = [b"\t".join([x.split(b"\t")[0], long_value, *x.split(b"\t")[2:]]) for x in lines]
  assert fast(FMT, lines) is not None
  chunk = base.RawChunk("mem", 1, lines)
  assert_bit_identical(FMT.parse(chunk, base.BadRecords()), FMT.parse_numpy(chunk, base.BadRecords()))


BAD_LINES = [
  b"",  # an empty line
  b"1\t2",  # too few fields
  b"\t".join([b"1"] * 41),  # too many
  b"\t".join([b"2"] + [b"1"] * 39),  # label
  b"\t".join([b"01"] + [b"1"] * 39),
  b"\t".join([b"1", b"1a"] + [b"1"] * 38),  # dense
  b"\t".join([b"1", b"+"] + [b"1"] * 38),
  b"\t".join([b"1", b"-"] + [b"1"] * 38),
  b"\t".join([b"1", b"1" * 33] + [b"1"] * 38),  # 33 characters
  b"\t".join([b"1", b"+" + b"1" * 32] + [b"1"] * 38),
  b"\t".join([b"1", b"--1"] + [b"1"] * 38),
  b"\t".join([b"1", b" 1"] + [b"1"] * 38),
  b"\t".join([b"1", b"1\xb1"] + [b"1"] * 38),
  b"\t".join([b"1"] * 14 + [b"123456789"] + [b"1"] * 25),  # hex: 9 digits
  b"\t".join([b"1"] * 14 + [b"g"] + [b"1"] * 25),
  b"\t".join([b"1"] * 14 + [b"\xc1"] + [b"1"] * 25),
  b"\t".join([b"1"] * 39 + [b"ab\r"]),
  b"\t".join([b"1"] * 39 + [b"-1"]),
]


@pytest.mark.parametrize("bad_line", BAD_LINES)
def test_a_bad_line_is_reported_as_numpy_reports_it(bad_line):
  rng = random.Random(len(bad_line))
  lines = [good_line(rng) for _ in range(300)]
  lines[rng.randrange(300)] = bad_line
  lines[rng.randrange(300)] = bad_line
  assert fast(FMT, lines) is None
  chunk = base.RawChunk("mem", 11, lines)
  skip_fast, skip_numpy = base.BadRecords("skip"), base.BadRecords("skip")
  assert_bit_identical(FMT.parse(chunk, skip_fast), FMT.parse_numpy(chunk, skip_numpy))
  assert skip_fast.count == skip_numpy.count >= 1 and skip_fast.examples == skip_numpy.examples
  with pytest.raises(base.BadRecordError) as fast_error:
    FMT.parse(chunk, base.BadRecords("error"))
  with pytest.raises(base.BadRecordError) as numpy_error:
    FMT.parse_numpy(chunk, base.BadRecords("error"))
  assert str(fast_error.value) == str(numpy_error.value)


def test_kernels_are_compiled_without_the_gil():
  assert text_kernels._criteo_kernel.targetoptions["nogil"]
  assert text_kernels._avazu_kernel.targetoptions["nogil"]


# ---------------------------------------------------------------------------------------------
# Avazu.

AVAZU = AvazuFormat()


def avazu_hashed(rng: random.Random) -> bytes:
  r = rng.random()
  if r < 0.05:
    return b""
  if r < 0.1:  # longer than the 64 bytes the kernel hashes itself
    return bytes(rng.choice(b"abcdef0123") for _ in range(rng.randrange(60, 200)))
  if r < 0.13:
    return b"a\x00b" if rng.random() < 0.5 else b"\x00"  # NUL bytes are skipped by both
  if r < 0.16:
    return "é".encode() * rng.randrange(1, 4)
  return f"{rng.randrange(0, 16**8):x}"[: rng.randrange(1, 9)].encode()


def avazu_hour(rng: random.Random) -> bytes:
  yy = rng.randrange(0, 100)
  mm = rng.randrange(1, 13)
  days = [31, 29 if yy % 4 == 0 else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][mm - 1]
  dd = rng.choice([1, days, rng.randrange(1, days + 1)])
  return f"{yy:02d}{mm:02d}{dd:02d}{rng.randrange(0, 24):02d}".encode()


def avazu_line(rng: random.Random) -> bytes:
  ident = str(rng.randrange(0, 10**20)).encode() if rng.random() < 0.9 else b""
  hashed = [avazu_hashed(rng) for _ in range(len(HEADER) - 3)]
  return b",".join([ident, rng.choice([b"0", b"1"]), avazu_hour(rng), *hashed])


def avazu_fast(lines):
  return text_kernels.avazu_columns(b"\n".join(lines + [b""]), len(lines), AVAZU.names)


@pytest.mark.parametrize("seed", range(3))
def test_avazu_good_chunks_are_bit_identical_to_numpy(seed):
  rng = random.Random(100 + seed)
  lines = [avazu_line(rng) for _ in range(rng.choice([1, 300, 2000]))]
  assert avazu_fast(lines) is not None
  chunk = base.RawChunk("mem", 2, lines)
  assert_bit_identical(AVAZU.parse(chunk, base.BadRecords()), AVAZU.parse_numpy(chunk, base.BadRecords()))


def test_avazu_every_day_of_the_century_agrees():
  """Hour of day and weekday of the first, 28th, 29th, 30th and 31st of every month that has it."""
  rng = random.Random(7)
  lines = []
  for yy in range(100):
    for mm in range(1, 13):
      days = [31, 29 if yy % 4 == 0 else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][mm - 1]
      for dd in sorted({1, 28, days}):
        hashed = [b"x"] * (len(HEADER) - 3)
        lines.append(b",".join([b"1", b"0", f"{yy:02d}{mm:02d}{dd:02d}{rng.randrange(24):02d}".encode(), *hashed]))
  assert avazu_fast(lines) is not None
  chunk = base.RawChunk("mem", 2, lines)
  assert_bit_identical(AVAZU.parse(chunk, base.BadRecords()), AVAZU.parse_numpy(chunk, base.BadRecords()))


def _avazu_with(click=b"1", hour=b"14102100", fields=None):
  fields = fields if fields is not None else [b"a"] * (len(HEADER) - 3)
  return b",".join([b"1000009418151094273", click, hour, *fields])


AVAZU_BAD_LINES = [
  b"",
  b"1,0",
  _avazu_with(fields=[b"a"] * (len(HEADER) - 2)),  # one field too many
  _avazu_with(fields=[b"a"] * (len(HEADER) - 4)),  # one too few
  _avazu_with(click=b"2"),
  _avazu_with(click=b""),
  _avazu_with(hour=b"1410210"),  # 7 digits
  _avazu_with(hour=b"141021000"),  # 9
  _avazu_with(hour=b"14102124"),  # hour 24
  _avazu_with(hour=b"14130100"),  # month 13
  _avazu_with(hour=b"14000100"),  # month 0
  _avazu_with(hour=b"14100000"),  # day 0
  _avazu_with(hour=b"15022900"),  # 2015-02-29
  _avazu_with(hour=b"14043100"),  # April 31st
  _avazu_with(hour=b"1410210a"),
  _avazu_with(hour=b"1410\xb12100"),
]


@pytest.mark.parametrize("bad_line", AVAZU_BAD_LINES)
def test_avazu_bad_line_is_reported_as_numpy_reports_it(bad_line):
  rng = random.Random(len(bad_line))
  lines = [avazu_line(rng) for _ in range(200)]
  lines[rng.randrange(200)] = bad_line
  assert avazu_fast(lines) is None
  chunk = base.RawChunk("mem", 2, lines)
  skip_fast, skip_numpy = base.BadRecords("skip"), base.BadRecords("skip")
  assert_bit_identical(AVAZU.parse(chunk, skip_fast), AVAZU.parse_numpy(chunk, skip_numpy))
  assert skip_fast.count == skip_numpy.count == 1 and skip_fast.examples == skip_numpy.examples
  with pytest.raises(base.BadRecordError) as fast_error:
    AVAZU.parse(chunk, base.BadRecords("error"))
  with pytest.raises(base.BadRecordError) as numpy_error:
    AVAZU.parse_numpy(chunk, base.BadRecords("error"))
  assert str(fast_error.value) == str(numpy_error.value)
