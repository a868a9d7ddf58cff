"""Synthetic click logs: determinism, id layout, Zipf frequencies, label model, multi-hot bags."""

import concurrent.futures

import numpy as np
import pytest

from recsys_jax import metrics
from recsys_jax.data import synthetic as syn
from tests.helpers.synthetic_reference import ReferenceSyntheticData


@pytest.fixture(scope="module")
def data():
  return syn.SyntheticData(syn.SyntheticConfig())


@pytest.fixture(scope="module")
def eval_set(data):
  return syn.stack_batches([data.batch(syn.EVAL, i, 10_000) for i in range(5)])


def _zipf_p(vocab, alpha, ranks):
  """P(rank r) (0-based) of a Zipf law truncated to ``vocab`` ranks, in float64."""
  w = np.arange(1, vocab + 1, dtype=np.float64) ** -alpha
  return w[np.asarray(ranks)] / w.sum()


def _assert_batches_equal(a, b):
  assert set(a) == set(b)
  for key in ("dense", "label", "prob"):
    np.testing.assert_array_equal(a[key], b[key])
  assert set(a["sparse"]) == set(b["sparse"])
  for f in a["sparse"]:
    np.testing.assert_array_equal(a["sparse"][f], b["sparse"][f])


def test_batches_are_deterministic_by_split_and_index(data):
  a = data.batch(syn.TRAIN, 7, 256)
  # Same (split, index) from another instance and after other batches: identical.
  other = syn.SyntheticData(syn.SyntheticConfig())
  other.batch(syn.TRAIN, 3, 64)
  _assert_batches_equal(a, other.batch(syn.TRAIN, 7, 256))
  _assert_batches_equal(a, data.batch(syn.TRAIN, 7, 256))
  assert a["dense"].shape == (256, 13) and a["dense"].dtype == np.float32
  assert a["label"].shape == (256,) and set(np.unique(a["label"])) <= {0.0, 1.0}
  assert len(a["sparse"]) == 26
  for ids in a["sparse"].values():
    assert ids.dtype == np.uint64 and ids.shape == (256, 1)
  # A different index, split or seed gives a different batch.
  for b in (
    data.batch(syn.TRAIN, 8, 256),
    data.batch(syn.EVAL, 7, 256),
    syn.SyntheticData(syn.SyntheticConfig(seed=1)).batch(syn.TRAIN, 7, 256),
  ):
    assert not np.array_equal(a["dense"], b["dense"])
    assert not np.array_equal(a["prob"], b["prob"])
    assert not np.array_equal(a["sparse"]["cat_00"], b["sparse"]["cat_00"])


def test_ids_are_hashed_ranks_over_the_whole_uint64_range(data):
  b = data.batch(syn.TRAIN, 0, 4096)
  all_ids = np.unique(np.concatenate([v.ravel() for v in b["sparse"].values()]))
  assert len(all_ids) > 5000
  high = (all_ids >= np.uint64(2**63)).mean()
  assert 0.4 < high < 0.6, high
  assert (all_ids < np.uint64(2**32)).sum() == 0  # not small integers
  for f in (4, 8, 13):  # small vocabularies: every id is the hash of a valid rank
    vocab = data.cfg.vocab_sizes[f]
    table = data.ids_of(f, np.arange(vocab))
    assert len(np.unique(table)) == vocab  # distinct ranks never collide
    assert np.isin(b["sparse"][data.feature_names[f]], table).all()
  # Different fields map the same rank to different ids.
  assert data.ids_of(0, np.array([0]))[0] != data.ids_of(1, np.array([0]))[0]


def test_top_rank_frequencies_follow_zipf(data, eval_set):
  n = eval_set["label"].shape[0]
  alpha = data.cfg.zipf_alpha
  for f in (0, 5, 8, 19, 24):
    vocab = data.cfg.vocab_sizes[f]
    ids = eval_set["sparse"][data.feature_names[f]][:, 0]
    for rank in (0, 1, 2):
      if rank >= vocab:
        continue
      p = _zipf_p(vocab, alpha, rank)
      count = (ids == data.ids_of(f, np.array([rank]))[0]).sum()
      sigma = np.sqrt(n * p * (1 - p))
      assert abs(count - n * p) < 5 * sigma, (f, rank, count, n * p, sigma)


def test_oracle_auc_and_label_rate(eval_set):
  label, prob = eval_set["label"], eval_set["prob"].astype(np.float64)
  n = label.shape[0]
  assert n == 50_000
  assert ((prob > 0) & (prob < 1)).all()
  oracle = metrics.auc(label, prob)
  assert 0.6 < oracle < 0.95, oracle
  # Labels are Bernoulli(prob): their mean matches the mean probability within 5 sigma.
  sigma = np.sqrt((prob * (1 - prob)).sum()) / n
  assert abs(label.mean() - prob.mean()) < 5 * sigma, (label.mean(), prob.mean(), sigma)
  # And labels are calibrated within probability bins, not only on average.
  bins = np.digitize(prob, [0.2, 0.4, 0.6])
  for k in range(4):
    m = bins == k
    if m.sum() > 1000:
      s = np.sqrt((prob[m] * (1 - prob[m])).sum()) / m.sum()
      assert abs(label[m].mean() - prob[m].mean()) < 5 * s


