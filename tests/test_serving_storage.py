"""A served version keeps what it reads (issue 25): storage going away changes no score.

One tiny synthetic DLRM run (three checkpoints, ``checkpoint_full_every=3``: the newest reads a
full snapshot and two incremental ones). The reference is the same scorer's answers before
anything was deleted; a deletion must leave them equal bit for bit, or fail loudly, never change
them.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from recsys_jax import train
from recsys_jax.serving import scorer


def _tiny(steps=12):
  from configs import tiny

  c = tiny.get_config()
  c.num_steps, c.batch_size, c.checkpoint_every, c.checkpoint_full_every = steps, 128, steps // 3, 3
  c.max_checkpoints = 3
  c.eval_samples, c.eval_batch_size = 256, 256
  c.data.vocab_sizes = (500, 200, 50, 1000)
  c.data.num_dense = 5
  return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  w = tmp_path_factory.mktemp("storage") / "run"
  train.train_and_evaluate(_tiny(), str(w))
  return str(w)


def _records(sc, n, seed=0):
  """``n`` records whose ids all have rows in the chain (drawn from the scorer's index)."""
  rng = np.random.default_rng(seed)
  ids = {t: sc.rows.tables[t].ids for t in sc.rows.tables}
  assert all(v.shape[0] > 20 for v in ids.values())
  return [
    {
      **{f"dense_{j:02d}": float(rng.random() * 3) for j in range(5)},
      **{t: int(rng.choice(v)) for t, v in ids.items()},
    }
    for _ in range(n)
  ]


def _copy(run, tmp_path):
  w = str(tmp_path / "w")
  shutil.copytree(run, w)
  return w


def test_deleting_the_served_snapshots_changes_no_score(run, tmp_path):
  w = _copy(run, tmp_path)
  sc = scorer.load_scorer(w, cache_bytes=10 << 10)  # 10 KiB: most rows are read from disk at each batch
  recs = _records(sc, 512)
  before = sc.predict(sc.encode(recs))
  for name in scorer.read_meta(w, sc.step)["ps_chain"]:
    shutil.rmtree(os.path.join(w, "ps_snapshots", name))
  after = sc.predict(sc.encode(recs))
  np.testing.assert_array_equal(after, before)


def test_a_missing_chunk_is_an_error_never_zeros(run, tmp_path):
  from recsys_jax.serving.api import SnapshotGone

  w = _copy(run, tmp_path)
  sc = scorer.load_scorer(w, cache_bytes=0, verify=False)  # no CRC pass at load: reads are the only check
  recs = _records(sc, 64)
  sc.predict(sc.encode(recs))
  held = sc.rows.held_dir
  assert held and held.startswith(os.path.join(w, "serving_held")) and os.path.isdir(held)
  chunks = [os.path.join(r, f) for r, _, fs in os.walk(held) for f in fs if "/weights/c/" in os.path.join(r, f)]
  assert chunks
  for c in chunks:  # what an operator's cleanup would do to the held files: the version cannot score
    os.remove(c)
  with pytest.raises(SnapshotGone, match="cannot be read"):
    sc.predict(sc.encode(recs))


def test_the_held_files_go_with_the_version(run, tmp_path):
  import gc

  w = _copy(run, tmp_path)
  sc = scorer.load_scorer(w)
  held = sc.rows.held_dir
  assert os.path.isdir(held)
  names = scorer.read_meta(w, sc.step)["ps_chain"]
  assert sorted(os.listdir(held)) == sorted(names)
  del sc
  gc.collect()
  assert not os.path.exists(held)
  assert all(os.path.isdir(os.path.join(w, "ps_snapshots", n)) for n in names)  # the trainer's are untouched
