"""Hot reload: the model version being served, replaced whole when a newer checkpoint appears.

``ModelHolder`` keeps one reference to the current ``Scorer``. A poller thread asks
``newest(workdir)`` every ``every_s`` seconds (cheap: it lists intact checkpoints and PS
snapshots); when a newer step appears, it builds the new scorer off the request path with
``load(workdir, step)`` and only then swaps the reference, in one assignment, so a batch that
took the reference keeps scoring with the version it took and the next batch gets the new one.
A load that fails is logged, the old version keeps serving, and the step is tried again at the
next poll (a snapshot still being written may be readable a moment later). Versions only move
forward: a step at or below the one served is never loaded.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from absl import logging

from recsys_jax.serving.api import RequestError, Scorer

Load = Callable[[str, Optional[int]], Scorer]
Newest = Callable[[str], Optional[int]]


class NoModel(RuntimeError):
  """The workdir holds no checkpoint to serve."""


class ModelHolder:
  """The version served now, and the poller that replaces it.

  Args:
    workdir: the training run's directory.
    load: ``load(workdir, step) -> Scorer`` (``serving.scorer.load_scorer``).
    newest: ``newest(workdir) -> step or None`` (``serving.scorer.newest_step``).
    step: serve this step (None: the newest).
    warm: called with a newly loaded version before it is swapped in (``Batcher.warm``: it compiles
      the batch shapes the traffic uses); a ``RequestError`` there (the new version refuses the
      recent requests: its schema changed) is logged and the version swapped in anyway, any other
      error fails the load.

  Raises:
    NoModel: no checkpoint in ``workdir``. The first load's own errors pass through.
  """

  def __init__(
    self,
    workdir: str,
    load: Load,
    newest: Newest,
    step: Optional[int] = None,
    warm: Optional[Callable[[Scorer], object]] = None,
  ):
    self.workdir, self._load, self._newest, self.warm = workdir, load, newest, warm
    if step is None:
      step = newest(workdir)
      if step is None:
        raise NoModel(f"no checkpoint in {workdir} to serve (train first, or point --workdir at a training run)")
    self._scorer = load(workdir, step)  # the one reference requests read; replaced whole, never changed
    self.step = step
    self.loads, self.failures = 1, 0
    self.last_error: Optional[str] = None
    self._failed_step: Optional[int] = None
    self._lock = threading.Lock()  # one check at a time (the poller, or a test calling check())
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def current(self) -> Scorer:
    """The version to use now (one attribute read: atomic)."""
    return self._scorer

  def check(self) -> bool:
    """Loads and swaps in the newest step if it is newer than the one served.

    Returns:
      Whether a new version is now served. A failed load returns False and keeps the old one.
    """
    with self._lock:
      try:
        step = self._newest(self.workdir)
      except Exception as e:  # noqa: BLE001 - a listing that fails (a directory being replaced) is tried again
        logging.warning("cannot list checkpoints in %s: %s", self.workdir, e)
        return False
      if step is None or step <= self.step:
        return False
      t0 = time.perf_counter()
      try:
        scorer = self._load(self.workdir, step)
        self._warm(scorer)
      except Exception as e:  # noqa: BLE001 - the old version keeps serving whatever went wrong
        self.failures += 1
        self.last_error = f"step {step}: {type(e).__name__}: {e}"
        if self._failed_step != step:  # once per step: a poll every second must not flood the log
          logging.warning("cannot load step %d from %s, still serving %s: %s", step, self.workdir, self.version, e)
          self._failed_step = step
        return False
      old = self._scorer.version
      self._scorer, self.step = scorer, step
      self.loads += 1
      self.last_error, self._failed_step = None, None
      logging.info(
        "now serving %s (was %s), loaded and warmed in %.2f s", scorer.version, old, time.perf_counter() - t0
      )
      return True

  def _warm(self, scorer: Scorer) -> None:
    if self.warm is None:
      return
    try:
      self.warm(scorer)
    except RequestError as e:
      logging.warning("%s refuses the recent requests (%s); serving it unwarmed", scorer.version, e)

  @property
  def version(self) -> str:
    return self._scorer.version

  def start(self, every_s: float) -> None:
    """Polls every ``every_s`` seconds in a daemon thread (0: never)."""
    if every_s <= 0 or self._thread is not None:
      return
    self._thread = threading.Thread(target=self._poll, args=(every_s,), name="serve-reload", daemon=True)
    self._thread.start()

  def _poll(self, every_s: float) -> None:
    while not self._stop.wait(every_s):
      try:
        self.check()
      except Exception:  # noqa: BLE001 - the poller must outlive any one failure
        logging.exception("reload check failed")

  def close(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
