"""Shuffled, resumable, per-process batches out of a list of sources in one format.

Order of one epoch, for a process ``i`` of ``P``:

1. the sources, permuted by ``(seed, epoch)`` (in the given order without ``shuffle``);
2. each source cut into raw chunks of ``chunk_records`` consecutive records
   (``Format.chunks``); the chunks of all sources in a row are numbered ``g = 0, 1, ...``
   and process ``i`` takes those with ``g % P == i`` (a split per process: disjoint, and
   together the whole epoch);
3. the process's chunks grouped in *windows* of ``window_chunks`` consecutive chunks; the
   records of a window are parsed and permuted by ``(seed, epoch, window, i)``;
4. batches are consecutive runs of ``batch_size`` records of that stream, across window and
   epoch boundaries (an epoch never ends a run short).

Memory is bounded by one window (``window_chunks * chunk_records`` records), whatever the
size of the files. A reading position is ``{'epoch', 'window', 'offset', 'bad_records'}``:
the next record is record ``offset`` of window ``window``; a stream restarted at a position
cuts (without parsing) and drops the chunks of the earlier windows and continues with
exactly the records the uninterrupted stream would have read next. ``bad_records`` restores
the skipped-record count as it stood at the start of that window, so nothing is counted twice.
A bad record is counted (and named) by the first epoch only: it is one bad record of the data,
however many epochs read it.

With an ``executor`` (the trainer's host worker threads), chunks are parsed on it up to one
window ahead of the window being read, across epoch boundaries, each with its own
``base.Recorder``; the stream reports their bad records in chunk order as it reaches
them, so batches, positions and bad-record counts, messages and errors are the same as
without one, for any number of workers. Memory is then about three windows.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

from recsys_jax.data import base


def initial_position() -> Dict[str, int]:
  """The position of the first record of the first epoch."""
  return {"epoch": 0, "window": 0, "offset": 0, "bad_records": 0}


class Stream:
  """One process's batches from ``sources`` (see the module docstring for the order).

  Args:
    fmt: the format of the sources.
    sources: paths (or names the format understands, e.g. MovieLens's 'train').
    batch_size: records per batch (this process's share of the global batch).
    seed: seeds the source and record permutations.
    shuffle: permute sources and records; False keeps the file order (evaluation).
    chunk_records: records per raw chunk (the unit of the split between processes).
    window_chunks: chunks per shuffle window (records are permuted within a window).
    process_index: this process.
    process_count: processes sharing the sources.
    bad: the bad-record policy and count.
    position: where to start (default: the beginning).
    epochs: epochs to read (None: forever); the last batch of the last epoch may be short.
    executor: a ``concurrent.futures`` executor to parse chunks ahead on (None: parse each
      window when it is reached, on the reading thread).
    times: a ``recsys_jax.training.stage_times.StageTimes`` (or anything with its
      ``time(stage)``) that times each chunk's parse as ``parse``; None: not timed.
  """

  def __init__(
    self,
    fmt: base.Format,
    sources: Sequence[str],
    batch_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    chunk_records: int = 8192,
    window_chunks: int = 8,
    process_index: int = 0,
    process_count: int = 1,
    bad: Optional[base.BadRecords] = None,
    position: Optional[Dict[str, int]] = None,
    epochs: Optional[int] = None,
    executor: Any = None,
    times: Any = None,
  ):
    if not sources:
      raise ValueError("data: no sources to read (check config.data.train_files / eval_files)")
    if batch_size <= 0 or chunk_records <= 0 or window_chunks <= 0:
      raise ValueError(
        f"data: batch_size={batch_size}, chunk_records={chunk_records}, window_chunks={window_chunks} must be positive"
      )
    if not 0 <= process_index < process_count:
      raise ValueError(f"data: process_index={process_index} not in [0, {process_count})")
    self.fmt, self.sources, self.batch_size = fmt, list(sources), int(batch_size)
    self.seed, self.shuffle = int(seed), bool(shuffle)
    self.chunk_records, self.window_chunks = int(chunk_records), int(window_chunks)
    self.process_index, self.process_count = int(process_index), int(process_count)
    self.bad = bad if bad is not None else base.BadRecords("error")
    self.epochs = epochs
    self.executor = executor
    self.times = times
    pos = dict(initial_position() if position is None else position)
    missing = set(initial_position()) - set(pos)
    if missing:
      raise ValueError(f"data: reading position {position} lacks {sorted(missing)}")
    self.position = pos
    self.bad.count = int(pos["bad_records"])
    self._it = self._batches()

  # -- order ----------------------------------------------------------------------------------
  def _source_order(self, epoch: int) -> list:
    if not self.shuffle:
      return list(self.sources)
    perm = np.random.default_rng([self.seed, epoch, 0x5EED]).permutation(len(self.sources))
    return [self.sources[i] for i in perm]

  def _my_chunks(self, epoch: int) -> Iterator[base.RawChunk]:
    chunks = itertools.chain.from_iterable(self.fmt.chunks(s, self.chunk_records) for s in self._source_order(epoch))
    return itertools.islice(chunks, self.process_index, None, self.process_count)

  def _chunks_from(self, epoch: int, first_window: int) -> Iterator[Tuple[int, Optional[base.RawChunk]]]:
    """``(epoch, raw chunk)`` from window ``first_window`` of ``epoch`` on, then the later epochs;
    ``(epoch, None)`` ends each epoch. The chunks before ``first_window`` are cut, not parsed."""
    while self.epochs is None or epoch < self.epochs:
      mine = self._my_chunks(epoch)
      for _ in range(first_window * self.window_chunks):
        if next(mine, None) is None:
          break
      for chunk in mine:
        yield epoch, chunk
      yield epoch, None
      epoch, first_window = epoch + 1, 0

  def _parses(self, chunks) -> Iterator[Tuple[int, Optional[Callable[[], base.Columns]]]]:
    """``(epoch, parse)`` for each of ``chunks``: ``parse()`` returns the chunk's records and reports
    its bad records to ``self.bad``. Called in chunk order; with an executor the parsing itself
    runs ahead on it (one window's worth of chunks)."""
    if self.executor is None:
      for epoch, chunk in chunks:
        yield epoch, None if chunk is None else functools.partial(self._parse, chunk, self._bad_of(epoch))
      return

    def parse(item):
      epoch, chunk = item
      if chunk is None:
        return None
      rec = base.Recorder()
      return self._parse(chunk, rec), rec

    def collect(future, path, bad):
      cols, rec = future.result()
      base.replay(bad, path, rec.faults, rec.count)
      return cols

    for (epoch, chunk), future in base.run_ahead(self.executor, parse, chunks, self.window_chunks):
      yield epoch, None if chunk is None else functools.partial(collect, future, chunk.path, self._bad_of(epoch))

  def _bad_of(self, epoch: int) -> base.BadRecords:
    """Where the bad records read in ``epoch`` go. A bad line is one bad record of the data: epoch 0
    reads every record once (over the processes), so it counts and names them; a later epoch meets
    the same ones and drops them uncounted (under 'error' it still stops at the first)."""
    if epoch == 0 or self.bad.policy == "error":
      return self.bad
    return base.Recorder(limit=0)

  def _parse(self, chunk: base.RawChunk, bad: base.BadRecords) -> base.Columns:
    with self.times.time("parse") if self.times is not None else contextlib.nullcontext():
      return self.fmt.parse(chunk, bad)

  # -- batches ----------------------------------------------------------------------------------
  def _batches(self) -> Iterator[Tuple[base.Columns, Dict[str, int]]]:
    pending, have = [], 0
    first_epoch, first_window, offset = self.position["epoch"], self.position["window"], self.position["offset"]
    parses = self._parses(self._chunks_from(first_epoch, first_window))
    epoch = first_epoch
    for epoch, items in itertools.groupby(parses, key=operator.itemgetter(0)):
      w = first = first_window if epoch == first_epoch else 0
      chunks = (parse for _, parse in items if parse is not None)
      read_any = False
      while True:
        window = list(itertools.islice(chunks, self.window_chunks))
        if not window:
          break
        bad_before = self.bad.count
        cols = base.concat_columns([parse() for parse in window])
        n = base.num_records(cols)
        read_any |= n > 0
        # The window's records in the order (seed, epoch, window, process) gives; each batch
        # gathers its run of them, so the permuted window is never copied whole.
        order = None
        if self.shuffle:
          order = np.random.default_rng([self.seed, epoch, w, self.process_index]).permutation(n)
        while offset < n:
          take = min(self.batch_size - have, n - offset)
          if order is None:
            pending.append(base.take_columns(cols, slice(offset, offset + take)))
          else:  # the sparse ids are gathered by the dedup, on a worker, where it reads them
            pending.append(base.take_records(cols, order[offset : offset + take]))
          have += take
          offset += take
          if have == self.batch_size:
            pos = {"epoch": epoch, "window": w, "offset": offset, "bad_records": bad_before}
            if offset == n:  # the next record starts the next window
              pos = {"epoch": epoch, "window": w + 1, "offset": 0, "bad_records": self.bad.count}
            one_copy = len(pending) == 1 and order is not None  # gathered: no view of the window but the sparse ids
            yield pending[0] if one_copy else base.concat_columns(pending), pos
            pending, have = [], 0
        offset = 0
        w += 1
      if not read_any and first == 0:
        raise ValueError(
          f"data: epoch {epoch} of {len(self.sources)} source(s) gave no records for process "
          f"{self.process_index} of {self.process_count} (first: {self._describe(self.sources[0])}): empty files, "
          "all records bad, or fewer chunks than processes"
        )
    if pending:
      yield base.concat_columns(pending), {"epoch": epoch + 1, "window": 0, "offset": 0, "bad_records": self.bad.count}

  def _describe(self, source: str) -> str:
    # A format whose sources are not paths (MovieLens's 'train', 'eval') says where they come from.
    describe = getattr(self.fmt, "describe", None)
    return describe(source) if describe is not None else source

  def __iter__(self):
    return self

  def __next__(self) -> Tuple[base.Columns, Dict[str, int]]:
    """The next batch and the position just after it."""
    return next(self._it)