def test_multi_hot_bags():
  lens = (1, 3, 5, 2)
  cfg = syn.SyntheticConfig(vocab_sizes=(50, 1000, 20, 7), multi_hot=lens, num_pairs=3)
  d = syn.SyntheticData(cfg)
  assert d.feature_max_len() == dict(zip(d.feature_names, lens))
  B = 3000
  b = d.batch(syn.TRAIN, 2, B)
  w = b["sparse_weights"]
  assert set(w) == {n for n, L in zip(d.feature_names, lens) if L > 1}
  for f, (name, L) in enumerate(zip(d.feature_names, lens)):
    ids = b["sparse"][name]
    assert ids.shape == (B, L) and ids.dtype == np.uint64
    if L == 1:
      assert (ids != 0).all()
      continue
    wf = w[name]
    assert wf.shape == (B, L) and wf.dtype == np.float32
    assert set(np.unique(wf)) <= {0.0, 1.0}
    n = wf.sum(axis=1)
    assert n.min() >= 1 and n.max() <= L
    assert set(n.astype(int)) == set(range(1, L + 1))  # every bag length occurs
    # Valid ids come first; padding has weight 0 and id 0; valid ids are hashed ranks.
    np.testing.assert_array_equal(wf, (np.arange(L)[None, :] < n[:, None]).astype(np.float32))
    np.testing.assert_array_equal(ids[wf == 0], 0)
    assert np.isin(ids[wf == 1], d.ids_of(f, np.arange(cfg.vocab_sizes[f]))).all()
  # One-hot configs have no weights at all.
  assert "sparse_weights" not in syn.SyntheticData(syn.SyntheticConfig(vocab_sizes=(5, 6))).batch(0, 0, 8)
  with pytest.raises(ValueError):
    syn.SyntheticData(syn.SyntheticConfig(vocab_sizes=(5, 6), multi_hot=(2,)))


def _logit(p):
  p = np.asarray(p, np.float64)
  return np.log(p) - np.log1p(-p)


def test_drift_turns_the_id_effects_and_keeps_the_records():
  """With drift, record r's id effects are cos(theta) a + sin(theta) b, theta = (pi/2) r / drift_records:
  checked on one eval batch placed (``eval_at_record``) at theta ~ 0, pi/4, pi/2 and pi, whose teacher
  logits z(theta) = c + cos(theta) A + sin(theta) B (no pair term here) must satisfy
  z(pi/4) = c + (A + B) / sqrt(2) with c, A, B read off the other three. The records themselves (ids,
  dense features) are those of the teacher without drift: only labels and probabilities move."""
  D = 10**12  # theta moves by ~1e-9 across a batch
  base = dict(pair_scale=0.0, drift_records=D)
  fixed = syn.SyntheticData(syn.SyntheticConfig(pair_scale=0.0)).batch(syn.EVAL, 0, 2048)
  z = {}
  for quarter in (0, 0.5, 1, 2):
    b = syn.SyntheticData(syn.SyntheticConfig(**base, eval_at_record=int(quarter * D))).batch(syn.EVAL, 0, 2048)
    for f in b["sparse"]:
      np.testing.assert_array_equal(b["sparse"][f], fixed["sparse"][f])
    np.testing.assert_array_equal(b["dense"], fixed["dense"])
    z[quarter] = _logit(b["prob"])
  np.testing.assert_allclose(z[0], _logit(fixed["prob"]), atol=1e-5)  # theta = 0 is the fixed teacher
  c = (z[0] + z[2]) / 2
  a, b_ = z[0] - c, z[1] - c
  np.testing.assert_allclose(z[0.5], c + (a + b_) / np.sqrt(2), atol=1e-3)  # probabilities are float32
  assert np.corrcoef(a, b_)[0, 1] < 0.1  # the effects turned toward independent ones
  assert np.abs(a).mean() > 0.3


def test_drift_moves_which_ids_click_not_the_click_rate():
  """Training record r and r + drift_records: the teacher's probabilities of the same records are
  nearly uncorrelated, while the mean click probability stays within a few percent."""
  cfg = syn.SyntheticConfig(drift_records=20 * 4096)
  d, fixed = syn.SyntheticData(cfg), syn.SyntheticData(syn.SyntheticConfig())
  early = d.batch(syn.TRAIN, 0, 4096)
  late = d.batch(syn.TRAIN, 20, 4096)  # a quarter turn on
  np.testing.assert_array_equal(early["prob"][0], fixed.batch(syn.TRAIN, 0, 4096)["prob"][0])
  again = fixed.batch(syn.TRAIN, 20, 4096)
  r = np.corrcoef(_logit(late["prob"]), _logit(again["prob"]))[0, 1]
  assert r < 0.6, r  # the dense term, which does not drift, keeps some correlation
  assert abs(late["prob"].mean() / again["prob"].mean() - 1) < 0.05
  np.testing.assert_array_equal(d.drift_angle([0, 20 * 4096]), [0.0, np.pi / 2])
  with pytest.raises(ValueError, match="drift_records"):
    syn.SyntheticData(syn.SyntheticConfig(drift_records=-1))


