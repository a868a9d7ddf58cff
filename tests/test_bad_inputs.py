"""Bad input gets one clear error: a corpus of known-bad inputs, the fixes the fuzzer led to, and
a small, seeded fuzz run per target (``python -m tests.fuzz`` is the long one).

``tests/corpus/expected.json`` lists each corpus file with the error type and message it must
give. The fuzz runs here use the same targets as ``python -m tests.fuzz`` (its checks decide
what is a crash), in-process and with a fixed hypothesis seed, so they are deterministic.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from recsys_jax.async_ps import wire
from recsys_jax.data import base, readers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "tests", "corpus")
with open(os.path.join(CORPUS, "expected.json")) as _f:
  EXPECTED = {k: v for k, v in json.load(_f).items() if not k.startswith("_")}

ERRORS = {"ValueError": ValueError, "WireError": wire.WireError, "BadRecordError": base.BadRecordError}


def read_everything(config) -> int:
  """Builds the reader and reads eval to its end and 3 train batches; returns records read."""
  reader = readers.build_reader(config)
  n = sum(v for _, v in reader.eval())
  train = reader.train()
  for _ in range(3):
    b, _ = next(train)
    n += base.num_records(b)
  return n


def reader_config(tiny_config, fmt: str, path: str, policy: str = "error"):
  c = tiny_config
  c.data.name = fmt
  c.data.on_bad_record = policy
  c.batch_size = c.eval_batch_size = 2
  c.eval_samples = 0
  c.data.chunk_records = 3
  if fmt == "movielens":
    c.data.path = path
    c.data.max_history, c.data.max_genres = 4, 3
  else:
    c.data.train_files = c.data.eval_files = (path,)
  if fmt in ("csv", "parquet"):
    c.data.dense = ("d1", "d2")
    c.data.categorical = ("c1",)
  return c


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_input_gives_its_documented_error(name, tiny_config, tmp_path):
  exp = EXPECTED[name]
  src = os.path.join(CORPUS, name)
  # A copy in tmp_path: readers never write, but the path in the message is then ours to match.
  path = str(tmp_path / os.path.basename(name))
  (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, path)
  error = ERRORS.get(exp.get("error"))
  match = exp["match"].replace("{path}", re.escape(path))
  if name.startswith("wire/") and "method" in exp:  # decodes, and the server's checks refuse it
    from recsys_jax.async_ps.server import rpc
    from tests.fuzz.wire import _Aborted, _Context

    with open(path, "rb") as f:
      data = f.read()
    server, ctx = rpc.ShardServer(), _Context()
    with pytest.raises(_Aborted):
      server._wrap(exp["method"], getattr(server, f"_rpc_{exp['method'].lower()}"))(data, ctx)
    assert ctx.code.name == exp["status"] and re.search(match, ctx.details), (ctx.code, ctx.details)
  elif name.startswith("wire/"):
    with open(path, "rb") as f:
      data = f.read()
    with pytest.raises(error, match=match):
      wire.decode(data)
  elif name.startswith("readers/"):
    with pytest.raises(error, match=match) as info:
      config = reader_config(tiny_config, exp["format"], path, exp.get("policy", "error"))
      config.data.update(exp.get("config", {}))
      read_everything(config)
    assert "\n" not in str(info.value), str(info.value)
  elif name.startswith("config/"):
    from recsys_jax.training.specs import build_specs
    from recsys_jax.training.validation import validate_config
    from tests.fuzz.config import assign

    with open(path) as f:
      for field, value in json.load(f)["overrides"].items():
        assign(tiny_config, field, value)
    with pytest.raises(error, match=match):
      validate_config(tiny_config)  # checks the values it can without the data
      build_specs(tiny_config, readers.build_reader(tiny_config).schema)  # the per-feature overrides
  else:
    raise AssertionError(f"corpus entry {name}: unknown kind")


# -- readers -------------------------------------------------------------------------------------


def _criteo_lines(n):
  return b"".join(b"\t".join([b"1"] + [b"3"] * 13 + [b"68fd1e64"] * 26) + b"\n" for _ in range(n))


def test_damaged_gzip_names_the_file_and_the_last_good_line(tiny_config, tmp_path):
  import gzip

  whole = gzip.compress(_criteo_lines(2000), mtime=0)
  path = str(tmp_path / "day_0.gz")
  with open(path, "wb") as f:
    f.write(whole[: len(whole) // 2])
  with pytest.raises(ValueError, match=rf"{re.escape(path)}: cannot be read after line (\d+) \(EOFError") as info:
    read_everything(reader_config(tiny_config, "criteo", path))
  last = int(re.search(r"after line (\d+)", str(info.value)).group(1))
  # The line named is the last one the gzip stream gave before it broke off.
  with gzip.open(path, "rb") as f:
    good = 0
    try:
      for _ in f:
        good += 1
    except EOFError:
      pass
  assert last == good > 0, (last, good)


def test_movielens_bad_lines_are_skipped_one_by_one_and_the_rest_read_as_from_a_clean_file(tmp_path):
  from recsys_jax.data import movielens

  header = b"userId,movieId,rating,timestamp\n"
  good = [
    b"%d,%d,%s,%d" % (u, m, r, 964982000 + 7 * i)
    for i, (u, m, r) in enumerate(
      [(1, 1, b"4.0"), (1, 2, b"3.0"), (2, 1, b"5.0"), (2, 3, b"1.5"), (3, 2, b"4.5"), (3, 3, b"2.0")]
    )
  ]
  bad = [
    b"1,2,4.0\x00,964982703",  # a NUL byte
    b"1,2,\xff\xfe,964982703",  # not UTF-8
    b'1,2,"' + b"7" * 140_000 + b'",1',  # a field over the csv module's limit
    b"99999999999999999999,2,4.0,964982703",  # beyond int64
    b"1,2,4.0,964982703\r5",  # a carriage return inside the line
  ]
  movies = b"movieId,title,genres\n1,A (1995),Comedy\n2,B (2001),Drama|Comedy\n3,C,\n"
  clean, dirty = tmp_path / "clean", tmp_path / "dirty"
  for d in (clean, dirty):
    d.mkdir()
    (d / "movies.csv").write_bytes(movies)
  (clean / "ratings.csv").write_bytes(header + b"".join(x + b"\n" for x in good))
  lines = [good[0], bad[0], good[1], bad[1], bad[2], good[2], good[3], bad[3], good[4], bad[4], good[5]]
  (dirty / "ratings.csv").write_bytes(header + b"".join(x + b"\n" for x in lines))
  policy = base.BadRecords("skip")
  got = movielens.MovieLensFormat(str(dirty), max_history=3, max_genres=2, bad=policy)
  want = movielens.MovieLensFormat(str(clean), max_history=3, max_genres=2)
  assert policy.count == len(bad)
  bad_lines = [2 + i for i, x in enumerate(lines) if x in bad]  # the header is line 1
  assert [int(re.search(r"ratings\.csv:(\d+):", e).group(1)) for e in policy.examples] == bad_lines
  for split in ("train", "eval"):
    a = base.read_all(got, split)
    b = base.read_all(want, split)
    assert base.num_records(a) == base.num_records(b) > 0
    for k in ("label", "dense"):
      np.testing.assert_array_equal(a[k], b[k])
    for k in b["sparse"]:
      np.testing.assert_array_equal(a["sparse"][k], b["sparse"][k])


def test_movielens_with_an_empty_eval_split_names_the_ratings_file(tiny_config, tmp_path):
  (tmp_path / "ratings.csv").write_bytes(b"userId,movieId,rating,timestamp\n1,1,4.0,964982703\n")
  (tmp_path / "movies.csv").write_bytes(b"movieId,title,genres\n1,A (1995),Comedy\n")
  config = reader_config(tiny_config, "movielens", str(tmp_path))
  config.data.eval_fraction = 0.0
  reader = readers.build_reader(config)
  with pytest.raises(ValueError, match=rf"first: {re.escape(str(tmp_path / 'ratings.csv'))}\[eval\]\): empty files"):
    list(reader.eval())


def test_parquet_integers_beyond_2_to_the_53_are_read_as_the_nearest_float(tiny_config, tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  big = [2**62, 2**53 + 1, 3]
  path = str(tmp_path / "big.parquet")
  pq.write_table(pa.table({"label": [1, 0, 1], "d1": [0.5, 1.0, 2.0], "d2": big, "c1": ["a", "b", "c"]}), path)
  config = reader_config(tiny_config, "parquet", path)
  config.data.dense_transform = "none"
  config.eval_batch_size = 3
  (batch, n), *_ = readers.build_reader(config).eval()
  assert n == 3
  np.testing.assert_array_equal(batch["dense"][:, 1], np.asarray(big, np.float64).astype(np.float32))


def test_parquet_damaged_inside_names_the_file(tiny_config, tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  path = str(tmp_path / "d.parquet")
  n = 64
  table = pa.table({"label": [i % 2 for i in range(n)], "d1": np.arange(n, dtype=np.float64), "d2": list(range(n))})
  pq.write_table(table.append_column("c1", pa.array([str(i) for i in range(n)])), path, row_group_size=16)
  data = bytearray(open(path, "rb").read())
  meta = pq.ParquetFile(path).metadata
  page = meta.row_group(2).column(0).data_page_offset  # inside the file, before the footer
  data[page : page + 24] = b"\xff" * 24  # the page header: no longer a valid one
  with open(path, "wb") as f:
    f.write(bytes(data))
  config = reader_config(tiny_config, "parquet", path)
  config.data.chunk_records = 16
  with pytest.raises(ValueError, match=rf"{re.escape(path)}: cannot be read after row 32 \("):
    read_everything(config)


# -- PS snapshots ----------------------------------------------------------------------------------


def _small_ps():
  from recsys_jax.async_ps.store.ps import ParameterServer
  from recsys_jax.embeddings.specs import TableSpec

  return ParameterServer([TableSpec(name="user", dim=4), TableSpec(name="item", dim=2, optimizer="adam")], seed=1)


def _remote_snapshot(tmp_path):
  """A RemotePS-layout snapshot (remote.json + server-0) of a PS with a few rows; returns (dir, rows)."""
  from recsys_jax.async_ps.snapshot import chain as snapshot_chain
  from recsys_jax.async_ps.snapshot import directory as snapshot

  ps = _small_ps()
  for t, dim in (("user", 4), ("item", 2)):
    ids = np.arange(5, dtype=np.uint64) * 7
    ps.lookup(t, ids)
    ps.apply(t, ids, np.ones((5, dim), np.float32))
  d = tmp_path / "snap"
  d.mkdir()
  snapshot.save(ps, str(d / "server-0"))
  manifest = {"format": snapshot_chain.FORMAT, "num_servers": 1, "step": 2, "incremental": False}
  (d / "remote.json").write_text(json.dumps(dict(manifest, parts=["server-0"], rows={}, meta={})))
  return str(d), ps.snapshot()


@pytest.mark.parametrize(
  "content, match",
  [
    (b"", r"remote\.json: cannot read the RemotePS snapshot manifest \(JSONDecodeError"),
    (b'{"format": "recsys_jax.remote_ps/1", "pa\xffrts": []}', r"remote\.json: cannot read .*UnicodeDecodeError"),
    (
      b'{"format": "recsys_jax.remote_ps/1", "parts": ["../elsewhere"]}',
      r"remote\.json: its parts \['\.\./elsewhere'\]",
    ),
    (b'{"format": "recsys_jax.remote_ps/1", "parts": [7]}', r"remote\.json: its parts \[7\] are not names"),
  ],
)
def test_a_damaged_remote_ps_manifest_is_a_value_error_naming_it(tmp_path, content, match):
  from recsys_jax.async_ps.snapshot import chain as snapshot_chain

  d, _ = _remote_snapshot(tmp_path)
  with open(os.path.join(d, "remote.json"), "wb") as f:
    f.write(content)
  with pytest.raises(ValueError, match=re.escape(d) + "/" + match):
    snapshot_chain.load_into(_small_ps(), [d])


@pytest.mark.parametrize(
  "old, new",
  [(b'"crc32"', b'"crc33"'), (b'"shape": [', b'"shape": ["'), (b'"incremental": false', b'"incremental": 0')],
)
def test_a_manifest_damaged_into_other_valid_json_is_named_and_restores_nothing(tmp_path, old, new):
  from recsys_jax.async_ps.server.service import ServiceError, ShardService
  from recsys_jax.async_ps.snapshot import chain as snapshot_chain
  from recsys_jax.async_ps.snapshot import directory as snapshot

  d, _ = _remote_snapshot(tmp_path)
  mpath = os.path.join(d, "server-0", "manifest.json")
  text = open(mpath, "rb").read()
  assert old in text
  text = text.replace(old, new, 1)
  if new.endswith(b'"'):
    text = text.replace(b'"shape": ["', b'"shape": ["x", ', 1)
  with open(mpath, "wb") as f:
    f.write(text)
  part = os.path.join(d, "server-0")
  with pytest.raises(ValueError, match=re.escape(f"PS snapshot {part}: manifest.json")):
    snapshot_chain.load_into(_small_ps(), [d])
  with pytest.raises(ValueError, match=re.escape(f"PS snapshot {part}: manifest.json")):
    snapshot.load(_small_ps(), [part])
  service = ShardService()
  tables = list(_small_ps().specs.values())
  service.configure(tables, {"seed": 1, "num_workers": 1, "staleness": 0, "shard_index": 0, "num_shards": 1})
  with pytest.raises(ServiceError, match=re.escape(f"PS snapshot {part}: manifest.json")) as info:
    service.restore(snapshot_chain.snapshot_parts([d]), 3)
  assert info.value.code == "FAILED_PRECONDITION"


def test_an_intact_remote_snapshot_restores_every_row(tmp_path):
  from recsys_jax.async_ps.snapshot import chain as snapshot_chain

  d, want = _remote_snapshot(tmp_path)
  ps = _small_ps()
  snapshot_chain.load_into(ps, [d])
  got = ps.snapshot()
  for t in want:
    order_w, order_g = np.argsort(want[t]["ids"]), np.argsort(got[t]["ids"])
    for k in want[t]:
      np.testing.assert_array_equal(got[t][k][order_g], want[t][k][order_w])


# -- checkpoints ----------------------------------------------------------------------------------


def _two_checkpoints(workdir):
  """Checkpoints 1 and 2 of a small dense state and PS; returns what each saved."""
  import jax.numpy as jnp

  from recsys_jax.checkpoint import Checkpointer

  ps = _small_ps()
  ckpt = Checkpointer(str(workdir), max_to_keep=3, full_every=1)
  saved = {}
  for step in (1, 2):
    ps.lookup("user", np.arange(3 * step, dtype=np.uint64))
    state = {"w": jnp.full((3, 2), float(step)), "b": jnp.arange(4.0) * step}
    ckpt.save(step, state, ps, {"data_position": step, "batch_size": 8})
    saved[step] = ({k: np.asarray(v) for k, v in state.items()}, ps.snapshot())
  ckpt.close()
  return saved


@pytest.mark.parametrize(
  "old, new",
  [
    (b'"data_position": 2', b'"data_position": 3'),  # one bit: 0x32 -> 0x33, still valid JSON
    (b'"state_crc32"', b'"state_crc33"'),  # the dense checksums' key renamed: they would be skipped
    (b'"batch_size": 8', b'"batch_size": 9'),
  ],
)
def test_meta_damaged_into_other_valid_json_falls_back_to_the_previous_checkpoint(tmp_path, old, new):
  import jax.numpy as jnp

  from recsys_jax.checkpoint import Checkpointer

  saved = _two_checkpoints(tmp_path)
  path = tmp_path / "checkpoints" / "2" / "meta" / "metadata"
  text = path.read_bytes()
  assert old in text
  path.write_bytes(text.replace(old, new, 1))
  ckpt = Checkpointer(str(tmp_path), max_to_keep=3)
  warnings = []
  template = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(4)}
  step, state, meta = ckpt.restore_newest_intact(template, _small_ps(), warnings.append)
  ckpt.close()
  assert step == 1 and meta["data_position"] == 1
  np.testing.assert_array_equal(np.asarray(state["w"]), saved[1][0]["w"])
  assert len(warnings) == 1 and "meta does not match its checksum" in warnings[0], warnings
  assert str(tmp_path / "checkpoints" / "2") in warnings[0]
  assert os.listdir(tmp_path / "checkpoints_damaged") == ["2"]


def test_a_damaged_snapshot_on_remote_ps_servers_falls_back_to_the_previous_checkpoint(tmp_path):
  import jax.numpy as jnp

  from recsys_jax.async_ps.client.remote import RemotePS
  from recsys_jax.async_ps.server import rpc
  from recsys_jax.checkpoint import Checkpointer

  server, port, _ = rpc.serve("127.0.0.1", 0, threads=4)
  specs = list(_small_ps().specs.values())
  try:
    with RemotePS([f"127.0.0.1:{port}"], specs, seed=1, timeout_s=20) as ps:
      ckpt = Checkpointer(str(tmp_path), max_to_keep=3, full_every=1)
      saved = {}
      for step in (1, 2):
        ids = np.arange(4 * step, dtype=np.uint64)
        ps.lookup("user", ids, step=step)
        ps.apply("user", ids, np.full((len(ids), 4), float(step), np.float32), step=step)
        ckpt.save(step, {"w": jnp.full(3, float(step))}, ps, {"data_position": step})
        saved[step] = ps.lookup("user", np.arange(8, dtype=np.uint64), create=False)
      ckpt.close()
      # Damage one chunk of step 2's snapshot: its checksum in the manifest no longer matches.
      part = tmp_path / "ps_snapshots" / "0000000002-full" / "server-0"
      chunk = next(
        p for p in sorted((part / "user" / "0" / "weights").rglob("*")) if p.is_file() and p.name != "zarr.json"
      )
      data = bytearray(chunk.read_bytes())
      data[len(data) // 2] ^= 0xFF
      chunk.write_bytes(bytes(data))
      warnings = []
      ckpt = Checkpointer(str(tmp_path), max_to_keep=3)
      step, state, meta = ckpt.restore_newest_intact({"w": jnp.zeros(3)}, ps, warnings.append)
      ckpt.close()
      assert step == 1 and meta["data_position"] == 1
      np.testing.assert_array_equal(ps.lookup("user", np.arange(8, dtype=np.uint64), create=False), saved[1])
      assert len(warnings) == 1 and "0000000002-full" in warnings[0] and "checksum" in warnings[0], warnings
  finally:
    server.stop(0)


# -- small fuzz runs, in-process, deterministic ----------------------------------------------------


def _fuzz(target, tmp_path, examples: int, seed: int = 1234, case_filter=None):
  """``examples`` inputs of ``target``'s strategy through its checks; fails on the first crash."""
  from hypothesis import given
  from hypothesis import seed as hseed

  from tests.fuzz import harness

  target.setup(str(tmp_path / "setup"))
  outcomes = []

  @harness.fuzz_settings(examples)
  @hseed(seed)
  @given(target.strategy())
  def one(case):
    case = harness.from_json(harness.to_json(case))  # as the fuzz run and a replay see it
    if case_filter is not None:
      case = case_filter(case)
    result = harness.run_case(target, case)
    assert result["outcome"] != "crash", result["detail"]
    outcomes.append(result["outcome"])

  one()
  return outcomes


