"""The stream: deterministic shuffled order, split per process, exact resume, bounded memory."""

import concurrent.futures
import time

import numpy as np
import pytest

from recsys_jax.data import base, stream

SIZES = (37, 0, 120, 5, 64)  # records per source (one is empty)
SCHEMA = base.Schema(num_dense=1, features=(base.FeatureInfo("f"),))


class _Numbered:
  """Records numbered globally (the number in 'dense'); records divisible by 29 are bad."""

  schema = SCHEMA

  def __init__(self):
    self.parsed = 0
    self.starts = np.cumsum((0,) + SIZES)

  def chunks(self, path, chunk_records):
    i = int(path[1:])
    ids = np.arange(self.starts[i], self.starts[i + 1])
    for k in range(0, len(ids), chunk_records):
      yield base.RawChunk(path, k + 1, list(ids[k : k + chunk_records]))

  def parse(self, chunk, bad):
    self.parsed += 1
    keep = []
    for j, rid in enumerate(chunk.payload):
      if rid % 29 == 0 and rid > 0:
        bad.report(chunk.path, chunk.first_line + j, "f", "divisible by 29")
      else:
        keep.append(rid)
    ids = np.asarray(keep, np.int64)
    return {
      "label": (ids % 2).astype(np.float32),
      "dense": ids[:, None].astype(np.float32),
      "sparse": {"f": ids[:, None].astype(np.uint64)},
    }


SOURCES = [f"s{i}" for i in range(len(SIZES))]
GOOD = [r for r in range(sum(SIZES)) if not (r % 29 == 0 and r > 0)]


def _ids(cols):
  return cols["dense"][:, 0].astype(np.int64).tolist()


def _stream(**kw):
  kw.setdefault("bad", base.BadRecords("skip"))
  return stream.Stream(_Numbered(), SOURCES, kw.pop("batch_size", 16), chunk_records=7, window_chunks=3, seed=3, **kw)


def test_one_epoch_is_a_permutation_and_depends_on_the_seed():
  s = _stream(epochs=1)
  got = [i for cols, _ in s for i in _ids(cols)]
  assert sorted(got) == GOOD and got != GOOD
  assert s.bad.count == sum(SIZES) // 29
  again = [i for cols, _ in _stream(epochs=1) for i in _ids(cols)]
  assert again == got
  other = stream.Stream(
    _Numbered(), SOURCES, 16, chunk_records=7, window_chunks=3, seed=4, epochs=1, bad=base.BadRecords("skip")
  )
  assert [i for cols, _ in other for i in _ids(cols)] != got


def test_epochs_reshuffle_and_batches_cross_epochs():
  s = _stream()
  n = len(GOOD)
  ids = []
  while len(ids) < 2 * n:
    ids += _ids(next(s)[0])
  assert sorted(ids[:n]) == GOOD and sorted(ids[n : 2 * n]) == GOOD
  assert ids[:n] != ids[n : 2 * n]


@pytest.mark.parametrize("procs", [2, 3])
def test_processes_split_an_epoch_disjointly(procs):
  parts = [
    [i for cols, _ in _stream(epochs=1, process_index=p, process_count=procs, batch_size=5) for i in _ids(cols)]
    for p in range(procs)
  ]
  flat = [i for p in parts for i in p]
  assert sorted(flat) == GOOD and len(flat) == len(set(flat))
  assert all(len(p) > 0 for p in parts)


def test_resume_at_any_position_reads_the_same_records():
  ref_stream = _stream()
  ref = [next(ref_stream) for _ in range(40)]  # over two epochs
  rng = np.random.default_rng(0)
  for k in sorted(set(rng.integers(0, 35, 12).tolist()) | {0, 1, 13}):
    pos = ref[k][1]
    resumed = _stream(position=pos)
    for j in range(k + 1, min(k + 6, 40)):
      cols, p = next(resumed)
      assert _ids(cols) == _ids(ref[j][0]), (k, j)
      assert p == ref[j][1]
      assert resumed.bad.count == ref[j][1]["bad_records"] or p["offset"] > 0


