"""Row-wise sparse optimizers for the parameter server, as pure numpy functions.

Each factory (``sgd``, ``adagrad``, ``rowwise_adagrad``, ``adam``, ``ftrl``) returns a
``RowOptimizer`` (``row_optimizer``, re-exported here with ``FusedUpdate`` and ``clipped``):
a pure numpy ``update`` and the in-place ``fused`` form that runs the ``kernels``, equal to
the bit. ``make`` builds one by name, with its hyper-parameters checked.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from recsys_jax.async_ps import kernels
from recsys_jax.async_ps.optim.row_optimizer import FusedUpdate, RowOptimizer, Slots, clipped, hyper, nonneg

__all__ = [
  "Slots",
  "RowOptimizer",
  "FusedUpdate",
  "clipped",
  "sgd",
  "adagrad",
  "rowwise_adagrad",
  "adam",
  "ftrl",
  "NAMES",
  "hyperparameters",
  "make",
]


def _f32(x: np.ndarray) -> np.ndarray:
  """``x`` as float32 (no copy when it already is)."""
  return np.asarray(x, np.float32)


def sgd(learning_rate: float) -> RowOptimizer:
  """Plain SGD: w <- w - lr * g. No state.

  Args:
    learning_rate: the step size (>= 0).

  Returns:
    A ``RowOptimizer``.
  """
  nonneg("sgd", "learning_rate", learning_rate)

  def init(num_rows: int, dim: int) -> Slots:
    del num_rows, dim
    return {}

  def update(w, slots, g):
    return w - np.float32(learning_rate) * g, slots

  lr = np.float32(learning_rate)

  def apply(w, slots, rows, g, clip):
    return kernels.sgd_apply(w, rows, g, lr, clip)

  return RowOptimizer(init, update, FusedUpdate(apply, {}))


def adagrad(learning_rate: float, initial_accumulator_value: float = 0.0, eps: float = 1e-8) -> RowOptimizer:
  """Element-wise Adagrad: acc <- acc + g^2; w <- w - lr * g / (sqrt(acc) + eps).

  Args:
    learning_rate: the step size (>= 0).
    initial_accumulator_value: the value ``acc`` starts from for a new row (>= 0).
    eps: added to the denominator for stability (>= 0).

  Returns:
    A ``RowOptimizer`` with one slot, ``acc``, shaped like the rows.
  """
  nonneg("adagrad", "learning_rate", learning_rate)
  nonneg("adagrad", "initial_accumulator_value", initial_accumulator_value)
  nonneg("adagrad", "eps", eps)
  lr, eps32, acc0 = np.float32(learning_rate), np.float32(eps), np.float32(initial_accumulator_value)

  def init(num_rows: int, dim: int) -> Slots:
    return {"acc": np.full((num_rows, dim), acc0, np.float32)}

  def update(w, slots, g):
    acc = slots["acc"] + g * g
    return w - lr * g / (np.sqrt(acc) + eps32), {"acc": acc}

  def apply(w, slots, rows, g, clip):
    return kernels.adagrad_apply(w, slots["acc"], rows, g, lr, eps32, clip)

  return RowOptimizer(init, update, FusedUpdate(apply, {"acc": True}))


def rowwise_adagrad(learning_rate: float, initial_accumulator_value: float = 0.0, eps: float = 1e-8) -> RowOptimizer:
  """Row-wise Adagrad (FBGEMM / TorchRec ``EXACT_ROWWISE_ADAGRAD``): one accumulator per row.

  For a row ``w`` of width ``D`` with gradient ``g``::

    acc <- acc + (1 / D) * sum_j g_j^2
    w   <- w - lr * g / (sqrt(acc) + eps)

  The state is ``D`` times smaller than element-wise Adagrad's.

  Args:
    learning_rate: the step size (>= 0).
    initial_accumulator_value: the value ``acc`` starts from for a new row (>= 0).
    eps: added to the denominator for stability (>= 0).

  Returns:
    A ``RowOptimizer`` with one slot, ``acc``, of shape ``[num_rows, 1]``.
  """
  name = "rowwise_adagrad"
  lr = np.float32(nonneg(name, "learning_rate", learning_rate))
  acc0 = np.float32(nonneg(name, "initial_accumulator_value", initial_accumulator_value))
  eps32 = np.float32(nonneg(name, "eps", eps))

  def init(num_rows: int, dim: int) -> Slots:
    del dim
    return {"acc": np.full((num_rows, 1), acc0, np.float32)}

  def update(w, slots, g):
    w, g = _f32(w), _f32(g)
    acc = _f32(slots["acc"]) + np.mean(g * g, axis=1, keepdims=True, dtype=np.float32)
    return w - lr * g / (np.sqrt(acc) + eps32), {"acc": acc}

  def apply(w, slots, rows, g, clip):
    return kernels.rowwise_adagrad_apply(w, slots["acc"], rows, g, lr, eps32, clip)

  return RowOptimizer(init, update, FusedUpdate(apply, {"acc": False}))


def _one_minus_pow(b: np.float32, t: np.ndarray) -> np.ndarray:
  """``1 - b**t`` in float32 for b in [0, 1) and t >= 1, as ``-expm1(t * log(b))``.

  ``1 - b**t`` computed directly in float32 cancels (for b = 0.999 and small t it is off by
  ~1e-5 relative); the ``expm1`` form keeps full float32 accuracy.
  """
  log_b = np.float32(math.log(float(b))) if b > 0.0 else np.float32(-np.inf)
  return -np.expm1(t * log_b)


def adam(learning_rate: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> RowOptimizer:
  """Adam with a per-row step count, so sparse rows get their own bias correction.

  For a row ``w`` with gradient ``g`` (element-wise; ``t`` is one number per row)::

    t <- t + 1
    m <- b1 * m + (1 - b1) * g
    v <- b2 * v + (1 - b2) * g^2
    w <- w - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

  This is ``optax.adam`` (with ``eps_root=0``) except that ``t`` counts the updates this row
  received rather than the global step: a row seen for the first time at step 1000 is
  bias-corrected with t = 1, as if it had its own optimizer. ``t`` is stored as float32, so it
  counts exactly up to 2^24 updates per row (by then the bias correction is 1 anyway).

  In float32, ``b1`` and ``b2`` are rounded once and ``1 - b`` and ``1 - b^t`` are computed
  from the rounded values without cancellation, so the moment weights sum exactly to the bias
  correction: a constant gradient gives ``m_hat = g`` and ``v_hat = g^2`` to float32 accuracy.

  Args:
    learning_rate: the step size (>= 0).
    b1: decay of the first moment, in [0, 1).
    b2: decay of the second moment, in [0, 1).
    eps: added to the denominator for stability (>= 0).

  Returns:
    A ``RowOptimizer`` with slots ``m`` and ``v`` shaped like the rows, and ``t`` of shape
    ``[num_rows, 1]``.
  """
  lr = np.float32(nonneg("adam", "learning_rate", learning_rate))
  b1 = hyper("adam", "b1", b1, lambda x: 0.0 <= x < 1.0, "in [0, 1)")
  b2 = hyper("adam", "b2", b2, lambda x: 0.0 <= x < 1.0, "in [0, 1)")
  eps32 = np.float32(nonneg("adam", "eps", eps))
  b1_32, b2_32 = np.float32(b1), np.float32(b2)
  c1, c2 = np.float32(1.0) - b1_32, np.float32(1.0) - b2_32  # exact for b in [0.5, 1)

  def init(num_rows: int, dim: int) -> Slots:
    return {
      "m": np.zeros((num_rows, dim), np.float32),
      "v": np.zeros((num_rows, dim), np.float32),
      "t": np.zeros((num_rows, 1), np.float32),
    }

  def update(w, slots, g):
    w, g = _f32(w), _f32(g)
    t = _f32(slots["t"]) + np.float32(1.0)
    m = b1_32 * _f32(slots["m"]) + c1 * g
    v = b2_32 * _f32(slots["v"]) + c2 * (g * g)
    m_hat = m / _one_minus_pow(b1_32, t)
    v_hat = v / _one_minus_pow(b2_32, t)
    return w - lr * m_hat / (np.sqrt(v_hat) + eps32), {"m": m, "v": v, "t": t}

  def apply(w, slots, rows, g, clip):
    # The bias corrections by numpy's expm1, as in ``update`` (one number per row). Rows out
    # of range are clamped here only to gather something; the kernel refuses them unwritten.
    t = slots["t"][np.clip(rows, 0, w.shape[0] - 1), 0] + np.float32(1.0)
    bc1, bc2 = _one_minus_pow(b1_32, t), _one_minus_pow(b2_32, t)
    return kernels.adam_apply(
      w, slots["m"], slots["v"], slots["t"], rows, g, bc1, bc2, lr, b1_32, b2_32, c1, c2, eps32, clip
    )

  return RowOptimizer(init, update, FusedUpdate(apply, {"m": True, "v": True, "t": False}))


def ftrl(
  learning_rate: float,
  learning_rate_power: float = -0.5,
  l1: float = 0.0,
  l2: float = 0.0,
  initial_accumulator_value: float = 0.1,
  beta: float = 0.0,
) -> RowOptimizer:
  """FTRL-Proximal (McMahan et al. 2013), with the update of ``tf.keras.optimizers.Ftrl``.

  Element-wise, with ``p = -learning_rate_power`` (so p = 0.5 by default) and ``lr`` the
  learning rate, for a weight ``w`` with gradient ``g``, accumulator ``n`` and linear term
  ``z``::

    n_new = n + g^2
    sigma = (n_new^p - n^p) / lr
    z    <- z + g - sigma * w
    q     = (beta + n_new^p) / lr + 2 * l2
    w    <- (sign(z) * l1 - z) / q   if |z| > l1,   else 0
    n    <- n_new

  With p = 0.5 and ``l2`` replaced by ``l2 / 2`` this is the per-coordinate algorithm of
  McMahan et al. (alpha = lr); like TensorFlow, ``l2`` here enters the denominator as
  ``2 * l2``. ``x^p`` is ``sqrt(x)`` for p = 0.5. From w = 0 with l1 = l2 = beta = 0, FTRL is
  Adagrad (p = 0.5, eps = 0) or SGD (p = 0). TensorFlow's ``l2_shrinkage_regularization_strength``
  is not supported.

  Args:
    learning_rate: the step size ``lr`` (> 0).
    learning_rate_power: ``-p``, <= 0 (-0.5: the usual 1/sqrt(n) schedule; 0: constant).
    l1: L1 strength (>= 0); weights with ``|z| <= l1`` are exactly 0.
    l2: L2 strength (>= 0).
    initial_accumulator_value: the value ``n`` starts from for a new row (>= 0).
    beta: the ``beta`` of McMahan et al., added to ``n^p`` in the denominator (>= 0).

  Returns:
    A ``RowOptimizer`` with slots ``accum`` (``n``) and ``linear`` (``z``), both shaped like the
    rows.
  """
  name = "ftrl"
  lr = np.float32(hyper(name, "learning_rate", learning_rate, lambda x: x > 0.0, "> 0"))
  power = -hyper(name, "learning_rate_power", learning_rate_power, lambda x: x <= 0.0, "<= 0")
  l1_32 = np.float32(nonneg(name, "l1", l1))
  l2_32 = np.float32(nonneg(name, "l2", l2))
  acc0 = np.float32(nonneg(name, "initial_accumulator_value", initial_accumulator_value))
  beta32 = np.float32(nonneg(name, "beta", beta))
  p32 = np.float32(power)

  def pow_p(x):
    return np.sqrt(x) if power == 0.5 else np.power(x, p32)

  def init(num_rows: int, dim: int) -> Slots:
    return {
      "accum": np.full((num_rows, dim), acc0, np.float32),
      "linear": np.zeros((num_rows, dim), np.float32),
    }

  def update(w, slots, g):
    w, g = _f32(w), _f32(g)
    n, z = _f32(slots["accum"]), _f32(slots["linear"])
    n_new = n + g * g
    n_new_p = pow_p(n_new)
    z = z + g - (n_new_p - pow_p(n)) / lr * w
    q = (beta32 + n_new_p) / lr + np.float32(2.0) * l2_32
    # |z| > l1 >= 0 implies some g != 0 so far, hence n_new > 0 and q > 0: the guard only
    # avoids 0 / 0 in the branch that is not taken.
    active = np.abs(z) > l1_32
    safe_q = np.where(active, q, np.float32(1.0))
    new_w = np.where(active, (np.sign(z) * l1_32 - z) / safe_q, np.float32(0.0))
    return new_w, {"accum": n_new, "linear": z}

  is_sqrt = power == 0.5
  no_pow = np.zeros((0, 0), np.float32)

  def apply(w, slots, rows, g, clip):
    if is_sqrt:
      pow_old = pow_new = no_pow
    else:
      # n^p by numpy's pow, as in ``update`` (numpy's SIMD pow and libm's differ in the last
      # bit): two passes more, for a learning_rate_power other than -0.5 only. Rows out of
      # range are clamped here only to gather something; the kernel refuses them unwritten.
      n = slots["accum"][np.clip(rows, 0, w.shape[0] - 1)]
      pow_old, pow_new = pow_p(n), pow_p(n + g * g)
    return kernels.ftrl_apply(
      w, slots["accum"], slots["linear"], rows, g, is_sqrt, pow_old, pow_new, lr, l1_32, l2_32, beta32, clip
    )

  return RowOptimizer(init, update, FusedUpdate(apply, {"accum": True, "linear": True}))


_FACTORIES: Dict[str, Callable[..., RowOptimizer]] = {
  "sgd": sgd,
  "adagrad": adagrad,
  "rowwise_adagrad": rowwise_adagrad,
  "adam": adam,
  "ftrl": ftrl,
}

NAMES = tuple(sorted(_FACTORIES))
"""The optimizer names ``make`` accepts."""


def _factory(name: str) -> Callable[..., RowOptimizer]:
  if name not in _FACTORIES:
    raise ValueError(f"unknown row optimizer {name!r}; choose one of {list(NAMES)}")
  return _FACTORIES[name]


def hyperparameters(name: str) -> Tuple[str, ...]:
  """The keyword arguments ``make(name, ...)`` accepts, ``'clip'`` included.

  Args:
    name: one of ``NAMES``.

  Returns:
    The argument names, in the factory's order, then ``'clip'``.

  Raises:
    ValueError: for an unknown name.
  """
  return (*inspect.signature(_factory(name)).parameters, "clip")


def make(name: str, clip: Optional[float] = None, **kwargs) -> RowOptimizer:
  """Builds a row optimizer by name, with keyword hyper-parameters and optional weight clipping.

  Args:
    name: one of ``NAMES`` ('adagrad', 'adam', 'ftrl', 'rowwise_adagrad', 'sgd').
    clip: if a positive number, the new weights are clipped element-wise to [-clip, clip]
      after every update (see ``clipped``); None (the default) leaves them as they are.
    **kwargs: the factory's hyper-parameters (e.g. ``learning_rate``).

  Returns:
    A ``RowOptimizer``.

  Raises:
    ValueError: for an unknown name, an unknown or missing argument (the message names it and
      lists the accepted ones), or an out-of-range value.
  """
  factory = _factory(name)
  params = inspect.signature(factory).parameters
  accepted = list(hyperparameters(name))
  unknown = sorted(set(kwargs) - set(params))
  if unknown:
    raise ValueError(f"row optimizer {name!r} got unknown argument(s) {unknown}; it accepts {accepted}")
  missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in kwargs]
  if missing:
    raise ValueError(f"row optimizer {name!r} needs argument(s) {missing}; it accepts {accepted}")
  if clip is not None:
    hyper(name, "clip", clip, lambda x: x > 0.0, "> 0 (or None)")
  return clipped(factory(**kwargs), clip)
