"""The preprocessed cache: batches through it are bit-identical to batches parsed from the source.

The reference is always the same stream over the uncached format. Counting formats check that a
warm cache really is read (no cutting, no parsing of the source), so a cache that silently fell
back to the source could not pass.
"""

import glob
import hashlib
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_jax.data import base, cache, chunkfile, readers, stream
from recsys_jax.data.avazu import HEADER as AVAZU_HEADER
from recsys_jax.data.avazu import AvazuFormat
from recsys_jax.data.criteo import CriteoFormat
from recsys_jax.data.tabular import TabularFormat

CHUNK, WINDOW, BATCH = 64, 3, 50


def Counting():
  """A CriteoFormat that counts how often it cuts a source and parses a chunk (its type and so
  its cache key unchanged)."""
  fmt = CriteoFormat()
  fmt.cuts = fmt.parses = 0
  chunks, parse = fmt.chunks, fmt.parse

  def counted_chunks(path, chunk_records):
    fmt.cuts += 1
    return chunks(path, chunk_records)

  def counted_parse(chunk, bad):
    fmt.parses += 1
    return parse(chunk, bad)

  fmt.chunks, fmt.parse = counted_chunks, counted_parse
  return fmt


def criteo_lines(n, rng, bad_every=0):
  """Criteo records: missing values, negatives; every ``bad_every``-th one has a bad label or field."""
  label = rng.integers(0, 2, n).astype(str).astype(object)
  dense = np.where(rng.random((n, 13)) < 0.2, "", rng.integers(-3, 1000, (n, 13)).astype(str)).astype(object)
  cats = np.where(rng.random((n, 26)) < 0.1, "", np.char.mod("%08x", rng.integers(0, 2**32, (n, 26)))).astype(object)
  if bad_every:
    bad = np.arange(bad_every - 1, n, bad_every)
    label[bad[1::2]] = "2"
    cats[bad[0::2], 3] = "zz"
  return ["\t".join(row) for row in np.column_stack([label, dense, cats]).tolist()]


@pytest.fixture
def sources(tmp_path):
  rng = np.random.default_rng(0)
  d = tmp_path / "data"
  d.mkdir()
  paths = []
  for i, n in enumerate((700, 0, 450, 333)):
    p = d / f"day_{i}"
    p.write_text("".join(line + "\n" for line in criteo_lines(n, rng, bad_every=37)))
    paths.append(str(p))
  return paths


def batches(fmt, paths, epochs=3, position=None, policy="skip", **kw):
  """Every batch and position of ``epochs`` epochs, and the bad-record policy object."""
  bad = base.BadRecords(policy)
  s = stream.Stream(
    fmt,
    paths,
    BATCH,
    chunk_records=CHUNK,
    window_chunks=WINDOW,
    seed=7,
    bad=bad,
    position=position,
    epochs=epochs,
    **kw,
  )
  return list(s), bad


def flat(cols):
  out = [("label", cols["label"]), ("dense", cols["dense"])]
  out += [(f"sparse/{k}", v) for k, v in cols["sparse"].items()]
  return out + [(f"sparse_weights/{k}", v) for k, v in (cols.get("sparse_weights") or {}).items()]


def assert_identical(got, want):
  """Same number of batches, same positions, every array with the same dtype, shape and bytes."""
  assert len(got) == len(want)
  for i, ((cg, pg), (cw, pw)) in enumerate(zip(got, want)):
    assert pg == pw, i
    fg, fw = flat(cg), flat(cw)
    assert [k for k, _ in fg] == [k for k, _ in fw], i
    for (k, a), (_, b) in zip(fg, fw):
      assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (i, k)


def chunk_files(root):
  return sorted(glob.glob(os.path.join(root, "*", "*", "*.chunk")))


