"""Training from files: every model, resumed mid-epoch at the same record, bad-record policies."""

import os

import jax
import numpy as np
import pytest

from recsys_jax import models, train
from recsys_jax.data import base

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = models.names()  # every module of recsys_jax/models/ that declares MODEL
SMALL_KWARGS = {  # small widths; a model not here trains with its defaults
  "dlrm": {"bottom": (16, 8), "top": (32,)},
  "dcn_v2": {"num_cross": 2, "low_rank": 4, "structure": "parallel", "deep": (32,)},
  "deepfm": {"deep": (32,)},
  "wide_deep": {"deep": (32,)},
  "din": {"target": "movie", "history": "history", "attention": (16,), "mlp": (32,)},
}


def _write_csv(path, n, rng, bad_line=None, start=0):
  """Columns: label, two counts, two categoricals, a multi-hot bag, a record id."""
  with open(path, "w") as f:
    f.write("label,d1,d2,c1,c2,tags,rid\n")
    for i in range(n):
      c1, c2 = rng.integers(0, 30), rng.integers(0, 10)
      tags = "|".join(str(t) for t in rng.choice(20, rng.integers(0, 4), replace=False))
      y = int(rng.random() < 1 / (1 + np.exp(-(c1 % 3 - 1 + (c2 > 4)))))
      line = f"{y},{rng.poisson(3)},{rng.random() * 10:.3f},u{c1},v{c2},{tags},{start + i}\n"
      if bad_line is not None and i + 2 == bad_line:  # +2: 1-based, after the header
        line = f"{y},not_a_number,1.0,u1,v1,,{start + i}\n"
      f.write(line)


def _csv_config(tiny_config, tmp_path, rng, bad_line=None):
  c = tiny_config
  d = tmp_path / "data"
  d.mkdir(exist_ok=True)
  _write_csv(d / "part-0.csv", 900, rng, bad_line=bad_line)
  _write_csv(d / "part-1.csv", 700, rng, start=900)
  _write_csv(d / "eval.csv", 500, rng, start=10_000)
  c.data.name = "csv"
  c.data.train_files = (str(d / "part-*.csv"),)
  c.data.eval_files = (str(d / "eval.csv"),)
  c.data.label = "label"
  c.data.dense = ("d1", "d2")
  c.data.categorical = ("c1", "c2", "rid")
  c.data.multi_hot = (("tags", "|", 3),)
  c.data.chunk_records = 100
  c.data.shuffle_window = 3
  c.batch_size = 64  # 1600 records: an epoch is 25 steps
  c.eval_samples = 0
  c.eval_batch_size = 128  # 500 eval records: the last batch is padded
  c.model.kwargs.bottom = (16, 8)
  return c


def _record_batches(monkeypatch):
  """Logs the record ids each training step reads (by step)."""
  seen = {}
  real = train.HostPipeline.prepare

  def prepare(self, step, batch, position=None, n_valid=None):
    if n_valid is None:  # a training batch
      seen[step] = batch["sparse"]["rid"][:, 0].copy()
    return real(self, step, batch, position, n_valid)

  monkeypatch.setattr(train.HostPipeline, "prepare", prepare)
  return seen


def test_run_stopped_mid_epoch_resumes_at_the_same_record(tiny_config, tmp_path, monkeypatch):
  c = _csv_config(tiny_config, tmp_path, np.random.default_rng(0))
  c.num_steps = 60  # 2.4 epochs: the resume point (step 37) is mid-epoch and mid-window
  seen = _record_batches(monkeypatch)
  full = train.train_and_evaluate(c, str(tmp_path / "full"))
  ref = dict(seen)
  assert sorted(ref) == list(range(60))
  epoch0 = np.concatenate([ref[t] for t in range(25)])
  assert len(np.unique(epoch0)) == 1600  # one epoch reads every record once

  seen.clear()
  half = c.copy_and_resolve_references()
  half.num_steps = 37
  train.train_and_evaluate(half, str(tmp_path / "resumed"))
  first = dict(seen)
  seen.clear()
  resumed = train.train_and_evaluate(c, str(tmp_path / "resumed"))
  assert resumed["resumed_from"] == 37
  assert sorted(first) == list(range(37)) and sorted(seen) == list(range(37, 60))
  for t in range(60):
    np.testing.assert_array_equal((first if t < 37 else seen)[t], ref[t], err_msg=f"step {t}")
  assert resumed["auc"] == full["auc"] and resumed["logloss"] == full["logloss"]
  assert full["eval_samples"] == 500


