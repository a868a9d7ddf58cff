"""Bad input gets one clear error: a corpus of known-bad inputs, the fixes the fuzzer led to, and
a small, seeded fuzz run per target (``experiments/fuzz.py`` is the long one).

``tests/corpus/expected.json`` lists each corpus file with the error type and message it must
give. The fuzz runs here use the same targets as ``experiments/fuzz.py`` (its checks decide
what is a crash), in-process and with a fixed hypothesis seed, so they are deterministic.
"""

from __future__ import annotations

import json
import os
import re
import shutil

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
  error = ERRORS[exp["error"]]
  match = exp["match"].replace("{path}", re.escape(path))
  if name.startswith("wire/"):
    with open(path, "rb") as f:
      data = f.read()
    with pytest.raises(error, match=match):
      wire.decode(data)
  elif name.startswith("readers/"):
    with pytest.raises(error, match=match) as info:
      read_everything(reader_config(tiny_config, exp["format"], path, exp.get("policy", "error")))
    assert "\n" not in str(info.value), str(info.value)
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
