"""Fuzz target 'readers': every file reader, through ``readers.build_reader`` as a run builds it.

An input is a format (criteo, avazu, csv, parquet, movielens), the bytes of its file(s) and a
few reader settings (bad-record policy, chunk size, batch size). The files are drawn as random
bytes, or as well-formed records with changes: a line cut short, fields added or dropped,
a value replaced by text, NUL bytes, bytes that are not UTF-8, a 200 kB field, numbers that
overflow (int64, float32) or are NaN/inf, an empty file, a header that lies (a column missing,
renamed, doubled, moved), a gzip file cut short or with flipped bits, a Parquet file with
flipped bits or cut short, a MovieLens file missing.

Correct: the reader yields batches whose columns have the schema's shapes and dtypes, labels in
{0, 1} and finite dense values, or raises a ``ValueError`` (the type the readers document:
``BadRecordError``, ``HeaderError`` and the plain ones are all ValueErrors) whose message names
the file; a ``BadRecordError`` also names the line (``path:line``). The train iterator is read
for at most 3 batches (it cycles forever), eval to its end.
"""

from __future__ import annotations

import gzip
import io
import os
import shutil
import tempfile
from typing import Any, Dict, List

import numpy as np
from hypothesis import strategies as st

from .harness import Crash, Target, clear_error

FORMATS = ("criteo", "avazu", "csv", "parquet", "movielens")
CSV_COLUMNS = ("label", "d1", "d2", "c1", "tags", "hist")
_HUGE_FIELD = 200_000

# A field's replacement: odd text and numbers a file might hold.
_ODD = st.one_of(
  st.binary(max_size=12),
  st.sampled_from(
    [
      b"",
      b"\0",
      b"a\0b",
      b"\xff\xfe",
      b"\xc3",
      b"nan",
      b"-inf",
      b"inf",
      b"1e39",
      b"-1e39",
      b"1e308",
      b"1e400",
      b"99999999999999999999",
      b"-9223372036854775809",
      b"9223372036854775807",
      b"0x1F",
      b"\xd9\xa3",
      b"1_000",
      b" 1 ",
      b'"',
      b'"a,b"',
      b"\r",
      b"\t",
      b",",
      b"|",
      b"-",
      b"+",
      b"1.5",
      b"deadbeef0",
      b"DEADBEEF",
      b"14102100",
      b"14023023",
      b"99999999",
    ]
  ),
  st.just(b"HUGE"),
)


def _hex(draw):
  return draw(st.sampled_from([b"", b"68fd1e64", b"80e26c9b", b"0a", b"FFFFFFFF", b"0"]))


@st.composite
def _criteo_line(draw):
  label = draw(st.sampled_from([b"0", b"1"]))
  dense = [draw(st.sampled_from([b"", b"0", b"1", b"-1", b"17", b"12345678901"])) for _ in range(13)]
  return b"\t".join([label, *dense, *[_hex(draw) for _ in range(26)]])


@st.composite
def _avazu_line(draw):
  hour = draw(st.sampled_from([b"14102100", b"14102923", b"16022915"]))
  rest = [draw(st.sampled_from([b"1005", b"0", b"1fbe01fe", b"", b"a99f214a"])) for _ in range(21)]
  return b",".join([b"1000009418151094273", draw(st.sampled_from([b"0", b"1"])), hour, *rest])


@st.composite
def _csv_line(draw):
  label = draw(st.sampled_from([b"0", b"1", b"1.0"]))
  d1, d2 = (draw(st.sampled_from([b"", b"0", b"2.5", b"-3", b"1e3"])) for _ in range(2))
  c1 = draw(st.sampled_from([b"us", b"", b"fr", b'"a,b"']))
  tags = draw(st.sampled_from([b"a|b", b"", b"x|y|z|w", b"|"]))
  hist = draw(st.sampled_from([b"1 2 3", b"", b"9"]))
  return b",".join([label, d1, d2, c1, tags, hist])


@st.composite
def _ratings_line(draw):
  u, m = draw(st.integers(1, 5)), draw(st.integers(1, 6))
  r = draw(st.sampled_from([b"0.5", b"4.0", b"3.5", b"5"]))
  return b"%d,%d,%s,%d" % (u, m, r, draw(st.integers(964982000, 964983000)))


@st.composite
def _movies_line(draw):
  m = draw(st.integers(1, 6))
  title = draw(
    st.sampled_from(
      [b"Toy Story (1995)", b'"American President, The (1995)"', b"No Year", b"Show (2006\xe2\x80\x932007)"]
    )
  )
  genres = draw(st.sampled_from([b"Comedy|Drama", b"(no genres listed)", b"", b"A|B|C|D|E|F|G|H|I|J"]))
  return b",".join([b"%d" % m, title, genres])


