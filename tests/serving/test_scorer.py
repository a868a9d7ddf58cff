"""Serving a trained model (issue 16): scores equal the trainer's own evaluation of the same records.

Three tiny runs are shared by the module (synthetic DLRM, synthetic multi-hot DCN-v2, DLRM on a
Criteo TSV written here); each checkpoints three times with ``checkpoint_full_every=3``, so the
newest checkpoint's PS chain is a full snapshot and two incremental ones. The reference is the
trainer's path, independent of ``recsys_jax.serving``: the run restored by ``build_job`` +
``RunCheckpoints`` (the PS loaded whole into RAM), its reader's eval set (or the same columns
for records the test makes up) through ``HostPipeline.prepare / lookup(create=False) / place``
and the jitted ``eval_step``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from recsys_jax import train
from recsys_jax.data import base
from recsys_jax.serving import artifact, scorer
from recsys_jax.serving.api import RequestError
from recsys_jax.serving.client import GrpcClient, HttpClient, ServeError
from recsys_jax.training import run_config
from recsys_jax.training.run_checkpoints import RunCheckpoints
from tests.serving import test_requests as test_serve_requests

_HEX = "0123456789abcdef"


def _tiny(steps=12):
  from configs import tiny

  c = tiny.get_config()
  c.num_steps, c.batch_size, c.checkpoint_every, c.checkpoint_full_every = steps, 128, steps // 3, 3
  c.max_checkpoints = 3
  c.eval_samples, c.eval_batch_size = 512, 256
  c.data.vocab_sizes = (500, 200, 50, 1000)
  c.data.num_dense = 5
  return c


def _criteo_lines(rng, n, vocab):
  lines = []
  for _ in range(n):
    dense = ["" if rng.random() < 0.1 else str(int(rng.integers(-3, 300))) for _ in range(13)]
    cats = []
    for j in range(26):
      r = rng.random()
      if r < 0.05:
        cats.append("")
      else:
        v = f"{int(rng.integers(0, vocab[j % len(vocab)])) * 7919 % 2**32:08x}"
        cats.append(v.upper() if rng.random() < 0.2 else v)
    lines.append("\t".join([str(int(rng.random() < 0.3))] + dense + cats))
  return lines


def _run(workdir, c):
  summary = train.train_and_evaluate(c, str(workdir))
  return {"workdir": str(workdir), "config": c, "summary": summary}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("serving")
  out = {}
  out["dlrm"] = _run(root / "dlrm", _tiny())
  c = _tiny()
  c.model.name = "dcn_v2"
  c.model.kwargs = {"num_cross": 2, "low_rank": 0, "structure": "stacked", "deep": (16, 8)}
  c.data.multi_hot = (1, 3, 2, 1)
  c.embeddings.combiner = "mean"
  out["dcn"] = _run(root / "dcn", c)
  rng = np.random.default_rng(0)
  data = root / "criteo"
  data.mkdir()
  (data / "train.tsv").write_text("\n".join(_criteo_lines(rng, 1536, (40, 300, 7))) + "\n")
  (data / "eval.tsv").write_text("\n".join(_criteo_lines(rng, 300, (60, 600, 9))) + "\n")  # unseen values too
  c = _tiny()
  c.data.name = "criteo"
  c.data.train_files, c.data.eval_files = (str(data / "train.tsv"),), (str(data / "eval.tsv"),)
  c.data.cache_dir = "off"
  c.model.kwargs.bottom = (16, 8)
  out["criteo"] = _run(root / "criteo", c)
  return out


class Reference:
  """The trainer's path: the run restored whole, scoring columns with its eval step."""

  def __init__(self, workdir):
    self.config = run_config.load(workdir)
    self.job = train.build_job(self.config, None)
    ckpts = RunCheckpoints(workdir, self.config)
    self.state, self.step, _ = ckpts.restore_latest(self.job.state, self.job.ps)
    ckpts.close()

  def eval_set(self):
    """(columns, logits) of the reader's eval set, as train.evaluate computes them."""
    cols, logits = [], []
    for batch, n in self.job.reader.eval():
      cols.append(base.take_columns(batch, slice(0, n)))
      logits.append(self.logits(batch)[:n])
    return base.concat_columns(cols), np.concatenate(logits)

  def logits(self, cols):
    import jax

    host = self.job.host
    cols = dict(cols, label=np.zeros(base.num_records(cols), np.float32))
    p = host.prepare(0, cols, n_valid=base.num_records(cols))
    host.lookup(p, create=False)
    _, rows, batch = host.place(p)
    return np.asarray(jax.device_get(self.job.eval_step(self.state.params, rows, batch))["logits"])


