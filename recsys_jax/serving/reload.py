"""Hot reload: the model version being served, replaced whole when a newer checkpoint appears.

``ModelHolder`` keeps one reference to the current ``Scorer``. A poller thread lists the complete
checkpoints every ``every_s`` seconds (cheap: ``steps(workdir)``, newest first); when one newer
than the version served appears, it builds the new scorer off the request path with
``load(workdir, step)`` and only then swaps the reference, in one assignment, so a batch that
took the reference keeps scoring with the version it took and the next batch gets the new one.

Versions only move forward, to intact ones: at start and at every poll the newest checkpoint that
loads is served. A load that fails because the trainer rotated the step away meanwhile is tried
again at once against the then-newest step; a step that is still there and fails to load is
damaged: it is named once in the log and in ``skipped`` (``/v1/model``), and skipped until its
files change (``signature(workdir, step)``), so an intact older step newer than the one served,
or a newer one appearing later, is served instead. A step at or below the one served is never
loaded.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional

from absl import logging

from recsys_jax.serving.api import RequestError, Scorer

Load = Callable[[str, Optional[int]], Scorer]
Newest = Callable[[str], Optional[int]]
Steps = Callable[[str], List[int]]
Signature = Callable[[str, int], Any]
TRIES = 8  # loads in one check: each failure is a step rotated away or a damaged one, skipped after


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
    steps: ``steps(workdir) -> complete steps, newest first`` (``serving.scorer.complete_steps``);
      None: only ``newest``'s step is a candidate.
    signature: ``signature(workdir, step) -> value`` that changes when the step's files change
      (``serving.scorer.step_signature``); None: a damaged step is skipped for good.

  Raises:
    NoModel: no checkpoint in ``workdir``, or none that loads (naming each one's error). With
      ``step`` given, that load's own errors pass through.
  """

  def __init__(
    self,
    workdir: str,
    load: Load,
    newest: Newest,
    step: Optional[int] = None,
    warm: Optional[Callable[[Scorer], object]] = None,
    steps: Optional[Steps] = None,
    signature: Optional[Signature] = None,
  ):
    self.workdir, self._load, self._newest, self.warm = workdir, load, newest, warm
    self._steps, self._signature = steps, signature
    self.loads, self.failures = 0, 0
    self.last_error: Optional[str] = None
    self.skipped: Dict[int, str] = {}  # damaged steps -> why, until their files change
    self._skip_sig: Dict[int, Any] = {}
    self._lock = threading.Lock()  # one check at a time (the poller, or a test calling check())
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None
    if step is not None:
      self._scorer = load(workdir, step)  # the one reference requests read; replaced whole, never changed
    else:
      said: List[str] = []  # said once the server serves; an error that stops it names them itself
      got = self._load_newest(None, warm=False, said=said)
      if got is None:
        if self.skipped:
          why = "; ".join(f"step {s}: {e}" for s, e in sorted(self.skipped.items(), reverse=True))
          raise NoModel(f"no checkpoint in {workdir} loads: {why}")
        raise NoModel(f"no checkpoint in {workdir} to serve (train first, or point --workdir at a training run)")
      self._scorer, step = got
      for line in said:
        logging.warning("%s", line)
    self.step = step
    self.loads = 1

  def current(self) -> Scorer:
    """The version to use now (one attribute read: atomic)."""
    return self._scorer

  def check(self) -> bool:
    """Loads and swaps in the newest intact step if it is newer than the one served.

    Returns:
      Whether a new version is now served. A failed load returns False and keeps the old one.
    """
    with self._lock:
      t0 = time.perf_counter()
      got = self._load_newest(self.step, warm=True)
      if got is None:
        return False
      scorer, step = got
      old = self._scorer.version
      self._scorer, self.step = scorer, step
      self.loads += 1
      self.last_error = None
      logging.info(
        "now serving %s (was %s), loaded and warmed in %.2f s", scorer.version, old, time.perf_counter() - t0
      )
      return True

  def _candidates(self, floor: Optional[int]) -> List[int]:
    """Complete steps above ``floor``, newest first, less the damaged ones whose files did not change."""
    try:
      steps = list(self._steps(self.workdir)) if self._steps is not None else [self._newest(self.workdir)]
    except Exception as e:  # noqa: BLE001 - a listing that fails (a directory being replaced) is tried again
      logging.warning("cannot list checkpoints in %s: %s", self.workdir, e)
      return []
    out = []
    for s in steps:
      if s is None or (floor is not None and s <= floor):
        continue
      if s in self.skipped:
        if self._signature is None or self._sig(s) == self._skip_sig.get(s):
          continue
        del self.skipped[s], self._skip_sig[s]  # its files changed: worth another try
      out.append(s)
    return out

  def _sig(self, step: int) -> Any:
    if self._signature is None:
      return None
    try:
      return self._signature(self.workdir, step)
    except Exception:  # noqa: BLE001 - gone or unreadable: a value unlike the one recorded
      return None

  def _load_newest(self, floor: Optional[int], warm: bool, said: Optional[List[str]] = None):
    """(scorer, step) of the newest step above ``floor`` that loads, or None."""
    for _ in range(TRIES):
      cands = self._candidates(floor)
      if not cands:
        return None
      step = cands[0]
      try:
        scorer = self._load(self.workdir, step)
        if warm:
          self._warm(scorer)
        return scorer, step
      except Exception as e:  # noqa: BLE001 - the old version keeps serving whatever went wrong
        self.failures += 1
        self.last_error = f"step {step}: {type(e).__name__}: {e}"
        if step not in self._candidates(floor):
          # The trainer rotated it away mid-load: the then-newest step is tried at once.
          logging.info("step %d of %s went away while it was loaded; trying the newest one", step, self.workdir)
          continue
        sig = self._sig(step) if self._signature is not None else None
        self.skipped[step], self._skip_sig[step] = f"{type(e).__name__}: {e}", sig
        line = (
          f"checkpoint step {step} of {self.workdir} cannot be served ({type(e).__name__}: {e}); skipping it "
          f"until its files change, serving {'the newest intact one' if floor is None else self.version}"
        )
        if said is None:
          logging.warning("%s", line)
        else:
          said.append(line)
    return None

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