def test_epochs_through_the_cache_are_bit_identical_and_a_later_run_reads_only_the_cache(tmp_path, sources):
  want, want_bad = batches(CriteoFormat(), sources)
  root = str(tmp_path / "cache")
  first = Counting()
  got, got_bad = batches(cache.CachedFormat(first, root), sources)
  assert_identical(got, want)
  assert got_bad.count == want_bad.count > 0 and got_bad.examples == want_bad.examples
  # 3 epochs over 11 + 0 + 8 + 6 chunks: the first parses each once, the later two read the cache.
  assert first.parses == 25 and len(chunk_files(root)) == 25
  later = Counting()
  again, again_bad = batches(cache.CachedFormat(later, root), sources)
  assert_identical(again, want)
  assert (later.cuts, later.parses) == (0, 0)
  assert again_bad.count == want_bad.count and again_bad.examples == want_bad.examples


def test_error_policy_raises_the_same_error_from_the_cache(tmp_path, sources):
  root = str(tmp_path / "cache")
  batches(cache.CachedFormat(CriteoFormat(), root), sources, epochs=1)
  with pytest.raises(base.BadRecordError) as want:
    batches(CriteoFormat(), sources, policy="error")
  later = Counting()
  with pytest.raises(base.BadRecordError) as got:
    batches(cache.CachedFormat(later, root), sources, policy="error")
  assert str(got.value) == str(want.value) and later.parses == 0


@pytest.mark.parametrize("procs", [2, 3])
def test_processes_writing_one_cache_read_what_they_would_parse(tmp_path, sources, procs):
  root = str(tmp_path / "cache")
  want = [batches(CriteoFormat(), sources, process_index=i, process_count=procs)[0] for i in range(procs)]
  # The processes advance in turn (as concurrent trainers would), each with its own format object.
  its = [
    stream.Stream(
      cache.CachedFormat(CriteoFormat(), root),
      sources,
      BATCH,
      chunk_records=CHUNK,
      window_chunks=WINDOW,
      seed=7,
      bad=base.BadRecords("skip"),
      epochs=3,
      process_index=i,
      process_count=procs,
    )
    for i in range(procs)
  ]
  got = [[] for _ in range(procs)]
  live = set(range(procs))
  while live:
    for i in sorted(live):
      b = next(its[i], None)
      if b is None:
        live.discard(i)
      else:
        got[i].append(b)
  for g, w in zip(got, want):
    assert_identical(g, w)
  # One process of a later run finds every chunk written by the others.
  later = Counting()
  assert_identical(batches(cache.CachedFormat(later, root), sources)[0], batches(CriteoFormat(), sources)[0])
  assert later.parses == 0


def digest(batch_list):
  """A hash of batches and positions, arrays with dtype and shape (for comparing across processes)."""
  h = hashlib.sha256()
  for cols, pos in batch_list:
    h.update(json.dumps(pos, sort_keys=True).encode())
    for k, a in flat(cols):
      h.update(f"{k}{a.dtype.str}{a.shape}".encode() + a.tobytes())
  return h.hexdigest()


_CHILD = """
import sys
from tests.data.test_cache import CriteoFormat, batches, cache, digest
i, procs = int(sys.argv[1]), int(sys.argv[2])
b, bad = batches(cache.CachedFormat(CriteoFormat(), {root!r}), {paths!r}, process_index=i, process_count=procs)
print(digest(b), bad.count)
"""


def test_concurrent_processes_share_one_cache(tmp_path, sources):
  root, procs = str(tmp_path / "cache"), 3
  script = _CHILD.format(root=root, paths=sources)
  env = dict(
    os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(__file__))), *sys.path])
  )
  children = [
    subprocess.Popen([sys.executable, "-c", script, str(i), str(procs)], stdout=subprocess.PIPE, text=True, env=env)
    for i in range(procs)
  ]
  outs = [c.communicate(timeout=300)[0].split() for c in children]
  assert all(c.returncode == 0 for c in children)
  for i, out in enumerate(outs):
    want, bad = batches(CriteoFormat(), sources, process_index=i, process_count=procs)
    assert out == [digest(want), str(bad.count)], i
  later = Counting()
  assert digest(batches(cache.CachedFormat(later, root), sources)[0]) == digest(batches(CriteoFormat(), sources)[0])
  assert later.parses == 0 and not glob.glob(os.path.join(root, "*", "*", "*.tmp-*"))


