"""Every row optimizer, on the settings a run gets from ``configs/default.py``, against float64.

The other optimizer tests use hand-picked settings (a 0.1 starting accumulator, eps 1e-6,
N(0, 1) gradients) under which eps hardly matters: Adagrad with eps moved inside the square
root passed them all. A run starts every accumulator at 0 (``initial_accumulator_value``), takes
each optimizer's own eps (1e-8), and sees gradients from about 1e-5 to 1. There, eps is a
visible part of each update of a row with small gradients (1e-3 of it at 1e-5), so eps inside
the square root (1e-4 in the denominator instead of 1e-8), a gradient counted twice (eps
against 2|g|), a missing bias correction or a lost accumulator all move the weights far more than
the float32 arithmetic does.

Each optimizer is built from the config exactly as a run builds it (``build_specs``), and three
implementations are compared with the same float64 reference after every step: the PS's
``Table`` (its fused update kernels), the optimizer's numpy ``update``, and the device forms
(``apply_sparse`` and ``apply_masked`` under ``jax.jit``) that hot rows use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from recsys_jax.async_ps.optim import optimizers
from recsys_jax.async_ps.store.table import Table
from recsys_jax.data.base import FeatureInfo, Schema
from recsys_jax.embeddings import device_optimizers
from recsys_jax.training.specs import build_specs
from tests.async_ps.test_optimizers import CONFIGS as _REFERENCE_CONFIGS

VOCAB, BATCH, STEPS = 24, 40, 10
# float32 against float64 (every form, weights and slots): measured at most 0.3 of this tolerance.
# Eps inside the square root, a doubled gradient or no bias correction land 1e-3 to 0.3 away.
RTOL, ATOL = 1e-5, 1e-7
REFERENCES = {name: ref for name, _, ref in _REFERENCE_CONFIGS.values()}


def _spec(name):
  """The table spec a default run builds for row optimizer ``name`` (one feature, one table)."""
  c = default.get_config()
  c.embeddings.optimizer = name
  (spec,), _, _ = build_specs(c, Schema(num_dense=1, features=(FeatureInfo("f"),)))
  return spec


def _gradients(rng, n, dim):
  """Per-id summed gradients of one step: each row's scale log-uniform in [1e-5, 1], each
  element 0.5 to 1 of it with a random sign, so some rows have only tiny gradients."""
  scale = 10.0 ** rng.uniform(-5.0, 0.0, (n, 1))
  return (scale * rng.uniform(0.5, 1.0, (n, dim)) * rng.choice([-1.0, 1.0], (n, dim))).astype(np.float32)


def _close(what, got, want):
  got, want = np.asarray(got, np.float32).astype(np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  err = np.abs(got - want) - (RTOL * np.abs(want) + ATOL)
  i = np.unravel_index(np.argmax(err), err.shape)
  assert err[i] <= 0.0, f"{what}: at {i} got {got[i]!r}, want {want[i]!r} (|diff| {abs(got[i] - want[i]):.3g})"


@pytest.mark.parametrize("name", optimizers.NAMES)
def test_default_settings_match_float64_reference(name):
  spec = _spec(name)
  kw = dict(spec.optimizer_kwargs)
  assert kw.get("initial_accumulator_value", 0.0) == 0.0 and "eps" not in kw  # the optimizer's own eps
  dim = spec.dim
  ref_init, ref_step = REFERENCES[name](kw)
  rng = np.random.default_rng(optimizers.NAMES.index(name))
  table = Table(spec, seed=1)
  ids = np.sort(rng.choice(1 << 40, size=VOCAB, replace=False).astype(np.uint64))
  w0 = table.lookup(ids)  # the rows' initial weights, from the default initializer
  ps, dev = optimizers.make(name, **kw), device_optimizers.make(name, **kw)
  np_w, np_s = w0.copy(), ps.init(VOCAB, dim)
  sparse = masked = (jnp.asarray(w0), dev.init(VOCAB, dim))
  sparse_fn, masked_fn = jax.jit(dev.apply_sparse), jax.jit(dev.apply_masked)
  ref_w, ref_s = w0.astype(np.float64), [ref_init(dim) for _ in range(VOCAB)]
  counts = np.zeros(VOCAB, int)
  p = 1.0 / np.arange(1, VOCAB + 1) ** 1.2
  p[-3:] = 0.0  # three rows never get a gradient
  for step in range(STEPS):
    rows = np.unique(rng.choice(VOCAB, size=BATCH, p=p / p.sum()))
    g = _gradients(rng, len(rows), dim)
    table.apply(ids[rows], g)
    new_w, new_s = ps.update(np_w[rows], {k: v[rows] for k, v in np_s.items()}, g)
    np_w[rows] = new_w
    for k, v in new_s.items():
      np_s[k][rows] = v
    pad = BATCH - len(rows)  # one shape for every step (one compile); index VOCAB is dropped
    idx = np.concatenate([rows, np.full(pad, VOCAB)]).astype(np.int32)
    gp = np.concatenate([g, np.ones((pad, dim), np.float32)])
    sparse = sparse_fn(*sparse, jnp.asarray(idx), jnp.asarray(gp))
    touched, g_full = np.zeros(VOCAB, bool), np.zeros((VOCAB, dim), np.float32)
    touched[rows], g_full[rows] = True, g
    masked = masked_fn(*masked, jnp.asarray(touched), jnp.asarray(g_full))
    for r, gr in zip(rows, g.astype(np.float64)):
      ref_w[r], ref_s[r] = ref_step(ref_w[r], ref_s[r], gr)
    counts[rows] += 1

    snap = table.snapshot()
    order = np.searchsorted(snap["ids"], ids)
    assert (snap["ids"][order] == ids).all()
    ref_slots = {k: np.stack([s[k] for s in ref_s]) for k in ref_s[0]}
    got = {
      "table": (snap["weights"][order], {k[5:]: v[order] for k, v in snap.items() if k.startswith("slot_")}),
      "numpy update": (np_w, np_s),
      "device apply_sparse": sparse,
      "device apply_masked": masked,
    }
    for form, (w, s) in got.items():
      _close(f"{name} {form} step {step}: weights", w, ref_w)
      assert sorted(s) == sorted(ref_slots), (form, sorted(s))
      for k, v in s.items():
        _close(f"{name} {form} step {step}: slot {k}", np.asarray(v).reshape(ref_slots[k].shape), ref_slots[k])
  # Not vacuous: rows were updated often, their weights moved, the untouched ones stayed.
  assert counts[-3:].sum() == 0 and counts.max() >= STEPS - 1
  assert np.abs(ref_w[:-3] - w0[:-3]).max() > 0.05
  np.testing.assert_array_equal(np.asarray(sparse[0])[-3:], w0[-3:])
