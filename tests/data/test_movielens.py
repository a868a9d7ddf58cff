"""MovieLens reader on the real ml-latest-small (counts, labels, temporal split, brute-force history)
and on a hand-written directory (exact values, bad lines)."""

import collections
import csv
import math
import os

import numpy as np
import pytest

from recsys_jax.data import base, movielens

H = 50


def read_split(fmt, split, chunk_records=1 << 20):
  chunks = list(fmt.chunks(split, chunk_records))
  return base.concat_columns([fmt.parse(c, base.BadRecords()) for c in chunks])


@pytest.fixture(scope="module")
def fmt(movielens_dir):
  return movielens.MovieLensFormat(movielens_dir, max_history=H)


@pytest.fixture(scope="module")
def raw(movielens_dir):
  """ratings.csv and movies.csv read independently, with the csv module."""
  with open(os.path.join(movielens_dir, "ratings.csv"), newline="") as f:
    rows = list(csv.reader(f))[1:]
  ratings = [(int(u), int(m), float(r), int(t)) for u, m, r, t in rows]
  with open(os.path.join(movielens_dir, "movies.csv"), newline="", encoding="utf-8") as f:
    movies = {int(m): (title, genres) for m, title, genres in list(csv.reader(f))[1:]}
  return ratings, movies


@pytest.fixture(scope="module")
def records(fmt, raw):
  """Both splits, each record mapped back to its (user, movie, rating, timestamp)."""
  ratings, _ = raw
  train, ev = read_split(fmt, "train"), read_split(fmt, "eval")
  users = sorted({r[0] for r in ratings})
  movies = sorted({r[1] for r in ratings})
  user_of = dict(zip(base.hash_ints(np.array(users), "user").tolist(), users))
  movie_of = dict(zip(base.hash_ints(np.array(movies), "movie").tolist(), movies))
  by_pair = {(u, m): (u, m, r, t) for u, m, r, t in ratings}
  assert len(by_pair) == len(ratings)  # a user rates a movie once: (user, movie) names a rating

  def originals(cols):
    return [
      by_pair[user_of[u], movie_of[m]]
      for u, m in zip(cols["sparse"]["user"][:, 0].tolist(), cols["sparse"]["movie"][:, 0].tolist())
    ]

  return train, ev, originals(train), originals(ev)


def test_counts_labels_and_temporal_split(fmt, raw, records):
  ratings, _ = raw
  train, ev, train_orig, eval_orig = records
  assert len(ratings) == 100_836
  assert fmt.num_train + fmt.num_eval == len(train["label"]) + len(ev["label"]) == 100_836
  assert len(ev["label"]) == round(0.2 * 100_836)
  labels = np.concatenate([train["label"], ev["label"]])
  assert int(labels.sum()) == sum(r >= 4 for _, _, r, _ in ratings)  # the same label rate
  # Every rating exactly once, labelled by its own rating.
  assert sorted(train_orig + eval_orig) == sorted(ratings)
  np.testing.assert_array_equal(labels, [r >= 4 for _, _, r, _ in train_orig + eval_orig])
  # In time order, the eval split after the train split.
  keys = [(t, u, m) for u, m, _, t in train_orig + eval_orig]
  assert keys == sorted(keys)  # sorted by (timestamp, userId, movieId)
  times = np.array([t for *_, t in train_orig + eval_orig])
  assert np.all(np.diff(times) >= 0)
  assert max(t for *_, t in train_orig) <= min(t for *_, t in eval_orig)
  np.testing.assert_array_equal(times, fmt.timestamps)


def brute_history(ratings_of_user, t):
  """The user's movies rated strictly before t, oldest first (ties by movieId), the last H."""
  earlier = sorted((tt, m) for m, tt in ratings_of_user if tt < t)
  return [m for _, m in earlier][-H:], len(earlier)


