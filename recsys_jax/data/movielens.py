"""MovieLens ratings as click-through records: user, movie, genres and the user's earlier movies.

``MovieLensFormat`` reads a MovieLens directory (``ratings.csv``: userId,movieId,rating,timestamp;
``movies.csv``: movieId,title,genres, e.g. ``ml-latest-small``) once, in memory, and serves one
record per rating, labelled ``rating >= 4``. The records are sorted by (timestamp, userId, movieId)
and split in time, so evaluation asks about the future of what training saw: with
``split='user'`` (the usual protocol for this data set) the latest ``eval_fraction`` of each user's
ratings are ``'eval'``; with ``split='time'`` the latest ``eval_fraction`` of all ratings are (a
cold-start test: in ml-latest-small only 10% of those come from users seen in training).

Features:
  * ``user``: hash_ints(userId, 'user'); ``movie``: hash_ints(movieId, 'movie'), one id each;
  * ``genres``: the movie's genres, a multi-hot bag (its first ``max_genres``), hashed per field;
  * ``history``: a sequence reading the ``movie`` table: the movies the user rated strictly earlier
    (timestamp < this rating's; ratings in the same second are not history), oldest first, the
    most recent ``max_history`` kept, padded at the end with weight 0.

Dense features, all known at the time of the rating (nothing from the future leaks in):
  0. log1p(the user's number of strictly earlier ratings): how much history there is;
  1. log1p(the movie's number of strictly earlier ratings, by anyone): its popularity so far;
  2. the release year from the title's ``(YYYY)``, as (year - 2000) / 20, 0 when absent;
  3. 1 when the year is absent (also for a movie missing from movies.csv), else 0.

The data set's licence (GroupLens, research use only, no redistribution outside its terms) is in
its README.txt; nothing of it is copied into this repository.
"""

from __future__ import annotations

import csv
import os
import re
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from recsys_jax.data import base

SPLITS = ("train", "eval")
NUM_DENSE = 4
RATINGS_HEADER = ["userId", "movieId", "rating", "timestamp"]
MOVIES_HEADER = ["movieId", "title", "genres"]
NO_GENRES = "(no genres listed)"
# The year closes the title: "(1995)", or "(2006–2007)" for a series (the first year is taken).
_YEAR = re.compile(r"\((\d{4})(?:\s*[-\u2013]\s*\d{0,4})?\)\s*$")


class _Payload:
  """Precomputed columns of consecutive records; ``num_rows`` is what ``RawChunk.__len__`` reads."""

  def __init__(self, columns: base.Columns):
    self.columns = columns
    self.num_rows = base.num_records(columns)


