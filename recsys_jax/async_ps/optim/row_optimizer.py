"""The row-optimizer interface of the parameter server: ``RowOptimizer``, its in-place form, clipping.

A ``RowOptimizer`` (built by the factories of ``optimizers``): ``init(num_rows, dim)`` builds
the per-row state (named slots, stored next to the rows) and ``update(weights, slots, grads)``
returns the new weights and slots for the rows that received a gradient. The PS gathers the
touched rows, calls ``update`` and scatters the results back, so each function sees only
dense arrays. State is float32, whatever the storage dtype of the rows.

Every slot has ``num_rows`` as its leading dimension, but not every slot is as wide as a
row: ``rowwise_adagrad``'s ``acc`` and ``adam``'s step count ``t`` are ``[num_rows, 1]``.
``update`` never writes into its inputs; it returns new arrays.

``fused(weights, slots, rows, grads)`` does the same update in place, on the full arrays: the
rows ``rows`` of ``weights`` and of every slot get the update for ``grads``, in one compiled
pass per row (``kernels``), without gathering or scattering. ``update`` is the reference
``fused`` is tested against: the same float32 operations in the same order (``expm1`` and
``pow`` taken from numpy), so the results are equal to the bit.

Also here: ``clipped`` (weight clipping around any optimizer) and the checks of the
hyper-parameters that the factories and ``optimizers.make`` share.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Dict, NamedTuple, Optional, Tuple, cast

import numpy as np

from recsys_jax.async_ps import kernels

Slots = Dict[str, np.ndarray]


class RowOptimizer(NamedTuple):
  """A row-wise optimizer: ``init`` makes the slots, ``update`` applies one gradient.

  ``fused``, when not None, is the in-place form of ``update`` on the full arrays (see
  ``FusedUpdate``): ``fused(weights, slots, rows, grads)`` with ``weights`` float32
  [num_rows, dim], ``slots`` the full slot arrays (as ``init`` makes them), ``rows`` distinct
  row numbers and ``grads`` float32 [len(rows), dim]; it returns None.
  """

  init: Callable[[int, int], Slots]
  update: Callable[[np.ndarray, Slots, np.ndarray], Tuple[np.ndarray, Slots]]
  fused: Optional[Callable[[np.ndarray, Slots, np.ndarray, np.ndarray], None]] = None


class FusedUpdate:
  """An optimizer's in-place update: ``self(weights, slots, rows, grads)``.

  For each ``i``, row ``rows[i]`` of ``weights`` and of each slot gets the update for
  ``grads[i]``, in place, exactly as ``update`` followed by a scatter would do it, then the
  new weights are clipped to ``[-clip, clip]`` when ``clip > 0``.

  The arrays are used as they are (nothing is copied, so the update lands in them): ``weights``
  and every slot must be C-contiguous float32 with ``num_rows`` rows; ``rows`` must be
  distinct (a repeated row would be updated twice) and in ``[0, num_rows)``; ``grads`` is
  converted to C-contiguous float32 if it is not.

  Raises:
    TypeError: ``weights`` or a slot is not a C-contiguous float32 array (e.g. 16-bit
      storage: use ``update`` on float32 copies instead).
    ValueError: a slot is missing or has the wrong shape, or ``grads`` is not [len(rows), dim].
    IndexError: a row is out of range; nothing was written.
  """

  def __init__(self, apply: Callable[..., int], widths: Dict[str, bool], clip: float = 0.0):
    """``apply(w, slots, rows, g, clip)`` calls the kernel; ``widths``: slot name -> full width (else 1)."""
    self._apply = apply
    self._widths = widths
    self.clip = float(clip)

  def with_clip(self, clip: float) -> "FusedUpdate":
    """The same update with the new weights also clipped to ``[-clip, clip]`` (clip > 0)."""
    bound = float(np.float32(clip))
    return FusedUpdate(self._apply, self._widths, bound if self.clip <= 0.0 else min(self.clip, bound))

  def apply_owned(self, weights: np.ndarray, slots: Slots, rows: np.ndarray, grads: np.ndarray) -> None:
    """``self(...)`` without its checks of the arrays, for a caller that made them as ``__call__``
    requires (a table's own weights and slots, int64 rows, float32 gradients, all contiguous):
    the checks cost about what the kernel does for a few hundred rows. A row out of range is still
    refused (``IndexError``, nothing written)."""
    bad = self._apply(weights, slots, kernels.read_only(rows), kernels.read_only(grads), np.float32(self.clip))
    if bad >= 0:
      raise IndexError(f"fused row update: row {rows[bad]} out of range [0, {weights.shape[0]}); nothing written")

  def __call__(self, weights: np.ndarray, slots: Slots, rows: np.ndarray, grads: np.ndarray) -> None:
    _check_full(weights, "weights")
    num_rows, dim = weights.shape
    for name, full in self._widths.items():
      if name not in slots:
        raise ValueError(f"fused row update: slot {name!r} missing (got {sorted(slots)})")
      _check_full(slots[name], f"slot {name!r}")
      want = (num_rows, dim if full else 1)
      if slots[name].shape != want:
        raise ValueError(f"fused row update: slot {name!r} has shape {slots[name].shape}, expected {want}")
    rows = np.ascontiguousarray(rows, np.int64).reshape(-1)
    grads = np.ascontiguousarray(grads, np.float32)
    if grads.shape != (rows.shape[0], dim):
      raise ValueError(f"fused row update: grads have shape {grads.shape}, expected {(rows.shape[0], dim)}")
    bad = self._apply(weights, slots, kernels.read_only(rows), kernels.read_only(grads), np.float32(self.clip))
    if bad >= 0:
      raise IndexError(f"fused row update: row {rows[bad]} out of range [0, {num_rows}); nothing written")


def _check_full(x: np.ndarray, what: str) -> None:
  if not (
    isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and x.flags.c_contiguous and x.flags.writeable
  ):
    desc = f"{x.dtype} {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__
    raise TypeError(
      f"fused row update: {what} must be a writeable C-contiguous float32 [rows, width] array, got {desc}"
    )


def hyper(opt: str, arg: str, value, ok: Callable[[float], bool], expected: str) -> float:
  """Checks one hyper-parameter: a finite real number (not a bool) for which ``ok`` holds.

  Args:
    opt: the optimizer's name, for the message.
    arg: the argument's name, for the message.
    value: the value given.
    ok: the range condition on ``float(value)``.
    expected: the range in words, e.g. ``'>= 0'``.

  Returns:
    ``float(value)``.

  Raises:
    ValueError: naming the optimizer and the argument when the value is not acceptable.
  """
  if (
    isinstance(value, bool)
    or not isinstance(value, numbers.Real)
    or not math.isfinite(float(value))
    or not ok(float(value))
  ):
    raise ValueError(f"row optimizer {opt!r}: {arg} must be a finite number {expected}, got {value!r}")
  return float(value)


def nonneg(opt: str, arg: str, value) -> float:
  return hyper(opt, arg, value, lambda x: x >= 0.0, ">= 0")


def clipped(opt: RowOptimizer, clip: Optional[float]) -> RowOptimizer:
  """Wraps an optimizer so that its new weights are clipped element-wise to [-clip, clip].

  The slots are those of ``opt``, unchanged; only the returned weights are clipped (so the
  next update starts from the clipped row, as in Persia and Monolith). ``fused`` clips too:
  inside the kernel for the built-in optimizers, by a pass over the updated rows otherwise.

  Args:
    opt: the optimizer to wrap.
    clip: the bound, a finite number > 0; ``None`` returns ``opt`` itself.

  Returns:
    A ``RowOptimizer`` with the same ``init`` as ``opt``.

  Raises:
    ValueError: if ``clip`` is neither None nor a finite positive number.
  """
  if clip is None:
    return opt
  bound = np.float32(hyper("clipped", "clip", clip, lambda x: x > 0.0, "> 0 (or None)"))

  def update(w, slots, g):
    new_w, new_slots = opt.update(w, slots, g)
    return np.clip(new_w, -bound, bound), new_slots

  fused: Optional[Callable[[np.ndarray, Slots, np.ndarray, np.ndarray], None]]
  if isinstance(opt.fused, FusedUpdate):
    fused = opt.fused.with_clip(cast(float, bound))  # np.float32: with_clip takes any real
  elif opt.fused is not None:
    inner = opt.fused

    def fused(weights, slots, rows, grads):
      inner(weights, slots, rows, grads)
      rows = np.asarray(rows, np.int64)
      weights[rows] = np.clip(weights[rows], -bound, bound)

  else:
    fused = None
  return RowOptimizer(opt.init, update, fused)
