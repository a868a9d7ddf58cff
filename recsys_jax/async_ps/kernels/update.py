"""Compiled (numba) kernels of the update path: the fused, in-place row-optimizer updates.

Conventions, which the callers (``optimizers``) guarantee:
  * arrays are C-contiguous; rows ``int64``, weights, slots and gradients ``float32``;
  * the rows of one row update are distinct (a repeated row would get two sequential updates,
    not the numpy scatter's last-write-wins) and in ``[0, num_rows)`` (checked: the row
    updates return the index of the first bad row, before writing anything, or -1);
  * arithmetic is float32, operation for operation as in the numpy ``update`` functions of
    ``optimizers`` (no fused multiply-add, no reassociation): +, -, *, / and sqrt are
    correctly rounded, so the results are bit-identical. Functions that are not (numpy's
    SIMD ``expm1`` and ``pow`` differ from libm's in the last bit for a fifth of the inputs)
    are left to numpy by the callers and passed in: Adam's per-row bias corrections, and
    FTRL's ``n^p`` when p != 0.5.

A ``clip`` argument > 0 clips the new weights to ``[-clip, clip]`` (as ``optimizers.clipped``);
``clip <= 0`` leaves them as they are.
"""

from __future__ import annotations

import numpy as np

from recsys_jax.async_ps.kernels.jit import (
  ROWS_AHEAD_1,
  ROWS_AHEAD_2,
  ROWS_AHEAD_3,
  jit,
  jit_inline,
  prefetch,
  prefetch_row,
)


@jit_inline
def _check_same_shape(a, w):
  if a.shape[0] != w.shape[0] or a.shape[1] != w.shape[1]:
    raise ValueError("row kernel: a slot is not shaped like the weights")


@jit_inline
def _check_row_slot(a, w):
  if a.shape[0] != w.shape[0] or a.shape[1] < 1:
    raise ValueError("row kernel: a per-row slot must be [num_rows, 1]")


@jit_inline
def _check_grads(g, rows, w):
  if g.shape[0] != rows.shape[0] or g.shape[1] != w.shape[1]:
    raise ValueError("row kernel: gradients must be [len(rows), dim]")


@jit_inline
def _clip(x, clip):
  if clip > 0:
    if x > clip:
      return clip
    if x < -clip:
      return -clip
  return x


@jit_inline
def _bad_row(rows, num_rows):
  """The index of the first row outside [0, num_rows), or -1."""
  for i in range(rows.shape[0]):
    r = rows[i]
    if r < 0 or r >= num_rows:
      return i
  return -1


@jit
def sgd_apply(w, rows, g, lr, clip):
  """w[r] <- clip(w[r] - lr * g[i]) for r = rows[i]. Returns the first bad row's index or -1."""
  _check_grads(g, rows, w)
  bad = _bad_row(rows, w.shape[0])
  if bad >= 0:
    return bad
  dim = w.shape[1]
  n = rows.shape[0]
  for i in range(n):
    if i + ROWS_AHEAD_1 < n:
      ra = rows[i + ROWS_AHEAD_1]
      prefetch_row(w, ra)
    r = rows[i]
    for j in range(dim):
      w[r, j] = _clip(w[r, j] - lr * g[i, j], clip)
  return -1


@jit
def adagrad_apply(w, acc, rows, g, lr, eps, clip):
  """Element-wise Adagrad, in place: acc += g^2; w <- clip(w - lr * g / (sqrt(acc) + eps))."""
  _check_grads(g, rows, w)
  _check_same_shape(acc, w)
  bad = _bad_row(rows, w.shape[0])
  if bad >= 0:
    return bad
  dim = w.shape[1]
  n = rows.shape[0]
  for i in range(n):
    if i + ROWS_AHEAD_2 < n:
      ra = rows[i + ROWS_AHEAD_2]
      prefetch_row(w, ra)
      prefetch_row(acc, ra)
    r = rows[i]
    for j in range(dim):
      gj = g[i, j]
      a = acc[r, j] + gj * gj
      acc[r, j] = a
      w[r, j] = _clip(w[r, j] - lr * gj / (np.sqrt(a) + eps), clip)
  return -1


