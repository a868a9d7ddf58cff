"""Progressive validation: every training batch is scored before it is trained on.

The standard evaluation of online learning (McMahan et al., "Ad click prediction: a view from
the trenches", KDD 2013): the model's score of an event is taken before the event updates the
model, so every event is a held-out one when it is scored, and the metric follows the model as
the data drifts, with no eval set. The train step returns the logits of its own forward pass,
made with the parameters and rows before its update (``make_train_step(predictions=True)``), so
scoring costs no second forward pass; the pusher thread hands them here with the labels.

``ProgressiveValidation`` keeps the last ``window`` events (``config.progressive.window``; 0 =
off) and, at every report (each ``log_every`` steps), gives the exact AUC, logloss and
calibration over them. Batches can carry a ``source`` name (a stream's file): each source gets
a window of its own, reported while it receives events. The windows start empty in every
process (they are not checkpointed): after a resume, the first reports cover fewer events.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, Optional

import numpy as np

from recsys_jax import metrics as metrics_lib


def window_of(config) -> int:
  """``config.progressive.window``: events in the window (0: off)."""
  return int(config.progressive.window)


_EPS = 1e-7  # probabilities are clipped to [eps, 1 - eps] for the logloss, as metrics.logloss does


def event_terms(logits: np.ndarray, labels: np.ndarray):
  """Per event: the AUC's sort key (``metrics.score_keys``), the logloss and the probability (float64).

  Computed once per event as its batch arrives, so that a report only sorts the keys and sums the
  rest: each event stays in the window for several reports.
  """
  z = np.asarray(logits, np.float32).reshape(-1)
  y = np.asarray(labels).reshape(-1) > 0.5
  p = 1.0 / (1.0 + np.exp(-z.astype(np.float64)))
  q = np.clip(p, _EPS, 1 - _EPS)
  loss = -np.where(y, np.log(q), np.log1p(-q))
  return metrics_lib.score_keys(y, z), loss, p


class _Window:
  """A ring of the last ``size`` events' terms (``event_terms``)."""

  def __init__(self, size: int):
    self.keys = np.zeros(size, np.int64)
    self.loss = np.zeros(size, np.float64)
    self.prob = np.zeros(size, np.float64)
    self.pos = 0  # where the next event goes
    self.filled = 0  # events held (<= size)
    self.seen = 0  # events added since the start
    self.reported = 0  # ``seen`` at the last report

  def add(self, terms) -> None:
    size, n = self.keys.size, terms[0].size
    self.seen += n
    if n >= size:  # only the last ``size`` events stay
      terms, n = [t[-size:] for t in terms], size
    first = min(n, size - self.pos)
    for ring, t in zip((self.keys, self.loss, self.prob), terms):
      ring[self.pos : self.pos + first] = t[:first]
      ring[: n - first] = t[first:]
    self.pos = (self.pos + n) % size
    self.filled = min(size, self.filled + n)

  def snapshot(self):
    """(a copy of the keys held, the sum of their losses, of their probabilities): what a report needs."""
    k = self.filled
    return self.keys[:k].copy(), float(self.loss[:k].sum()), float(self.prob[:k].sum())


def window_metrics(keys: np.ndarray, loss_sum: float, prob_sum: float) -> Dict[str, Optional[float]]:
  """AUC, logloss and calibration of events from their terms (float64, as the evaluation computes them).

  AUC is None (JSON null) where the events hold one class only, or none; logloss and calibration
  too where there are no events.
  """
  n = int(keys.size)
  if n == 0:
    return {"auc": None, "logloss": None, "calibration": None, "mean_prediction": None, "mean_label": None}
  n_pos = int(np.count_nonzero(keys & 1))
  return {
    "auc": metrics_lib.auc_of_keys(keys) if 0 < n_pos < n else None,
    "logloss": loss_sum / n,
    "calibration": (prob_sum / n) / (n_pos / n) if n_pos else None,
    "mean_prediction": prob_sum / n,
    "mean_label": n_pos / n,
  }


class ProgressiveValidation:
  """Windows of the last ``window`` scored events: one over every batch, one per source.

  ``add`` is called by the pusher thread, ``report`` by the training loop; a lock keeps them
  apart (an add copies one batch's terms in; a report copies the window's sort keys and sums its
  losses and probabilities, then sorts outside the lock).
  """

  def __init__(self, window: int):
    if window < 1:
      raise ValueError(f"progressive validation needs a window of at least one event, got {window}")
    self.window = int(window)
    self._lock = threading.Lock()
    self._all = _Window(self.window)
    self._sources: Dict[str, _Window] = {}
    self._add_s = 0.0  # the adds' time since the last report (on the pusher thread)

  def add(self, logits, labels, source: Optional[str] = None) -> None:
    """One batch's scores (taken before the batch trained the model) and labels; ``source``
    names where the batch came from (e.g. its file), or None."""
    if np.size(logits) != np.size(labels):
      raise ValueError(f"progressive validation: {np.size(logits)} logits for {np.size(labels)} labels")
    t0 = time.perf_counter()
    terms = event_terms(logits, labels)  # outside the lock: the report may be sorting
    with self._lock:
      self._all.add(terms)
      self._add_s += time.perf_counter() - t0
      if source is not None:
        w = self._sources.get(source)
        if w is None:
          w = self._sources[source] = _Window(self.window)
        w.add(terms)

  def take(self) -> "Taken":
    """What the next report covers, copied under the lock (the window's sort keys and sums, and
    those of every source that received events since the last one), for ``Taken.metrics`` to
    compute anywhere: the copy is quick, the sort of a million keys is not (30-50 ms), and the
    training loop that asks for a report must not wait for it. A source that received no events
    since the last report is dropped: that report covered all of its events."""
    with self._lock:
      snap = self._all.snapshot()
      seen = self._all.seen
      self._all.reported = seen
      add_ms, self._add_s = 1e3 * self._add_s, 0.0
      idle = [s for s, w in self._sources.items() if w.seen == w.reported]
      for s in idle:
        del self._sources[s]
      held = {}
      for s, w in self._sources.items():
        held[s] = (w.snapshot(), w.seen)
        w.reported = w.seen
    return Taken((snap, seen, add_ms), held)

  def report(self) -> Dict[str, Optional[float]]:
    """The metrics over the window now (``take().metrics()``'s first part)."""
    return self.take().metrics()[0]


class Taken:
  """A report's copies (``ProgressiveValidation.take``); ``metrics`` computes it."""

  def __init__(self, window, sources):
    self._window, self._sources = window, sources

  def metrics(self):
    """``(the metrics over the window, {source: its metrics})``: AUC, logloss, calibration... as
    ``window_metrics``, with ``events`` (held in the window), ``events_seen`` (added since the
    start) and, over the whole window, ``add_ms`` (what adding the events since the last report
    took the pusher thread)."""
    snap, seen, add_ms = self._window
    out = {**window_metrics(*snap), "events": int(snap[0].size), "events_seen": seen, "add_ms": add_ms}
    sources = {
      s: {**window_metrics(*snap), "events": int(snap[0].size), "events_seen": seen}
      for s, (snap, seen) in self._sources.items()
    }
    return out, sources
