"""pool() and its gradient under jit against float64 numpy references (np.add.at for the gradient)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recsys_jax.embeddings import pooling


def _inputs(seed, U=9, D=5, B=6, F=3, L=4, weighted=True):
  rng = np.random.default_rng(seed)
  rows = rng.normal(size=(U, D)).astype(np.float32)
  # Few distinct rows for many slots: every row occurs many times, within and across bags.
  inverse = rng.integers(0, U - 2, size=(B, F, L)).astype(np.int32)  # the last rows are bucket padding
  inverse[0, 0, :] = 3  # one bag made of a single repeated row
  weights = None
  if weighted:
    weights = rng.choice(np.array([0.0, 0.25, 1.0, 1.5, -2.0], np.float32), size=(B, F, L))
  cot = rng.normal(size=(B, F, D)).astype(np.float32)
  return rows, inverse, weights, cot


def _ref_pool(rows, inverse, weights):
  rows = rows.astype(np.float64)
  B, F, L = inverse.shape
  w = np.ones((B, F, L)) if weights is None else weights.astype(np.float64)
  out = np.zeros((B, F, rows.shape[1]))
  for b in range(B):
    for f in range(F):
      for pos in range(L):
        out[b, f] += w[b, f, pos] * rows[inverse[b, f, pos]]
  return out


def _ref_grad(rows, inverse, weights, cot):
  w = np.ones(inverse.shape) if weights is None else weights.astype(np.float64)
  g = np.zeros(rows.shape, np.float64)
  contrib = w[..., None] * cot.astype(np.float64)[:, :, None, :]  # [B, F, L, D]
  np.add.at(g, inverse.reshape(-1), contrib.reshape(-1, rows.shape[1]))
  return g


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_pool_and_grad_match_numpy(weighted, seed):
  rows, inverse, weights, cot = _inputs(seed, weighted=weighted)

  @jax.jit
  def fwd(r, inv, w):
    return pooling.pool(r, inv, w)

  @jax.jit
  def grad(r, inv, w, c):
    return jax.grad(lambda rr: jnp.sum(pooling.pool(rr, inv, w) * c))(r)

  out = np.asarray(fwd(rows, inverse, weights))
  assert out.shape == (6, 3, 5)
  np.testing.assert_allclose(out, _ref_pool(rows, inverse, weights), rtol=1e-5, atol=1e-5)

  g = np.asarray(grad(rows, inverse, weights, cot))
  ref = _ref_grad(rows, inverse, weights, cot)
  np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5)
  # Rows referenced by nothing (bucket padding) get exactly zero gradient.
  np.testing.assert_array_equal(g[-2:], 0.0)
  # The test data has repeats: a row's gradient is a sum over several occurrences.
  counts = np.bincount(inverse.reshape(-1), minlength=rows.shape[0])
  assert counts.max() >= 5


def test_grad_is_not_just_last_occurrence():
  """A row that occurs twice in one bag (weights 1 and 2) receives 3 x the cotangent."""
  rows = np.arange(8, dtype=np.float32).reshape(4, 2)
  inverse = np.array([[[1, 1, 0]]], np.int32)
  weights = np.array([[[1.0, 2.0, 0.0]]], np.float32)
  cot = np.array([[[1.0, -1.0]]], np.float32)
  g = jax.jit(jax.grad(lambda r: jnp.sum(pooling.pool(r, inverse, weights) * cot)))(rows)
  np.testing.assert_allclose(np.asarray(g), [[0, 0], [3, -3], [0, 0], [0, 0]], atol=1e-6)
  out = pooling.pool(rows, inverse, weights)
  np.testing.assert_allclose(np.asarray(out), [[[6.0, 9.0]]], atol=1e-6)


def test_embed_features_pools_bags_and_keeps_masked_sequences():
  rows, inverse, weights, _ = _inputs(3)
  feats = (("a", "pooled", 4), ("s", "sequence", 3), ("c", "pooled", 2))
  pooled, seqs = jax.jit(lambda r, i, w: pooling.embed_features(r, i, w, feats))(rows, inverse, weights)
  assert list(pooled) == ["a", "c"] and list(seqs) == ["s"]
  ref = _ref_pool(rows, inverse, weights)
  for i, n in ((0, "a"), (2, "c")):
    assert pooled[n].shape == (6, 5)
    np.testing.assert_allclose(np.asarray(pooled[n]), ref[:, i], rtol=1e-5, atol=1e-5)
  x, mask = seqs["s"]
  assert x.shape == (6, 3, 5) and mask.shape == (6, 3)
  want_mask = weights[:, 1, :3] != 0
  np.testing.assert_array_equal(np.asarray(mask), want_mask)
  want = np.where(want_mask[..., None], rows[inverse[:, 1, :3]], 0.0)  # ordered rows, padding zeroed
  np.testing.assert_allclose(np.asarray(x), want, rtol=1e-6)
  # No gradient reaches a row through a padded slot, whatever the model does with it.
  g = jax.grad(lambda r: jnp.sum(pooling.embed_features(r, inverse, weights, feats)[1]["s"][0]))(rows)
  counts = np.zeros(rows.shape[0])
  np.add.at(counts, inverse[:, 1, :3][want_mask], 1.0)
  np.testing.assert_allclose(np.asarray(g), np.repeat(counts[:, None], 5, axis=1), atol=1e-6)


def test_embed_features_all_pooled_equals_the_reference():
  rows, inverse, weights, _ = _inputs(4)
  feats = (("a", "pooled", 4), ("b", "pooled", 4), ("c", "pooled", 4))
  pooled, seqs = pooling.embed_features(rows, inverse, weights, feats)
  ref = _ref_pool(rows, inverse, weights)
  assert not seqs and list(pooled) == ["a", "b", "c"]
  for i, n in enumerate(("a", "b", "c")):
    np.testing.assert_allclose(np.asarray(pooled[n]), ref[:, i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weighted", [True, False])
def test_embed_features_gradient_through_every_pooled_feature(weighted):
  # Each pooled feature gets its own cotangent: the rows' gradient must send each one back
  # through its own feature's slots (the split into features is transposed as a whole).
  rows, inverse, weights, cot = _inputs(5, weighted=weighted)
  feats = tuple((n, "pooled", 4) for n in ("a", "b", "c"))

  def loss(r):
    pooled, _ = pooling.embed_features(r, inverse, weights, feats)
    return sum(jnp.sum(pooled[n] * cot[:, k]) for k, n in enumerate(("a", "b", "c")))

  g = np.asarray(jax.jit(jax.grad(loss))(rows))
  np.testing.assert_allclose(g, _ref_grad(rows, inverse, weights, cot), rtol=1e-5, atol=1e-5)
