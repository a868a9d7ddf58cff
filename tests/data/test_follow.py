"""The stream source (recsys_jax/data/follow.py): which files count, their order, files arriving
while it runs, exact restarts from every position, bad records and damaged files."""

import concurrent.futures
import gzip
import os
import threading
import time

import numpy as np
import pytest

from recsys_jax.data import base, follow
from recsys_jax.data.tabular import TabularFormat


def _fmt():
  return TabularFormat(
    file_type="csv",
    label="label",
    label_threshold=None,
    dense=("rid",),
    dense_transform="none",  # the record id comes back as it is
    categorical=("c",),
    multi_hot=(),
    sequence=(),
    delimiter=",",
  )


def _write(directory, name, rids, mtime=None, bad=(), rename=True):
  """A CSV file of records ``rids`` (those in ``bad`` malformed), written under a temporary name
  and renamed into place (``rename`` False: left under ``name + '.tmp'``). Returns the good rids."""
  tmp = os.path.join(directory, name + ".tmp")
  with open(tmp, "w") as f:
    f.write("label,rid,c\n")
    for r in rids:
      f.write(f"{r % 2},{'oops' if r in bad else r},v{r % 7}\n")
  if mtime is not None:
    os.utime(tmp, (mtime, mtime))
  if rename:
    os.rename(tmp, os.path.join(directory, name))
  return [r for r in rids if r not in bad]


def _ids(cols):
  return cols["dense"][:, 0].astype(np.int64).tolist()


def _stream(directory, **kw):
  kw.setdefault("bad", base.BadRecords("skip"))
  kw.setdefault("poll_s", 0.01)
  kw.setdefault("idle_exit_s", 0.1)
  return follow.DirectoryStream(_fmt(), str(directory), kw.pop("batch_size", 8), chunk_records=5, **kw)


def _drain(s):
  """Every (record ids, position) the stream gives until it ends."""
  return [(_ids(cols), pos) for cols, pos in s]


def test_only_renamed_files_count_and_they_are_read_in_mtime_order(tmp_path):
  a = _write(tmp_path, "a.csv", range(0, 13), mtime=3000)
  b = _write(tmp_path, "b.csv", range(100, 111), mtime=1000)
  c = _write(tmp_path, "c.csv", range(200, 209), mtime=2000)
  _write(tmp_path, "d.csv", range(300, 310), mtime=500, rename=False)  # d.csv.tmp: still being written
  for name in (".hidden.csv", "e.csv.inprogress"):
    _write(tmp_path, "x", range(400, 405))
    os.rename(tmp_path / "x", tmp_path / name)
  (tmp_path / "sub").mkdir()
  _write(tmp_path / "sub", "f.csv", range(500, 505), mtime=10)
  assert [n for _, n in follow.complete_files(str(tmp_path))] == ["b.csv", "c.csv", "a.csv"]
  got = _drain(_stream(tmp_path))
  stream_ids = b + c + a
  n = len(stream_ids) // 8 * 8  # the records that do not fill a last batch wait for more
  assert [r for ids, _ in got for r in ids] == stream_ids[:n]
  last = got[-1][1]
  assert last["file"] == "a.csv" and last["done"] == ("b.csv", "c.csv") and last["record"] == n - len(b) - len(c)


def test_a_tmp_file_is_not_read_until_renamed_and_a_restart_goes_on_with_it(tmp_path):
  a = _write(tmp_path, "a.csv", range(0, 16), mtime=1000)
  _write(tmp_path, "b.csv", range(100, 108), mtime=500, rename=False)
  first = _drain(_stream(tmp_path))
  assert [r for ids, _ in first for r in ids] == a
  os.rename(tmp_path / "b.csv.tmp", tmp_path / "b.csv")  # older mtime than a.csv, but arrives after it
  again = _drain(_stream(tmp_path, position=first[-1][1]))
  assert [r for ids, _ in again for r in ids] == list(range(100, 108))
  assert again[-1][1]["done"] == ("a.csv",) and again[-1][1]["file"] == "b.csv"


def test_files_arriving_while_it_runs_are_read_in_arrival_order(tmp_path):
  """A writer thread renames files in while the stream is read: each is picked up, in the order it
  arrived (here against its name order and its mtime order), and all of a file's batches come out
  while the stream waits for the next one (nothing parsed ahead is held back)."""
  names = ["z.csv", "m.csv", "a.csv"]
  expect = []
  s = _stream(tmp_path, batch_size=5, idle_exit_s=1.5)
  arrived = []

  def writer():
    for i, name in enumerate(names):
      time.sleep(0.4)
      expect.extend(_write(tmp_path, name, range(100 * i, 100 * i + 10), mtime=5000 - i))
      arrived.append(time.monotonic())

  t = threading.Thread(target=writer)
  t.start()
  got = []
  for cols, _ in s:
    got.append((_ids(cols), time.monotonic()))
  t.join()
  assert [r for ids, _ in got for r in ids] == expect
  for k, (ids, when) in enumerate(got):
    i = ids[0] // 100
    assert when >= arrived[i], k  # no batch before the file holding its records was renamed in
    if i + 1 < len(names):  # and every batch of a file while the stream waits for the next one
      assert when < arrived[i + 1], k