@pytest.mark.parametrize("warm", [False, True])
def test_resume_from_a_mid_window_position(tmp_path, sources, warm):
  want, _ = batches(CriteoFormat(), sources)
  k = next(i for i, (_, pos) in enumerate(want) if pos["epoch"] == 1 and pos["window"] >= 1 and pos["offset"] > 0)
  position = want[k][1]
  root = str(tmp_path / "cache")
  if warm:
    batches(cache.CachedFormat(CriteoFormat(), root), sources, epochs=1)
  got, bad = batches(cache.CachedFormat(CriteoFormat(), root), sources, position=position)
  assert_identical(got, want[k + 1 :])
  assert bad.count == batches(CriteoFormat(), sources)[1].count


def corrupt_truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def corrupt_flip_data_bit(path):
  with open(path, "r+b") as f:
    f.seek(-100, os.SEEK_END)
    b = f.read(1)
    f.seek(-100, os.SEEK_END)
    f.write(bytes([b[0] ^ 0x10]))


def corrupt_header(path):
  with open(path, "r+b") as f:
    f.seek(20)
    b = f.read(1)
    f.seek(20)
    f.write(bytes([b[0] ^ 0x01]))


def corrupt_empty(path):
  open(path, "wb").close()


@pytest.mark.parametrize(
  "corrupt, why",
  [
    (corrupt_truncate, "truncated"),
    (corrupt_flip_data_bit, "checksum"),
    (corrupt_header, "crc32"),
    (corrupt_empty, "shorter than"),
  ],
)
def test_a_damaged_chunk_file_is_named_parsed_again_and_rewritten(tmp_path, sources, caplog, corrupt, why):
  want, _ = batches(CriteoFormat(), sources)
  root = str(tmp_path / "cache")
  batches(cache.CachedFormat(CriteoFormat(), root), sources, epochs=1)
  victim = chunk_files(root)[5]
  corrupt(victim)
  later = Counting()
  with caplog.at_level(logging.WARNING):
    got, _ = batches(cache.CachedFormat(later, root), sources)
  assert_identical(got, want)
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and victim in r.getMessage()]
  assert len(warnings) == 1 and "corrupt" in warnings[0] and why in warnings[0], caplog.text
  assert later.parses == 1  # that chunk only, once: it was rewritten for the next epochs
  chunkfile.read_chunk(victim)  # valid again


def test_damaged_chunks_of_one_source_cost_one_pass_over_it(tmp_path, sources):
  root = str(tmp_path / "cache")
  batches(cache.CachedFormat(CriteoFormat(), root), sources, epochs=1)
  day_0 = [f for f in chunk_files(root) if os.path.basename(os.path.dirname(os.path.dirname(f))).startswith("day_0-")]
  for f in (day_0[2], day_0[6], day_0[9]):
    corrupt_flip_data_bit(f)
  later = Counting()
  got, _ = batches(cache.CachedFormat(later, root), sources, epochs=1)
  assert_identical(got, batches(CriteoFormat(), sources, epochs=1)[0])
  assert (later.cuts, later.parses) == (1, 3)