LINES = {
  "criteo": _criteo_line,
  "avazu": _avazu_line,
  "csv": _csv_line,
  "ratings": _ratings_line,
  "movies": _movies_line,
}
SEPS = {"criteo": b"\t", "avazu": b",", "csv": b",", "ratings": b",", "movies": b","}


def _header(kind: str) -> List[bytes]:
  from recsys_jax.data.avazu import HEADER

  return {
    "criteo": [],
    "avazu": [h.encode() for h in HEADER],
    "csv": [c.encode() for c in CSV_COLUMNS],
    "ratings": [b"userId", b"movieId", b"rating", b"timestamp"],
    "movies": [b"movieId", b"title", b"genres"],
  }[kind]


@st.composite
def _edit(draw):
  """One change to a file of lines: (what, line, field, value)."""
  what = draw(st.sampled_from(["field", "field", "field", "cut", "drop_field", "add_field", "raw_line", "blank"]))
  return [what, draw(st.integers(0, 50)), draw(st.integers(0, 60)), draw(_ODD), draw(st.integers(0, 400))]


@st.composite
def text_file(draw, kind: str):
  """A text file of ``kind`` as a dict: its header (possibly lying), lines and the edits to them."""
  n = draw(st.integers(0, 12))
  lines = draw(st.lists(LINES[kind](), min_size=n, max_size=n))
  header = _header(kind)
  header_edit = None
  if header and draw(st.integers(0, 4)) == 0:
    header_edit = [
      draw(st.sampled_from(["drop", "rename", "double", "swap", "extra", "empty", "bom", "bytes"])),
      draw(st.integers(0, 30)),
      draw(_ODD),
    ]
  edits = draw(st.lists(_edit(), max_size=4))
  gz = kind in ("criteo", "avazu", "csv") and draw(st.integers(0, 5)) == 0
  gz_damage = (
    draw(st.one_of(st.none(), st.tuples(st.sampled_from(["cut", "flip"]), st.integers(0, 10**6)))) if gz else None
  )
  return {
    "kind": kind,
    "header": header,
    "header_edit": header_edit,
    "lines": lines,
    "edits": edits,
    "gz": gz,
    "gz_damage": gz_damage,
  }


def _odd_value(v: bytes) -> bytes:
  return b"7" * _HUGE_FIELD if v == b"HUGE" else v