@pytest.mark.parametrize("workers", [0, 2])
def test_a_restart_at_every_position_reads_what_the_uninterrupted_stream_reads_next(tmp_path, workers):
  """Bad records in the middle of chunks and files, a file ending mid-batch, an empty file: from the
  position after each batch, a new stream gives exactly the batches (and skipped counts) that
  followed it, with or without worker threads parsing ahead."""
  _write(tmp_path, "a.csv", range(0, 23), mtime=1, bad={3, 11, 17})
  _write(tmp_path, "b.csv", range(100, 100), mtime=2)  # a header and no record
  _write(tmp_path, "c.csv", range(200, 219), mtime=3, bad={210})
  _write(tmp_path, "d.csv", range(300, 330), mtime=4)
  pool = concurrent.futures.ThreadPoolExecutor(workers) if workers else None
  try:
    full = _drain(_stream(tmp_path, executor=pool, batch_size=6))
    counts = []
    bad = base.BadRecords("skip")
    for _ in _stream(tmp_path, executor=pool, batch_size=6, bad=bad):
      counts.append(bad.count)
    assert len(full) == (23 - 3 + 19 - 1 + 30) // 6
    for j in range(len(full)):
      bad = base.BadRecords("skip")
      rest = _stream(tmp_path, executor=pool, batch_size=6, position=full[j][1], bad=bad)
      got = []
      for cols, pos in rest:
        got.append((_ids(cols), pos))
        assert bad.count == counts[j + len(got)], (j, len(got))
      assert got == full[j + 1 :], j
  finally:
    if pool is not None:
      pool.shutdown()


def test_a_malformed_record_is_named_or_skipped(tmp_path):
  _write(tmp_path, "a.csv", range(0, 10), mtime=1)
  _write(tmp_path, "b.csv", range(100, 110), mtime=2, bad={104})
  with pytest.raises(base.BadRecordError, match=r"b\.csv:6: field 'rid'"):  # line 6: after the header
    _drain(_stream(tmp_path, bad=base.BadRecords("error"), batch_size=5))
  bad = base.BadRecords("skip")
  got = _drain(_stream(tmp_path, bad=bad, batch_size=5))
  assert [r for ids, _ in got for r in ids][:15] == list(range(10)) + [100, 101, 102, 103, 105]
  assert bad.count == 1 and "b.csv:6" in bad.examples[0]


