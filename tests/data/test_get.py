"""Getting the MovieLens data (``python -m recsys_jax.data.get``) from a zip laid out as GroupLens' is, served
over local http and file:// URLs, and finding it (``config.data.path = ''``) or saying in one line how to get it."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
import zipfile

import pytest

from recsys_jax.data import get

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_zip(path, source, change=None):
  """ml-latest-small.zip's layout: one folder holding the csv files and README.txt (links.csv too)."""
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    z.writestr("ml-latest-small/", "")
    for name in sorted(os.listdir(source)):
      with open(os.path.join(source, name), "rb") as f:
        data = f.read()
      if name == change:
        data = data[:-2] + b"9\n"  # one rating's last digit
      z.writestr(f"ml-latest-small/{name}", data)
    z.writestr("ml-latest-small/links.csv", "movieId,imdbId,tmdbId\n1,0114709,862\n")
  return path


@pytest.fixture
def http_url(tmp_path):
  """Serves tmp_path/www over http on a free port; yields (base URL, the request paths seen)."""
  seen = []

  class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
      seen.append(self.path)

  (tmp_path / "www").mkdir()
  server = http.server.ThreadingHTTPServer(
    ("127.0.0.1", 0), functools.partial(Handler, directory=str(tmp_path / "www"))
  )
  threading.Thread(target=server.serve_forever, daemon=True).start()
  yield f"http://127.0.0.1:{server.server_address[1]}", seen
  server.shutdown()
  server.server_close()


def test_get_downloads_checks_and_unpacks_then_keeps_what_is_there(movielens_dir, tmp_path, http_url):
  base_url, seen = http_url
  make_zip(tmp_path / "www" / "ml-latest-small.zip", movielens_dir)
  dest = tmp_path / "data"
  got = get.get_movielens(str(dest), f"{base_url}/ml-latest-small.zip", say=lambda m: None)
  assert got == str(dest / get.MOVIELENS_DIR)
  for name in ("ratings.csv", "movies.csv", "README.txt"):
    with open(os.path.join(movielens_dir, name), "rb") as a, open(os.path.join(got, name), "rb") as b:
      assert a.read() == b.read(), name
  assert sorted(os.listdir(dest)) == [get.MOVIELENS_DIR]  # no temporary files left
  assert seen and all(p.endswith("ml-latest-small.zip") for p in seen)
  n = len(seen)
  said = []
  assert get.get_movielens(str(dest), f"{base_url}/ml-latest-small.zip", say=said.append) == got
  assert len(seen) == n and "already there" in said[0]  # checked, not downloaded again
  # A config with data.path '' finds it through $RECSYS_JAX_DATA.
  env = dict(os.environ, RECSYS_JAX_DATA=str(dest))
  out = subprocess.run(
    [sys.executable, "-c", "from recsys_jax.data import get; print(get.find_movielens(''))"],
    env=env,
    cwd=str(tmp_path),
    capture_output=True,
    text=True,
    check=True,
  )
  assert out.stdout.strip() == got


def test_a_changed_file_or_a_wrong_archive_checksum_leaves_nothing(movielens_dir, tmp_path):
  bad = make_zip(tmp_path / "bad.zip", movielens_dir, change="ratings.csv")
  dest = tmp_path / "data"
  with pytest.raises(get.DataNotFound, match=r"ratings.csv has sha256 [0-9a-f]{64}, expected aa289ca8"):
    get.get_movielens(str(dest), bad.as_uri(), say=lambda m: None)
  assert not dest.exists()  # nothing left behind, not even the folder it made
  good = make_zip(tmp_path / "good.zip", movielens_dir)
  with pytest.raises(get.DataNotFound, match="the archive has sha256"):
    get.get_movielens(str(dest), good.as_uri(), archive_sha256="0" * 64, say=lambda m: None)
  assert not dest.exists()  # nothing left behind, not even the folder it made
  right = get.sha256_of(str(good))
  assert os.path.isdir(get.get_movielens(str(dest), good.as_uri(), archive_sha256=right, say=lambda m: None))


def test_cli_failure_is_one_error_line(tmp_path):
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "recsys_jax.data.get",
      "movielens",
      f"--dest={tmp_path}",
      f"--url={(tmp_path / 'no.zip').as_uri()}",
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
  )
  assert r.returncode == 2
  lines = r.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: could not download {(tmp_path / 'no.zip').as_uri()}: "), lines
  assert "--url=file:///" in lines[0] and "--config.data.path" in lines[0], lines  # the next step offline


def test_a_failed_download_leaves_no_folder_behind(tmp_path):
  """Offline, the data folder the command would have made is not left behind empty."""
  dest = tmp_path / "new" / "data"
  with pytest.raises(get.DataNotFound, match="could not download"):
    get.get_movielens(str(dest), (tmp_path / "no.zip").as_uri(), say=lambda m: None)
  assert os.listdir(tmp_path) == []
  (tmp_path / "kept").mkdir()  # a folder that was there before stays
  with pytest.raises(get.DataNotFound):
    get.get_movielens(str(tmp_path / "kept"), (tmp_path / "no.zip").as_uri(), say=lambda m: None)
  assert os.listdir(tmp_path) == ["kept"] and os.listdir(tmp_path / "kept") == []


def test_nothing_found_names_every_place_tried_and_the_command(tmp_path, monkeypatch):
  monkeypatch.setattr(get, "_REPO", str(tmp_path / "checkout"))
  monkeypatch.setenv("RECSYS_JAX_DATA", str(tmp_path / "mine"))
  monkeypatch.chdir(tmp_path)
  with pytest.raises(get.DataNotFound) as e:
    get.find_movielens("")
  msg = str(e.value)
  m = get.MOVIELENS_DIR
  tried = [f"{tmp_path}/mine/{m}", f"data/{m}", f"{tmp_path}/checkout/data/{m}", f"{tmp_path}/shared/data/{m}"]
  assert f"(tried {', '.join(tried)})" in msg, msg
  assert get.GET_COMMAND in msg and "\n" not in msg
  with pytest.raises(get.DataNotFound, match=r"config.data.path = '/nowhere' is not a directory: get it with"):
    get.find_movielens("/nowhere")
  assert get.find_movielens(str(tmp_path)) == str(tmp_path)  # a directory: its reader names what it lacks


def test_the_main_job_without_its_data_stops_with_one_line(tmp_path):
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "recsys_jax.main",
      "--config=configs/movielens.py",
      f"--config.data.path={tmp_path / 'nowhere'}",
      f"--workdir={tmp_path / 'run'}",
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=300,
  )
  assert r.returncode == 2, r.stderr
  errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and get.GET_COMMAND in errors[0], r.stderr
  assert "Traceback" not in r.stderr


def test_data_in_the_current_directory_is_found_before_the_checkouts(movielens_dir, tmp_path, monkeypatch):
  monkeypatch.delenv("RECSYS_JAX_DATA", raising=False)
  (tmp_path / "data").mkdir()
  os.symlink(movielens_dir, tmp_path / "data" / get.MOVIELENS_DIR)
  monkeypatch.chdir(tmp_path)
  assert get.find_movielens("") == os.path.join("data", get.MOVIELENS_DIR)