class MovieLensFormat:
  """The MovieLens ratings of a directory, preprocessed once in memory, split in time.

  ``chunks('train' | 'eval', n)`` cuts a split into raw chunks that already hold the columns;
  ``parse`` hands them out. Bad lines of the CSV files are reported at load time to ``bad``.
  ``num_train`` and ``num_eval`` count the records of each split; ``timestamps`` holds every
  record's timestamp in record order (train, then eval).
  """

  def __init__(
    self,
    directory: str,
    *,
    max_history: int = 50,
    max_genres: int = 8,
    eval_fraction: float = 0.2,
    split: str = "time",
    bad: Optional[base.BadRecords] = None,
  ):
    """Loads and preprocesses ``directory``'s ratings.csv and movies.csv.

    Args:
      directory: a MovieLens directory holding ratings.csv and movies.csv.
      max_history: movies kept in the ``history`` sequence (the user's most recent earlier ones).
      max_genres: genre ids kept per movie (its first ones, as movies.csv lists them).
      eval_fraction: the fraction of ratings, the latest in time, that form the ``'eval'`` split.
      split: ``'time'`` (the latest of all ratings) or ``'user'`` (the latest of each user's,
        ``round(eval_fraction * n_u)`` of a user with ``n_u`` ratings).
      bad: where malformed CSV lines go (default: policy ``'error'``, which raises naming file and line).
    """
    if max_history < 2 or max_genres < 2:
      # Length-1 bags would need weights to mark an empty one, which one-hot features lack.
      raise ValueError(f"max_history ({max_history}) and max_genres ({max_genres}) must be >= 2")
    if split not in ("time", "user"):
      raise ValueError(f"MovieLens split {split!r}: choose 'time' or 'user'")
    if not 0.0 <= eval_fraction < 1.0:
      raise ValueError(f"eval_fraction {eval_fraction} must be in [0, 1)")
    self.directory = directory
    self.max_history, self.max_genres, self.eval_fraction = int(max_history), int(max_genres), float(eval_fraction)
    self.bad = bad if bad is not None else base.BadRecords("error")
    self.ratings_path = os.path.join(directory, "ratings.csv")
    self.movies_path = os.path.join(directory, "movies.csv")
    self.schema = base.Schema(
      num_dense=NUM_DENSE,
      features=(
        base.FeatureInfo("user", 1, "pooled"),
        base.FeatureInfo("movie", 1, "pooled"),
        base.FeatureInfo("genres", self.max_genres, "pooled"),
        base.FeatureInfo("history", self.max_history, "sequence", "movie"),
      ),
    )
    users, movies, ratings, times = _read_ratings(self.ratings_path, self.bad)
    genres, years = _read_movies(self.movies_path, self.bad)
    self._columns, self.timestamps = self._build(users, movies, ratings, times, genres, years)
    n = base.num_records(self._columns)
    if split == "time":
      is_eval = np.arange(n) >= n - int(round(n * self.eval_fraction))
    else:  # each user's latest: rank within the user in time order against the user's count
      user = self._columns["sparse"]["user"][:, 0]
      by_user = np.argsort(user, kind="stable")
      _, start, count = np.unique(user[by_user], return_index=True, return_counts=True)
      rank = np.arange(n) - np.repeat(start, count)
      cut = np.repeat(count - np.round(count * self.eval_fraction).astype(np.int64), count)
      is_eval = np.empty(n, bool)
      is_eval[by_user] = rank >= cut
    # Train records, then eval records, each in time order.
    order = np.concatenate([np.flatnonzero(~is_eval), np.flatnonzero(is_eval)])
    self._columns, self.timestamps = base.take_columns(self._columns, order), self.timestamps[order]
    self.num_eval = int(is_eval.sum())
    self.num_train = n - self.num_eval
    self._bounds = {"train": (0, self.num_train), "eval": (self.num_train, n)}

  def _build(
    self,
    users: np.ndarray,
    movies: np.ndarray,
    ratings: np.ndarray,
    times: np.ndarray,
    genres: Dict[int, List[str]],
    years: Dict[int, int],
  ) -> Tuple[base.Columns, np.ndarray]:
    """Columns of all ratings in (timestamp, userId, movieId) order, and their timestamps."""
    order = np.lexsort((movies, users, times))
    users, movies, ratings, times = users[order], movies[order], ratings[order], times[order]
    n = len(users)
    movie_ids = base.hash_ints(movies, "movie")

    # The user's earlier ratings: group by user (stable, so each group stays in time order) and
    # count, for each rating, the group's ratings before the first one in its own second.
    by_user = np.argsort(users, kind="stable")
    u_prior, u_run_start = _prior_counts(users[by_user], times[by_user])
    lens = np.minimum(u_prior, self.max_history)
    slot = np.arange(self.max_history)
    valid = slot[None, :] < lens[:, None]
    src = np.where(valid, u_run_start[:, None] - lens[:, None] + slot[None, :], 0)
    history = np.zeros((n, self.max_history), np.uint64)
    history_w = np.zeros((n, self.max_history), np.float32)
    history[by_user] = np.where(valid, movie_ids[by_user][src], np.uint64(0))
    history_w[by_user] = valid
    user_prior = np.empty(n, np.int64)
    user_prior[by_user] = u_prior

    by_movie = np.argsort(movies, kind="stable")
    m_prior, _ = _prior_counts(movies[by_movie], times[by_movie])
    movie_prior = np.empty(n, np.int64)
    movie_prior[by_movie] = m_prior

    # Genres and year once per distinct movie; a movie missing from movies.csv has neither.
    distinct, inverse = np.unique(movies, return_inverse=True)
    bags = [genres.get(int(m), []) for m in distinct]
    g_ids, g_w = base.multi_hot(bags, "genres", self.max_genres)
    year = np.array([years.get(int(m), -1) for m in distinct], np.int64)[inverse]
    has_year = year >= 0

    dense = np.stack(
      [
        np.log1p(user_prior),
        np.log1p(movie_prior),
        np.where(has_year, (year - 2000) / 20.0, 0.0),
        (~has_year).astype(np.float64),
      ],
      axis=1,
    ).astype(np.float32)
    columns = {
      "label": (ratings >= 4.0).astype(np.float32),
      "dense": dense,
      "sparse": {
        "user": base.hash_ints(users, "user").reshape(n, 1),
        "movie": movie_ids.reshape(n, 1),
        "genres": g_ids[inverse],
        "history": history,
      },
      "sparse_weights": {"genres": g_w[inverse], "history": history_w},
    }
    return columns, times

  def split_bounds(self, split: str) -> Tuple[int, int]:
    """[start, stop) of ``split`` in the time-sorted records."""
    if split not in SPLITS:
      raise ValueError(f"MovieLens split {split!r}: choose one of {SPLITS}")
    return self._bounds[split]

  def describe(self, split: str) -> str:
    """Where a split's records come from, for messages: ``<ratings.csv>[train]``."""
    return f"{self.ratings_path}[{split}]"

  def chunks(self, path: str, chunk_records: int) -> Iterator[base.RawChunk]:
    """Cuts a split into raw chunks of precomputed columns, in time order.

    Args:
      path: the split, ``'train'`` or ``'eval'``.
      chunk_records: records per chunk (the last may be shorter).

    Returns:
      An iterator of raw chunks; ``first_line`` is the 1-based record number within the split.
    """
    start, stop = self.split_bounds(path)
    if chunk_records < 1:
      raise ValueError(f"chunk_records {chunk_records} must be >= 1")
    name = self.describe(path)

    def gen() -> Iterator[base.RawChunk]:
      for lo in range(start, stop, chunk_records):
        part = base.take_columns(self._columns, slice(lo, min(lo + chunk_records, stop)))
        yield base.RawChunk(name, lo - start + 1, _Payload(part))

    return gen()

  def parse(self, chunk: base.RawChunk, bad: base.BadRecords) -> base.Columns:
    """The chunk's columns (a copy: callers may write to them); bad lines went to the loader's ``bad``.

    Args:
      chunk: a raw chunk from ``chunks``.
      bad: unused; malformed lines were reported when the files were loaded.

    Returns:
      The chunk's columns.
    """
    del bad
    return base.concat_columns([chunk.payload.columns])


