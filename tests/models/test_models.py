"""Tests for the model zoo: each model against a float64 numpy reimplementation from its own
params, the interface every model shares (shapes, num_dense=0, gradients, logical axes,
linear terms), a short learning check, and the convention that finds them (a model added as
one module plus one config trains)."""

import ast
import glob
import importlib.util
import itertools
import math
import os
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from recsys_jax import models
from recsys_jax.models import LINEAR_SUFFIX, pool_sequences, split_linear
from recsys_jax.models.dcn_v2 import DCNv2
from recsys_jax.models.deepfm import DeepFM, fm_interaction
from recsys_jax.models.din import DIN
from recsys_jax.models.dlrm import DLRM, dot_interaction
from recsys_jax.models.dlrm import MLP as DlrmMLP
from recsys_jax.models.layers import MLP
from recsys_jax.models.wide_deep import WideDeep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

B = 6
KEY = jax.random.PRNGKey(0)


# ------------------------------------------------------------------------------------
# Helpers: inputs and float64 references.


def _emb(rng, dims, b=B):
  return {k: rng.normal(size=(b, d)).astype(np.float32) for k, d in dims.items()}


def _linear(rng, names, b=B):
  return {k + LINEAR_SUFFIX: rng.normal(size=(b, 1)).astype(np.float32) for k in names}


def _seq(rng, d, length=5, b=B):
  values = rng.normal(size=(b, length, d)).astype(np.float32)
  mask = rng.random((b, length)) < 0.6
  mask[0] = False  # one user with an empty history
  mask[1] = True  # and one with a full one
  return values, mask


def _init(model, *args):
  # One compiled init is much cheaper on CPU than running the initializers op by op.
  return nn.unbox(model.init(KEY, *args))


def _params(variables):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), nn.unbox(variables)["params"])


def _np_mlp(p, x, relu_last):
  n = len(p)
  for i in range(n):
    x = x @ p[f"dense_{i}"]["kernel"] + p[f"dense_{i}"]["bias"]
    if i < n - 1 or relu_last:
      x = np.maximum(x, 0)
  return x


def _np_concat(dense, emb):
  return np.concatenate([np.asarray(dense, np.float64)] + [np.asarray(emb[k], np.float64) for k in sorted(emb)], -1)


def _np_pool(values, mask):
  out = np.zeros((values.shape[0], values.shape[2]))
  for b in range(values.shape[0]):
    if mask[b].any():
      out[b] = values[b][mask[b]].astype(np.float64).mean(0)
  return out


# ------------------------------------------------------------------------------------
# layers


def test_pool_sequences_is_the_masked_mean():
  rng = np.random.default_rng(0)
  values, mask = _seq(rng, 4)
  values[~mask] = np.nan  # padding must not leak, whatever it holds
  emb = _emb(rng, {"a": 3})
  out = pool_sequences(emb, {"hist": (values, mask)})
  assert sorted(out) == ["a", "hist"]
  np.testing.assert_array_equal(out["a"], emb["a"])
  np.testing.assert_allclose(out["hist"], _np_pool(values, mask), rtol=1e-6)
  np.testing.assert_array_equal(out["hist"][0], 0.0)  # empty sequence
  assert pool_sequences(emb, None) == emb
  with pytest.raises(ValueError, match="'a'"):
    pool_sequences(emb, {"a": (values, mask)})


def test_split_linear():
  main, linear = split_linear({"a": 1, "a" + LINEAR_SUFFIX: 2, "b": 3})
  assert main == {"a": 1, "b": 3}
  assert linear == {"a": 2}


def test_mlp_is_reexported_from_dlrm():
  assert DlrmMLP is MLP


# ------------------------------------------------------------------------------------
# DLRM