def render_text(spec: Dict[str, Any]) -> bytes:
  """The bytes of a drawn text file."""
  sep = SEPS[spec["kind"]]
  lines = [bytes(x) for x in spec["lines"]]
  for what, i, j, value, cut in spec["edits"]:
    value = _odd_value(value)
    if what == "blank":
      lines.insert(i % (len(lines) + 1), b"")
      continue
    if not lines:
      lines.append(value)
      continue
    i %= len(lines)
    fields = lines[i].split(sep)
    j %= len(fields)
    if what == "field":
      fields[j] = value
    elif what == "drop_field":
      del fields[j]
    elif what == "add_field":
      fields.insert(j, value)
    elif what == "cut":
      lines[i] = lines[i][: cut % (len(lines[i]) + 1)]
      continue
    elif what == "raw_line":
      lines[i] = value
      continue
    lines[i] = sep.join(fields)
  header = [bytes(h) for h in spec["header"]]
  if spec["header_edit"] is not None and header:
    what, j, value = spec["header_edit"]
    j %= len(header)
    value = _odd_value(value)
    if what == "drop":
      del header[j]
    elif what == "rename":
      header[j] = value
    elif what == "double":
      header.insert(j, header[j])
    elif what == "swap":
      header[j], header[0] = header[0], header[j]
    elif what == "extra":
      header.append(value or b"x")
    elif what == "empty":
      header = []
    elif what == "bom":
      header[0] = b"\xef\xbb\xbf" + header[0]
    elif what == "bytes":
      header = [value]
  out = sep.join(header) + b"\n" if spec["header"] and (header or spec["header_edit"][0] != "empty") else b""
  out += b"".join(x + b"\n" for x in lines)
  if spec.get("gz"):
    out = gzip.compress(out, mtime=0)
    if spec["gz_damage"] is not None:
      what, k = spec["gz_damage"]
      b = bytearray(out)
      if what == "cut":
        b = b[: k % len(b)]
      else:
        b[(k // 8) % len(b)] ^= 1 << (k % 8)
      out = bytes(b)
  return out


@st.composite
def parquet_file(draw):
  """A Parquet file as a dict: rows (columns of CSV_COLUMNS, values of several types) and damage."""
  n = draw(st.integers(0, 8))
  label = draw(st.lists(st.sampled_from([0, 1, 1.0, 2, None, "1", "x", float("nan")]), min_size=n, max_size=n))
  d1 = draw(
    st.lists(st.sampled_from([0.0, 2.5, -3.0, None, float("inf"), 1e39, 1e308, float("nan")]), min_size=n, max_size=n)
  )
  d2 = draw(st.lists(st.sampled_from([0, 7, -2, None, 2**62]), min_size=n, max_size=n))
  c1 = draw(st.lists(st.sampled_from(["us", "", None, "\0", "é"]), min_size=n, max_size=n))
  tags = draw(
    st.lists(st.one_of(st.none(), st.lists(st.sampled_from(["a", "b", "", None]), max_size=4)), min_size=n, max_size=n)
  )
  hist = draw(st.lists(st.sampled_from(["1 2 3", "", None]), min_size=n, max_size=n))
  drop = draw(st.one_of(st.none(), st.sampled_from(CSV_COLUMNS)))
  damage = draw(
    st.one_of(st.none(), st.none(), st.tuples(st.sampled_from(["cut", "flip", "flip", "zero"]), st.integers(0, 10**7)))
  )
  label_type = draw(st.sampled_from(["int", "float", "str", "auto"]))
  return {
    "kind": "parquet",
    "cols": [label, d1, d2, c1, tags, hist],
    "drop": drop,
    "damage": damage,
    "label_type": label_type,
  }


def render_parquet(spec: Dict[str, Any]) -> bytes:
  import pyarrow as pa
  import pyarrow.parquet as pq

  label, d1, d2, c1, tags, hist = spec["cols"]
  types = {
    "int": pa.int64(),
    "float": pa.float64(),
    "str": pa.string(),
  }
  lt = types.get(spec["label_type"])
  if lt is not None:
    label = [None if v is None else (str(v) if lt == pa.string() else v) for v in label]
    try:
      label_arr = pa.array(label, lt)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
      label_arr = pa.array([None if v is None else str(v) for v in label], pa.string())
  else:
    label_arr = pa.array([None if v is None else str(v) for v in label], pa.string())
  cols = {
    "label": label_arr,
    "d1": pa.array(d1, pa.float64()),
    "d2": pa.array(d2, pa.int64()),
    "c1": pa.array(c1, pa.string()),
    "tags": pa.array(tags, pa.list_(pa.string())),
    "hist": pa.array(hist, pa.string()),
  }
  if spec["drop"]:
    del cols[spec["drop"]]
  buf = io.BytesIO()
  pq.write_table(pa.table(cols), buf, row_group_size=3)
  out = bytearray(buf.getvalue())
  if spec["damage"] is not None:
    what, k = spec["damage"]
    if what == "cut":
      out = out[: k % len(out)]
    elif what == "flip":
      out[(k // 8) % len(out)] ^= 1 << (k % 8)
    else:
      start = k % len(out)
      out[start : start + 16] = bytes(len(out[start : start + 16]))
  return bytes(out)


@st.composite
def reader_input(draw):
  fmt = draw(st.sampled_from(FORMATS))
  if draw(st.integers(0, 9)) == 0:
    files = {"random": draw(st.binary(max_size=400))}
  elif fmt == "parquet":
    files = {"file": draw(parquet_file())}
  elif fmt == "movielens":
    files = {"ratings": draw(text_file("ratings")), "movies": draw(text_file("movies"))}
    if draw(st.integers(0, 9)) == 0:
      files[draw(st.sampled_from(["ratings", "movies"]))] = None  # missing
  else:
    files = {"file": draw(text_file(fmt))}
  settings = {
    "policy": draw(st.sampled_from(["error", "skip"])),
    "chunk_records": draw(st.integers(1, 6)),
    "shuffle_window": draw(st.integers(1, 3)),
    "batch_size": draw(st.sampled_from([1, 2, 4])),
    "eval_samples": draw(st.sampled_from([0, 3])),
    "label_threshold": draw(st.sampled_from([None, None, 0.5])),
    "dense_transform": draw(st.sampled_from(["log1p", "none"])),
  }
  return {"format": fmt, "files": files, "settings": settings}


def _write(case: Dict[str, Any], d: str) -> List[str]:
  """Writes the input's files under ``d``; returns the names an error may use for them."""
  fmt, files = case["format"], case["files"]
  if fmt == "movielens":
    names = {"ratings": "ratings.csv", "movies": "movies.csv"}
    for key, name in names.items():
      spec = files.get(key, files.get("random"))
      if spec is None:
        continue
      data = spec if isinstance(spec, bytes) else render_text(spec)
      with open(os.path.join(d, name), "wb") as f:
        f.write(data)
    return [d]
  spec = files.get("file", files.get("random"))
  gz = isinstance(spec, dict) and spec.get("gz")
  ext = {"criteo": ".tsv", "avazu": ".csv", "csv": ".csv", "parquet": ".parquet"}[fmt] + (".gz" if gz else "")
  path = os.path.join(d, "data" + ext)
  if isinstance(spec, bytes):
    data = spec
  elif fmt == "parquet":
    data = render_parquet(spec)
  else:
    data = render_text(spec)
  with open(path, "wb") as f:
    f.write(data)
  return [path]


def make_config(case: Dict[str, Any], d: str, paths: List[str]):
  from configs import tiny

  s = case["settings"]
  c = tiny.get_config()
  c.data.name = case["format"]
  c.data.on_bad_record = s["policy"]
  c.data.chunk_records = s["chunk_records"]
  c.data.shuffle_window = s["shuffle_window"]
  c.batch_size = s["batch_size"]
  c.eval_batch_size = s["batch_size"]
  c.eval_samples = s["eval_samples"]
  if case["format"] == "movielens":
    c.data.path = d
    c.data.max_history = 4
    c.data.max_genres = 3
  else:
    c.data.train_files = tuple(paths)
    c.data.eval_files = tuple(paths)
  if case["format"] in ("csv", "parquet"):
    c.data.label = "label"
    c.data.label_threshold = s["label_threshold"]
    c.data.dense = ("d1", "d2")
    c.data.dense_transform = s["dense_transform"]
    c.data.categorical = ("c1",)
    c.data.multi_hot = (("tags", "|", 3),)
    c.data.sequence = (("hist", " ", 4),)
  return c


def check_batch(cols: Dict[str, Any], schema, size: int, where: str) -> None:
  """A batch as the trainer expects it: shapes, dtypes, labels in {0, 1}, finite dense values."""
  label, dense = cols["label"], cols["dense"]
  if label.dtype != np.float32 or label.shape != (size,):
    raise Crash(f"{where}: label {label.dtype} {label.shape}, expected float32 ({size},)")
  if not np.isin(label, (0.0, 1.0)).all():
    raise Crash(f"{where}: labels outside {{0, 1}}: {np.unique(label)[:5]}")
  if dense.dtype != np.float32 or dense.shape != (size, schema.num_dense):
    raise Crash(f"{where}: dense {dense.dtype} {dense.shape}, expected float32 ({size}, {schema.num_dense})")
  if not np.isfinite(dense).all():
    raise Crash(f"{where}: dense values that are not finite: {dense[~np.isfinite(dense)][:5]}")
  for f in schema.features:
    ids = cols["sparse"].get(f.name)
    if ids is None or ids.dtype != np.uint64 or ids.shape != (size, f.max_len):
      raise Crash(
        f"{where}: feature {f.name}: {None if ids is None else (ids.dtype, ids.shape)}, expected uint64 ({size}, {f.max_len})"
      )
    w = (cols.get("sparse_weights") or {}).get(f.name)
    if w is not None and (w.shape != ids.shape or not np.isfinite(w).all() or (w < 0).any()):
      raise Crash(f"{where}: feature {f.name}: weights {w.dtype} {w.shape} not finite and >= 0")


def run_reader(case: Dict[str, Any], d: str) -> str:
  """Builds the reader the input describes in ``d`` and reads it; returns the outcome."""
  from recsys_jax.data import base, readers

  names = _write(case, d)
  config = make_config(case, d, names)
  try:
    reader = readers.build_reader(config)
    for b, n in reader.eval():
      check_batch(b, reader.schema, config.eval_batch_size, "eval batch")
      if not 0 < n <= config.eval_batch_size:
        raise Crash(f"eval batch: n_valid {n} outside (0, {config.eval_batch_size}]")
    train = reader.train()
    for _ in range(3):
      b, pos = next(train)
      check_batch(b, reader.schema, config.batch_size, "train batch")
  except Crash:
    raise
  except Exception as e:  # noqa: BLE001 - classified here
    clear_error(e, [ValueError], names, "reader")
    if isinstance(e, base.BadRecordError):
      import re

      if not any(re.search(re.escape(n) + r"[^:]*:\d+", str(e)) for n in names):
        raise Crash(f"BadRecordError does not name the line: {str(e)[:300]}") from None
    if "\n" in str(e).strip():
      raise Crash(f"error of several lines: {str(e)[:300]!r}") from None
    return "clear"
  return "accepted"


class ReadersTarget(Target):
  name = "readers"
  deadline_s = 10.0
  memory_limit_gib = 4.0

  def setup(self, workdir: str) -> None:
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    import pyarrow.parquet  # noqa: F401 - imported once, not inside the first input's time

    from recsys_jax.data import criteo, readers, tabular  # noqa: F401

  def strategy(self):
    return reader_input()

  def run(self, case) -> str:
    d = tempfile.mkdtemp(dir=self.workdir)
    try:
      return run_reader(case, d)
    finally:
      shutil.rmtree(d, ignore_errors=True)
