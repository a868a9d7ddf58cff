"""Exact evaluation metrics: AUC (with ties), logloss, calibration; float64 numpy, and a compiled
AUC of float32 scores (integer counts) for large windows."""

from __future__ import annotations

import numba
import numpy as np

from recsys_jax.sorting import radix_sort


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
  """Exact ROC AUC: the Mann-Whitney statistic with tied scores given average ranks.

  Args:
    labels: 0/1 labels [N].
    scores: real scores [N] (logits or probabilities: only their order matters).

  Returns:
    P(score of a random positive > score of a random negative) + 0.5 P(tie).

  Raises:
    ValueError: if only one class is present.
  """
  y = np.asarray(labels).reshape(-1) > 0.5
  s = np.asarray(scores, np.float64).reshape(-1)
  if y.shape != s.shape:
    raise ValueError(f"labels {y.shape} and scores {s.shape} differ in shape")
  n_pos = int(y.sum())
  n_neg = y.size - n_pos
  if n_pos == 0 or n_neg == 0:
    raise ValueError("AUC needs both positive and negative labels")
  order = np.argsort(s, kind="mergesort")
  s_sorted = s[order]
  # Average rank (1-based) of each run of tied scores.
  boundaries = np.flatnonzero(np.diff(s_sorted)) + 1
  starts = np.concatenate([[0], boundaries])
  ends = np.concatenate([boundaries, [s.size]])
  avg = (starts + ends + 1) / 2.0
  ranks = np.empty(s.size, np.float64)
  ranks[order] = np.repeat(avg, ends - starts)
  return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(labels: np.ndarray, probs: np.ndarray, eps: float = 1e-7) -> float:
  """Mean binary cross-entropy of probabilities (clipped to [eps, 1 - eps])."""
  y = np.asarray(labels, np.float64).reshape(-1)
  p = np.clip(np.asarray(probs, np.float64).reshape(-1), eps, 1 - eps)
  return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def calibration(labels: np.ndarray, probs: np.ndarray) -> float:
  """Mean predicted probability over observed positive rate (1.0 is calibrated)."""
  return float(np.mean(probs) / max(np.mean(labels), 1e-12))


def auc_float32(labels: np.ndarray, scores: np.ndarray) -> float:
  """Exact ROC AUC of float32 scores, as ``auc`` gives it (ties count half), about 10x faster.

  Each (score, label) pair is packed into one int64 whose order is the score's (``score_keys``),
  so one radix sort of integers, no argsort, orders the records (``auc_of_keys``). Counts are exact integers; only the final division is floating point.

  Raises:
    ValueError: if only one class is present, the shapes differ or a score is NaN.
  """
  return auc_of_keys(score_keys(labels, scores))


def score_keys(labels: np.ndarray, scores: np.ndarray) -> np.ndarray:
  """int64 keys that order as the float32 scores do, with the 0/1 label in the lowest bit.

  A progressive-validation window (``recsys_jax.online.progressive``) packs each batch as it
  arrives and keeps the keys, so a report only sorts them (``auc_of_keys``).

  Raises:
    ValueError: if the shapes differ or a score is NaN.
  """
  y = np.asarray(labels).reshape(-1) > 0.5
  s = np.asarray(scores, np.float32).reshape(-1) + np.float32(0.0)  # -0.0 + 0.0 is +0.0: one key for zero
  if y.shape != s.shape:
    raise ValueError(f"labels {y.shape} and scores {s.shape} differ in shape")
  if np.isnan(s).any():
    raise ValueError("AUC of NaN scores is undefined")
  bits = s.view(np.int32)
  # As signed integers, positive floats already order; negative ones order backwards in their
  # magnitude bits, which the xor flips.
  mono = bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))
  return (mono.astype(np.int64) << 1) | y


_KEY_OFFSET = 1 << 32  # score_keys's keys lie in [-2**32, 2**32): shifted, 33-bit unsigned ones


@numba.njit(nogil=True, cache=True)
def _auc_counts(keys):
  """``(positives, negatives, twice the pairs ordered right with ties counted half)`` of
  ``score_keys`` keys (any order), or ``(-1, 0, 0)`` if a key lies outside their range: the
  keys shifted to unsigned, radix-sorted, and counted in one pass over runs of equal scores."""
  n = keys.shape[0]
  u = np.empty(n, np.uint64)
  for i in range(n):
    k = keys[i] + _KEY_OFFSET
    if k < 0 or k >= 2 * _KEY_OFFSET:
      return -1, 0, 0
    u[i] = np.uint64(k)
  u = radix_sort(u, np.empty(n, np.uint64))
  n_pos = n_neg = pairs2 = 0  # negatives below the run so far, and the pairs counted
  i = 0
  while i < n:
    score = u[i] >> np.uint64(1)
    pos = neg = 0
    while i < n and (u[i] >> np.uint64(1)) == score:
      if u[i] & np.uint64(1):
        pos += 1
      else:
        neg += 1
      i += 1
    pairs2 += 2 * pos * n_neg + pos * neg  # each positive over every lower negative, half a tie
    n_pos += pos
    n_neg += neg
  return n_pos, n_neg, pairs2


def auc_of_keys(keys: np.ndarray) -> float:
  """Exact ROC AUC of records packed by ``score_keys`` (in any order; ties count half).

  Compiled, without the interpreter lock: a radix sort of the keys and one pass over them
  (a million keys in about 15 ms here, against 83 ms for ``np.sort`` and numpy's counting).
  Counts are exact integers; only the final division is floating point.

  Raises:
    ValueError: if only one class is present, or a key is not one ``score_keys`` makes.
  """
  n_pos, n_neg, pairs2 = _auc_counts(np.ascontiguousarray(keys, np.int64))
  if n_pos < 0:
    raise ValueError("AUC keys must come from metrics.score_keys (a key lies outside [-2**32, 2**32))")
  if n_pos == 0 or n_neg == 0:
    raise ValueError("AUC needs both positive and negative labels")
  return pairs2 / (2.0 * n_pos * n_neg)