def test_skipped_count_is_not_doubled_by_a_resume():
  full = _stream(epochs=1, batch_size=10)
  batches = list(full)
  mid = batches[len(batches) // 2][1]
  resumed = _stream(epochs=1, batch_size=10, position=mid)
  for _ in resumed:
    pass
  assert resumed.bad.count == full.bad.count == sum(SIZES) // 29


def test_memory_is_one_window_and_resume_does_not_parse_skipped_windows():
  fmt = _Numbered()
  s = stream.Stream(fmt, SOURCES, 4, chunk_records=7, window_chunks=3, bad=base.BadRecords("skip"))
  next(s)
  assert fmt.parsed == 3  # one window parsed for the first batch
  fmt_ref = _Numbered()
  ref = stream.Stream(fmt_ref, SOURCES, 16, chunk_records=7, window_chunks=3, seed=3, bad=base.BadRecords("skip"))
  for _ in range(9):  # within the first epoch
    _, pos = next(ref)
  assert pos["epoch"] == 0 and pos["window"] >= 2
  next(ref)
  fmt2 = _Numbered()
  resumed = stream.Stream(
    fmt2, SOURCES, 16, chunk_records=7, window_chunks=3, seed=3, position=pos, bad=base.BadRecords("skip")
  )
  next(resumed)
  assert fmt2.parsed == fmt_ref.parsed - 3 * pos["window"]  # the windows before the position are cut, not parsed


def test_unshuffled_single_pass_keeps_order_and_ends_short():
  got = list(_stream(epochs=1, shuffle=False, batch_size=50))
  assert [i for c, _ in got for i in _ids(c)] == GOOD
  assert base.num_records(got[-1][0]) == len(GOOD) % 50


def test_bad_policy_error_names_the_record():
  with pytest.raises(base.BadRecordError, match=r"s0:30: field 'f'"):
    list(_stream(epochs=1, bad=base.BadRecords("error"), shuffle=False))


def test_no_records_is_an_error():
  with pytest.raises(ValueError, match="gave no records"):
    next(stream.Stream(_Numbered(), ["s1"], 4))


class _Jittery(_Numbered):
  """Parses after a random short sleep, so that chunks parsed on worker threads finish out of order."""

  def parse(self, chunk, bad):
    time.sleep(float(np.random.default_rng(int(chunk.payload[0]) if chunk.payload else 0).random()) * 0.004)
    return super().parse(chunk, bad)


def _everything(s, n):
  out = []
  for _ in range(n):
    try:
      cols, pos = next(s)
    except StopIteration:
      break
    out.append((_ids(cols), cols["label"].tolist(), pos, s.bad.count))
  return out, list(s.bad.examples)


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("epochs", [None, 2])
def test_parsing_ahead_on_workers_changes_nothing(workers, epochs):
  """Batches, positions and bad-record counts and examples equal the inline stream's, from the start and resumed."""
  kw = dict(batch_size=11, epochs=epochs)
  want = _everything(_stream(**kw), 60)
  with concurrent.futures.ThreadPoolExecutor(workers) as ex:
    s = stream.Stream(
      _Jittery(), SOURCES, 11, chunk_records=7, window_chunks=3, seed=3, epochs=epochs,
      bad=base.BadRecords("skip"), executor=ex,
    )  # fmt: skip
    assert _everything(s, 60) == want
    for k in (0, 4, 13, 21):
      pos = want[0][k][2]
      resumed = _stream(**kw, position=pos, executor=ex)
      got, _ = _everything(resumed, 60 - k - 1)
      assert got == want[0][k + 1 :]


def test_parsing_ahead_raises_the_first_bad_record_in_order():
  with concurrent.futures.ThreadPoolExecutor(3) as ex:
    s = stream.Stream(
      _Jittery(), SOURCES, 16, chunk_records=7, window_chunks=3, epochs=1, shuffle=False,
      bad=base.BadRecords("error"), executor=ex,
    )  # fmt: skip
    with pytest.raises(base.BadRecordError, match=r"s0:30: field 'f'"):
      list(s)


class _KeepsOneFault(_Numbered):
  """Reports its bad records as the preprocessed cache does: the first one, then the rest as a count."""

  def parse(self, chunk, bad):
    rec = base.Recorder(limit=1)
    cols = super().parse(chunk, rec)
    base.replay(bad, chunk.path, rec.faults, rec.count)
    return cols


def test_parsing_ahead_keeps_counts_beyond_the_faults_a_format_lists():
  def run(executor):
    s = stream.Stream(
      _KeepsOneFault(), SOURCES, 9, chunk_records=40, window_chunks=2, seed=3, epochs=1,
      bad=base.BadRecords("skip"), executor=executor,
    )  # fmt: skip
    return [(p, s.bad.count) for _, p in s], s.bad.examples

  want = run(None)
  assert want[0][-1][1] == sum(SIZES) // 29  # every bad record counted, though chunks list only their first
  with concurrent.futures.ThreadPoolExecutor(2) as ex:
    assert run(ex) == want


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_record_is_counted_once_however_many_epochs_read_it(workers):
  """A bad line is one bad record of the data: the first epoch counts and names it, later epochs
  skip it without counting it again (and a restart in a later epoch goes on with that count)."""
  one = sum(SIZES) // 29
  ex = concurrent.futures.ThreadPoolExecutor(workers) if workers else None
  try:
    s = _stream(epochs=3, executor=ex)
    positions = [p for _, p in s]
    assert s.bad.count == one and positions[-1]["bad_records"] == one
    assert len(s.bad.examples) == len(set(s.bad.examples)) == min(one, s.bad.log_first)
    later = next(p for p in positions if p["epoch"] == 2)
    resumed = _stream(epochs=3, executor=ex, position=later)
    list(resumed)
    assert resumed.bad.count == one
  finally:
    if ex is not None:
      ex.shutdown()
  with pytest.raises(base.BadRecordError):  # under 'error' a later epoch still stops at it
    list(_stream(epochs=3, position={**later, "bad_records": 0}, bad=base.BadRecords("error")))
