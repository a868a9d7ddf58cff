"""A stream source: the files arriving in a directory, trained in arrival order as they come.

Online training (``config.data.stream_dir``) reads a directory into which a pipeline writes
files of one format (Criteo TSV, Avazu, CSV or Parquet: ``config.data.name``), hourly or minute
partitions, with no end.

**Completeness rule: a file counts once it is renamed into place.** A writer writes under a name
this reader ignores (one that starts with ``.``, or ends with ``.tmp`` or ``.inprogress``) and
renames the finished file to its final name, which is atomic within one filesystem; the file is
then complete and is never read half written. Subdirectories are ignored.

**Order.** Each listing of the directory takes the complete files not seen before, in the order of
``(mtime, name)``, and queues them behind those found by earlier listings: files are trained in
arrival order, each once (a file once seen is never read again, even if it is rewritten), and the
records of a file in file order (no shuffling in a stream: online learning follows time).
Batches are consecutive runs of ``batch_size`` records across file boundaries. While no complete
file waits, the reader logs one line and lists the directory again every ``poll_s`` seconds (a
sleep, not a busy loop); with ``idle_exit_s`` > 0 it ends once the directory has given nothing new
for that long (the trainer then takes its final checkpoint and exits 0). The records that do not
fill a last batch are not trained then: the position before them is saved, and the next run
reads them first.

**Position.** The position after a batch names the file and the record in it:
``{'file': name, 'record': r, 'chunk': c, 'offset': o, 'done': [names], 'bad_records': b,
'chunk_records': n}``: the next record is good record ``r`` of ``file`` (its records that parse,
counted from 0), which is record ``o`` of its raw chunk ``c`` of ``chunk_records`` records;
``done`` lists the files read to their end before it, in order. A restart cuts (without parsing)
the chunks of ``file`` before ``c``, continues at its record ``o``, then reads the files of the
directory not in ``done`` in ``(mtime, name)`` order, so at the same files it continues at exactly
the record an uninterrupted run would have read next. ``bad_records`` is the skipped-record count
at the start of chunk ``c`` (it is re-parsed, and its bad records counted again). ``done`` keeps
the names of files still in the directory: a consumed file that is deleted leaves it (so deleting
trained files bounds the position; a new file under that name is then read as a new file).

**Bad input.** A malformed record is named (path and line) and handled by ``on_bad_record``:
``'error'`` stops the run (the trainer saves the step reached first), ``'skip'`` drops and counts
it. A file that cannot be read to its end (a damaged gzip) is named with the last line read;
under ``'skip'`` the rest of it counts as one bad record and the stream goes on with the next file;
so does a file that cannot be cut into records at all (an empty CSV file, or one whose header is
not text or lacks the columns).

One trainer process only: several processes would have to agree on the arrival order and on
where the stream ends (``build_reader`` refuses it).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

from absl import logging

from recsys_jax.data import base

IGNORED_PREFIXES = (".",)
IGNORED_SUFFIXES = (".tmp", ".inprogress")
_POSITION_KEYS = ("file", "record", "chunk", "offset", "done", "bad_records", "chunk_records")


def is_complete(name: str) -> bool:
  """Whether a directory entry's name is a finished file's (not a writer's temporary name)."""
  return not name.startswith(IGNORED_PREFIXES) and not name.endswith(IGNORED_SUFFIXES)


def complete_files(directory: str) -> List[Tuple[float, str]]:
  """``(mtime, name)`` of the complete regular files in ``directory``, sorted.

  Raises:
    ValueError: naming the directory if it cannot be listed.
  """
  out = []
  try:
    entries = list(os.scandir(directory))
  except OSError as e:
    raise ValueError(f"config.data.stream_dir = {directory!r}: cannot list it ({e.strerror or e})") from None
  for entry in entries:
    if not is_complete(entry.name):
      continue
    try:
      if not entry.is_file():
        continue
      out.append((entry.stat().st_mtime, entry.name))
    except FileNotFoundError:  # renamed or removed between the listing and the stat
      continue
  return sorted(out)


def initial_position(chunk_records: int) -> Dict[str, Any]:
  """The position before the first record of the stream."""
  return {
    "file": None,
    "record": 0,
    "chunk": 0,
    "offset": 0,
    "done": [],
    "bad_records": 0,
    "chunk_records": chunk_records,
  }


_IDLE = object()
"""Drawn from the chunk source while no complete file waits: the parsed chunks are handed over."""


class DirectoryStream:
  """Batches of the files arriving in ``directory`` (see the module docstring).

  Args:
    fmt: the format of the files.
    directory: the directory to follow.
    batch_size: records per batch.
    chunk_records: records per raw chunk (the unit parsed ahead and resumed at).
    poll_s: seconds between listings while no complete file waits.
    idle_exit_s: end once no new file arrived for this long (0: never end).
    bad: the bad-record policy and count.
    position: where to start (default: the first record of the first file).
    executor: a ``concurrent.futures`` executor to parse chunks ahead on (None: on the reading thread).
    ahead: chunks parsed ahead of the one being batched.
    times: a ``StageTimes`` that times each chunk's parse as ``parse`` (None: not timed).
    clock: the clock the idle time is measured on (tests).
  """

  def __init__(
    self,
    fmt: base.Format,
    directory: str,
    batch_size: int,
    *,
    chunk_records: int = 8192,
    poll_s: float = 1.0,
    idle_exit_s: float = 0.0,
    bad: Optional[base.BadRecords] = None,
    position: Optional[Dict[str, Any]] = None,
    executor: Any = None,
    ahead: int = 2,
    times: Any = None,
    clock=time.monotonic,
  ):
    if batch_size <= 0 or chunk_records <= 0:
      raise ValueError(f"data: batch_size={batch_size}, chunk_records={chunk_records} must be positive")
    if not poll_s > 0 or idle_exit_s < 0:
      raise ValueError(f"data: stream_poll_s={poll_s} must be > 0 and stream_idle_exit_s={idle_exit_s} >= 0")
    if not os.path.isdir(directory):
      raise ValueError(f"config.data.stream_dir = {directory!r}: no such directory")
    self.fmt, self.directory, self.batch_size = fmt, directory, int(batch_size)
    self.chunk_records, self.poll_s, self.idle_exit_s = int(chunk_records), float(poll_s), float(idle_exit_s)
    self.bad = bad if bad is not None else base.BadRecords("error")
    self.executor, self.ahead, self.times = executor, max(1, int(ahead)), times
    self._clock = clock
    self._closed = threading.Event()
    pos = dict(initial_position(self.chunk_records) if position is None else position)
    missing = sorted(set(_POSITION_KEYS) - set(pos))
    if missing:
      raise ValueError(
        f"data: stream position {position} lacks {missing} (written by a run that did not read a stream?)"
      )
    if int(pos["chunk_records"]) != self.chunk_records:
      raise ValueError(
        f"data: the stream position was written with chunk_records={pos['chunk_records']}, config has "
        f"{self.chunk_records}: it names a record by its chunk; use {pos['chunk_records']} or a new workdir"
      )
    self.position = pos
    self._done = list(pos["done"])
    """The files read to their end, in order (less those deleted since): the batcher appends, a listing prunes."""
    self.bad.count = int(pos["bad_records"])
    self._it = self._batches()

  def wake(self) -> None:
    """Wakes a reader waiting for files; the next draw ends the stream (the trainer's prefetcher
    calls it when the run ends, from another thread than the one drawing)."""
    self._closed.set()

  def __iter__(self):
    return self

  def __next__(self) -> Tuple[base.Columns, Dict[str, Any]]:
    """The next batch and the position just after it."""
    return next(self._it)

  # -- files ----------------------------------------------------------------------------------
  def _files(self, done: List[str]) -> Iterator[Any]:
    """The names of the files to read, in arrival order, with ``_IDLE`` whenever none waits;
    ends after ``idle_exit_s`` without a new file, or once woken (``wake``). ``done`` (the files read to
    their end, in order) loses the names no longer in the directory at each listing."""
    seen = set(done)
    current = self.position["file"]
    if current is not None:
      seen.add(current)
    waiting: Deque[str] = collections.deque()
    idle_since = None
    while not self._closed.is_set():
      listing = complete_files(self.directory)
      names = {name for _, name in listing}
      done[:] = [name for name in done if name in names]
      seen.intersection_update(names | set(waiting) | ({current} if current else set()))
      for _, name in listing:
        if name not in seen:
          seen.add(name)
          waiting.append(name)
      if waiting:
        idle_since = None
        while waiting:
          current = waiting.popleft()
          yield current
        continue
      yield _IDLE
      now = self._clock()
      if idle_since is None:
        idle_since = now
        logging.warning(
          "stream: no complete file waiting in %s; listing it again every %g s%s",
          self.directory,
          self.poll_s,
          f" (the run ends after {self.idle_exit_s:g} s without one)" if self.idle_exit_s else "",
        )
      elif self.idle_exit_s and now - idle_since >= self.idle_exit_s:
        logging.warning("stream: no new file in %s for %g s: the stream ends", self.directory, now - idle_since)
        return
      self._closed.wait(self.poll_s)

  def _chunks(self) -> Iterator[Any]:
    """``(file, chunk index, raw chunk)`` of the stream from the position on, ``(file, None, None)``
    after each file's last chunk, and ``_IDLE`` while no complete file waits."""
    pos = self.position
    if pos["file"] is not None:
      path = os.path.join(self.directory, pos["file"])
      if not os.path.isfile(path):
        raise ValueError(
          f"data: the stream position is in {path} (record {pos['record']}), which is no longer there: "
          "put it back, or start a new workdir"
        )
      yield from self._file_chunks(pos["file"], int(pos["chunk"]))
    for name in self._files(self._done):
      if name is _IDLE:
        yield _IDLE
      else:
        yield from self._file_chunks(name, 0)

  def _file_chunks(self, name: str, first_chunk: int) -> Iterator[Any]:
    """The file's chunks from ``first_chunk`` on, then ``(name, None, None)``, or ``(name, None, error)``
    if it cannot be read to its end: the error is raised or counted in its place in chunk order."""
    try:
      # Inside the try: a format that reads a header when asked for the chunks (CSV) raises here
      # for a file without one (empty, or not text), which is then the file's one bad record.
      chunks = self.fmt.chunks(os.path.join(self.directory, name), self.chunk_records)
      for i, chunk in enumerate(chunks):
        if i >= first_chunk:  # the earlier ones are cut, not parsed
          yield name, i, chunk
    except ValueError as e:  # base.unreadable names the file and the last line read
      yield name, None, e
      return
    yield name, None, None

  # -- parsing ahead --------------------------------------------------------------------------
  def _parse(self, chunk: base.RawChunk, bad: base.BadRecords) -> base.Columns:
    with self.times.time("parse") if self.times is not None else contextlib.nullcontext():
      return self.fmt.parse(chunk, bad)

  def _parsed(self) -> Iterator[Tuple[str, Optional[int], Optional[base.Columns], int]]:
    """``(file, chunk index, columns, bad count before the chunk)`` in stream order (``(file, None,
    None, count)`` at a file's end). With an executor, up to ``ahead`` chunks are parsed ahead,
    each with its own ``Recorder`` whose bad records are reported here in chunk order; all that
    is parsed is handed over before the reader waits for files."""
    pending: Deque[Tuple[Any, Any]] = collections.deque()

    def resolve(item, future):
      name, i, chunk = item
      before = self.bad.count
      if isinstance(chunk, ValueError):  # the file cannot be read on from here
        if self.bad.policy == "error":
          raise chunk
        path = os.path.join(self.directory, name)
        self.bad.report(path, 0, "<file>", f"the rest of the file is skipped: {base.one_line(chunk)}")
        chunk = None
      if chunk is None:
        return name, None, None, before
      if future is None:
        return name, i, self._parse(chunk, self.bad), before
      cols, rec = future.result()
      base.replay(self.bad, chunk.path, rec.faults, rec.count)
      return name, i, cols, before

    def parse(chunk):
      rec = base.Recorder()
      return self._parse(chunk, rec), rec

    for item in self._chunks():
      if item is _IDLE:
        while pending:
          yield resolve(*pending.popleft())
        continue
      if self.executor is None or not isinstance(item[2], base.RawChunk):
        pending.append((item, None))
      else:
        pending.append((item, self.executor.submit(parse, item[2])))
      while len(pending) > self.ahead:
        yield resolve(*pending.popleft())
    while pending:
      yield resolve(*pending.popleft())

  # -- batches --------------------------------------------------------------------------------
  def _batches(self) -> Iterator[Tuple[base.Columns, Dict[str, Any]]]:
    pos = self.position
    start_file, start_chunk, skip = pos["file"], int(pos["chunk"]), int(pos["offset"])
    file_records = int(pos["record"]) - skip  # good records of the current file before its current chunk
    done: Tuple[str, ...] = tuple(pos["done"])  # shared by the positions until a file ends
    parts: List[base.Columns] = []
    have = 0
    for name, i, cols, bad_before in self._parsed():
      if cols is None:  # the file is read to its end
        self._done.append(name)
        done, file_records = tuple(self._done), 0
        continue
      n = base.num_records(cols)
      off = skip if (name, i) == (start_file, start_chunk) else 0
      while off < n:
        take = min(self.batch_size - have, n - off)
        parts.append(base.take_columns(cols, slice(off, off + take)))
        have += take
        off += take
        if have == self.batch_size:
          if off == n:  # the next record starts the next chunk
            where = {"chunk": i + 1, "offset": 0, "record": file_records + n, "bad_records": self.bad.count}
          else:
            where = {"chunk": i, "offset": off, "record": file_records + off, "bad_records": bad_before}
          position = {"file": name, "done": done, "chunk_records": self.chunk_records, **where}
          yield (parts[0] if len(parts) == 1 else base.concat_columns(parts)), position
          parts, have = [], 0
      file_records += n


def stream_reader_train(
  fmt: base.Format,
  data_config,
  batch_size: int,
  bad: base.BadRecords,
  position=None,
  executor=None,
  ahead=2,
  times=None,
) -> DirectoryStream:
  """The training stream ``config.data`` names (``stream_dir``, ``chunk_records``, ``stream_poll_s``,
  ``stream_idle_exit_s``)."""
  return DirectoryStream(
    fmt,
    os.path.expanduser(str(data_config.stream_dir)),
    batch_size,
    chunk_records=data_config.chunk_records,
    poll_s=data_config.get("stream_poll_s", 1.0),
    idle_exit_s=data_config.get("stream_idle_exit_s", 0.0),
    bad=bad,
    position=position,
    executor=executor,
    ahead=ahead,
    times=times,
  )


def describe(position: Dict[str, Any]) -> str:
  """A stream position in words (a log line)."""
  if position.get("file") is None:
    return "the start of the stream"
  return f"{position['file']} record {position['record']} ({len(position['done'])} file(s) read before it)"


__all__ = ["DirectoryStream", "complete_files", "describe", "initial_position", "is_complete", "stream_reader_train"]
