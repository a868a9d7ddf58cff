"""The parameter server's row optimizers in jax, for embedding rows that train on the device.

Rows kept on the accelerator (the hot set) must train exactly as they would on the PS, so that a
row moving between the two sees one optimizer. ``make(name, clip, **kwargs)`` takes the names
and keyword hyper-parameters of ``async_ps.optimizers.make`` and returns a
``DeviceRowOptimizer`` whose ``update`` is the PS's numpy ``update`` written in ``jax.numpy``:
the same float32 operations in the same order, with the constants rounded on the host as the PS
rounds them (adam's ``1 - b`` in float32 and ``1 - b^t`` as ``-expm1(t * log b)``; ftrl's
``n^p`` as ``sqrt`` for p = 0.5, ``pow`` otherwise). The results agree with the PS's to float32
rounding, not to the bit: under jit XLA contracts ``a * b + c`` into one fused multiply-add (on
CPU as on GPU; no flag turns that off), and its ``expm1``, ``pow`` and sums are not numpy's.

This module imports nothing from ``async_ps`` (embeddings sit below it), so it does not check
the ranges of the hyper-parameters: build the PS's optimizer from the same arguments for that
(every table does).

The table-level forms run inside a jitted step on static shapes: ``apply_sparse`` updates the
rows named by a padded index, ``apply_masked`` every row of a mask (for gradients all-reduced
densely across processes).
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Callable, Dict, Optional, Tuple

import jax.numpy as jnp
import numpy as np

__all__ = ["DeviceRowOptimizer", "NAMES", "make"]

Slots = Dict[str, jnp.ndarray]
_UpdateFn = Callable[[jnp.ndarray, Slots, jnp.ndarray], Tuple[jnp.ndarray, Slots]]
_F32 = jnp.float32


class DeviceRowOptimizer:
  """A row optimizer on device arrays; build it with ``make``.

  Attributes:
    name: the optimizer's name.
    clip: the weight bound (float32), or None for no clipping.
    slot_widths: slot name -> True if the slot is as wide as a row, False if it is [rows, 1]
      (the names and shapes of the PS optimizer's ``init``).
    slot_init: slot name -> the value every slot of a new row starts from.

  A plain class (hashed by identity), so ``jax.jit(opt.apply_sparse)`` works.
  """

  def __init__(
    self,
    name: str,
    slot_init: Dict[str, Tuple[bool, float]],
    update: _UpdateFn,
    clip: Optional[float],
  ):
    self.name = name
    self.slot_widths = {k: full for k, (full, _) in slot_init.items()}
    self.slot_init = {k: v for k, (_, v) in slot_init.items()}
    self.clip = None if clip is None else np.float32(clip)
    self._update = update

  def __repr__(self) -> str:
    return f"DeviceRowOptimizer({self.name!r}, clip={self.clip})"

  def init(self, num_rows: int, dim: int) -> Slots:
    """The slots of ``num_rows`` new rows of width ``dim``: float32, as the PS's ``init`` makes them."""
    return {
      k: jnp.full((num_rows, dim if full else 1), self.slot_init[k], _F32) for k, full in self.slot_widths.items()
    }

  def update(self, w: jnp.ndarray, slots: Slots, g: jnp.ndarray) -> Tuple[jnp.ndarray, Slots]:
    """New float32 weights and slots for rows ``w`` [n, dim] with gradients ``g`` [n, dim].

    The PS's ``update``: every row given is updated (a zero gradient is an update too: adam
    counts it in ``t``); the weights are clipped when ``clip`` is set, the slots never.
    """
    new_w, new_slots = self._update(w.astype(_F32), {k: v.astype(_F32) for k, v in slots.items()}, g.astype(_F32))
    if self.clip is not None:
      new_w = jnp.clip(new_w, -self.clip, self.clip)
    return new_w, new_slots

  def apply_sparse(
    self, table_w: jnp.ndarray, table_slots: Slots, idx: jnp.ndarray, g: jnp.ndarray
  ) -> Tuple[jnp.ndarray, Slots]:
    """Updates rows ``idx`` of a table and of its slots; returns the new table and slots.

    Args:
      table_w: [num_rows, dim] weights (float32, or a 16-bit float: the update runs in
        float32 and is rounded back, as the PS does for 16-bit storage).
      table_slots: the slots as ``init(num_rows, dim)`` shapes them.
      idx: int [n] distinct row numbers; any value outside [0, num_rows) is padding, whose
        gradient is ignored. A row given twice is updated once with one of its gradients.
      g: [n, dim] the summed gradient of each row.
    """
    num_rows = self._check_table(table_w, table_slots)
    if idx.ndim != 1 or g.shape != (idx.shape[0], table_w.shape[1]):
      raise ValueError(
        f"{self!r}.apply_sparse: idx {idx.shape} and g {g.shape} must be [n] and [n, {table_w.shape[1]}]"
      )
    if num_rows == 0:
      return table_w, table_slots
    # jnp indexing wraps negative numbers around to the end: send them past it, so they are padding too.
    idx = jnp.where((idx >= 0) & (idx < num_rows), idx, num_rows)
    # Padding gathers the last row (mode='clip') rather than a fill value, so its discarded update
    # is computed on finite numbers (no 0 / 0 to trip jax_debug_nans with eps = 0).
    w = table_w.at[idx].get(mode="clip")
    slots = {k: v.at[idx].get(mode="clip") for k, v in table_slots.items()}
    new_w, new_slots = self.update(w, slots, g)
    out_w = table_w.at[idx].set(new_w.astype(table_w.dtype), mode="drop")
    out_slots = {k: v.at[idx].set(new_slots[k], mode="drop") for k, v in table_slots.items()}
    return out_w, out_slots

  def apply_masked(
    self, table_w: jnp.ndarray, table_slots: Slots, touched: jnp.ndarray, g_full: jnp.ndarray
  ) -> Tuple[jnp.ndarray, Slots]:
    """Updates every row where ``touched`` (bool [num_rows]) with its row of ``g_full`` [num_rows, dim].

    The other rows, and their slots, are returned unchanged whatever their ``g_full`` holds.
    Same arguments otherwise as ``apply_sparse``.
    """
    num_rows = self._check_table(table_w, table_slots)
    if touched.shape != (num_rows,) or g_full.shape != table_w.shape:
      raise ValueError(
        f"{self!r}.apply_masked: touched {touched.shape} and g_full {g_full.shape} must be "
        f"[{num_rows}] and {list(table_w.shape)}"
      )
    new_w, new_slots = self.update(table_w, table_slots, g_full)
    keep = ~touched.astype(bool)[:, None]
    out_w = jnp.where(keep, table_w, new_w.astype(table_w.dtype))
    out_slots = {k: jnp.where(keep, v, new_slots[k]) for k, v in table_slots.items()}
    return out_w, out_slots

  def _check_table(self, table_w, table_slots) -> int:
    """Shapes are static under jit, so a mismatch is reported at trace time, by name."""
    if table_w.ndim != 2:
      raise ValueError(f"{self!r}: table weights must be [num_rows, dim], got shape {table_w.shape}")
    num_rows, dim = table_w.shape
    if set(table_slots) != set(self.slot_widths):
      raise ValueError(f"{self!r}: slots {sorted(table_slots)} given, expected {sorted(self.slot_widths)}")
    for k, full in self.slot_widths.items():
      want = (num_rows, dim if full else 1)
      if table_slots[k].shape != want:
        raise ValueError(f"{self!r}: slot {k!r} has shape {table_slots[k].shape}, expected {want}")
    return num_rows


# The factories: (slot name -> (full width, initial value), update), with the PS's signatures and defaults.


def _sgd(learning_rate: float):
  lr = np.float32(learning_rate)

  def update(w, slots, g):
    return w - lr * g, slots

  return {}, update


def _adagrad(learning_rate: float, initial_accumulator_value: float = 0.0, eps: float = 1e-8):
  lr, eps32 = np.float32(learning_rate), np.float32(eps)

  def update(w, slots, g):
    acc = slots["acc"] + g * g
    return w - lr * g / (jnp.sqrt(acc) + eps32), {"acc": acc}

  return {"acc": (True, np.float32(initial_accumulator_value))}, update


def _rowwise_adagrad(learning_rate: float, initial_accumulator_value: float = 0.0, eps: float = 1e-8):
  lr, eps32 = np.float32(learning_rate), np.float32(eps)

  def update(w, slots, g):
    # The PS's mean: a float32 sum divided by the width in float32.
    acc = slots["acc"] + jnp.sum(g * g, axis=1, keepdims=True) / np.float32(g.shape[1])
    return w - lr * g / (jnp.sqrt(acc) + eps32), {"acc": acc}

  return {"acc": (False, np.float32(initial_accumulator_value))}, update


def _log32(b: np.float32) -> np.float32:
  """log(b) in float64 rounded to float32, as the PS's ``_one_minus_pow`` takes it (-inf for 0)."""
  return np.float32(math.log(float(b))) if b > 0.0 else np.float32(-np.inf)


def _adam(learning_rate: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8):
  lr, eps32 = np.float32(learning_rate), np.float32(eps)
  b1_32, b2_32 = np.float32(b1), np.float32(b2)
  # 1 - b from the rounded b, in float32, and 1 - b^t as -expm1(t log b): what the PS computes.
  c1, c2 = np.float32(1.0) - b1_32, np.float32(1.0) - b2_32
  log_b1, log_b2 = _log32(b1_32), _log32(b2_32)

  def update(w, slots, g):
    t = slots["t"] + np.float32(1.0)
    m = b1_32 * slots["m"] + c1 * g
    v = b2_32 * slots["v"] + c2 * (g * g)
    m_hat = m / -jnp.expm1(t * log_b1)
    v_hat = v / -jnp.expm1(t * log_b2)
    return w - lr * m_hat / (jnp.sqrt(v_hat) + eps32), {"m": m, "v": v, "t": t}

  return {"m": (True, 0.0), "v": (True, 0.0), "t": (False, 0.0)}, update


def _ftrl(
  learning_rate: float,
  learning_rate_power: float = -0.5,
  l1: float = 0.0,
  l2: float = 0.0,
  initial_accumulator_value: float = 0.1,
  beta: float = 0.0,
):
  lr = np.float32(learning_rate)
  power = -float(learning_rate_power)
  p32, l1_32, l2_32, beta32 = np.float32(power), np.float32(l1), np.float32(l2), np.float32(beta)

  def pow_p(x):
    return jnp.sqrt(x) if power == 0.5 else jnp.power(x, p32)

  def update(w, slots, g):
    n, z = slots["accum"], slots["linear"]
    n_new = n + g * g
    n_new_p = pow_p(n_new)
    z = z + g - (n_new_p - pow_p(n)) / lr * w
    q = (beta32 + n_new_p) / lr + np.float32(2.0) * l2_32
    # As on the PS: q > 0 wherever |z| > l1; the guard only avoids 0 / 0 in the branch not taken.
    active = jnp.abs(z) > l1_32
    safe_q = jnp.where(active, q, np.float32(1.0))
    new_w = jnp.where(active, (jnp.sign(z) * l1_32 - z) / safe_q, np.float32(0.0))
    return new_w, {"accum": n_new, "linear": z}

  return {"accum": (True, np.float32(initial_accumulator_value)), "linear": (True, 0.0)}, update


_FACTORIES = {
  "sgd": _sgd,
  "adagrad": _adagrad,
  "rowwise_adagrad": _rowwise_adagrad,
  "adam": _adam,
  "ftrl": _ftrl,
}

NAMES = tuple(sorted(_FACTORIES))
"""The optimizer names ``make`` accepts (those of ``async_ps.optimizers``)."""


def make(name: str, clip: Optional[float] = None, **kwargs) -> DeviceRowOptimizer:
  """Builds the device form of the PS row optimizer ``async_ps.optimizers.make(name, clip, **kwargs)``.

  Args:
    name: one of ``NAMES``.
    clip: a bound > 0: new weights are clipped element-wise to [-clip, clip]; None: no clipping.
    **kwargs: the optimizer's hyper-parameters, by the PS's names (e.g. ``learning_rate``).

  Raises:
    ValueError: an unknown name, an unknown or missing argument, or a clip that is not > 0.
      The ranges of the other hyper-parameters are the PS's ``make`` to check.
  """
  if name not in _FACTORIES:
    raise ValueError(f"unknown row optimizer {name!r} for the device; choose one of {list(NAMES)}")
  factory = _FACTORIES[name]
  params = inspect.signature(factory).parameters
  accepted = [*params, "clip"]
  unknown = sorted(set(kwargs) - set(params))
  missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in kwargs]
  if unknown or missing:
    raise ValueError(
      f"device row optimizer {name!r}: unknown argument(s) {unknown}, missing {missing}; it accepts {accepted}"
    )
  ok = isinstance(clip, numbers.Real) and not isinstance(clip, bool) and math.isfinite(clip) and clip > 0
  if clip is not None and not ok:
    raise ValueError(f"device row optimizer {name!r}: clip must be a finite number > 0 (or None), got {clip!r}")
  slot_init, update = factory(**kwargs)
  return DeviceRowOptimizer(name, slot_init, update, clip)