def test_history_and_dense_match_brute_force(raw, records):
  ratings, movies = raw
  train, ev, train_orig, eval_orig = records
  cols = base.concat_columns([train, ev])
  orig = train_orig + eval_orig
  by_user = collections.defaultdict(list)
  by_movie = collections.defaultdict(list)
  for u, m, _, t in ratings:
    by_user[u].append((m, t))
    by_movie[m].append(t)
  rng = np.random.default_rng(0)
  sample = rng.choice(len(orig), 300, replace=False).tolist()
  # Ratings that share their second with another of the user's (ties), and the first ratings.
  sample += [i for i, (u, _, _, t) in enumerate(orig) if sum(tt == t for _, tt in by_user[u]) > 1][:20]
  sample += [int(np.argmax(cols["dense"][:, 0] == 0))]
  truncated = 0
  for i in sample:
    u, m, _, t = orig[i]
    hist, n_before = brute_history(by_user[u], t)
    truncated += n_before > H
    w = cols["sparse_weights"]["history"][i]
    np.testing.assert_array_equal(w, np.arange(H) < len(hist))
    expect = np.zeros(H, np.uint64)
    expect[: len(hist)] = base.hash_ints(np.array(hist, np.int64), "movie")
    np.testing.assert_array_equal(cols["sparse"]["history"][i], expect)
    # Dense: earlier ratings of the user and of the movie; the year from the title.
    assert cols["dense"][i, 0] == pytest.approx(math.log1p(n_before), rel=1e-6)
    assert cols["dense"][i, 1] == pytest.approx(math.log1p(sum(tt < t for tt in by_movie[m])), rel=1e-6)
    title, genres = movies[m]
    year = title.strip()[-5:-1]
    if year.isdigit():
      assert cols["dense"][i, 2:].tolist() == pytest.approx([(int(year) - 2000) / 20, 0.0])
    # Genres: the hashed tokens, '(no genres listed)' as an empty bag.
    tokens = [] if genres == "(no genres listed)" else genres.split("|")
    ids, gw = base.multi_hot([tokens], "genres", 8)
    np.testing.assert_array_equal(cols["sparse"]["genres"][i], ids[0])
    np.testing.assert_array_equal(cols["sparse_weights"]["genres"][i], gw[0])
  assert truncated > 50  # the sample covers long histories (kept: the most recent H)


def test_movie_reappears_in_later_history(fmt, records):
  train, ev, train_orig, eval_orig = records
  cols = base.concat_columns([train, ev])
  orig = train_orig + eval_orig
  rows_of_user = collections.defaultdict(list)
  for i, (u, *_) in enumerate(orig):
    rows_of_user[u].append(i)
  checked = 0
  for i in np.random.default_rng(1).choice(len(orig), 300, replace=False).tolist():
    u, _, _, t = orig[i]
    later = [j for j in rows_of_user[u] if orig[j][3] > t]
    if not later:
      continue
    j = later[0]
    # Ratings of the user in [t, t_next): if more than H, this one may have scrolled out.
    if sum(t <= orig[k][3] < orig[j][3] for k in rows_of_user[u]) > H:
      continue
    assert cols["sparse"]["movie"][i, 0] in cols["sparse"]["history"][j][cols["sparse_weights"]["history"][j] > 0]
    checked += 1
  assert checked > 200
  # The history reads the movie table, whose ids the movie feature also uses.
  assert base.FeatureInfo("history", H, "sequence", "movie") in fmt.schema.features


def test_chunks_concatenate_to_the_split(fmt, records, movielens_dir):
  train, ev, _, _ = records
  for split, whole in (("train", train), ("eval", ev)):
    for chunk_records in (997, 8192, 1 << 20):
      chunks = list(fmt.chunks(split, chunk_records))
      assert all(len(c) == chunk_records for c in chunks[:-1])
      assert [c.first_line for c in chunks] == list(range(1, len(whole["label"]) + 1, chunk_records))
      assert chunks[0].path == f"{movielens_dir}/ratings.csv[{split}]"
      got = base.concat_columns([fmt.parse(c, base.BadRecords()) for c in chunks])
      for key in ("label", "dense"):
        np.testing.assert_array_equal(got[key], whole[key])
      for f in whole["sparse"]:
        np.testing.assert_array_equal(got["sparse"][f], whole["sparse"][f])
      for f in whole["sparse_weights"]:
        np.testing.assert_array_equal(got["sparse_weights"][f], whole["sparse_weights"][f])
  with pytest.raises(ValueError, match=r"'test'.*\('train', 'eval'\)"):
    list(fmt.chunks("test", 10))


RATINGS = [
  "userId,movieId,rating,timestamp",
  "1,10,4.0,100",
  "1,20,3.0,100",  # same second as the one before: neither is the other's history
  "1,30,5.0,200",
  "2,10,2.0,150",
  "1,40,4.5,300",  # movie 40 is not in movies.csv
]
MOVIES = [
  "movieId,title,genres",
  '10,"Film, The ""Best"" (1999)",Comedy|Drama',
  "20,No Year,(no genres listed)",
  "30,Series (2006\u20132007),Action",
]


def write_dir(tmp_path, ratings, movies=MOVIES):
  tmp_path.mkdir(parents=True, exist_ok=True)
  (tmp_path / "ratings.csv").write_text("\n".join(ratings) + "\n")
  (tmp_path / "movies.csv").write_text("\n".join(movies) + "\n", encoding="utf-8")
  return str(tmp_path)