# ---------------------------------------------------------------------------------------------
# Loading.


def _prior_counts(keys: np.ndarray, times: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """Per record of key-grouped, time-sorted arrays: how many of its group are strictly earlier.

  Returns:
    (count of the group's records with a smaller time, index where the record's (key, time) run
    starts: the strictly earlier records of its group are those just before it).
  """
  n = len(keys)
  pos = np.arange(n)
  new_key = np.ones(n, bool)
  new_key[1:] = keys[1:] != keys[:-1]
  new_run = new_key.copy()
  new_run[1:] |= times[1:] != times[:-1]
  group_start = np.maximum.accumulate(np.where(new_key, pos, 0))
  run_start = np.maximum.accumulate(np.where(new_run, pos, 0))
  return run_start - group_start, run_start


def _check_header(path: str, header: Optional[List[str]], expected: List[str]) -> None:
  if header is None:
    raise ValueError(f"{path}: empty file, expected the header {','.join(expected)}")
  header = [h.strip().lstrip("\ufeff") for h in header]
  if header != expected:
    raise ValueError(f"{path}: header {header} is not the MovieLens header {expected}")


def _split(raw: bytes) -> Tuple[Optional[List[str]], Optional[str]]:
  """(fields, None) of one CSV line, or (None, why it is not a line of UTF-8 CSV)."""
  try:
    text = raw.rstrip(b"\r\n").decode("utf-8")
  except UnicodeDecodeError as e:
    return None, f"not UTF-8 ({e.reason} at byte {e.start})"
  if "\0" in text:
    return None, "holds a NUL byte"
  try:
    return next(csv.reader([text]), []), None
  except csv.Error as e:  # e.g. a field longer than csv.field_size_limit()
    return None, f"not CSV ({e})"


def _rows(path: str, expected: List[str], bad: base.BadRecords) -> Iterator[Tuple[int, List[str]]]:
  """(line number, fields) of each non-blank line of a MovieLens CSV file after its header.

  Lines are split one at a time (MovieLens quotes titles but never spans lines), so a line that
  is not UTF-8, holds a NUL byte or does not split is one bad record, reported with its line
  number, and the lines after it are read as usual.
  """
  line_no = 0
  try:
    with open(path, "rb") as f:
      for line_no, raw in enumerate(f, 1):
        row, why = _split(raw)
        if line_no == 1:
          if why:
            raise ValueError(f"{path}:1: the header line is {why}")
          _check_header(path, row, expected)
        elif why:
          bad.report(path, line_no, "<line>", why)
        elif row:  # a blank line is skipped, as csv.DictReader skips them
          yield line_no, row
  except base.READ_ERRORS as e:  # missing, a directory, unreadable
    raise base.unreadable(path, line_no, e) from None
  if line_no == 0:
    _check_header(path, None, expected)


# Each column of ratings.csv: its name, how it is read, and what it must be.
_RATING_FIELDS = (
  ("userId", int, "an integer"),
  ("movieId", int, "an integer"),
  ("rating", float, "a number"),
  ("timestamp", int, "an integer"),
)
_INT64_MAX = 2**63 - 1


def _read_ratings(path: str, bad: base.BadRecords) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """userId, movieId, rating and timestamp arrays of the good lines of ratings.csv."""
  users: List[int] = []
  movies: List[int] = []
  ratings: List[float] = []
  times: List[int] = []
  for line, row in _rows(path, RATINGS_HEADER, bad):
    if len(row) != 4:
      bad.report(path, line, "<line>", f"wrong field count: {len(row)} fields, expected 4")
      continue
    values, fault = [], None
    for text, (name, cast, what) in zip(row, _RATING_FIELDS):
      try:
        values.append(cast(text))
      except ValueError:
        fault = (name, f"not {what}: {text[:40]!r}")
        break
      if cast is int and abs(values[-1]) > _INT64_MAX:  # the arrays below are int64
        fault = (name, f"{text[:40]!r} is outside the int64 range")
        break
    if fault is None and not 0.5 <= values[2] <= 5.0:  # also false for NaN
      fault = ("rating", f"{values[2]} is outside [0.5, 5]")
    if fault is not None:
      bad.report(path, line, *fault)
      continue
    u, m, r, t = values
    users.append(u)
    movies.append(m)
    ratings.append(r)
    times.append(t)
  return (
    np.asarray(users, np.int64),
    np.asarray(movies, np.int64),
    np.asarray(ratings, np.float64),
    np.asarray(times, np.int64),
  )


def _read_movies(path: str, bad: base.BadRecords) -> Tuple[Dict[int, List[str]], Dict[int, int]]:
  """Genres and release year by movieId from movies.csv (titles hold commas and quotes: csv module)."""
  genres: Dict[int, List[str]] = {}
  years: Dict[int, int] = {}
  for line, row in _rows(path, MOVIES_HEADER, bad):
    if len(row) != 3:
      bad.report(path, line, "<line>", f"wrong field count: {len(row)} fields, expected 3")
      continue
    try:
      movie = int(row[0])
    except ValueError:
      bad.report(path, line, "movieId", f"not an integer: {row[0][:40]!r}")
      continue
    genres[movie] = [g for g in row[2].split("|") if g and g != NO_GENRES]
    match = _YEAR.search(row[1].strip())
    if match:
      years[movie] = int(match.group(1))
  return genres, years