def _sigmoid(z):
  return 1.0 / (1.0 + np.exp(-np.asarray(z, np.float64)))


def _synthetic_records(cols, max_len):
  recs = []
  for i in range(base.num_records(cols)):
    r = {f"dense_{j:02d}": float(x) for j, x in enumerate(cols["dense"][i])}
    for name, ids in cols["sparse"].items():
      w = cols.get("sparse_weights", {}).get(name)
      if max_len[name] > 1:
        r[name] = [int(x) for x, keep in zip(ids[i], w[i]) if keep]
      else:
        r[name] = int(ids[i, 0])
    recs.append(r)
  return recs


def _criteo_records(path, n):
  recs = []
  for k, line in enumerate(open(path).read().splitlines()[:n]):
    f = line.split("\t")
    r = {f"I{j + 1}": f[1 + j] for j in range(13)}
    if k % 2:  # ints as JSON numbers for half of them, strings for the rest
      r.update({key: int(v) for key, v in r.items() if v})
    r.update({f"C{j + 1}": f[14 + j] for j in range(26)})
    recs.append(r)
  return recs


@pytest.fixture(scope="module")
def refs(runs):
  return {k: Reference(v["workdir"]) for k, v in runs.items()}


def _records(name, runs, ref, cols):
  if name == "criteo":
    return _criteo_records(runs[name]["config"].data.eval_files[0], base.num_records(cols))
  return _synthetic_records(cols, ref.job.reader.schema.feature_max_len())


@pytest.mark.parametrize("name", ["dlrm", "dcn", "criteo"])
def test_scores_equal_the_trainers_evaluation(runs, refs, name, tmp_path):
  ref = refs[name]
  cols, want = ref.eval_set()
  assert np.isclose(runs[name]["summary"]["eval_samples"], want.shape[0])
  recs = _records(name, runs, ref, cols)
  sc = scorer.load_scorer(runs[name]["workdir"])
  assert sc.version == f"step-{ref.step}" == f"step-{runs[name]['config'].num_steps}"
  assert len(sc.chain) == 3 and sc.chain[0].endswith("-full") and sc.chain[2].endswith("-incr")  # full + 2 incrementals
  ck = sc.checkpoint  # what it was loaded from, declared (LoadedCheckpoint)
  assert (ck.step, ck.workdir, ck.chain) == (ref.step, os.path.abspath(runs[name]["workdir"]), sc.chain)
  assert ck.config.num_steps == runs[name]["config"].num_steps and ck.load_s > 0 and sc.params is ck.params
  with pytest.raises(AttributeError, match="stpe"):  # a version derived from it takes declared attributes only
    sc.derive("v2", stpe=3)
  got = sc.predict(sc.concat([sc.encode(recs[a : a + 100]) for a in range(0, len(recs), 100)]))
  np.testing.assert_allclose(got, _sigmoid(want), rtol=0, atol=1e-6)
  artifact.export_artifact(runs[name]["workdir"], str(tmp_path / "art"))
  art = artifact.load_artifact(str(tmp_path / "art"))
  assert art.version == sc.version
  np.testing.assert_allclose(art.predict(art.encode(recs[:256])), _sigmoid(want[:256]), rtol=0, atol=1e-6)


def test_unseen_ids_read_what_evaluation_reads_and_create_nothing(runs, refs):
  ref = refs["dcn"]
  cols, _ = ref.eval_set()
  cols = base.take_columns(cols, slice(0, 64))
  rng = np.random.default_rng(1)
  for name, ids in cols["sparse"].items():  # half of the ids replaced by ids no run has seen
    fresh = rng.integers(1 << 62, 1 << 63, ids.shape, dtype=np.int64).astype(np.uint64)
    cols["sparse"][name] = np.where(rng.random(ids.shape) < 0.5, fresh, ids)
  recs = _synthetic_records(cols, ref.job.reader.schema.feature_max_len())
  rows_before = {t: int(s["rows"]) for t, s in ref.job.ps.stats().items()}
  want = _sigmoid(ref.logits(cols))
  assert {t: int(s["rows"]) for t, s in ref.job.ps.stats().items()} == rows_before
  sc = scorer.load_scorer(runs["dcn"]["workdir"])
  index_before = sc.rows.num_rows()
  np.testing.assert_allclose(sc.predict(sc.encode(recs)), want, rtol=0, atol=1e-6)
  assert sc.rows.num_rows() == index_before