@jit_inline
def _block_sq_sum(g, i, lo, n):
  """sum_j g[i, lo + j]^2 over j < n <= 128 in float32, as numpy's ``pairwise_sum`` leaf:
  up to 8 terms sequentially, else eight interleaved partial sums then the remainder."""
  if n < 8:
    s = np.float32(0.0)
    for j in range(lo, lo + n):
      s += g[i, j] * g[i, j]
    return s
  r0 = g[i, lo] * g[i, lo]
  r1 = g[i, lo + 1] * g[i, lo + 1]
  r2 = g[i, lo + 2] * g[i, lo + 2]
  r3 = g[i, lo + 3] * g[i, lo + 3]
  r4 = g[i, lo + 4] * g[i, lo + 4]
  r5 = g[i, lo + 5] * g[i, lo + 5]
  r6 = g[i, lo + 6] * g[i, lo + 6]
  r7 = g[i, lo + 7] * g[i, lo + 7]
  end8 = lo + n - n % 8
  j = lo + 8
  while j < end8:
    r0 += g[i, j] * g[i, j]
    r1 += g[i, j + 1] * g[i, j + 1]
    r2 += g[i, j + 2] * g[i, j + 2]
    r3 += g[i, j + 3] * g[i, j + 3]
    r4 += g[i, j + 4] * g[i, j + 4]
    r5 += g[i, j + 5] * g[i, j + 5]
    r6 += g[i, j + 6] * g[i, j + 6]
    r7 += g[i, j + 7] * g[i, j + 7]
    j += 8
  s = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
  while j < lo + n:
    s += g[i, j] * g[i, j]
    j += 1
  return s


@jit_inline
def _pairwise_sq_sum(g, i, n, task_lo, task_n, vals):
  """sum_j g[i, j]^2 over j < n in float32, summed in numpy's pairwise order.

  This is numpy's ``pairwise_sum`` (what ``np.add.reduce`` does along a contiguous axis):
  blocks of up to 128 terms (``_block_sq_sum``), larger ranges halved (at a multiple of 8)
  and the halves' sums added. The recursion is run on an explicit stack (``task_lo``,
  ``task_n``: >= 3 * 64 entries, ``vals``: >= 64) because numba's cache cannot hold
  recursive functions.
  """
  if n <= 128:
    return _block_sq_sum(g, i, 0, n)
  task_lo[0] = 0
  task_n[0] = n
  nt = 1
  nv = 0
  while nt > 0:
    nt -= 1
    lo = task_lo[nt]
    m = task_n[nt]
    if m < 0:  # add the last two sums
      nv -= 1
      vals[nv - 1] = vals[nv - 1] + vals[nv]
    elif m <= 128:
      vals[nv] = _block_sq_sum(g, i, lo, m)
      nv += 1
    else:  # left half, then right half, then add
      m2 = m // 2
      m2 -= m2 % 8
      task_n[nt] = -1
      task_lo[nt + 1] = lo + m2
      task_n[nt + 1] = m - m2
      task_lo[nt + 2] = lo
      task_n[nt + 2] = m2
      nt += 3
  return vals[0]


@jit
def rowwise_adagrad_apply(w, acc, rows, g, lr, eps, clip):
  """Row-wise Adagrad, in place: acc[r, 0] += mean_j g^2; w <- clip(w - lr * g / (sqrt(acc) + eps))."""
  _check_grads(g, rows, w)
  _check_row_slot(acc, w)
  bad = _bad_row(rows, w.shape[0])
  if bad >= 0:
    return bad
  dim = w.shape[1]
  fdim = np.float32(dim)
  task_lo = np.empty(192, np.int64)
  task_n = np.empty(192, np.int64)
  vals = np.empty(64, np.float32)
  n = rows.shape[0]
  for i in range(n):
    if i + ROWS_AHEAD_1 < n:
      ra = rows[i + ROWS_AHEAD_1]
      prefetch_row(w, ra)
      prefetch(acc, ra, 0)
    r = rows[i]
    a = acc[r, 0] + _pairwise_sq_sum(g, i, dim, task_lo, task_n, vals) / fdim
    acc[r, 0] = a
    den = np.sqrt(a) + eps
    for j in range(dim):
      w[r, j] = _clip(w[r, j] - lr * g[i, j] / den, clip)
  return -1