def test_a_deleted_or_garbled_manifest_is_named_and_the_source_cut_again(tmp_path, sources, caplog):
  want, _ = batches(CriteoFormat(), sources)
  root = str(tmp_path / "cache")
  batches(cache.CachedFormat(CriteoFormat(), root), sources, epochs=1)
  manifests = sorted(glob.glob(os.path.join(root, "*", "*", cache.MANIFEST)))
  assert len(manifests) == 4
  os.unlink(manifests[0])
  with open(manifests[2], "w") as f:
    f.write('{"chunks": 3')
  later = Counting()
  with caplog.at_level(logging.WARNING):
    got, _ = batches(cache.CachedFormat(later, root), sources)
  assert_identical(got, want)
  text = caplog.text
  assert manifests[0] in text and "missing" in text and manifests[2] in text and "corrupt" in text
  # The two sources were cut again once, their chunk files reused, the manifests rewritten.
  assert (later.cuts, later.parses) == (2, 0)
  assert all(os.path.exists(m) for m in manifests)


def test_a_source_read_in_part_gets_no_manifest_and_no_warning(tmp_path, sources, caplog):
  root = str(tmp_path / "cache")
  s = stream.Stream(
    cache.CachedFormat(CriteoFormat(), root),
    sources,
    BATCH,
    chunk_records=CHUNK,
    shuffle=False,
    bad=base.BadRecords("skip"),
  )
  next(s)  # a run (or an evaluation) that stops early: chunk files, no manifests
  written = len(chunk_files(root))
  assert written and not glob.glob(os.path.join(root, "*", "*", cache.MANIFEST))
  later = Counting()
  with caplog.at_level(logging.WARNING):
    got, _ = batches(cache.CachedFormat(later, root), sources)
  assert_identical(got, batches(CriteoFormat(), sources)[0])
  assert "data cache" not in caplog.text and later.parses == 25 - written


def test_a_changed_source_is_detected_and_its_cache_rebuilt(tmp_path, sources, caplog):
  root = str(tmp_path / "cache")
  batches(cache.CachedFormat(CriteoFormat(), root), sources, epochs=1)
  old_dirs = sorted(glob.glob(os.path.join(root, "*", "*-*")))
  rng = np.random.default_rng(1)
  with open(sources[0], "a") as f:  # one more record
    f.write(criteo_lines(1, rng)[0] + "\n")
  # Same size and mtime, other bytes in the first MiB: only the head's hash tells.
  st = os.stat(sources[2])
  text = open(sources[2]).read()
  with open(sources[2], "w") as f:
    f.write(("1" if text[0] == "0" else "0") + text[1:])  # the first label
  os.utime(sources[2], ns=(st.st_atime_ns, st.st_mtime_ns))
  assert os.stat(sources[2]).st_size == st.st_size
  want, _ = batches(CriteoFormat(), sources)
  later = Counting()
  with caplog.at_level(logging.WARNING):
    got, _ = batches(cache.CachedFormat(later, root), sources)
  assert_identical(got, want)
  stale = [d for d in old_dirs if not os.path.exists(d)]
  assert len(stale) == 2 and all(d in caplog.text for d in stale)
  assert later.parses == 11 + 8  # chunks of the two changed sources, once each
  again = Counting()
  assert_identical(batches(cache.CachedFormat(again, root), sources)[0], want)
  assert again.parses == 0


def test_format_parameters_and_chunk_size_get_their_own_cache(tmp_path, sources):
  root = str(tmp_path / "cache")
  batches(cache.CachedFormat(CriteoFormat(), root), sources, epochs=1)
  uncached = stream.Stream(
    CriteoFormat(), sources, BATCH, chunk_records=50, window_chunks=WINDOW, bad=base.BadRecords("skip")
  )
  want = [next(uncached)]
  s = stream.Stream(
    cache.CachedFormat(CriteoFormat(), root),
    sources,
    BATCH,
    chunk_records=50,
    window_chunks=WINDOW,
    bad=base.BadRecords("skip"),
  )
  assert_identical([next(s)], want)
  assert len({os.path.basename(os.path.dirname(p)).split("-")[0] for p in chunk_files(root)}) == 2