def test_hand_written_directory(tmp_path):
  fmt = movielens.MovieLensFormat(write_dir(tmp_path, RATINGS), max_history=2, eval_fraction=0.4)
  train, ev = read_split(fmt, "train"), read_split(fmt, "eval")
  cols = base.concat_columns([train, ev])
  # Time order (timestamp, user, movie): (100,1,10) (100,1,20) (150,2,10) (200,1,30) (300,1,40).
  assert (len(train["label"]), len(ev["label"])) == (3, 2)
  np.testing.assert_array_equal(cols["label"], [1, 0, 0, 1, 1])
  np.testing.assert_array_equal(cols["sparse"]["user"][:, 0], base.hash_ints(np.array([1, 1, 2, 1, 1]), "user"))
  movie = base.hash_ints(np.array([10, 20, 10, 30, 40]), "movie")
  np.testing.assert_array_equal(cols["sparse"]["movie"][:, 0], movie)
  m10, m20, m30 = base.hash_ints(np.array([10, 20, 30]), "movie")
  expect = np.array([[0, 0], [0, 0], [0, 0], [m10, m20], [m20, m30]], np.uint64)
  np.testing.assert_array_equal(cols["sparse"]["history"], expect)
  np.testing.assert_array_equal(cols["sparse_weights"]["history"], expect != 0)
  dense = [
    [0, 0, -0.05, 0],
    [0, 0, 0, 1],
    [0, math.log1p(1), -0.05, 0],
    [math.log1p(2), 0, 0.3, 0],
    [math.log1p(3), 0, 0, 1],
  ]
  np.testing.assert_allclose(cols["dense"], np.array(dense, np.float32), rtol=1e-6)
  genres = [["Comedy", "Drama"], [], ["Comedy", "Drama"], ["Action"], []]
  ids, w = base.multi_hot(genres, "genres", 8)
  np.testing.assert_array_equal(cols["sparse"]["genres"], ids)
  np.testing.assert_array_equal(cols["sparse_weights"]["genres"], w)


@pytest.mark.parametrize(
  "line,field",
  [("1,50,abc,400", "rating"), ("1,50,4.0", "<line>"), ("1,50,7,400", "rating"), ("1,50,4.0,soon", "timestamp")],
)
def test_bad_ratings_line(tmp_path, line, field):
  ratings = RATINGS[:3] + [line] + RATINGS[3:]  # the bad line is line 4
  directory = write_dir(tmp_path, ratings)
  path = os.path.join(directory, "ratings.csv")
  with pytest.raises(base.BadRecordError, match=rf"{path}:4: field '{field}'"):
    movielens.MovieLensFormat(directory)
  bad = base.BadRecords("skip")
  fmt = movielens.MovieLensFormat(directory, max_history=2, eval_fraction=0.4, bad=bad)
  assert bad.count == 1 and bad.examples[0].startswith(f"{path}:4:")
  ref = movielens.MovieLensFormat(write_dir(tmp_path / "ref", RATINGS), max_history=2, eval_fraction=0.4)
  for split in movielens.SPLITS:
    a, b = read_split(fmt, split), read_split(ref, split)
    np.testing.assert_array_equal(a["dense"], b["dense"])
    for f in b["sparse"]:
      np.testing.assert_array_equal(a["sparse"][f], b["sparse"][f])


def test_bad_movies_line(tmp_path):
  directory = write_dir(tmp_path, RATINGS, MOVIES[:2] + ["x20,No Year,Drama"] + MOVIES[3:])
  with pytest.raises(base.BadRecordError, match=rf"{directory}/movies.csv:3: field 'movieId'"):
    movielens.MovieLensFormat(directory)
  bad = base.BadRecords("skip")
  fmt = movielens.MovieLensFormat(directory, bad=bad)
  assert bad.count == 1 and fmt.num_train + fmt.num_eval == 5  # movie 20 rated, now without genres


def test_per_user_split_holds_each_users_latest_ratings(raw, movielens_dir):
  ratings, _ = raw
  fmt = movielens.MovieLensFormat(movielens_dir, max_history=H, split="user")
  train, ev = read_split(fmt, "train"), read_split(fmt, "eval")
  users = sorted({r[0] for r in ratings})
  user_of = dict(zip(base.hash_ints(np.array(users), "user").tolist(), users))
  t_train, t_eval = fmt.timestamps[: fmt.num_train], fmt.timestamps[fmt.num_train :]
  assert np.all(np.diff(t_train) >= 0) and np.all(np.diff(t_eval) >= 0)  # each split in time order
  by_user = collections.defaultdict(lambda: ([], []))
  for cols, ts, k in ((train, t_train, 0), (ev, t_eval, 1)):
    for u, t in zip(cols["sparse"]["user"][:, 0].tolist(), ts.tolist()):
      by_user[user_of[u]][k].append(t)
  counts = collections.Counter(r[0] for r in ratings)
  assert set(by_user) == set(counts)
  for u, (tr, evs) in by_user.items():
    assert len(evs) == round(0.2 * counts[u]) and len(tr) + len(evs) == counts[u]
    assert not tr or not evs or max(tr) <= min(evs)  # the user's eval ratings are the latest
  assert fmt.num_train + fmt.num_eval == 100_836 and 19_000 < fmt.num_eval < 21_000