@jit
def adam_apply(w, m, v, t, rows, g, bc1s, bc2s, lr, b1, b2, c1, c2, eps, clip):
  """Adam with a per-row step count ``t`` ([R, 1]), in place: t += 1, then m, v and w.

  ``c1 = 1 - b1`` and ``c2 = 1 - b2`` (float32, as the caller rounded them); ``bc1s[i]`` and
  ``bc2s[i]`` are the bias corrections ``1 - b^t`` of row ``rows[i]`` for its new ``t``.
  """
  _check_grads(g, rows, w)
  _check_same_shape(m, w)
  _check_same_shape(v, w)
  _check_row_slot(t, w)
  if bc1s.shape[0] != rows.shape[0] or bc2s.shape[0] != rows.shape[0]:
    raise ValueError("adam_apply: one bias correction per row")
  bad = _bad_row(rows, w.shape[0])
  if bad >= 0:
    return bad
  dim = w.shape[1]
  n = rows.shape[0]
  for i in range(n):
    if i + ROWS_AHEAD_3 < n:
      ra = rows[i + ROWS_AHEAD_3]
      prefetch_row(w, ra)
      prefetch_row(m, ra)
      prefetch_row(v, ra)
      prefetch(t, ra, 0)
    r = rows[i]
    t[r, 0] = t[r, 0] + np.float32(1.0)
    bc1 = bc1s[i]
    bc2 = bc2s[i]
    for j in range(dim):
      gj = g[i, j]
      mj = b1 * m[r, j] + c1 * gj
      vj = b2 * v[r, j] + c2 * (gj * gj)
      m[r, j] = mj
      v[r, j] = vj
      w[r, j] = _clip(w[r, j] - lr * (mj / bc1) / (np.sqrt(vj / bc2) + eps), clip)
  return -1


@jit
def ftrl_apply(w, accum, linear, rows, g, is_sqrt, pow_old, pow_new, lr, l1, l2, beta, clip):
  """FTRL-Proximal (``optimizers.ftrl``), in place.

  With ``is_sqrt`` (p = 0.5), ``n^p`` is ``sqrt(n)``, computed here; otherwise ``pow_old[i]``
  and ``pow_new[i]`` ([len(rows), dim]) are ``n^p`` of row ``rows[i]`` before and after the
  update.
  """
  _check_grads(g, rows, w)
  _check_same_shape(accum, w)
  _check_same_shape(linear, w)
  if not is_sqrt:
    _check_grads(pow_old, rows, w)
    _check_grads(pow_new, rows, w)
  bad = _bad_row(rows, w.shape[0])
  if bad >= 0:
    return bad
  dim = w.shape[1]
  two_l2 = np.float32(2.0) * l2
  n = rows.shape[0]
  for i in range(n):
    if i + ROWS_AHEAD_3 < n:
      ra = rows[i + ROWS_AHEAD_3]
      prefetch_row(w, ra)
      prefetch_row(accum, ra)
      prefetch_row(linear, ra)
    r = rows[i]
    for j in range(dim):
      gj = g[i, j]
      n_old = accum[r, j]
      n_new = n_old + gj * gj
      if is_sqrt:
        n_new_p = np.sqrt(n_new)
        n_p = np.sqrt(n_old)
      else:
        n_new_p = pow_new[i, j]
        n_p = pow_old[i, j]
      z = (linear[r, j] + gj) - (n_new_p - n_p) / lr * w[r, j]
      accum[r, j] = n_new
      linear[r, j] = z
      if abs(z) > l1:
        q = (beta + n_new_p) / lr + two_l2
        sign = np.float32(1.0) if z > 0 else np.float32(-1.0)
        new_w = (sign * l1 - z) / q
      else:
        new_w = np.float32(0.0)
      w[r, j] = _clip(new_w, clip)
  return -1
