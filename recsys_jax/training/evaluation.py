"""Exact AUC, logloss and calibration of the current model over the reader's eval set."""

from __future__ import annotations

from typing import Dict

import jax
import numpy as np
from absl import logging

from recsys_jax import metrics as metrics_lib
from recsys_jax.parallel import distributed
from recsys_jax.training.host import HostPipeline


def auc_or_nan(y: np.ndarray, s: np.ndarray) -> float:
  """AUC, or NaN (with a warning) for an eval set of one class: the AUC is undefined there, and
  raising at the end of a run would lose its summary (e.g. data whose every label is 1)."""
  if y.size and y.min() == y.max():
    logging.warning("the eval set has only labels %g: AUC is undefined, reported as NaN", y[0])
    return float("nan")
  return metrics_lib.auc(y, s)


def evaluate(state, eval_step, host: HostPipeline, config) -> Dict[str, float]:
  """Exact AUC and logloss over the reader's whole eval set (read-only PS lookups).

  With several processes each evaluates its share of the eval set on its own devices (with a
  local copy of the dense parameters), so no process waits for another's batches; the
  logits and labels are gathered at the end and every process computes the same metrics.
  """
  params = state.params
  if host.multi_process:
    params = jax.device_put(distributed.local_copy(params), host.eval_replicated)
  pre = host.eval_prefetcher(config.prefetch_depth)
  outs = []
  try:
    while True:
      _, item = pre.get()
      if item is None:
        break
      _, rows, batch = item
      outs.append(eval_step(params, rows, batch))
  finally:
    pre.close()
  outs = jax.device_get(outs)
  got = {k: np.concatenate([o[k][o["valid"]] for o in outs]) for k in (outs[0] if outs else {}) if k != "valid"}
  if host.multi_process:
    got = {k: distributed.gather_ragged(got.get(k, np.zeros(0, np.float32))) for k in ("logits", "label", "prob")}
    got = {k: v for k, v in got.items() if v.size or k != "prob"}
  if not got or got["label"].size == 0:
    raise ValueError("evaluation read no records: check config.data.eval_files / eval_samples")
  z, y = got["logits"].astype(np.float64), got["label"]
  p = 1.0 / (1.0 + np.exp(-z))
  out = {
    "auc": auc_or_nan(y, z),
    "logloss": metrics_lib.logloss(y, p),
    "calibration": metrics_lib.calibration(y, p),
    "eval_samples": int(y.size),
  }
  if "prob" in got:
    q = got["prob"]
    out["oracle_auc"] = auc_or_nan(y, q)
    out["oracle_logloss"] = metrics_lib.logloss(y, q)
  return out
