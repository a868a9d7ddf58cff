"""Device row optimizers (jax) against the parameter server's: a real ``Table`` is the reference.

Each test trains a PS ``Table`` and device copies of it (``apply_sparse`` with a padded index,
``apply_masked`` with a mask) on the same per-id summed gradients of batches with repeated
ids, under ``jax.jit``, and compares weights and every slot after every step.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from recsys_jax.async_ps.optim import optimizers
from recsys_jax.async_ps.store.table import Table
from recsys_jax.embeddings import device_optimizers
from recsys_jax.embeddings.specs import TableSpec

VOCAB, DIM, BATCH, PAD, STEPS = 24, 5, 40, 32, 8
RTOL, ATOL = 1e-6, 1e-7
CLIP = 0.08

CONFIGS = {
  "sgd": ("sgd", {"learning_rate": 0.1}),
  "adagrad": ("adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.1, "eps": 1e-6}),
  "rowwise_adagrad": ("rowwise_adagrad", {"learning_rate": 0.05, "initial_accumulator_value": 0.2, "eps": 1e-4}),
  "adam": ("adam", {"learning_rate": 0.1, "b1": 0.9, "b2": 0.999}),
  "adam_b": ("adam", {"learning_rate": 0.02, "b1": 0.5, "b2": 0.99, "eps": 1e-6}),
  "ftrl": ("ftrl", {"learning_rate": 0.1, "learning_rate_power": -0.5, "l1": 0.05, "l2": 0.1}),
  "ftrl_power": (
    "ftrl",
    {"learning_rate": 0.1, "learning_rate_power": -0.3, "l1": 0.02, "l2": 0.05, "beta": 0.5},
  ),
  "ftrl_power0": ("ftrl", {"learning_rate": 0.1, "learning_rate_power": 0.0, "initial_accumulator_value": 0.0}),
}


def _table(name, kw, clip, storage="float32"):
  okw = tuple(kw.items()) + ((("clip", clip),) if clip is not None else ())
  spec = TableSpec(name="t", dim=DIM, optimizer=name, optimizer_kwargs=okw, init_scale=0.1, storage_dtype=storage)
  return Table(spec, seed=3)


def _state(table, order):
  """The table's weights and slots (float32 numpy), rows in the order of the ids ``order``."""
  snap = table.snapshot()
  pos = np.argsort(snap["ids"])[np.searchsorted(np.sort(snap["ids"]), order)]
  assert (snap["ids"][pos] == order).all()
  return snap["weights"][pos], {k[5:]: v[pos] for k, v in snap.items() if k.startswith("slot_")}


def _batch(rng):
  """Ids of one batch: skewed over the vocabulary, so ids repeat and a few rows are never touched."""
  p = 1.0 / np.arange(1, VOCAB + 1) ** 1.2
  p[-3:] = 0.0  # the last three rows never get a gradient
  return rng.choice(VOCAB, size=BATCH, p=p / p.sum())


