"""A PS server's export and import of rows with their optimizer slots: ``RowsService``, a mixin of
``service.ShardService``.

The trainer moves its hottest rows, with their optimizer slots, to the accelerator and back, and
writes them back before a checkpoint. ``export_rows`` reads rows of distinct ids once the pushes
of the steps before ``step`` (if given) are applied, so that no gradient still on its way is
missing from what it reads; ``import_rows`` sets rows and their slots. Both run under the lock
that steps are applied under (``_apply_lock``), so neither sees nor changes a step's update half
applied, and a server whose restore failed refuses both.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from recsys_jax.async_ps.budget import Active, TimeLeft
from recsys_jax.async_ps.errors import ServiceError

Rows = Dict[str, Tuple[np.ndarray, Dict[str, np.ndarray]]]


class RowsService:
  """``export_rows`` and ``import_rows`` of a ``ShardService`` (over its tables, locks and steps)."""

  def _wait_before(self, step: Optional[int], what: str, time_left: TimeLeft, active: Active) -> None:
    """Holding ``_cond``: with a step, refuses one too far ahead and waits until every step before
    it is applied; refuses while the tables are broken (a failed restore)."""
    if step is not None:
      self._check_step(step, what)
      self._wait_applied(step - 1, time_left, active, what)
    elif self._broken is not None:
      raise ServiceError("FAILED_PRECONDITION", self._broken)

  def _refuse_broken(self) -> None:
    # Under _apply_lock: a Restore sets _broken holding it.
    if self._broken is not None:
      raise ServiceError("FAILED_PRECONDITION", self._broken)

  def export_rows(
    self,
    ids: Mapping[str, np.ndarray],
    step: Optional[int],
    time_left: TimeLeft,
    active: Active,
    admit: Optional[Callable[[], None]] = None,
  ) -> Rows:
    """Rows of distinct ids with their optimizer slots (``ParameterServer.export_rows_many``).

    With a step, first waits until the pushes of every step before it are applied (as a
    snapshot does), then ``admit`` (which may wait for memory: a call waiting for pushes holds
    none).

    Returns:
      {table: (float32 weights, {slot: float32 values})}.
    """
    with self._cond:
      self._wait_before(
        step, "an export of rows" if step is None else f"the export of rows at step {step}", time_left, active
      )
    if admit is not None:
      admit()
    with self._apply_lock:
      self._refuse_broken()
      return self.ps.export_rows_many(ids)

  def import_rows(self, rows: Mapping[str, Tuple[np.ndarray, np.ndarray, Mapping[str, np.ndarray]]]) -> Dict[str, Any]:
    """Sets rows and their optimizer slots (``ParameterServer.import_rows_many``; ``rows`` as
    ``ParameterServer.check_import`` returns them).

    Returns:
      {'rows': rows imported per table}.
    """
    with self._apply_lock:
      self._refuse_broken()
      self.ps.import_rows_many(rows, checked=True)
    return {"rows": {t: int(r[0].shape[0]) for t, r in rows.items()}}