def test_padding_changes_no_score_and_each_bucket_compiles_once(runs):
  sc = scorer.load_scorer(runs["dlrm"]["workdir"], max_batch=8)
  rng = np.random.default_rng(2)
  recs = [
    {
      **{f"dense_{j:02d}": float(rng.random() * 3) for j in range(5)},
      **{f"cat_{k:02d}": int(rng.integers(0, 50)) for k in range(4)},
    }
    for _ in range(21)
  ]
  alone = np.concatenate([sc.predict(sc.encode([r])) for r in recs])
  with pytest.raises(RequestError, match="9 records in one request; at most 8"):
    sc.encode(recs[:9])
  # The front may concatenate requests past max_batch: predict scores them max_batch at a time.
  np.testing.assert_allclose(sc.predict(sc.concat([sc.encode(recs[:8]), sc.encode(recs[8:16])])), alone[:16], atol=1e-6)
  for size in (2, 3, 5, 8):
    got = np.concatenate([sc.predict(sc.encode(recs[a : a + size])) for a in range(0, len(recs), size)])
    np.testing.assert_allclose(got, alone, rtol=0, atol=1e-6)
  traces = sc.traces["eval"]
  assert traces <= 4 * 2  # batch buckets 1, 2, 4, 8 x at most two rows buckets here
  for size in (1, 2, 3, 4, 5, 6, 7, 8):
    sc.predict(sc.encode(recs[:size]))
  assert sc.traces["eval"] == traces  # nothing new compiled for sizes already seen
  # Raw records score through the Python API as they are, any number of them (21 > max_batch 8).
  encoded = sc.concat([sc.encode(recs[a : a + 8]) for a in range(0, len(recs), 8)])
  np.testing.assert_array_equal(sc.predict(recs), sc.predict(encoded))
  with pytest.raises(RequestError, match="cat_00"):
    sc.predict(recs[:3] + [{k: v for k, v in recs[3].items() if k != "cat_00"}])
  with pytest.raises(TypeError, match="predict takes records"):
    sc.predict({"records": recs})