def _np_dlrm(p, dense, emb):
  x = _np_mlp(p["bottom"], np.asarray(dense, np.float64), relu_last=True)
  t = np.stack([x] + [np.asarray(emb[k], np.float64) for k in sorted(emb)], axis=1)
  z = np.einsum("bfd,bgd->bfg", t, t)
  i, j = np.triu_indices(t.shape[1], k=1)
  return _np_mlp(p["top"], np.concatenate([x, z[:, i, j]], -1), relu_last=False)[:, 0]


def test_dlrm_matches_reference_and_pools_sequences():
  rng = np.random.default_rng(1)
  dense, emb = rng.normal(size=(B, 4)).astype(np.float32), _emb(rng, {"z": 8, "a": 8, "m": 8})
  model = DLRM(bottom=(16, 8), top=(12,))
  variables = _init(model, dense, emb)
  out = model.apply(variables, dense, emb)
  np.testing.assert_allclose(out, _np_dlrm(_params(variables), dense, emb), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(out, model.apply(variables, dense, emb, None))

  seq = _seq(rng, 8)
  with_seq = model.apply(variables, dense, {k: emb[k] for k in ("a", "m")}, {"z": seq})
  pooled = dict(emb, z=_np_pool(*seq).astype(np.float32))
  np.testing.assert_allclose(with_seq, _np_dlrm(_params(variables), dense, pooled), rtol=1e-5, atol=1e-6)


def _np_dot_interaction(t, cot):
  """Pair dot products and, for the cotangent ``cot`` of them, t's gradient, in float64 loops."""
  t, cot = np.asarray(t, np.float64), np.asarray(cot, np.float64)
  i, j = np.triu_indices(t.shape[1], k=1)
  out, grad = np.zeros((t.shape[0], len(i))), np.zeros_like(t)
  for p, (a, b) in enumerate(zip(i, j)):
    out[:, p] = (t[:, a] * t[:, b]).sum(-1)
    grad[:, a] += cot[:, p, None] * t[:, b]
    grad[:, b] += cot[:, p, None] * t[:, a]
  return out, grad


@pytest.mark.parametrize("shape", [(6, 4, 3), (33, 27, 16), (2, 2, 5), (3, 1, 4)])
def test_dot_interaction_and_its_gradient_match_float64(shape):
  rng = np.random.default_rng(shape[1])
  t = rng.normal(size=shape).astype(np.float32)
  n = shape[1] * (shape[1] - 1) // 2
  cot = rng.normal(size=(shape[0], n)).astype(np.float32)
  out, vjp = jax.vjp(jax.jit(dot_interaction), t)
  want_out, want_grad = _np_dot_interaction(t, cot)
  assert out.shape == (shape[0], n)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(vjp(cot)[0], want_grad, rtol=1e-5, atol=1e-5)
  # The autodiff formulation it replaced (experiments/bench_step.py times both) agrees to round-off.
  i, j = np.triu_indices(shape[1], k=1)
  _, old_vjp = jax.vjp(lambda x: jnp.einsum("bfd,bgd->bfg", x, x)[:, i, j], t)
  np.testing.assert_allclose(vjp(cot)[0], old_vjp(cot)[0], rtol=1e-5, atol=1e-5)


def test_dlrm_names_unequal_widths():
  rng = np.random.default_rng(2)
  with pytest.raises(ValueError, match=r"'b': 4"):
    _init(DLRM(bottom=(8,)), np.zeros((B, 2), np.float32), _emb(rng, {"a": 8, "b": 4}))


# ------------------------------------------------------------------------------------
# DCN-v2


def _np_dcn(p, dense, emb, low_rank, structure):
  x0 = _np_concat(dense, emb)
  x = x0
  for i in range(len(p["cross"]) // (2 if low_rank else 1)):
    c = p["cross"]
    if low_rank:
      h = (x @ c[f"v_{i}"]["kernel"]) @ c[f"u_{i}"]["kernel"] + c[f"u_{i}"]["bias"]
    else:
      h = x @ c[f"w_{i}"]["kernel"] + c[f"w_{i}"]["bias"]
    x = x0 * h + x
  if structure == "stacked":
    h = _np_mlp(p["deep"], x, relu_last=True)
  else:
    h = np.concatenate([x, _np_mlp(p["deep"], x0, relu_last=True)], -1)
  return (h @ p["logit"]["kernel"] + p["logit"]["bias"])[:, 0]


@pytest.mark.parametrize("low_rank,structure", itertools.product([0, 3], ["stacked", "parallel"]))
def test_dcn_matches_numpy(low_rank, structure):
  rng = np.random.default_rng(3)
  dense, emb = rng.normal(size=(B, 3)).astype(np.float32), _emb(rng, {"b": 4, "a": 6})
  model = DCNv2(num_cross=2, low_rank=low_rank, structure=structure, deep=(16, 8))
  variables = _init(model, dense, emb)
  # Nonzero cross biases, so a mistake in where the bias goes shows.
  variables = jax.tree.map(lambda x: x + 0.1 if x.ndim == 1 else x, variables)
  p = _params(variables)
  d = 3 + 4 + 6
  if low_rank:
    assert sorted(p["cross"]) == ["u_0", "u_1", "v_0", "v_1"]
    assert p["cross"]["v_0"]["kernel"].shape == (d, 3) and "bias" not in p["cross"]["v_0"]
    assert p["cross"]["u_0"]["kernel"].shape == (3, d) and p["cross"]["u_0"]["bias"].shape == (d,)
  else:
    assert sorted(p["cross"]) == ["w_0", "w_1"]
    assert p["cross"]["w_0"]["kernel"].shape == (d, d)
  # Stacked, the logit reads the deep output; parallel, the cross output beside it.
  assert p["logit"]["kernel"].shape == ((8,) if structure == "stacked" else (d + 8,)) + (1,)
  out = model.apply(variables, dense, emb)
  np.testing.assert_allclose(out, _np_dcn(p, dense, emb, low_rank, structure), rtol=1e-5, atol=1e-6)


def test_dcn_rejects_unknown_structure():
  with pytest.raises(ValueError, match="structure"):
    _init(DCNv2(structure="mixed"), np.zeros((B, 2), np.float32), {})


# ------------------------------------------------------------------------------------
# DeepFM


def _np_fm(fields):
  """Brute force: sum over every pair of fields of their inner product."""
  f = np.asarray(fields, np.float64)
  return sum((f[:, i] * f[:, j]).sum(-1) for i in range(f.shape[1]) for j in range(i + 1, f.shape[1]))


def test_fm_interaction_is_the_pairwise_sum():
  fields = np.random.default_rng(4).normal(size=(B, 5, 4)).astype(np.float32)
  np.testing.assert_allclose(fm_interaction(fields), _np_fm(fields), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_dense", [3, 0])
def test_deepfm_is_first_order_plus_fm_plus_deep(num_dense):
  rng = np.random.default_rng(5)
  dense, emb = rng.normal(size=(B, num_dense)).astype(np.float32), _emb(rng, {"b": 4, "a": 4, "c": 4})
  lin = _linear(rng, emb)
  model = DeepFM(deep=(16,))
  variables = _init(model, dense, dict(emb, **lin))
  variables = jax.tree.map(lambda x: x + 0.1 if x.ndim == 1 else x, variables)
  p = _params(variables)
  assert ("dense_field" in p) == (num_dense > 0)

  d64 = np.asarray(dense, np.float64)
  first = (d64 @ p["linear_dense"]["kernel"] + p["linear_dense"]["bias"])[:, 0] + sum(
    np.asarray(v, np.float64)[:, 0] for v in lin.values()
  )
  fields = [np.asarray(emb[k], np.float64) for k in emb]
  if num_dense:
    fields.append(d64 @ p["dense_field"]["kernel"])
  second = _np_fm(np.stack(fields, 1))
  deep = _np_mlp(p["deep"], _np_concat(dense, emb), relu_last=False)[:, 0]
  out = model.apply(variables, dense, dict(emb, **lin))
  np.testing.assert_allclose(out, first + second + deep, rtol=1e-5, atol=1e-5)


def test_deepfm_names_unequal_widths():
  rng = np.random.default_rng(6)
  emb = _emb(rng, {"a": 4, "b": 6})
  with pytest.raises(ValueError, match=r"'b': 6"):
    _init(DeepFM(), np.zeros((B, 2), np.float32), dict(emb, **_linear(rng, emb)))


# ------------------------------------------------------------------------------------
# Wide & Deep


def test_wide_deep_logit_minus_deep_is_the_wide_part():
  rng = np.random.default_rng(7)
  dense, emb = rng.normal(size=(B, 3)).astype(np.float32), _emb(rng, {"a": 4, "b": 2})
  lin = _linear(rng, emb)
  model = WideDeep(deep=(16,))
  variables = _init(model, dense, dict(emb, **lin))
  variables = jax.tree.map(lambda x: x + 0.1 if x.ndim == 1 else x, variables)
  p = _params(variables)
  out = np.asarray(model.apply(variables, dense, dict(emb, **lin)), np.float64)
  deep = _np_mlp(p["deep"], _np_concat(dense, emb), relu_last=False)[:, 0]
  wide = (np.asarray(dense, np.float64) @ p["wide_dense"]["kernel"] + p["wide_dense"]["bias"])[:, 0]
  wide += lin["a" + LINEAR_SUFFIX][:, 0] + lin["b" + LINEAR_SUFFIX][:, 0]
  np.testing.assert_allclose(out - deep, wide, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [DeepFM, WideDeep])
def test_linear_models_need_their_linear_terms(cls):
  assert cls.linear_terms
  rng = np.random.default_rng(8)
  dense, emb = np.zeros((B, 2), np.float32), _emb(rng, {"a": 4, "b": 4})
  with pytest.raises(ValueError, match="b" + LINEAR_SUFFIX):
    _init(cls(), dense, dict(emb, **_linear(rng, ["a"])))
  with pytest.raises(ValueError, match="c" + LINEAR_SUFFIX):
    _init(cls(), dense, dict(emb, **_linear(rng, ["a", "b", "c"])))


def test_other_models_take_no_linear_terms():
  assert not any(models.get(name).linear_terms for name in models.names() if name not in ("deepfm", "wide_deep"))


# ------------------------------------------------------------------------------------
# DIN


def _din_inputs(rng, num_dense=2):
  dense = rng.normal(size=(B, num_dense)).astype(np.float32)
  emb = _emb(rng, {"movie": 4, "user": 3})
  seqs = {"history": _seq(rng, 4, length=6), "genres": _seq(rng, 2, length=3)}
  return dense, emb, seqs


def _np_din(p, dense, emb, seqs):
  values, mask = seqs["history"]
  values = np.where(mask[..., None], values.astype(np.float64), 0)
  pooled = dict(emb, genres=_np_pool(*seqs["genres"]))
  t = np.broadcast_to(np.asarray(emb["movie"], np.float64)[:, None], values.shape)
  a = np.concatenate([values, t, values - t, values * t], -1)
  w = np.where(mask, _np_mlp(p["attention"]["mlp"], a, relu_last=False)[..., 0], 0)
  interest = (w[..., None] * values).sum(1)
  x = np.concatenate([_np_concat(dense, pooled), interest], -1)
  return _np_mlp(p["mlp"], x, relu_last=False)[:, 0], w


def test_din_matches_numpy():
  rng = np.random.default_rng(9)
  dense, emb, seqs = _din_inputs(rng)
  model = DIN(target="movie", history="history", attention=(8,), mlp=(16,))
  variables = _init(model, dense, emb, seqs)
  variables = jax.tree.map(lambda x: x + 0.1 if x.ndim == 1 else x, variables)
  p = _params(variables)
  want, want_w = _np_din(p, dense, emb, seqs)
  np.testing.assert_allclose(model.apply(variables, dense, emb, seqs), want, rtol=1e-5, atol=1e-6)

  from recsys_jax.models.din import AttentionUnit

  values, mask = seqs["history"]
  w = AttentionUnit((8,)).apply(
    {"params": variables["params"]["attention"]}, values * mask[..., None], emb["movie"], mask
  )
  np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(w)[~mask] == 0) and np.any(np.asarray(w)[mask] != 0)


def test_din_padding_never_reaches_the_output():
  rng = np.random.default_rng(10)
  dense, emb, seqs = _din_inputs(rng)
  model = DIN(target="movie", history="history", attention=(8,), mlp=(16,))
  variables = _init(model, dense, emb, seqs)
  out = model.apply(variables, dense, emb, seqs)

  values, mask = seqs["history"]
  noisy = np.where(mask[..., None], values, rng.normal(size=values.shape) * 100).astype(np.float32)
  noisy[0, 0, 0], noisy[0, 1, 1] = np.inf, np.nan  # row 0 is all padding
  np.testing.assert_array_equal(model.apply(variables, dense, emb, dict(seqs, history=(noisy, mask))), out)

  b, j = 2, int(np.argmax(mask[2]))
  changed = values.copy()
  changed[b, j] += 1.0
  moved = np.asarray(model.apply(variables, dense, emb, dict(seqs, history=(changed, mask))))
  assert moved[b] != out[b]
  np.testing.assert_array_equal(np.delete(moved, b), np.delete(np.asarray(out), b))


def test_din_without_history_ignores_it():
  rng = np.random.default_rng(11)
  dense, emb, seqs = _din_inputs(rng)
  model = DIN(target="movie", history="history", use_history=False, attention=(8,), mlp=(16,))
  variables = _init(model, dense, emb, seqs)
  assert "attention" not in variables["params"]
  out = model.apply(variables, dense, emb, seqs)
  values, mask = seqs["history"]
  other = (rng.normal(size=values.shape).astype(np.float32), ~mask)
  np.testing.assert_array_equal(model.apply(variables, dense, emb, dict(seqs, history=other)), out)
  np.testing.assert_array_equal(model.apply(variables, dense, emb, {"genres": seqs["genres"]}), out)


def test_din_names_missing_features():
  rng = np.random.default_rng(12)
  dense, emb, seqs = _din_inputs(rng)
  with pytest.raises(ValueError, match="'item'"):
    _init(DIN(target="item", history="history"), dense, emb, seqs)
  with pytest.raises(ValueError, match="'clicks'"):
    _init(DIN(target="movie", history="clicks"), dense, emb, seqs)
  with pytest.raises(ValueError, match="width"):
    _init(DIN(target="user", history="history"), dense, emb, seqs)


# ------------------------------------------------------------------------------------
# Every model: the shared interface.

SMALL = {  # small widths; a model not here is tested with its defaults
  "dlrm": dict(bottom=(8, 4), top=(16,)),
  "dcn_v2": dict(num_cross=2, low_rank=2, deep=(16,)),
  "deepfm": dict(deep=(16,)),
  "wide_deep": dict(deep=(16,)),
  "din": dict(target="movie", history="history", attention=(8,), mlp=(16,)),
}
EQUAL_DIMS = ("dlrm", "deepfm")


def _model_inputs(name, rng, num_dense, b=B):
  dims = {"movie": 4, "user": 4, "site": 4} if name in EQUAL_DIMS else {"movie": 4, "user": 3, "site": 5}
  dense = rng.normal(size=(b, num_dense)).astype(np.float32)
  emb = _emb(rng, dims, b)
  if models.get(name).linear_terms:
    emb.update(_linear(rng, dims, b))
  seqs = {"history": _seq(rng, 4, b=b)}
  return dense, emb, seqs


def test_every_model_is_found_by_the_convention():
  """The models are the package's modules that assign MODEL at top level (read here from their
  source, not imported), each the class its module defines; each has small test arguments, and
  every config in configs/ names one of them."""
  home = os.path.join(ROOT, "recsys_jax", "models")
  declare = []
  for path in glob.glob(os.path.join(home, "*.py")):
    tree = ast.parse(open(path, encoding="utf-8").read())
    if any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "MODEL" for t in n.targets) for n in tree.body):
      declare.append(os.path.basename(path)[:-3])
  assert models.names() == sorted(declare) and "layers" not in declare
  for name in models.names():
    cls = models.get(name)
    assert issubclass(cls, nn.Module) and cls.__module__ == f"recsys_jax.models.{name}"
  assert set(SMALL) <= set(models.names())
  for path in glob.glob(os.path.join(ROOT, "configs", "*.py")):
    spec = importlib.util.spec_from_file_location("_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "get_config"):
      assert module.get_config().model.name in models.names(), path


@pytest.mark.parametrize("name", ["dcn", "layers", "__init__", "../dlrm", "dlrm.py", ""])
def test_an_unknown_model_is_one_line_naming_the_models(name):
  from configs import tiny
  from recsys_jax.training.validation import validate_config

  want = f"unknown model {name!r}; choose one of ['dcn_v2', 'deepfm', 'din', 'dlrm', 'wide_deep']"
  with pytest.raises(ValueError) as e:
    models.get(name)
  assert str(e.value) == want
  c = tiny.get_config()
  c.model.name = name
  with pytest.raises(ValueError) as e:
    validate_config(c)
  assert str(e.value) == (
    f"config.model.name = {name!r}: unknown model; choose one of ['dcn_v2', 'deepfm', 'din', 'dlrm', 'wide_deep']"
  )


def test_model_arguments_are_the_dataclass_fields_with_their_types():
  from typing import Sequence

  assert models.arguments("dcn_v2") == {
    "num_cross": models.Argument(int, 3),
    "low_rank": models.Argument(int, 0),
    "structure": models.Argument(str, "stacked"),
    "deep": models.Argument(Sequence[int], (256, 128)),
  }
  import dataclasses

  din = models.arguments("din")
  assert din["target"] == models.Argument(str, dataclasses.MISSING) and din["use_history"] == models.Argument(
    bool, True
  )


@pytest.mark.parametrize(
  "name, kwargs, error",
  [
    ("dlrm", {"bottom": (16, 0)}, r"config\.model\.kwargs\.bottom = \(16, 0\): must be a tuple of positive integers"),
    ("dlrm", {"bottom": None}, r"config\.model\.kwargs\.bottom = None: must be a tuple of positive integers"),
    (
      "dlrm",
      {"bogus": 1},
      r"config\.model\.kwargs\.bogus: model 'dlrm' takes no such argument; it takes \['bottom', 'top'\]",
    ),
    ("dcn_v2", {"num_cross": -1}, r"config\.model\.kwargs\.num_cross = -1: must be an integer >= 0"),
    ("dcn_v2", {"num_cross": True}, r"config\.model\.kwargs\.num_cross = True: must be an integer >= 0"),
    ("dcn_v2", {"structure": 3}, r"config\.model\.kwargs\.structure = 3: must be a string"),
    (
      "din",
      {"target": "cat_00", "history": "cat_01", "use_history": 1},
      r"config\.model\.kwargs\.use_history = 1: must be True or False",
    ),
    ("din", {"history": "cat_01"}, r"config\.model\.kwargs\.target: model 'din' needs it \(it has no default\)"),
  ],
)
def test_model_kwargs_are_checked_against_the_field_types(tiny_config, name, kwargs, error):
  from recsys_jax.training.validation import validate_config

  tiny_config.model.name = name
  tiny_config.model.kwargs = kwargs
  with pytest.raises(ValueError, match=f"^{error}$"):
    validate_config(tiny_config)


@pytest.mark.parametrize("name,num_dense", itertools.product(models.names(), [3, 0]))
def test_every_model_interface(name, num_dense):
  rng = np.random.default_rng(13)
  model = models.get(name)(**SMALL.get(name, {}))
  dense, emb, seqs = _model_inputs(name, rng, num_dense)

  boxed = jax.eval_shape(model.init, KEY, dense, emb, seqs)
  assert list(boxed) == ["params"]
  leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
  assert all(len(x.names) == x.value.ndim and set(x.names) <= {"embed", "mlp"} for x in leaves)

  params = _init(model, dense, emb, seqs)["params"]
  out = model.apply({"params": params}, dense, emb, seqs)
  assert out.shape == (B,) and out.dtype == jnp.float32 and np.all(np.isfinite(out))

  def total(emb, seq_values):
    s = {k: (seq_values[k], seqs[k][1]) for k in seqs}
    return model.apply({"params": params}, dense, emb, s).sum()

  g_emb, g_seq = jax.jit(jax.grad(total, argnums=(0, 1)))(emb, {k: v for k, (v, _) in seqs.items()})
  for k, g in itertools.chain(g_emb.items(), g_seq.items()):
    assert np.any(np.asarray(g) != 0), f"{name}: no gradient reaches {k}"
  values, mask = seqs["history"]
  np.testing.assert_array_equal(np.asarray(g_seq["history"])[~mask], 0)


@pytest.mark.parametrize("name", models.names())
def test_every_model_learns_a_teacher(name):
  """200 Adam steps on fixed inputs with labels from a random nonlinear teacher."""
  rng = np.random.default_rng(14)
  n = 128
  model = models.get(name)(**SMALL.get(name, {}))
  dense, emb, seqs = _model_inputs(name, rng, 3, b=n)
  x = _np_concat(dense, pool_sequences(split_linear(emb)[0], seqs))
  w1, w2 = rng.normal(size=(x.shape[1], 8)), rng.normal(size=8)
  labels = (np.tanh(x @ w1) @ w2 > 0).astype(np.float32)

  tx = optax.adam(1e-2)

  def loss_fn(params):
    return optax.sigmoid_binary_cross_entropy(model.apply({"params": params}, dense, emb, seqs), labels).mean()

  def body(carry, _):
    params, opt = carry
    loss, g = jax.value_and_grad(loss_fn)(params)
    updates, opt = tx.update(g, opt, params)
    return (optax.apply_updates(params, updates), opt), loss

  @jax.jit  # init and all the steps in one compile: the cheapest way through on CPU
  def train():
    params = nn.unbox(model.init(KEY, dense, emb, seqs))["params"]
    (params, _), losses = jax.lax.scan(body, (params, tx.init(params)), None, length=200)
    return losses[0], loss_fn(params)

  first, final = train()
  assert final < 0.2 * first, (float(first), float(final))


# ------------------------------------------------------------------------------------
# A model added as one module plus one config: docs/models.md's example, trained.


def _docs_block(path):
  """The code block under `path`: in docs/models.md (the page's example is the one tested)."""
  text = open(os.path.join(ROOT, "docs", "models.md"), encoding="utf-8").read()
  return re.search(f"`{re.escape(path)}`:\n\n```python\n(.*?)```", text, re.S).group(1)


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
  """A directory on the models' search path (RECSYS_JAX_MODELS_PATH), not in the package."""
  d = tmp_path / "models"
  d.mkdir()
  before = models.names()
  monkeypatch.setenv(models.PATH_VARIABLE, str(d))
  yield d
  monkeypatch.delenv(models.PATH_VARIABLE)
  for m in [m for m in sys.modules if m.startswith("recsys_jax.models.") and str(d) in str(sys.modules[m].__file__)]:
    del sys.modules[m]
  assert models.names() == before  # gone with the variable


def test_a_model_added_as_one_module_trains(models_dir, tmp_path):
  from recsys_jax import train
  from recsys_jax.training.validation import validate_config

  (models_dir / "logreg.py").write_text(_docs_block("recsys_jax/models/logreg.py"))
  (tmp_path / "logreg_config.py").write_text(_docs_block("configs/logreg.py"))
  assert len(_docs_block("recsys_jax/models/logreg.py").splitlines()) <= 25
  spec = importlib.util.spec_from_file_location("logreg_config", tmp_path / "logreg_config.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  assert "logreg" in models.names() and models.get("logreg").__name__ == "LogReg"
  assert models.arguments("logreg") == {"temperature": models.Argument(float, 1.0)}

  c.num_steps, c.log_every, c.eval_samples, c.eval_batch_size = 4, 1, 512, 512
  losses = []
  record = lambda step, kind, values: kind == "train" and losses.append(values["loss"])  # noqa: E731
  summary = train.train_and_evaluate(c, str(tmp_path / "run"), on_metrics=record)
  assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
  assert summary["model"] == "logreg" and math.isfinite(summary["logloss"])
  # Its parameters are the trained model's: one linear layer over 8 pooled features of width 8 and 13 dense.
  params = train.build_job(c, str(tmp_path / "run")).state.params
  shapes = jax.tree_util.tree_map(lambda x: x.shape, params)
  assert shapes == {"logit": {"bias": (1,), "kernel": (c.data.num_dense + 8 * c.embeddings.dim, 1)}}, shapes

  # Its float field is checked as one (an annotation the old string match did not list).
  c.model.kwargs.temperature = float("nan")
  with pytest.raises(ValueError, match=r"^config\.model\.kwargs\.temperature = nan: must be a finite number$"):
    validate_config(c)


TYPED = """
from typing import Callable, Optional, Sequence, Tuple

import flax.linen as nn


class Typed(nn.Module):
  i: int = 1
  f: float = 1.0
  b: bool = True
  s: str = "x"
  widths: Sequence[int] = (1,)
  names: Sequence[str] = ("a",)
  maybe: Optional[int] = None
  fixed: Tuple[int, ...] = (1,)
  table: dict = None
  fn: Callable = None


MODEL = Typed
"""


@pytest.mark.parametrize(
  "field, bad, what",
  [
    ("i", 2**31, "an integer >= 0"),
    ("f", float("inf"), "a finite number"),
    ("b", 0, "True or False"),
    ("s", 1, "a string"),
    ("widths", (1, -2), "a tuple of positive integers"),
    ("names", ("a", 1), "a tuple of strings"),
    ("maybe", "x", "None or an integer >= 0"),
    ("fixed", (1.5,), "a tuple of positive integers"),
    ("table", {"a": 1}, "of type dict, which a config cannot give"),
    ("fn", None, "of type typing.Callable, which a config cannot give"),
  ],
)
def test_every_field_type_is_checked(models_dir, tiny_config, field, bad, what):
  """Each annotation a model's field may have: a good value passes, a bad one is refused naming the type."""
  from recsys_jax.training.validation import validate_config

  (models_dir / "typed.py").write_text(TYPED)
  tiny_config.model.name = "typed"
  good = dict(i=0, f=2, b=False, s="y", widths=[3, 4], names=("p", "q"), maybe=None, fixed=(2,))
  tiny_config.model.kwargs = good
  validate_config(tiny_config)
  tiny_config.model.kwargs = {field: bad}
  with pytest.raises(
    ValueError, match=f"^config\\.model\\.kwargs\\.{field} = {re.escape(repr(bad))}: must be {re.escape(what)}$"
  ):
    validate_config(tiny_config)
