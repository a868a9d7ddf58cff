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
from typing import Dict, Optional

import numpy as np

from recsys_jax import metrics as metrics_lib


def window_of(config) -> int:
  """``config.progressive.window``: events in the window, 0 (off) where the config has none."""
  section = config.get("progressive") if hasattr(config, "get") else None
  return int(section.get("window", 0)) if section is not None else 0


class _Window:
  """A ring of the last ``size`` events' logits and labels (float32, one byte)."""

  def __init__(self, size: int):
    self.logits = np.zeros(size, np.float32)
    self.labels = np.zeros(size, np.uint8)
    self.pos = 0  # where the next event goes
    self.filled = 0  # events held (<= size)
    self.seen = 0  # events added since the start
    self.reported = 0  # ``seen`` at the last report

  def add(self, logits: np.ndarray, labels: np.ndarray) -> None:
    size, n = self.logits.size, logits.size
    self.seen += n
    if n >= size:  # only the last ``size`` events stay
      logits, labels, n = logits[-size:], labels[-size:], size
    first = min(n, size - self.pos)
    self.logits[self.pos : self.pos + first] = logits[:first]
    self.labels[self.pos : self.pos + first] = labels[:first]
    self.logits[: n - first] = logits[first:]
    self.labels[: n - first] = labels[first:]
    self.pos = (self.pos + n) % size
    self.filled = min(size, self.filled + n)

  def held(self):
    """Copies of the events held (in ring order: the metrics do not depend on the order)."""
    return self.logits[: self.filled].copy(), self.labels[: self.filled].copy()


def window_metrics(logits: np.ndarray, labels: np.ndarray) -> Dict[str, Optional[float]]:
  """AUC, logloss and calibration of events (float64, as the evaluation computes them).

  AUC is None (JSON null) where the events hold one class only, or none; logloss and calibration
  too where there are no events.
  """
  n = int(labels.size)
  if n == 0:
    return {"auc": None, "logloss": None, "calibration": None, "mean_prediction": None, "mean_label": None}
  y = labels.astype(np.float64)
  p = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
  n_pos = int(labels.sum())
  return {
    "auc": metrics_lib.auc_float32(labels, logits) if 0 < n_pos < n else None,
    "logloss": metrics_lib.logloss(y, p),
    "calibration": metrics_lib.calibration(y, p) if n_pos else None,
    "mean_prediction": float(p.mean()),
    "mean_label": n_pos / n,
  }


class ProgressiveValidation:
  """Windows of the last ``window`` scored events: one over every batch, one per source.

  ``add`` is called by the pusher thread, ``report`` by the training loop; a lock keeps them
  apart (an add copies one batch; a report copies the window, then computes outside the lock).
  """

  def __init__(self, window: int):
    if window < 1:
      raise ValueError(f"progressive validation needs a window of at least one event, got {window}")
    self.window = int(window)
    self._lock = threading.Lock()
    self._all = _Window(self.window)
    self._sources: Dict[str, _Window] = {}

  def add(self, logits, labels, source: Optional[str] = None) -> None:
    """One batch's scores (taken before the batch trained the model) and labels; ``source``
    names where the batch came from (e.g. its file), or None."""
    z = np.asarray(logits, np.float32).reshape(-1)
    y = (np.asarray(labels).reshape(-1) > 0.5).astype(np.uint8)
    if z.shape != y.shape:
      raise ValueError(f"progressive validation: {z.size} logits for {y.size} labels")
    with self._lock:
      self._all.add(z, y)
      if source is not None:
        w = self._sources.get(source)
        if w is None:
          w = self._sources[source] = _Window(self.window)
        w.add(z, y)

  def report(self) -> Dict[str, Optional[float]]:
    """The metrics over the window (``events``: held in it; ``events_seen``: added since the start)."""
    with self._lock:
      z, y = self._all.held()
      seen = self._all.seen
      self._all.reported = seen
    return {**window_metrics(z, y), "events": int(y.size), "events_seen": seen}

  def report_sources(self) -> Dict[str, Dict[str, Optional[float]]]:
    """Per source that received events since the last call: the metrics over its window (its
    last ``window`` events). A source that received none since is dropped: the last report
    that named it covered all of its events."""
    with self._lock:
      idle = [s for s, w in self._sources.items() if w.seen == w.reported]
      for s in idle:
        del self._sources[s]
      held = {}
      for s, w in self._sources.items():
        held[s] = (*w.held(), w.seen)
        w.reported = w.seen
    return {s: {**window_metrics(z, y), "events": int(y.size), "events_seen": seen} for s, (z, y, seen) in held.items()}