def test_bounded_cache_serves_a_table_four_times_larger_with_the_same_scores(runs, refs):
  ref = refs["criteo"]
  cols, want = ref.eval_set()
  recs = _criteo_records(runs["criteo"]["config"].data.eval_files[0], base.num_records(cols))
  full = scorer.load_scorer(runs["criteo"]["workdir"])
  total = sum(full.rows.num_rows().values())
  small = scorer.load_scorer(runs["criteo"]["workdir"], cache_rows=total // 4)
  cap = small.rows.capacity_rows()
  assert 0 < cap <= total // 4
  held = []
  for a in range(0, len(recs), 16):
    np.testing.assert_allclose(
      small.predict(small.encode(recs[a : a + 16])), full.predict(full.encode(recs[a : a + 16])), rtol=0, atol=0
    )
    held.append(small.rows.held_rows())
    assert small.rows.held_bytes() <= cap * 8 * 4
  assert max(held) <= cap and max(held) > cap // 2  # it fills up, and never past its bound
  assert full.rows.held_rows() > cap  # the unbounded cache holds more than the bounded one may


def test_newest_step_reports_only_complete_checkpoints(runs, tmp_path):
  import shutil

  src = runs["dlrm"]["workdir"]
  w = str(tmp_path / "w")
  shutil.copytree(src, w)
  steps = sorted(int(s) for s in os.listdir(os.path.join(w, "checkpoints")))
  assert scorer.newest_step(w) == steps[-1]
  os.makedirs(os.path.join(w, "checkpoints", "999"))  # an uncommitted or foreign directory
  os.makedirs(os.path.join(w, "checkpoints", "1000.orbax-checkpoint-tmp-1"))
  assert scorer.newest_step(w) == steps[-1]
  meta = os.path.join(w, "checkpoints", str(steps[-1]), "meta", "metadata")
  text = open(meta).read()
  open(meta, "w").write(text.replace('"data_position": ', '"data_position": 1', 1))  # still JSON, CRC fails
  assert scorer.newest_step(w) == steps[-2]
  # The older one's chain loses its incremental snapshot: not complete either.
  chain = scorer.read_meta(w, steps[-2])["ps_chain"]
  shutil.rmtree(os.path.join(w, "ps_snapshots", chain[-1]))
  assert scorer.newest_step(w) == (steps[-3] if len(steps) > 2 else None)
  sc = scorer.load_scorer(w)  # falls back past the damaged ones
  assert sc.version == f"step-{steps[-3]}"
  with pytest.raises(Exception, match=str(steps[-1])):
    scorer.load_scorer(w, step=steps[-1])


def test_damaged_artifact_is_refused_naming_the_file(runs, tmp_path):
  out = str(tmp_path / "art")
  artifact.export_artifact(runs["dlrm"]["workdir"], out)
  with pytest.raises(FileExistsError):
    artifact.export_artifact(runs["dlrm"]["workdir"], out)
  fwd = os.path.join(out, artifact.FORWARD)
  blob = bytearray(open(fwd, "rb").read())
  blob[len(blob) // 2] ^= 1
  open(fwd, "wb").write(bytes(blob))
  with pytest.raises(artifact.ArtifactError, match="forward.jax is damaged"):
    artifact.load_artifact(out)
  os.remove(os.path.join(out, artifact.PARAMS))
  with pytest.raises(artifact.ArtifactError, match="forward.jax|params.npz"):
    artifact.load_artifact(out)
  open(os.path.join(out, artifact.MANIFEST), "w").write("{not json")
  with pytest.raises(artifact.ArtifactError, match="manifest.json"):
    artifact.load_artifact(out)


def test_artifact_scores_without_model_or_training_code(runs, refs, tmp_path):
  out = str(tmp_path / "art")
  artifact.export_artifact(runs["dcn"]["workdir"], out)
  cols, want = refs["dcn"].eval_set()
  recs = _synthetic_records(base.take_columns(cols, slice(0, 8)), refs["dcn"].job.reader.schema.feature_max_len())
  code = (
    "import json, sys\n"
    "for m in ('recsys_jax.models', 'recsys_jax.training', 'recsys_jax.train', 'configs', 'flax'):\n"
    "  sys.modules[m] = None  # importing any of them fails\n"
    "from recsys_jax.serving import artifact\n"
    f"sc = artifact.load_artifact({out!r})\n"
    "print(json.dumps(sc.predict(sc.encode(json.loads(sys.stdin.read()))).tolist()))\n"
  )
  import json

  res = subprocess.run(
    [sys.executable, "-c", code], input=json.dumps(recs), capture_output=True, text=True, timeout=300
  )
  assert res.returncode == 0, res.stderr[-3000:]
  np.testing.assert_allclose(json.loads(res.stdout.strip().splitlines()[-1]), _sigmoid(want[:8]), rtol=0, atol=1e-6)


def test_config_json_written_by_the_run_and_a_changed_one_kept_beside(runs, tmp_path):
  w = runs["dlrm"]["workdir"]
  assert run_config.load(w).to_dict() == runs["dlrm"]["config"].to_dict()
  d = str(tmp_path)
  c = _tiny()
  assert run_config.save(d, c) is None and run_config.save(d, c) is None  # a resume with the same config
  c.num_steps = 99
  c.model.kwargs.top = (8,)
  assert run_config.save(d, c) == ["model.kwargs", "num_steps"]
  assert sorted(os.listdir(d)) == ["config.1.json", "config.json"]
  assert run_config.load(d).num_steps == 99 and run_config.load(d).model.kwargs.top == (8,)


@pytest.mark.parametrize("name", ["dlrm", "dcn", "criteo"])
def test_http_and_grpc_answers_equal_the_trainers_evaluation(runs, refs, name):
  """The server's answers (micro-batched: several clients at once) are the trainer's eval scores."""
  import concurrent.futures

  from recsys_jax.serving.client import GrpcClient, HttpClient
  from recsys_jax.serving.server import ServerOptions, Serving

  ref = refs[name]
  cols, want = ref.eval_set()
  recs = _records(name, runs, ref, cols)
  srv = Serving(
    runs[name]["workdir"], scorer.load_scorer, scorer.newest_step, ServerOptions(reload_every_s=0, max_wait_s=0.005)
  )
  try:
    spans = [(a, min(a + 37, len(recs))) for a in range(0, len(recs), 37)]

    def ask(i):  # a client is one connection: one per request here, HTTP and gRPC in turn
      c = HttpClient("127.0.0.1", srv.http_port) if i % 2 else GrpcClient(f"127.0.0.1:{srv.grpc_port}")
      try:
        return c.predict(recs[slice(*spans[i])])
      finally:
        c.close()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      answers = list(pool.map(ask, range(len(spans))))
  finally:
    srv.stop()
  assert {a["version"] for a in answers} == {f"step-{ref.step}"}
  got = np.concatenate([np.asarray(a["scores"], np.float64) for a in answers])
  np.testing.assert_allclose(got, _sigmoid(want), rtol=0, atol=1e-6)


# -- bad requests through the real encoder ----------------------------------------------------

DROP = object()  # a field left out of the record


def _good(fields, i=0):
  return {f: (0.25 * i + 0.5 if kind == "float" else 3 * i + 1) for f, kind in fields.items()}


def _cases(fields):
  """name -> (records, field, record index): the fake's record-level cases, on this model's fields."""
  floats = [f for f, k in fields.items() if k == "float"]
  ints = [f for f, k in fields.items() if k == "int"]
  assert floats and ints and set(fields) == set(floats) | set(ints), fields
  good = _good(fields)

  def bad(**kv):
    r = dict(good, **kv)
    return [good, {k: v for k, v in r.items() if v is not DROP}]

  f, n = floats[0], ints[-1]
  return {
    "missing feature": (bad(**{n: DROP}), n),
    "missing dense feature": (bad(**{f: DROP}), f),
    "unknown feature": (bad(zz=1.0), "zz"),
    "wrong type (string for float)": (bad(**{f: "1.5"}), f),
    "wrong type (bool for float)": (bad(**{f: True}), f),
    "wrong type (string for int)": (bad(**{n: "a"}), n),
    "wrong type (fraction for int)": (bad(**{n: 1.5}), n),
    "wrong type (bool for int)": (bad(**{n: True}), n),
    "wrong type (list for int)": (bad(**{n: [1, 2]}), n),
    "null value": (bad(**{f: None}), f),
    "a record not an object": ([good, [1, 2]], "records"),
  }


# The fake model's record-level cases (a field and a record named) must all have a real-model twin.
_RECORD_LEVEL = {name for name, (_, _, field, record) in test_serve_requests.BAD.items() if record is not None}


@pytest.fixture(scope="module")
def served(runs):
  """The synthetic DLRM run behind the serving front, and its scorer in this process."""
  from recsys_jax.serving.server import ServerOptions, Serving

  w = runs["dlrm"]["workdir"]
  s = Serving(w, scorer.load_scorer, scorer.newest_step, ServerOptions(max_batch=8, max_wait_s=0.001, reload_every_s=0))
  yield s, scorer.load_scorer(w)
  s.stop()


def test_every_record_level_case_of_the_fake_is_here_too(served):
  mine = set(_cases(served[1].fields()))
  missing = {c for c in _RECORD_LEVEL if c not in mine and c.replace("number for string", "string for int") not in mine}
  assert not missing, missing


@pytest.mark.parametrize("side", ["http", "grpc"])
def test_bad_records_refused_by_the_real_encoder_then_good_answered(served, side):
  """Each record-level bad request through the real model's encoder (synthetic data: float and
  int fields), not the fake model's checks that ``test_serve_requests`` exercises: refused over
  HTTP (400) and gRPC (INVALID_ARGUMENT) naming the field and the record, and the next good
  request answered with the scores the same checkpoint gives in this process."""
  s, sc = served
  fields = sc.fields()
  goods = [_good(fields, i) for i in range(3)]
  want = np.asarray(sc.predict(sc.encode(goods)), np.float64)
  c = HttpClient("127.0.0.1", s.http_port) if side == "http" else GrpcClient(f"127.0.0.1:{s.grpc_port}")
  try:
    for case, (records, field) in _cases(fields).items():
      body = json.dumps({"records": records}).encode()
      with pytest.raises(ServeError) as e:
        if side == "http":
          c.request("POST", "/v1/predict", body)
        else:
          c.call("Predict", body)
      assert e.value.status == (400 if side == "http" else "INVALID_ARGUMENT"), (case, e.value)
      assert (e.value.field, e.value.record) == (field, 1), (case, e.value)
      assert field in e.value.message, (case, e.value)
      a = c.predict(goods)
      assert a["version"] == sc.version
      np.testing.assert_allclose(a["scores"], want, rtol=1e-6, err_msg=case)
  finally:
    c.close()
