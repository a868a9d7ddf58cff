"""Test helper: the synthetic generator before its speed-ups, kept verbatim as the reference.

``tests/data/test_synthetic.py`` checks that ``recsys_jax.data.synthetic.SyntheticData.batch`` returns
bit for bit what this returns (the committed figures depend on the exact values); not a test module.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from recsys_jax.data.synthetic import EVAL, SyntheticConfig
from recsys_jax.hashing import name_seed, splitmix64, uniform01


def _normal(h: np.ndarray) -> np.ndarray:
  """Standard normals from uint64 hashes (Box-Muller on two derived uniforms)."""
  u1 = uniform01(h)
  u2 = uniform01(splitmix64(h))
  return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


class ReferenceSyntheticData:
  """The generator as it was before its speed-ups (commit 4983112), verbatim but for ``batch_and_logits``
  (the old ``batch`` returning its logits too)."""

  def __init__(self, cfg: SyntheticConfig):
    if len(cfg.multi_hot) not in (0, len(cfg.vocab_sizes)):
      raise ValueError(
        f"data.multi_hot has {len(cfg.multi_hot)} entries; give none or one per field ({len(cfg.vocab_sizes)})"
      )
    if any(v < 1 for v in cfg.vocab_sizes):
      raise ValueError(f"data.vocab_sizes must be >= 1, got {cfg.vocab_sizes}")
    if cfg.drift_records < 0 or cfg.eval_at_record < 0:
      raise ValueError(
        f"data.drift_records ({cfg.drift_records}) and data.eval_at_record ({cfg.eval_at_record}) must be >= 0"
      )
    self.cfg = cfg
    self.num_fields = len(cfg.vocab_sizes)
    self.feature_names = tuple(f"cat_{i:02d}" for i in range(self.num_fields))
    self.max_len = tuple(cfg.multi_hot) or (1,) * self.num_fields
    self._field_seed = [name_seed(n, cfg.seed) for n in self.feature_names]
    self._effect_seed = [name_seed(n + "/effect", cfg.seed) for n in self.feature_names]
    self._vector_seed = [name_seed(n + "/vector", cfg.seed) for n in self.feature_names]
    # The second, independent effects and vectors a drifting teacher turns toward.
    self._effect_seed_b = [name_seed(n + "/effect/drift", cfg.seed) for n in self.feature_names]
    self._vector_seed_b = [name_seed(n + "/vector/drift", cfg.seed) for n in self.feature_names]
    self._cdf = []
    for v in cfg.vocab_sizes:
      p = np.arange(1, v + 1, dtype=np.float64) ** -cfg.zipf_alpha
      c = np.cumsum(p)
      self._cdf.append(c / c[-1])
    rng = np.random.default_rng([cfg.seed, 12345])
    self._dense_mu = rng.uniform(0.0, 3.0, cfg.num_dense)
    self._dense_sigma = rng.uniform(0.5, 1.5, cfg.num_dense)
    hidden = 16
    self._w1 = rng.normal(size=(cfg.num_dense, hidden)) / np.sqrt(cfg.num_dense)
    self._b1 = rng.normal(size=hidden) * 0.5
    self._w2 = rng.normal(size=hidden) / np.sqrt(hidden)
    self._field_w = rng.uniform(0.5, 1.5, self.num_fields)
    pairs = set()
    while len(pairs) < min(cfg.num_pairs, self.num_fields * (self.num_fields - 1) // 2):
      a, b = sorted(rng.choice(self.num_fields, 2, replace=False).tolist())
      pairs.add((a, b))
    self.pairs = sorted(pairs)

  # ids and teacher terms -----------------------------------------------------------
  def ids_of(self, field: int, ranks: np.ndarray) -> np.ndarray:
    """The uint64 id of a (0-based) rank in a field."""
    return splitmix64(ranks.astype(np.uint64) ^ self._field_seed[field])

  def _effect(self, field: int, ranks: np.ndarray, turn=None) -> np.ndarray:
    """Each rank's effect; ``turn``: (cos, sin) of the drift angle per record (None: no drift)."""
    a = _normal(splitmix64(ranks.astype(np.uint64) ^ self._effect_seed[field]))
    if turn is None:
      return a
    b = _normal(splitmix64(ranks.astype(np.uint64) ^ self._effect_seed_b[field]))
    return turn[0][:, None] * a + turn[1][:, None] * b

  def _vector(self, field: int, ranks: np.ndarray, turn=None) -> np.ndarray:
    d = self.cfg.teacher_dim
    cols = splitmix64(np.arange(1, d + 1, dtype=np.uint64) * np.uint64(0x632BE59BD9B4E019))

    def draw(seed):
      return _normal(splitmix64(splitmix64(ranks.astype(np.uint64) ^ seed)[..., None] ^ cols))

    if turn is None:
      return draw(self._vector_seed[field])
    a, b = draw(self._vector_seed[field]), draw(self._vector_seed_b[field])
    return turn[0][:, None, None] * a + turn[1][:, None, None] * b

  def drift_angle(self, records: np.ndarray) -> np.ndarray:
    """The teacher's drift angle (radians) at training record indices ``records`` (0 without drift)."""
    r = np.asarray(records, np.float64)
    return r * (0.5 * np.pi / self.cfg.drift_records) if self.cfg.drift_records else np.zeros_like(r)

  def _dense_term(self, dense: np.ndarray) -> np.ndarray:
    h = np.tanh(dense @ self._w1 + self._b1)
    return h @ self._w2

  # batches --------------------------------------------------------------------------
  def batch(self, split: int, index: int, batch_size: int) -> Dict[str, object]:
    """Returns batch ``index`` of ``split`` (TRAIN or EVAL) with ``batch_size`` examples."""
    return self.batch_and_logits(split, index, batch_size)[0]

  def batch_and_logits(self, split: int, index: int, batch_size: int) -> Tuple[Dict[str, object], np.ndarray]:
    """``batch(split, index, batch_size)`` and its records' float64 teacher logits, whose every bit
    shows the teacher's arithmetic (the batch's float32 probabilities round most of it away)."""
    cfg = self.cfg
    rng = np.random.default_rng([cfg.seed, split, index])
    counts = np.floor(np.exp(rng.normal(self._dense_mu, self._dense_sigma, (batch_size, cfg.num_dense))))
    dense = np.log1p(np.maximum(counts - 1.0, 0.0)).astype(np.float32)
    z = cfg.bias + cfg.dense_scale * self._dense_term((dense - self._dense_mu) / 2.0)
    sparse, weights, vecs = {}, {}, {}
    turn = None
    if cfg.drift_records:  # the teacher of each record's place in the training stream
      first = index * batch_size + (cfg.eval_at_record if split == EVAL else 0)
      theta = self.drift_angle(first + np.arange(batch_size))
      turn = (np.cos(theta), np.sin(theta))
    for f in range(self.num_fields):
      L = self.max_len[f]
      ranks = np.searchsorted(self._cdf[f], rng.random((batch_size, L)), side="right")
      ranks = np.minimum(ranks, cfg.vocab_sizes[f] - 1)
      if L > 1:
        n = rng.integers(1, L + 1, batch_size)
        mask = np.arange(L)[None, :] < n[:, None]
      else:
        mask = np.ones((batch_size, 1), bool)
      ids = np.where(mask, self.ids_of(f, ranks), np.uint64(0))
      sparse[self.feature_names[f]] = ids
      m = mask.astype(np.float64)
      denom = m.sum(1)
      eff = (self._effect(f, ranks, turn) * m).sum(1) / denom
      z += cfg.id_scale * self._field_w[f] * eff
      if any(f in p for p in self.pairs):
        vecs[f] = (self._vector(f, ranks, turn) * m[..., None]).sum(1) / denom[:, None]
      if L > 1:
        weights[self.feature_names[f]] = mask.astype(np.float32)
    if self.pairs:
      inter = sum((vecs[a] * vecs[b]).sum(-1) for a, b in self.pairs)
      z += cfg.pair_scale * inter / np.sqrt(cfg.teacher_dim)
    prob = 1.0 / (1.0 + np.exp(-z))
    label = (rng.random(batch_size) < prob).astype(np.float32)
    out = {"dense": dense, "sparse": sparse, "label": label, "prob": prob.astype(np.float32)}
    if weights:
      out["sparse_weights"] = weights
    return out, z

  def feature_max_len(self) -> Dict[str, int]:
    return dict(zip(self.feature_names, self.max_len))