def test_a_damaged_file_is_named_and_under_skip_the_stream_goes_on(tmp_path):
  _write(tmp_path, "a.csv", range(0, 10), mtime=1)
  data = gzip.compress(b"label,rid,c\n" + b"".join(f"1,{r},v\n".encode() for r in range(2000)))
  (tmp_path / "b.csv.gz").write_bytes(data[: len(data) // 2])  # cut short
  os.utime(tmp_path / "b.csv.gz", (2, 2))
  _write(tmp_path, "c.csv", range(300, 310), mtime=3)
  before = []
  with pytest.raises(ValueError, match=r"b\.csv\.gz: cannot be read after line"):
    for cols, _ in _stream(tmp_path, bad=base.BadRecords("error"), batch_size=5):
      before.append(_ids(cols))
  assert before == [list(range(5)), list(range(5, 10))]  # the error comes in its place: a.csv's batches first
  bad = base.BadRecords("skip")
  got = [r for ids, _ in _drain(_stream(tmp_path, bad=bad, batch_size=5)) for r in ids]
  assert got[:10] == list(range(10)) and got[-10:] == list(range(300, 310))
  assert bad.count == 1 and "b.csv.gz" in bad.examples[0]


def test_deleted_files_leave_the_position_and_the_position_is_checked(tmp_path):
  _write(tmp_path, "a.csv", range(0, 10), mtime=1)
  _write(tmp_path, "b.csv", range(100, 110), mtime=2)
  first = _drain(_stream(tmp_path, batch_size=5))
  assert first[-1][1]["done"] == ("a.csv",) and first[-1][1]["file"] == "b.csv"
  os.remove(tmp_path / "a.csv")
  _write(tmp_path, "c.csv", range(200, 210), mtime=3)
  again = _drain(_stream(tmp_path, batch_size=5, position=first[-1][1]))
  assert [r for ids, _ in again for r in ids] == list(range(200, 210))
  assert again[-1][1]["done"] == ("b.csv",)  # a.csv is gone: the position forgets it
  os.remove(tmp_path / "c.csv")
  with pytest.raises(ValueError, match=r"c\.csv \(record 10\), which is no longer there"):
    _drain(_stream(tmp_path, batch_size=5, position=again[-1][1]))
  with pytest.raises(ValueError, match="written with chunk_records=5"):
    follow.DirectoryStream(_fmt(), str(tmp_path), 5, chunk_records=7, position=again[-1][1])
  with pytest.raises(ValueError, match="lacks"):
    follow.DirectoryStream(_fmt(), str(tmp_path), 5, position={"epoch": 0, "window": 0, "offset": 0})


def test_an_idle_stream_waits_polling_and_wake_ends_it(tmp_path):
  s = _stream(tmp_path, poll_s=30.0, idle_exit_s=0.0)  # would wait forever
  t0 = time.monotonic()
  threading.Timer(0.3, s.wake).start()
  assert _drain(s) == []
  assert 0.25 < time.monotonic() - t0 < 5.0


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("content", ["empty", "garbage"])
def test_an_empty_or_garbage_file_is_one_bad_record_under_skip_and_named_under_error(tmp_path, content, workers):
  """A file without a readable header (0 bytes, or random bytes) cannot be cut into records: under
  'skip' it counts as one bad record, named, and the stream goes on with the next file (so a restart
  does not meet it again); under 'error' it stops the stream in its place, naming the file."""
  _write(tmp_path, "a.csv", range(0, 10), mtime=1)
  data = b"" if content == "empty" else np.random.default_rng(0).bytes(20_000)
  (tmp_path / "b.csv").write_bytes(data)
  os.utime(tmp_path / "b.csv", (2, 2))
  _write(tmp_path, "c.csv", range(300, 310), mtime=3)
  pool = concurrent.futures.ThreadPoolExecutor(workers) if workers else None
  try:
    before = []
    with pytest.raises(ValueError, match=r"/b\.csv:"):
      for cols, _ in _stream(tmp_path, bad=base.BadRecords("error"), batch_size=5, executor=pool):
        before.append(_ids(cols))
    assert before == [list(range(5)), list(range(5, 10))]  # in its place: a.csv's batches first
    bad = base.BadRecords("skip")
    got = _drain(_stream(tmp_path, bad=bad, batch_size=5, executor=pool))
    assert [r for ids, _ in got for r in ids] == list(range(10)) + list(range(300, 310))
    assert bad.count == 1 and "b.csv" in bad.examples[0]
    assert got[-1][1]["done"] == ("a.csv", "b.csv")
  finally:
    if pool is not None:
      pool.shutdown()


@pytest.mark.parametrize("how", ["renamed_over", "rewritten_in_place"])
def test_a_file_once_read_is_not_read_again_when_replaced_under_its_name(tmp_path, monkeypatch, how):
  """A file once seen is never read again, even if it is rewritten: a finished file renamed over
  the name of one already read (the writer's normal way to put a file in place), or the file
  rewritten in place, with a newer mtime, is skipped, both by the running stream (the next
  listing after the file was read) and by a restart from a position that lists it as done; the
  files that do arrive new are still read, each once."""

  def replace(name, rids, mtime):
    if how == "renamed_over":
      _write(tmp_path, name, rids, mtime=mtime)
    else:
      with open(tmp_path / name, "w") as f:
        f.write("label,rid,c\n" + "".join(f"{r % 2},{r},v\n" for r in rids))
      os.utime(tmp_path / name, (mtime, mtime))

  a = _write(tmp_path, "a.csv", range(0, 16), mtime=1000)
  listings = []
  real = follow.complete_files

  def listing(directory):
    # Deterministic: the second listing comes after a.csv was read to its end.
    listings.append(directory)
    if len(listings) == 2:
      replace("a.csv", range(900, 916), 3000)
      _write(tmp_path, "b.csv", range(100, 108), mtime=2000)
    return real(directory)

  monkeypatch.setattr(follow, "complete_files", listing)
  first = _drain(_stream(tmp_path))
  assert len(listings) >= 3  # the stream listed the directory after the replacement
  assert [r for ids, _ in first for r in ids] == a + list(range(100, 108))
  assert first[-1][1]["file"] == "b.csv" and first[-1][1]["done"] == ("a.csv",)
  monkeypatch.setattr(follow, "complete_files", real)
  replace("a.csv", range(800, 816), 4000)  # replaced again before the restart
  c = _write(tmp_path, "c.csv", range(200, 208), mtime=500)
  again = _drain(_stream(tmp_path, position=first[-1][1]))
  assert [r for ids, _ in again for r in ids] == c
  assert again[-1][1]["done"] == ("a.csv", "b.csv")
