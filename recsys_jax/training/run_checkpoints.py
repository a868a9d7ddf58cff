"""A run's checkpoints: resuming from the latest one, and saving one consistent cut.

``recsys_jax.checkpoint.Checkpointer`` writes and reads (dense state, PS snapshot,
meta); this adds what a run must agree on to resume (batch size, trainer processes, data
source) and the reader positions of the steps not yet saved, so a checkpoint after step t
holds the position just after batch t.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import jax

from recsys_jax import checkpoint as checkpoint_lib
from recsys_jax import write_waits
from recsys_jax.async_ps.protocol import RowStore
from recsys_jax.data import follow
from recsys_jax.parallel import distributed
from recsys_jax.training import run_config
from recsys_jax.training.writers import say

if TYPE_CHECKING:
  from recsys_jax.training.hot_rows import HotRows


class RunCheckpoints:
  """Resumes and saves a run's checkpoints under ``<workdir>/checkpoints``.

  Args:
    workdir: the run directory.
    config: the run's config (``max_checkpoints``, ``checkpoint_full_every``, and the fields
      a resume must match).
  """

  def __init__(self, workdir: str, config):
    self.config = config
    self.workdir = workdir
    self.ckpt = checkpoint_lib.Checkpointer(
      workdir, max_to_keep=config.max_checkpoints, full_every=config.checkpoint_full_every
    )
    self.directory = self.ckpt.directory
    self.latest: Optional[int] = None
    """The checkpoint this run resumed from (None: a fresh run); set by ``restore_latest``."""
    self._latest_meta: Dict[str, Any] = {}
    self.last_saved: Optional[int] = None
    self.positions: Dict[int, Any] = {}
    """The reader's position after each step's batch, since the last save."""
    self.after_save: Optional[Callable[[Optional[int]], None]] = None
    """Called with ``covered()`` after each save (the publisher prunes the deltas it covers)."""
    write_waits.note_last_good(self.last_good)  # named if a write hangs after SIGTERM

  def restore_latest(self, state, ps: RowStore, announce: bool = True) -> Tuple[Any, int, Any]:
    """Loads the newest intact checkpoint, if any, into ``ps`` (damaged newer ones are set
    aside, each named in one line: ``recsys_jax.checkpoint.Checkpointer.restore_newest_intact``).
    ``announce``: say "resumed from ..." (a run resuming; ``build_job`` says its own line).

    Returns:
      ``(state, start, position)``: the dense state, the first step to train and the
      reader's position; ``(state, 0, None)`` if the workdir holds no checkpoint.

    Raises:
      ValueError: if the checkpoint was written by a run that reads other data, in other
        batches or with another number of trainer processes.
      CheckpointError: if no checkpoint can be read; they are left as they are.
    """
    config = self.config
    start, position = 0, None
    try:
      restored = self.ckpt.restore_newest_intact(state, ps, warn=say)
    except checkpoint_lib.CheckpointError as e:
      differ = run_config.differences_from_written(self.workdir, config)
      if not differ:
        raise
      # The checkpoints are intact; the config given shapes another state than the one they hold.
      shown = "; ".join(f"{k} = {a!r} there, {b!r} here" for k, a, b in differ[:3])
      more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
      raise ValueError(
        f"{self.directory} holds checkpoints of another config ({run_config.newest_name(self.workdir)}): "
        f"{shown}{more}; they cannot be restored into this one: use a new --workdir, or the values they were written with"
      ) from e
    self.latest = self.last_saved = restored[0] if restored else None
    if restored is not None:
      latest, state, meta = restored
      self._latest_meta = meta
      where = f"{self.directory}/{latest}"
      if meta.get("batch_size") != config.batch_size:
        raise ValueError(
          f"{where} was written with batch_size={meta.get('batch_size')}, "
          f"config has {config.batch_size}: the data position would not match; use a new workdir"
        )
      start = int(meta["data_position"])
      position = meta.get("reader_position", {"batch": start})
      written_by = len(meta.get("reader_positions", [None]))  # a one-process run stores no list
      if written_by != jax.process_count():
        raise ValueError(
          f"{where} was written by {written_by} trainer process(es), this job has "
          f"{jax.process_count()}: each reads its own part of the data, so the split would not match; use a new workdir"
        )
      if written_by > 1:
        position = meta["reader_positions"][jax.process_index()]
      if meta.get("data") not in (None, config.data.name):
        raise ValueError(
          f"{where} was written reading data {meta['data']!r}, config has {config.data.name!r}: use a new workdir"
        )
      if announce:
        say(f"resumed from {where} at step {start}{_of(config.num_steps, position)}")
    self.positions = {start - 1: position}
    return state, start, position

  def save(self, step: int, state, ps: RowStore, pusher, hot: Optional[HotRows] = None) -> None:
    """Saves the cut after ``step - 1``: waits for the pushes of steps < step (none later is made).

    ``hot``: the run's hot rows: once the pushes are in, the hot rows go back into
    the PS before its snapshot (so it has every row), and the hot set is a part of the checkpoint,
    written before its commit (a checkpoint is never committed without it).

    Raises:
      CheckpointError: the checkpoint could not be written (one line: what, where, and the last
        good checkpoint, which is left as it was).
    """
    pusher.flush(step - 1)
    if hot is not None:
      hot.write_back(ps)
    meta = {"data_position": step, "batch_size": self.config.batch_size, "data": self.config.data.name}
    meta["reader_position"] = self.positions[step - 1]
    if jax.process_count() > 1:  # every process's own position, in process order
      meta["reader_positions"] = distributed.allgather_json(self.positions[step - 1])
    for k in [k for k in self.positions if k < step - 1]:
      del self.positions[k]
    parts = {}
    if hot is not None and hot.enabled:
      parts[hot.state_name()] = functools.partial(hot.save_state, step=step)
    try:
      self.ckpt.save(step, state, ps, meta, parts)
    except checkpoint_lib.CheckpointError as e:
      raise checkpoint_lib.CheckpointError(f"{e}; last good checkpoint: {self.last_good()} (left as it was)") from e
    self.last_saved = step
    if self.after_save is not None:
      self.after_save(self.covered())

  def covered(self) -> Optional[int]:
    """The older of the two newest checkpoints kept (None with fewer): deltas published at or
    before it are in both, so a model server that loads either needs none of them."""
    steps = self.ckpt.all_steps()
    return steps[-2] if len(steps) >= 2 else None

  def latest_part(self, name: str) -> Optional[str]:
    """Where the part ``name`` of the checkpoint this run resumed from is (None: a fresh run)."""
    return None if self.latest is None else self.ckpt.part_path(self.latest, self._latest_meta, name)

  def latest_dir(self) -> Optional[str]:
    """The directory of the checkpoint this run resumed from (None: a fresh run)."""
    return None if self.latest is None else os.path.join(self.directory, str(self.latest))

  def last_good(self) -> str:
    """The directory of the last checkpoint saved or resumed from ('none' if there is none): a save
    that failed or hangs after its commit (deleting older ones) counts, as a resume would take it."""
    last = max((s for s in (self.last_saved, self.ckpt.committed) if s is not None), default=None)
    return "none" if last is None else os.path.join(self.directory, str(last))

  def close(self) -> None:
    self.ckpt.close()


def _of(num_steps: int, position: Any) -> str:
  """Where a resumed run stands: ``of <num_steps>``, or for a run without a step limit what ends it
  and, on a stream, the file and record it reads on from."""
  if num_steps >= 0:
    return f" of {num_steps}"
  where = ""
  if isinstance(position, dict) and "done" in position:
    where = f", reading on at {follow.describe(position)}"
  return f" (num_steps=-1: until the stream ends or the run is stopped){where}"