def test_an_unwritable_cache_warns_once_and_reads_the_source(tmp_path, sources, caplog, monkeypatch):
  want, _ = batches(CriteoFormat(), sources)

  def fail(path, *a):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(chunkfile, "write_chunk", fail)
  with caplog.at_level(logging.WARNING):
    got, _ = batches(cache.CachedFormat(CriteoFormat(), str(tmp_path / "cache")), sources)
  assert_identical(got, want)
  assert caplog.text.count("cannot write") == 1


def write_avazu(path, n, rng):
  lines = [",".join(AVAZU_HEADER)]
  for i in range(n):
    hour = f"141021{rng.integers(0, 24):02d}" if i % 29 != 5 else "14133199"  # some bad hours
    row = [str(i), str(rng.integers(0, 2)), hour] + [f"{rng.integers(0, 50):x}" for _ in AVAZU_HEADER[3:]]
    lines.append(",".join(row))
  path.write_text("\n".join(lines) + "\n")


def write_tabular(path, n, rng, parquet):
  cols = {
    "label": rng.integers(0, 2, n).astype(float),
    "d": np.where(rng.random(n) < 0.05, np.nan, rng.random(n) * 10),  # NaN: a bad record
    "c": [f"u{v}" for v in rng.integers(0, 30, n)],
    "tags": ["|".join(str(t) for t in rng.choice(20, rng.integers(0, 5), replace=False)) for _ in range(n)],
  }
  if parquet:
    pq.write_table(pa.table(cols), str(path), row_group_size=40)
  else:
    rows = zip(cols["label"], cols["d"], cols["c"], cols["tags"])
    path.write_text("label,d,c,tags\n" + "".join(f"{y:g},{d},{c},{t}\n" for y, d, c, t in rows))


@pytest.mark.parametrize("kind", ["avazu", "csv", "parquet"])
def test_other_formats_through_the_cache(tmp_path, kind):
  rng = np.random.default_rng(3)
  paths = []
  for i, n in enumerate((300, 170)):
    p = tmp_path / f"part{i}.{kind}"
    if kind == "avazu":
      write_avazu(p, n, rng)
    else:
      write_tabular(p, n, rng, kind == "parquet")
    paths.append(str(p))

  def make():
    if kind == "avazu":
      return AvazuFormat()
    return TabularFormat(file_type=kind, label="label", dense=["d"], categorical=["c"], multi_hot=[("tags", "|", 3)])

  want, want_bad = batches(make(), paths, process_index=1, process_count=2)
  assert want_bad.count > 0
  root = str(tmp_path / "cache")
  for _ in range(2):  # cold, then warm
    got, bad = batches(cache.CachedFormat(make(), root), paths, process_index=1, process_count=2)
    assert_identical(got, want)
    assert bad.count == want_bad.count


def test_cache_dir_config(tmp_path, sources):
  class D(dict):
    __getattr__ = dict.__getitem__

  work = str(tmp_path / "work")
  assert readers.cache_root(D(cache_dir=""), work) == os.path.join(work, "data_cache")
  assert readers.cache_root(D(cache_dir=""), None) is None
  assert readers.cache_root(D(cache_dir="c"), work) == os.path.join(work, "c")
  assert readers.cache_root(D(cache_dir="/abs/c"), work) == "/abs/c"
  for off in (None, "none", "off", "None"):
    assert readers.cache_root(D(cache_dir=off), work) is None

  from configs import default

  c = default.get_config()
  c.data.name = "criteo"
  c.data.train_files = c.data.eval_files = (os.path.join(os.path.dirname(sources[0]), "day_*"),)
  c.data.on_bad_record = "skip"
  c.batch_size = 64
  reader = readers.build_reader(c, workdir=work)
  assert isinstance(reader.fmt, cache.CachedFormat)
  next(reader.train())
  assert chunk_files(os.path.join(work, "data_cache"))
  c.data.cache_dir = "none"
  assert isinstance(readers.build_reader(c, workdir=work).fmt, CriteoFormat)