def test_bad_record_policies_through_the_trainer(tiny_config, tmp_path):
  c = _csv_config(tiny_config, tmp_path, np.random.default_rng(1), bad_line=17)
  c.data.shuffle = False  # files in order: the bad line is in the first window of every epoch
  c.num_steps = 5
  with pytest.raises(base.BadRecordError, match=r"part-0\.csv:17: field 'd1'"):
    train.train_and_evaluate(c, str(tmp_path / "error"))
  c.data.on_bad_record = "skip"
  c.num_steps = 30  # into the second epoch: the bad line is one bad record, counted and named once
  s = train.train_and_evaluate(c, str(tmp_path / "skip"))
  assert s["bad_records_skipped"] == 1 and len(s["bad_record_examples"]) == 1, s["bad_record_examples"]
  assert "part-0.csv:17" in s["bad_record_examples"][0]
  assert "bad records   1 skipped" in train.format_summary(s)


@pytest.mark.parametrize(
  "model", [pytest.param(m, marks=pytest.mark.slow) if m in ("dcn_v2", "deepfm", "wide_deep") else m for m in MODELS]
)  # with -m slow: DCN-v2 trains on MovieLens in the default run, Wide & Deep's first-order terms are DeepFM's,
# and DeepFM (10 s here) trains through the trainer past AUC 0.55, checkpoints and resumes in
# test_data_without_dense_columns_trains_checkpoints_and_resumes[deepfm] and learns a teacher with
# dense inputs in tests/models/test_models.py (test_every_model_learns_a_teacher[deepfm])
def test_every_model_trains_on_tiny_synthetic(tiny_config, tmp_path, model):
  c = tiny_config
  c.model.name = model
  kwargs = dict(SMALL_KWARGS.get(model, {}))
  if model == "din":  # a behaviour sequence over the same table as the target field
    c.data.multi_hot = (1, 6, 1, 1, 1, 1, 1, 1)
    c.embeddings.features = {"cat_01": {"kind": "sequence", "table": "cat_00"}}
    kwargs.update(target="cat_00", history="cat_01")
  c.model.kwargs = kwargs
  s = train.train_and_evaluate(c, str(tmp_path))
  assert s["auc"] > 0.66, s["auc"]  # chance is 0.5; DLRM reaches ~0.74 here, the oracle 0.83
  if model in ("deepfm", "wide_deep"):
    assert s["ps_rows"] > 0 and np.isfinite(s["logloss"])


@pytest.mark.parametrize(
  "model",
  ["dlrm", "deepfm", pytest.param("dcn_v2", marks=pytest.mark.slow), pytest.param("wide_deep", marks=pytest.mark.slow)],
)  # DLRM and a model with first-order terms in the default run; the other two (8-11 s each) with -m slow
def test_data_without_dense_columns_trains_checkpoints_and_resumes(tiny_config, tmp_path, model):
  """No numeric columns: the models' kernels over them have zero size, which orbax cannot save."""
  c = _csv_config(tiny_config, tmp_path, np.random.default_rng(2))
  c.data.dense = ()
  c.model.name = model
  c.model.kwargs = dict(SMALL_KWARGS[model])
  c.num_steps = 12
  sizes = [x.size for x in jax.tree.leaves(train.build_job(c, str(tmp_path / "probe")).state.params)]
  assert (0 in sizes) == (model != "dcn_v2")  # DCN-v2 concatenates dense and embeddings: no dense-only layer
  full = train.train_and_evaluate(c, str(tmp_path / "full"))
  half = c.copy_and_resolve_references()
  half.num_steps = 5
  train.train_and_evaluate(half, str(tmp_path / "resumed"))
  resumed = train.train_and_evaluate(c, str(tmp_path / "resumed"))
  assert resumed["resumed_from"] == 5
  assert resumed["auc"] == full["auc"] and resumed["logloss"] == full["logloss"]
  assert full["auc"] > 0.55, full["auc"]


@pytest.fixture(scope="module")
def movielens_base(movielens_dir):
  from configs import movielens

  c = movielens.get_config()
  c.data.path = movielens_dir
  c.num_steps = 150  # half an epoch: enough to beat chance clearly, quick
  c.embeddings.dim = 8  # as SMALL_KWARGS["dlrm"]["bottom"][-1]
  c.log_every = 50
  c.progress_bar = False
  return c


@pytest.mark.parametrize(
  "model", [m if m == "dcn_v2" else pytest.param(m, marks=pytest.mark.slow) for m in MODELS]
)  # the others take 12-22 s each: with -m slow; DLRM and DIN train on tiny synthetic data in the default run, DeepFM on csv data
def test_every_model_trains_on_movielens(movielens_base, tmp_path, model):
  c = movielens_base.copy_and_resolve_references()
  c.model.name = model
  c.model.kwargs = SMALL_KWARGS[model]
  s = train.train_and_evaluate(c, str(tmp_path))
  assert s["eval_samples"] == 20164
  assert s["auc"] > 0.65, s["auc"]