def _assert_bits_equal(a, b, where):
  """Every array of batch ``a`` has the dtype, shape and bytes of ``b``'s (floats compared bit for bit)."""
  assert set(a) == set(b), where
  for k in a:
    if isinstance(a[k], dict):
      _assert_bits_equal(a[k], b[k], f"{where} {k}")
      continue
    assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), f"{where} {k}"
    assert np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), f"{where} {k} differs"


def test_batches_are_bit_identical_to_the_reference_generator(monkeypatch):
  """The speed-ups change no value: every array of every batch, and the float64 teacher logits behind
  it (the float32 probabilities would hide a last-bit change), is bit for bit what the generator returned
  before them (``tests/helpers/synthetic_reference.py``): train and eval, one-hot and multi-hot bags,
  with and without drift, several seeds, vocabularies, bag lengths, teacher_dims (sums of under and over
  8 terms) and batch sizes; while a field is still hashed per draw, after it is tabulated, and for a
  field too large to tabulate."""
  monkeypatch.setattr(syn, "TABLE_MAX_RANKS", 6000)  # so that the 8000- and 10000-rank fields stay untabulated
  seeds = np.random.default_rng(2026).integers(0, 2**31, 4).tolist()
  mixed = dict(vocab_sizes=(50, 1000, 20, 7, 8000, 3), num_pairs=6)
  cfgs = [
    syn.SyntheticConfig(seed=seeds[0]),
    syn.SyntheticConfig(seed=seeds[1], drift_records=50_000, eval_at_record=123_457, teacher_dim=7),
    syn.SyntheticConfig(**mixed, seed=seeds[2], multi_hot=(1, 3, 9, 2, 4, 1), teacher_dim=9),
    syn.SyntheticConfig(
      **mixed, seed=seeds[3], multi_hot=(2, 1, 5, 1, 3, 1), drift_records=777, eval_at_record=10**6, teacher_dim=3
    ),
  ]
  sizes = (1, 7, 300, 64, 1500, 5, 2000)
  for cfg in cfgs:
    new, ref = syn.SyntheticData(cfg), ReferenceSyntheticData(cfg)
    for split in (syn.TRAIN, syn.EVAL):
      for i, size in enumerate(sizes):
        (a, za), (b, zb) = (g.batch_and_logits(split, 3 * i + split, size) for g in (new, ref))
        _assert_bits_equal(dict(a, logits=za), dict(b, logits=zb), cfg)
    small = [f for f, v in enumerate(cfg.vocab_sizes) if v <= syn.TABLE_MAX_RANKS]
    assert new.tabulated_fields() == tuple(small)  # both paths were compared


def test_guided_search_is_searchsorted():
  """GuidedSearch returns np.searchsorted(cdf, u, side="right") for every u in [0, 1), checked on the
  values where an off-by-one would show: each cdf value, its neighbours, each bucket's edges."""
  rng = np.random.default_rng(7)
  cdfs = [np.array([1.0]), np.array([0.25, 0.25, 0.5, 1.0, 1.0])]  # repeated values, flat steps
  for v, alpha in ((3, 1.2), (1000, 0.5), (10_000, 1.2), (300, 2.0), (5000, 2.0)):
    c = np.cumsum(np.arange(1, v + 1, dtype=np.float64) ** -alpha)
    cdfs.append(c / c[-1])
  for cdf in cdfs[:-1]:
    search = syn.GuidedSearch(cdf)
    assert search.ok
    edges = np.arange(search.buckets + 1) / search.buckets
    u = np.concatenate([cdf, edges, rng.random(100_000), [0.0]])
    u = np.concatenate([u, np.nextafter(u, 0.0), np.nextafter(u, 1.0)])
    u = u[(u >= 0.0) & (u < 1.0)].reshape(-1, 1)
    np.testing.assert_array_equal(search(u), np.searchsorted(cdf, u, side="right"))
  assert not syn.GuidedSearch(cdfs[-1]).ok  # a tail too dense for 1 << 18 buckets: searched as before


def test_batches_drawn_on_threads_match_the_reference():
  """The trainer draws batches on worker threads: several at once, while fields get tabulated, still give
  the reference's batches bit for bit."""
  cfg = syn.SyntheticConfig(vocab_sizes=(3000, 40, 700, 9), multi_hot=(1, 2, 1, 3), num_pairs=4, drift_records=999)
  new, ref = syn.SyntheticData(cfg), ReferenceSyntheticData(cfg)
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    got = list(pool.map(lambda i: new.batch_and_logits(syn.TRAIN, i, 200), range(24)))
  for i, (b, z) in enumerate(got):
    want, want_z = ref.batch_and_logits(syn.TRAIN, i, 200)
    _assert_bits_equal(dict(b, logits=z), dict(want, logits=want_z), i)
  assert new.tabulated_fields() == (0, 1, 2, 3)
