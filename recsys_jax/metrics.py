"""Exact evaluation metrics in float64 numpy: AUC (with ties), logloss, calibration."""

from __future__ import annotations

import numpy as np


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
  """Exact ROC AUC of float32 scores, as :func:`auc` gives it (ties count half), about 10x faster.

  Each (score, label) pair is packed into one int64 whose order is the score's (``score_keys``),
  so one plain sort of integers, no argsort, orders the records: a million take about 15 ms here
  where ``auc`` takes 150. Counts are exact integers; only the final division is floating point.

  Raises:
    ValueError: if only one class is present, the shapes differ or a score is NaN.
  """
  return auc_of_keys(score_keys(labels, scores))


def score_keys(labels: np.ndarray, scores: np.ndarray) -> np.ndarray:
  """int64 keys that order as the float32 scores do, with the 0/1 label in the lowest bit.

  A progressive-validation window (:mod:`recsys_jax.online.progressive`) packs each batch as it
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


def auc_of_keys(keys: np.ndarray) -> float:
  """Exact ROC AUC of records packed by ``score_keys`` (in any order; ties count half).

  Raises:
    ValueError: if only one class is present.
  """
  keys = np.sort(keys)
  is_pos = (keys & 1).astype(bool)
  n_pos = int(np.count_nonzero(is_pos))
  n_neg = keys.size - n_pos
  if n_pos == 0 or n_neg == 0:
    raise ValueError("AUC needs both positive and negative labels")
  # Negatives at or below each positive (a tie's negatives sort before its positives): its
  # 1-based position less the positives up to it; summed over positives, twice, so that half a
  # tie stays an integer.
  pairs2 = 2 * (int(np.flatnonzero(is_pos).sum()) + n_pos - n_pos * (n_pos + 1) // 2)
  score = keys >> 1
  tied = score[1:] == score[:-1]
  if tied.any():  # a tie is counted whole above; it counts half: less pos x neg of every tied group
    starts = np.flatnonzero(np.concatenate([[True], ~tied]))
    pos_g = np.add.reduceat(is_pos.astype(np.int64), starts)
    neg_g = np.diff(np.append(starts, keys.size)) - pos_g
    pairs2 -= int((pos_g * neg_g).sum())
  return pairs2 / (2.0 * n_pos * n_neg)
