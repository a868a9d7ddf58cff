"""Getting and finding the public data sets the configs read.

    python -m recsys_jax.data.get movielens [--dest=DIR]

downloads GroupLens' ml-latest-small archive, checks it and unpacks it into
``DIR/movielens-latest-small`` (default ``DIR``: ``$RECSYS_JAX_DATA``, else ``./data``). A config
whose ``data.path`` is '' finds it there (``find_movielens``); any other directory holding
``ratings.csv`` and ``movies.csv`` works with ``--config.data.path=DIR``.

The data set's licence (research use, no commercial use, redistribution only under the same
terms) is in the README.txt it unpacks with; nothing of it is committed to this repository.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from typing import Callable, Dict, List, Optional

ENV = "RECSYS_JAX_DATA"
"""A folder of data sets: the first place searched, and where ``get`` puts them by default."""
MOVIELENS_URL = "https://files.grouplens.org/datasets/movielens/ml-latest-small.zip"
MOVIELENS_DIR = "movielens-latest-small"
# SHA-256 of the two files the reader uses, after unpacking; NOT of the zip archive. The machines
# this was written on have no internet, so the archive itself could not be hashed; these are of
# ml-latest-small as GroupLens generated it on 2018-09-26 (its README.txt says so), the copy kept
# in this project's shared data folder. A different archive (GroupLens calls the data set a
# development one that "may change over time") fails the check and unpacks nothing.
MOVIELENS_SHA256 = {
  "ratings.csv": "aa289ca83157595d0df6aea1be6a4ded676ddc4385472e8313a8ed9805352646",
  "movies.csv": "5a5f32dd9bb3797b8e728a1b98958789d2b13f294a69fdfbc5727f8a9611aa07",
}
GET_COMMAND = "python -m recsys_jax.data.get movielens"
# The repository checkout (this file is recsys_jax/data/get.py), for a clone used in place.
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class DataNotFound(ValueError):
  """A data set is not where the config says (or anywhere searched); the message says how to get it."""


def data_roots() -> List[str]:
  """Folders searched, in order, for a data set a config names by '': ``$RECSYS_JAX_DATA``, ``./data``,
  ``<checkout>/data`` and ``<checkout>/../shared/data`` (the layout of this project's machines and CI)."""
  roots = [os.environ[ENV]] if os.environ.get(ENV) else []
  roots += ["data", os.path.join(_REPO, "data"), os.path.join(os.path.dirname(_REPO), "shared", "data")]
  out: List[str] = []
  for r in roots:
    if os.path.abspath(r) not in map(os.path.abspath, out):
      out.append(r)
  return out


def default_dest() -> str:
  """Where ``get`` puts data sets unless told: ``$RECSYS_JAX_DATA``, else ``./data``."""
  return os.environ.get(ENV) or "data"


def is_movielens(directory: str) -> bool:
  return all(os.path.isfile(os.path.join(directory, f)) for f in MOVIELENS_SHA256)


def find_movielens(path: str = "") -> str:
  """The MovieLens directory to read: ``path`` itself (any directory: the reader names a file missing in it), or
  for '' the first of ``data_roots`` holding ratings.csv and movies.csv.

  Raises:
    DataNotFound: one line naming what was tried and the command that gets the data.
  """
  if path:
    if os.path.isdir(path):
      return path
    what = f"config.data.path = {path!r} is not a directory"
  else:
    tried = [os.path.join(r, MOVIELENS_DIR) for r in data_roots()]
    found = [d for d in tried if is_movielens(d)]
    if found:
      return found[0]
    what = "MovieLens data not found (tried " + ", ".join(tried) + ")"
  raise DataNotFound(
    f"{what}: get it with `{GET_COMMAND}` (it writes {os.path.join(default_dest(), MOVIELENS_DIR)}, "
    "searched when data.path is '') or pass --config.data.path=DIR (a directory holding ratings.csv and movies.csv)"
  )


def sha256_of(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _unpack(archive: str, into: str, expected: Dict[str, str]) -> None:
  """Unpacks the archive's data folder (its files, flat) into ``into`` and checks ``expected``'s hashes."""
  try:
    with zipfile.ZipFile(archive) as z:
      # ml-latest-small.zip holds one folder, ml-latest-small/, with the csv files and README.txt.
      members = [m for m in z.infolist() if not m.is_dir()]
      top = {os.path.dirname(m.filename) for m in members if os.path.basename(m.filename) in expected}
      if len(top) != 1:
        raise DataNotFound(f"the archive holds {sorted(expected)} in {len(top)} folders, expected one")
      (folder,) = top
      for m in members:
        name = os.path.basename(m.filename)
        if os.path.dirname(m.filename) == folder and name not in ("", ".", ".."):
          with z.open(m) as src, open(os.path.join(into, name), "wb") as dst:
            shutil.copyfileobj(src, dst)
  except zipfile.BadZipFile as e:
    raise DataNotFound(f"the download is not a zip archive ({e})") from None
  for name, want in expected.items():
    got = sha256_of(os.path.join(into, name))
    if got != want:
      raise DataNotFound(
        f"{name} has sha256 {got}, expected {want}: not the ml-latest-small this code was tested on "
        "(unzip it yourself and pass --config.data.path to use it anyway)"
      )


def _missing_parents(path: str) -> List[str]:
  """The folders ``os.makedirs(path)`` would create, deepest first."""
  out = []
  path = os.path.abspath(path)
  while not os.path.exists(path):
    out.append(path)
    path = os.path.dirname(path)
  return out


def get_movielens(
  dest: str, url: str = MOVIELENS_URL, archive_sha256: Optional[str] = None, say: Callable[[str], None] = print
) -> str:
  """Downloads ``url``, checks it and unpacks it into ``dest/movielens-latest-small``; returns that directory.

  Nothing is left behind on a failure (the files are unpacked beside it and moved in once checked);
  a directory already there whose files pass the check is kept as it is.

  Args:
    dest: the folder of data sets (created if missing).
    url: where the zip archive is (https, http or file).
    archive_sha256: the archive's SHA-256 if known (not checked when None; the files always are).

  Raises:
    DataNotFound: the download failed, or the archive or its files are not the expected ones.
  """
  final = os.path.join(dest, MOVIELENS_DIR)
  if is_movielens(final) and all(sha256_of(os.path.join(final, f)) == h for f, h in MOVIELENS_SHA256.items()):
    say(f"{final} is already there (checksums match)")
    return final
  if os.path.exists(final):
    raise DataNotFound(f"{final} exists but is not the expected ml-latest-small: move it away first")
  created = _missing_parents(dest)
  os.makedirs(dest, exist_ok=True)
  work = tempfile.mkdtemp(prefix=f".{MOVIELENS_DIR}.", dir=dest)
  done = False
  try:
    archive = os.path.join(work, "archive.zip")
    say(f"downloading {url}")
    try:
      with urllib.request.urlopen(url, timeout=60) as r, open(archive, "wb") as f:
        shutil.copyfileobj(r, f)
    except (urllib.error.URLError, OSError, ValueError) as e:
      raise DataNotFound(
        f"could not download {url}: {getattr(e, 'reason', e)}; on a machine without internet, fetch "
        f"{os.path.basename(MOVIELENS_URL)} elsewhere and run: python -m recsys_jax.data.get movielens "
        "--url=file:///path/to/it.zip (or unzip it and pass --config.data.path=DIR)"
      ) from None
    if archive_sha256 is not None and sha256_of(archive) != archive_sha256.lower():
      raise DataNotFound(f"{url}: the archive has sha256 {sha256_of(archive)}, expected {archive_sha256}")
    unpacked = os.path.join(work, MOVIELENS_DIR)
    os.mkdir(unpacked)
    _unpack(archive, unpacked, MOVIELENS_SHA256)
    os.replace(unpacked, final)
    done = True
  finally:
    shutil.rmtree(work, ignore_errors=True)
    if not done:  # the folders this call made, if they stayed empty: a failure leaves nothing behind
      for d in created:
        try:
          os.rmdir(d)
        except OSError:
          break
  try:
    found = os.path.abspath(find_movielens("")) == os.path.abspath(final)
  except DataNotFound:
    found = False
  use = "the MovieLens configs find it there" if found else f"use it with --config.data.path={final}"
  say(f"{final}: ratings.csv and movies.csv checked (sha256); {use}")
  return final


def main(argv: Optional[List[str]] = None) -> int:
  p = argparse.ArgumentParser(prog="python -m recsys_jax.data.get", description=__doc__.split("\n\n")[0])
  p.add_argument("dataset", choices=["movielens"], help="the data set (MovieLens ml-latest-small)")
  p.add_argument(
    "--dest", default=os.environ.get(ENV) or "data", help=f"folder of data sets (default: ${ENV} or ./data)"
  )
  p.add_argument("--url", default=MOVIELENS_URL, help="where the zip archive is (a mirror, or file:///path.zip)")
  p.add_argument("--archive_sha256", default=None, help="the archive's SHA-256, checked when given")
  args = p.parse_args(argv)
  try:
    get_movielens(args.dest, args.url, args.archive_sha256)
  except DataNotFound as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
