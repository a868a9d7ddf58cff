"""One consistent cut of a run: dense train state, PS snapshot and input position.

The dense state and a JSON ``meta`` item (step, data position, the PS snapshot chain) are
saved side by side by one orbax ``CheckpointManager`` under ``<workdir>/checkpoints``. The
PS is written by ``async_ps.snapshot`` through tensorstore under ``<workdir>/ps_snapshots``:
a full snapshot every ``full_every`` checkpoints and incremental ones (only rows changed
since the previous checkpoint) in between; each checkpoint's meta names the chain it needs.

The caller saves only after the pushes of every step <= ``step`` are applied and before any
later push, which makes the parts agree. The PS snapshot is written first (to a temporary
directory, renamed when whole) and the orbax checkpoint last, also atomically, so a crash
at any point leaves the previous checkpoint as it was; snapshots no kept checkpoint refers
to are deleted only after a save succeeded.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

import jax
import orbax.checkpoint as ocp

from recsys_jax.async_ps import snapshot
from recsys_jax.parallel import distributed


class CheckpointError(RuntimeError):
  """A checkpoint that exists but cannot be read."""


def _without_empty(tree: Any) -> Any:
  """The tree with zero-size arrays as None: orbax refuses to save them, and they hold nothing
  (a model's kernel over no dense features, and its optimizer state)."""
  return jax.tree.map(lambda x: None if getattr(x, "size", 1) == 0 else x, tree)


def _with_empty(restored: Any, template: Any) -> Any:
  """Puts the template's zero-size arrays back where ``_without_empty`` left None."""

  def empty(x):
    return x is None or getattr(x, "size", 1) == 0

  leaves, treedef = jax.tree.flatten(template, is_leaf=lambda x: x is None)
  got = jax.tree.leaves(restored, is_leaf=lambda x: x is None)
  return jax.tree.unflatten(treedef, [t if empty(t) else r for t, r in zip(leaves, got, strict=True)])


class Checkpointer:
  """Saves and restores (dense state, PS, meta) in a workdir.

  Args:
    workdir: the run directory.
    max_to_keep: orbax checkpoints kept (with the PS snapshots their chains need).
    full_every: every this many saves the PS snapshot is full; incremental in between
      (1: always full).
  """

  def __init__(self, workdir: str, max_to_keep: int = 2, full_every: int = 1):
    if full_every < 1:
      raise ValueError(f"full_every must be >= 1, got {full_every}")
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.ps_directory = os.path.abspath(os.path.join(workdir, "ps_snapshots"))
    self.full_every = full_every
    self._mgr = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
      item_names=("state", "meta"),
    )
    self._chain: List[str] = []
    self._since_full = 0

  def latest_step(self) -> Optional[int]:
    return self._mgr.latest_step()

  def save(self, step: int, state: Any, ps, meta: Dict[str, Any]) -> None:
    """Writes checkpoint ``step`` (PS snapshot, then dense state + meta) and waits for it."""
    full = not self._chain or self._since_full + 1 >= self.full_every
    name = f"{step:010d}-{'full' if full else 'incr'}"
    chain = [name] if full else self._chain + [name]
    path = os.path.join(self.ps_directory, name)
    primary = jax.process_index() == 0
    if primary:
      shutil.rmtree(path, ignore_errors=True)  # an orphan from a crash after the PS write
    try:
      if hasattr(ps, "save_snapshot"):
        # Remote PS servers: one process asks them; each waits until every trainer's pushes of
        # the steps before ``step`` are applied, so the snapshot is one cut.
        if primary:
          ps.save_snapshot(path, incremental=not full, meta={"step": int(step)}, step=int(step))
      else:
        snapshot.save(ps, path, incremental=not full, meta={"step": int(step)})
      self._mgr.save(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardSave(_without_empty(state)),
          meta=ocp.args.JsonSave(dict(meta, step=int(step), ps_chain=chain)),
        ),
      )
      self._mgr.wait_until_finished()
    except BaseException:
      self._chain = []  # change tracking was reset by the snapshot: the next one must be full
      raise
    self._chain = chain
    self._since_full = 0 if full else self._since_full + 1
    self._collect_garbage(primary)

  def _collect_garbage(self, delete: bool = True) -> None:
    # Every process reads the metas (orbax reads are collective); only one deletes.
    needed = set(self._chain)
    for s in self._mgr.all_steps():
      try:
        needed.update(self._read_meta(s)["ps_chain"])
      except CheckpointError:
        return  # keep everything rather than guess
    if not delete:
      return
    for name in os.listdir(self.ps_directory) if os.path.isdir(self.ps_directory) else []:
      if name not in needed and not name.endswith(".tmp"):
        shutil.rmtree(os.path.join(self.ps_directory, name), ignore_errors=True)

  def _read_meta(self, step: int) -> Dict[str, Any]:
    path = os.path.join(self.directory, str(step))
    try:
      return self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # orbax raises many types; name the place and keep the cause
      raise CheckpointError(f"checkpoint {path}: meta cannot be read ({type(e).__name__}: {e})") from e

  def restore(self, step: int, state_template: Any, ps) -> Tuple[Any, Dict[str, Any]]:
    """Loads checkpoint ``step`` into ``ps`` and returns (dense state, meta).

    Raises:
      CheckpointError: naming the directory, if any part is missing or unreadable; the
        files are left as they are.
    """
    path = os.path.join(self.directory, str(step))
    meta = self._read_meta(step)
    try:
      args = ocp.args.Composite(state=ocp.args.StandardRestore(_without_empty(state_template)))
      state = _with_empty(self._mgr.restore(step, args=args).state, state_template)
    except Exception as e:
      raise CheckpointError(
        f"checkpoint {path} cannot be restored ({type(e).__name__}: {e}). It was left as it is; "
        f"move it away to resume from an earlier one, or use a new workdir."
      ) from e
    chain = list(meta.get("ps_chain", []))
    paths = [os.path.join(self.ps_directory, n) for n in chain]
    try:
      if hasattr(ps, "load_snapshot"):  # remote PS servers: loaded once, then every trainer goes on
        if jax.process_index() == 0:
          ps.load_snapshot(paths, step=int(step))
        distributed.barrier(f"ps restored at step {step}")
      else:
        snapshot.load(ps, paths)
    except (ValueError, OSError) as e:
      raise CheckpointError(f"checkpoint {path}: its PS snapshot chain {chain} cannot be loaded: {e}") from e
    self._chain = chain
    self._since_full = len(chain) - 1
    return state, meta

  def close(self) -> None:
    self._mgr.close()