def test_fuzz_wire(tmp_path):
  from tests.fuzz.wire import WireTarget

  outcomes = _fuzz(WireTarget(), tmp_path, 60)
  assert len(outcomes) == 60 and "clear" in outcomes


def test_fuzz_readers(tmp_path):
  from tests.fuzz.readers import ReadersTarget

  outcomes = _fuzz(ReadersTarget(), tmp_path, 50)
  assert len(outcomes) == 50 and {"clear", "accepted"} <= set(outcomes)


def test_fuzz_config_validation(tmp_path):
  from tests.fuzz.config import ConfigTarget

  # Validation only: the 1-step builds (a compile each) are the slow test's and the fuzz run's.
  outcomes = _fuzz(ConfigTarget(), tmp_path, 60, case_filter=lambda c: dict(c, build=False))
  assert len(outcomes) == 60 and {"clear", "accepted"} <= set(outcomes)


def test_fuzz_checkpoint_restore(tmp_path):
  from tests.fuzz.checkpoint import CheckpointTarget

  outcomes = _fuzz(CheckpointTarget(small=True), tmp_path, 12)
  assert len(outcomes) == 12


@pytest.mark.slow
def test_fuzz_run_finds_no_crash_and_no_hang(tmp_path):
  out = tmp_path / "fuzz.json"
  cmd = [sys.executable, "-m", "tests.fuzz", "--budget_s=240", "--seed=7"]
  cmd += [f"--crash_dir={tmp_path / 'crashes'}", f"--json_out={out}"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
  lines = [json.loads(x) for x in out.read_text().splitlines()]
  total = lines[-1]
  assert total["target"] == "total" and total["tried"] > 100, proc.stderr[-3000:]
  assert {x["target"] for x in lines[:-1]} == {"readers", "config", "checkpoint", "wire"}
  assert all(x["tried"] > 0 for x in lines[:-1]), lines
  assert total["crashes"] == 0 and total["hangs"] == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert proc.returncode == 0


def _fnv_reference(value: bytes, field: str) -> int:
  from recsys_jax.hashing import name_seed, splitmix64

  h = int(name_seed(field))
  for byte in value:
    if byte:  # NUL bytes are padding to the vectorised hash: skipped
      h = ((h ^ byte) * 0x100000001B3) % 2**64
  return int(splitmix64(np.uint64(h)))


def test_long_values_hash_as_the_reference_in_one_pass(tmp_path):
  import time

  long = "x7" * 500_000  # 1 MB: the column-by-column hash took ~25 s
  values = ["a", long, "Zürich", "b" * 1500, "", "q" * 1024]
  want = [_fnv_reference(v.encode(), "f") for v in values]
  t0 = time.perf_counter()
  assert base.hash_strings(values, "f").tolist() == want  # a list: long values one by one
  assert base.hash_strings([v.encode() for v in values], "f").tolist() == want
  ascii_values = [v for v in values if v.isascii()]
  assert base.hash_strings(np.array(ascii_values), "f").tolist() == [
    _fnv_reference(v.encode(), "f") for v in ascii_values
  ]
  assert time.perf_counter() - t0 < 20, time.perf_counter() - t0


def test_an_avazu_file_with_a_1_mb_field_reads_in_seconds(tiny_config, tmp_path):
  import time

  from recsys_jax.data.avazu import HEADER

  fields = ["1000009418151094273", "1", "14102100"] + ["1005"] * 21
  long = list(fields)
  long[5] = "7" * 1_000_000  # site_id
  lines = [",".join(HEADER)] + [",".join(f) for f in [fields, long, fields]]
  path = str(tmp_path / "train.csv")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  config = reader_config(tiny_config, "avazu", path)
  config.eval_batch_size = 3
  t0 = time.perf_counter()
  (batch, n), *_ = readers.build_reader(config).eval()
  assert time.perf_counter() - t0 < 10  # over 20 s before (a numpy call per byte)
  assert n == 3 and batch["sparse"]["site_id"][1, 0] == _fnv_reference(long[5].encode(), "site_id")


def test_a_csv_field_longer_than_the_limit_is_one_bad_record(tiny_config, tmp_path):
  from recsys_jax.data.csv_lines import MAX_FIELD_CHARS

  path = str(tmp_path / "t.csv")
  with open(path, "w") as f:
    f.write("label,d1,d2,c1\n1,2,3,us\n" + f"0,1,2,{'z' * (MAX_FIELD_CHARS + 1)}\n" + "1,4,5,fr\n")
  with pytest.raises(base.BadRecordError, match=rf"{re.escape(path)}:3: field '<line>': field 4 has 4097 characters"):
    read_everything(reader_config(tiny_config, "csv", path))
  config = reader_config(tiny_config, "csv", path, policy="skip")
  config.eval_batch_size = 2
  reader = readers.build_reader(config)
  (batch, n), *_ = reader.eval()
  assert n == 2 and batch["label"].tolist() == [1.0, 1.0] and reader.bad.count == 0  # eval counts apart


def test_an_eval_set_of_one_class_reports_auc_nan_instead_of_failing_the_run():
  from recsys_jax.metrics import auc
  from recsys_jax.training.evaluation import auc_or_nan

  s = np.array([0.3, -1.0, 2.0])
  assert np.isnan(auc_or_nan(np.ones(3, np.float32), s)) and np.isnan(auc_or_nan(np.zeros(3, np.float32), s))
  y = np.array([1.0, 0.0, 1.0], np.float32)
  assert auc_or_nan(y, s) == auc(y, s) == 1.0  # both positives (0.3, 2.0) score above the negative (-1.0)


def test_a_mesh_size_that_does_not_divide_the_devices_names_the_field():
  from recsys_jax.parallel import mesh

  with pytest.raises(
    ValueError, match=r"config\.mesh: 1 devices are not divisible by 2147483648 \(replica=-1, fsdp=2147483648\)"
  ):
    mesh.mesh_shape(-1, 2**31, 1)


def test_a_damaged_orbax_step_metadata_file_does_not_stop_the_checkpointer(tmp_path):
  import jax.numpy as jnp

  from recsys_jax.checkpoint import Checkpointer

  saved = _two_checkpoints(tmp_path)
  path = tmp_path / "checkpoints" / "2" / "_CHECKPOINT_METADATA"
  text = path.read_bytes()
  # Two keys damaged: orbax files the first unknown one under custom_metadata and raised a
  # ValueError for the second when the manager listed the steps, before any restore.
  path.write_bytes(text.replace(b'"item_handlers"', b'"item_handlerw"').replace(b'"metrics"', b'"letrics"'))
  ckpt = Checkpointer(str(tmp_path), max_to_keep=3)
  warnings = []
  step, state, meta = ckpt.restore_newest_intact(
    {"w": jnp.zeros((3, 2)), "b": jnp.zeros(4)}, _small_ps(), warnings.append
  )
  ckpt.close()
  assert step in (1, 2) and meta["data_position"] == step
  np.testing.assert_array_equal(np.asarray(state["w"]), saved[step][0]["w"])
  assert len(warnings) == (step == 1)


def test_a_checkpoint_written_before_meta_checksums_still_restores(tmp_path):
  import jax.numpy as jnp

  from recsys_jax.checkpoint import Checkpointer

  saved = _two_checkpoints(tmp_path)
  path = tmp_path / "checkpoints" / "2" / "meta" / "metadata"
  meta = json.loads(path.read_text())
  del meta["meta_crc32"]  # what the code before this change wrote: state_crc32 only
  path.write_text(json.dumps(meta))
  ckpt = Checkpointer(str(tmp_path), max_to_keep=3)
  warnings = []
  step, state, got = ckpt.restore_newest_intact(
    {"w": jnp.zeros((3, 2)), "b": jnp.zeros(4)}, _small_ps(), warnings.append
  )
  ckpt.close()
  assert step == 2 and got == meta and not warnings
  np.testing.assert_array_equal(np.asarray(state["w"]), saved[2][0]["w"])