def _close(what, got, want, row_scaled=False):
  """|got - want| <= RTOL |want| + ATOL element-wise; with ``row_scaled``, + RTOL max|row| as well.

  Under jit XLA fuses ``a * b + c`` into one multiply-add, so the device and the PS differ by
  an ulp per operation. Where an element is a small difference of large terms (ftrl's
  ``z = z + g - sigma * w`` summing gradients of both signs), that ulp is of the terms, which
  are as large as the rest of the row: ``row_scaled`` measures the error against the row.
  """
  got, want = np.asarray(got, np.float32).astype(np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, what
  tol = RTOL * np.abs(want) + ATOL
  if row_scaled:
    tol = tol + RTOL * np.abs(want).max(axis=1, keepdims=True)
  err = np.abs(got - want) - tol
  i = np.unravel_index(np.argmax(err), err.shape)
  assert err[i] <= 0.0, f"{what}: at {i} got {got[i]!r}, want {want[i]!r} (|diff| {abs(got[i] - want[i]):.3g})"


def _run(name, kw, clip, storage="float32", seed=0):
  """Trains a Table and the device forms side by side; returns the final PS weights of the rows updated."""
  rng = np.random.default_rng(seed)
  table = _table(name, kw, clip, storage)
  ids = np.sort(rng.choice(np.iinfo(np.int64).max, size=VOCAB, replace=False).astype(np.uint64))
  table.lookup(ids)  # creates the rows (initial weights and slots)
  w0, s0 = _state(table, ids)
  opt = device_optimizers.make(name, clip=clip, **kw)
  wdtype = ml_dtypes.bfloat16 if storage == "bfloat16" else np.float32
  sparse = (jnp.asarray(w0.astype(wdtype)), {k: jnp.asarray(v) for k, v in s0.items()})
  masked = sparse
  sparse_fn, masked_fn = jax.jit(opt.apply_sparse), jax.jit(opt.apply_masked)
  t_max, ever = 0.0, np.zeros(VOCAB, bool)
  for step in range(STEPS):
    pos = _batch(rng)
    g = rng.normal(0.0, 1.0, (BATCH, DIM)).astype(np.float32)
    rows, inv = np.unique(pos, return_inverse=True)
    gsum = np.zeros((rows.shape[0], DIM), np.float32)
    np.add.at(gsum, inv, g)
    assert rows.shape[0] < BATCH  # ids repeat
    table.apply(ids[rows], gsum)
    ever[rows] = True

    # Padding of every kind, with large gradients that would show if they were applied, mixed in.
    pad = np.array([VOCAB, VOCAB + 3, 2**31 - 1, -1, -VOCAB] + [VOCAB] * (PAD - rows.shape[0] - 5), np.int32)
    idx = np.concatenate([rows.astype(np.int32), pad])
    gp = np.concatenate([gsum, rng.normal(50.0, 10.0, (pad.shape[0], DIM)).astype(np.float32)])
    perm = rng.permutation(PAD)
    sparse = sparse_fn(*sparse, jnp.asarray(idx[perm]), jnp.asarray(gp[perm]))

    touched = np.zeros(VOCAB, bool)
    touched[rows] = True
    g_full = rng.normal(50.0, 10.0, (VOCAB, DIM)).astype(np.float32)  # garbage on untouched rows
    g_full[rows] = gsum
    masked = masked_fn(*masked, jnp.asarray(touched), jnp.asarray(g_full))

    want_w, want_s = _state(table, ids)
    assert sorted(want_s) == sorted(opt.slot_widths)
    for form, (w, s) in (("sparse", sparse), ("masked", masked)):
      assert w.dtype == wdtype
      _close(f"{name} {form} step {step}: weights", w, want_w)
      for k in want_s:
        _close(f"{name} {form} step {step}: slot {k}", s[k], want_s[k], row_scaled=k == "linear")
    if "t" in want_s:
      t_max = float(want_s["t"].max())
  # The untouched rows are as they started, and (for adam) rows were updated several times.
  np.testing.assert_array_equal(np.asarray(sparse[0], np.float32)[-3:], w0[-3:])
  if name == "adam":
    assert t_max >= 4
  return want_w[ever]


@pytest.mark.parametrize("clip", [None, CLIP], ids=["noclip", "clip"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_device_update_matches_ps_table(config, clip):
  name, kw = CONFIGS[config]
  w = _run(name, kw, clip, seed=sorted(CONFIGS).index(config))
  if clip is not None:
    assert np.abs(w).max() <= np.float32(CLIP)
    assert (np.abs(w) == np.float32(CLIP)).sum() >= 3  # the bound was active, so clipping was tested


@pytest.mark.parametrize("config", ["adam", "ftrl_power"])
def test_bfloat16_rows_round_as_the_ps_does(config):
  name, kw = CONFIGS[config]
  _run(name, kw, None, storage="bfloat16", seed=11)


def test_names_hyperparameters_and_init_match_the_ps():
  assert device_optimizers.NAMES == optimizers.NAMES
  for name in optimizers.NAMES:
    ps_params = inspect.signature(optimizers._factory(name)).parameters
    dev_params = inspect.signature(device_optimizers._FACTORIES[name]).parameters
    assert [(k, p.default) for k, p in dev_params.items()] == [(k, p.default) for k, p in ps_params.items()], name
  for config, (name, kw) in CONFIGS.items():
    ps, dev = optimizers.make(name, **kw), device_optimizers.make(name, **kw)
    want, got = ps.init(7, 3), dev.init(7, 3)
    assert sorted(got) == sorted(want) == sorted(dev.slot_widths), config
    for k, v in want.items():
      assert got[k].dtype == jnp.float32 and got[k].shape == v.shape == (7, 3 if dev.slot_widths[k] else 1), config
      np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=f"{config} slot {k}")


def test_update_on_gathered_rows_matches_ps_update():
  """``update`` itself on rows with grown slots, eagerly and under jit, against the PS's numpy ``update``."""
  rng = np.random.default_rng(5)
  for config, (name, kw) in CONFIGS.items():
    for clip in (None, CLIP):
      ps, dev = optimizers.make(name, clip=clip, **kw), device_optimizers.make(name, clip=clip, **kw)
      w = rng.normal(0.0, 0.1, (6, DIM)).astype(np.float32)
      slots = ps.init(6, DIM)
      for _ in range(3):
        g = rng.normal(0.0, 1.0, (6, DIM)).astype(np.float32)
        want_w, want_s = ps.update(w, slots, g)
        for fn in (dev.update, jax.jit(dev.update)):
          got_w, got_s = fn(jnp.asarray(w), {k: jnp.asarray(v) for k, v in slots.items()}, jnp.asarray(g))
          _close(f"{config} clip={clip}", got_w, want_w)
          for k in want_s:
            _close(f"{config} clip={clip} slot {k}", got_s[k], want_s[k], row_scaled=k == "linear")
        w, slots = want_w, want_s


def test_bad_arguments_name_what_is_wrong():
  with pytest.raises(
    ValueError, match=r"'adamw'.*choose one of \['adagrad', 'adam', 'ftrl', 'rowwise_adagrad', 'sgd'\]"
  ):
    device_optimizers.make("adamw", learning_rate=0.1)
  with pytest.raises(ValueError, match=r"unknown argument\(s\) \['lr'\], missing \['learning_rate'\]"):
    device_optimizers.make("adam", lr=0.1)
  with pytest.raises(ValueError, match="clip must be a finite number > 0"):
    device_optimizers.make("sgd", clip=0.0, learning_rate=0.1)
  opt = device_optimizers.make("rowwise_adagrad", learning_rate=0.1)
  w, slots = jnp.zeros((4, 3)), opt.init(4, 3)
  with pytest.raises(ValueError, match=r"slot 'acc' has shape \(4, 3\), expected \(4, 1\)"):
    opt.apply_sparse(w, {"acc": jnp.zeros((4, 3))}, jnp.zeros(2, jnp.int32), jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match=r"idx \(2,\) and g \(2, 4\) must be \[n\] and \[n, 3\]"):
    opt.apply_sparse(w, slots, jnp.zeros(2, jnp.int32), jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match=r"touched \(3,\) .* must be \[4\]"):
    opt.apply_masked(w, slots, jnp.zeros(3, bool), jnp.zeros((4, 3)))
