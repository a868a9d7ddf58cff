"""One consistent cut of a run: dense train state, PS snapshot and input position.

The dense state and a JSON ``meta`` item (step, data position, the PS snapshot chain) are
saved side by side by one orbax ``CheckpointManager`` under ``<workdir>/checkpoints``. The
PS is written by ``async_ps.snapshot`` through tensorstore under ``<workdir>/ps_snapshots``:
a full snapshot every ``full_every`` checkpoints and incremental ones (only rows changed
since the previous checkpoint) in between; each checkpoint's meta names the chain it needs.

A run's other state (the hot set: one file per trainer process) goes with a checkpoint as its
*parts*: files under ``<workdir>/checkpoint_parts/<step>/``, each written and synced before the
commit, with its CRC32 recorded in the meta. A checkpoint is thus committed only with every part
in place, and one whose part is missing or fails its checksum is damaged like one whose dense
state is (set aside at a resume; the previous one is used).

The caller saves only after the pushes of every step <= ``step`` are applied and before any
later push, which makes the parts agree. The PS snapshot and the parts are written first (to
temporary names, renamed when whole) and the orbax checkpoint last, also atomically, so a crash
at any point leaves the previous checkpoint as it was; snapshots and parts no kept checkpoint
refers to are deleted only after a save succeeded.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from recsys_jax import checkpoint_files, write_waits
from recsys_jax import workdir as workdir_lib
from recsys_jax.async_ps.protocol import RowStore
from recsys_jax.parallel import distributed


class CheckpointError(RuntimeError):
  """A checkpoint that exists but cannot be read, or one that cannot be written."""


# Status codes with which a remote PS server refuses to restore a snapshot that is damaged or missing.
_SNAPSHOT_REFUSED = ("FAILED_PRECONDITION", "NOT_FOUND")


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


def checksums(state: Any) -> Dict[str, str]:
  """CRC32 of every non-empty array of a dense state, by tree path (hex strings).

  Read from this process's own shards (``distributed.local_copy``), so every process
  computes the same values without communication.
  """
  flat = jax.tree_util.tree_flatten_with_path(_without_empty(state))[0]
  arrays = distributed.local_copy([x for _, x in flat])
  return {
    jax.tree_util.keystr(path): f"{zlib.crc32(np.ascontiguousarray(a).tobytes()) & 0xFFFFFFFF:08x}"
    for (path, _), a in zip(flat, arrays)
  }


def meta_checksum(meta: Dict[str, Any]) -> str:
  """CRC32 of a meta dict without its own ``meta_crc32``, over its canonical JSON.

  The dense arrays have their own checksums (``state_crc32``, inside the meta); this one covers
  the rest: a bit flipped in a digit of ``data_position`` still leaves valid JSON, which would
  otherwise resume from the wrong record.
  """
  rest = {k: v for k, v in meta.items() if k != "meta_crc32"}
  return f"{zlib.crc32(json.dumps(rest, sort_keys=True, separators=(',', ':')).encode()) & 0xFFFFFFFF:08x}"


def _first_mismatch(expected: Dict[str, str], got: Dict[str, str]) -> Optional[str]:
  for name in sorted(set(expected) | set(got)):
    if expected.get(name) != got.get(name):
      return f"{name} (written {expected.get(name)}, read {got.get(name)})"
  return None


class Checkpointer:
  """Saves and restores (dense state, PS, meta) in a workdir.

  Every save records a CRC32 of each dense array in the meta, reads the state back and
  compares before older checkpoints are deleted, so the newest checkpoint kept is always a
  verified one. A restore compares the checksums before the state is used.

  Args:
    workdir: the run directory.
    max_to_keep: orbax checkpoints kept (with the PS snapshots their chains need).
    full_every: every this many saves the PS snapshot is full; incremental in between
      (1: always full).
  """

  def __init__(self, workdir: str, max_to_keep: int = 2, full_every: int = 1):
    if full_every < 1:
      raise ValueError(f"full_every must be >= 1, got {full_every}")
    self.directory = workdir_lib.checkpoints(workdir)
    self.ps_directory = workdir_lib.ps_snapshots(workdir)
    self.damaged_directory = workdir_lib.checkpoints_damaged(workdir)
    self.parts_directory = workdir_lib.all_checkpoint_parts(workdir)
    self._workdir = os.path.abspath(workdir)
    self.full_every = full_every
    self.max_to_keep = max_to_keep
    self._mgr = self._open()
    self._chain: List[str] = []
    self._since_full = 0
    self._failed: Optional[BaseException] = None  # the last save's error, if it failed
    self.committed: Optional[int] = None
    """The step of the last checkpoint this process saved that was committed and read back intact."""

  def step_dir(self, step: int) -> str:
    """The directory of the checkpoint at ``step`` (as errors and write waits name it)."""
    return os.path.join(self.directory, str(step))

  def _open(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
      self.directory,
      # Rotation is ours (``_rotate``): orbax would delete old checkpoints before the new one is
      # verified. lightweight_initialize: orbax reads no step's _CHECKPOINT_METADATA when it lists
      # the steps (it only feeds time- and metric-based retention, which we do not use), so one
      # damaged file cannot stop it from starting; a restore of that step fails and falls back.
      options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True, lightweight_initialize=True),
      item_names=("state", "meta"),
    )

  def save(
    self,
    step: int,
    state: Any,
    ps: RowStore,
    meta: Dict[str, Any],
    parts: Optional[Mapping[str, checkpoint_files.PartWriter]] = None,
  ) -> None:
    """Writes checkpoint ``step`` (PS snapshot and parts, then dense state + meta) and waits for it.

    Args:
      parts: this process's parts, by file name (unique over the processes: e.g. with the process
        index in it); every process's are written before the commit, their CRC32s in the meta.

    Raises:
      CheckpointError: one line naming what could not be written and where (a full disk, a
        failed orbax or tensorstore write); the checkpoints saved before are left as they were.
      ConnectionError: a remote PS server out of reach.
    """
    where = self.step_dir(step)
    try:
      with write_waits.writing(f"checkpoint {where}"):
        self._save(step, state, ps, meta, dict(parts or {}))
    except BaseException as e:
      self._chain = []  # change tracking was reset by the snapshot: the next one must be full
      self._failed = e
      if isinstance(e, (CheckpointError, ConnectionError)) or not isinstance(e, Exception):
        raise
      raise CheckpointError(f"checkpoint {where} could not be written: {checkpoint_files.cause(e)}") from e

  def _save(
    self, step: int, state: Any, ps: RowStore, meta: Dict[str, Any], parts: Dict[str, checkpoint_files.PartWriter]
  ) -> None:
    full = not self._chain or self._since_full + 1 >= self.full_every
    name = f"{step:010d}-{'full' if full else 'incr'}"
    chain = [name] if full else self._chain + [name]
    path = os.path.join(self.ps_directory, name)
    primary = jax.process_index() == 0
    crc = checksums(state)
    if primary:
      shutil.rmtree(path, ignore_errors=True)  # an orphan from a crash after the PS write
    checkpoint_files.fault_point("before_snapshot", step, self._workdir)
    # Remote PS servers: one process asks them; each waits until every trainer's pushes of
    # the steps before ``step`` are applied, so the snapshot is one cut. (An in-process PS has
    # one trainer process.)
    try:
      if primary:
        with write_waits.writing(f"checkpoint {self.step_dir(step)} (its PS snapshot {path})"):
          ps.save_snapshot(path, incremental=not full, meta={"step": int(step)}, step=int(step))
    except ConnectionError:
      raise  # a PS server out of reach says nothing about the checkpoint
    except Exception as e:
      raise CheckpointError(
        f"checkpoint {self.step_dir(step)} could not be written: its PS snapshot {path}: {checkpoint_files.cause(e)}"
      ) from e
    checkpoint_files.fault_point("before_parts", step, self._workdir)
    meta = dict(meta, step=int(step), ps_chain=chain, state_crc32=crc, parts_crc32=self._write_parts(step, parts))
    meta["meta_crc32"] = meta_checksum(meta)
    checkpoint_files.fault_point("before_commit", step, self._workdir)
    where = self.step_dir(step)
    with write_waits.writing(f"checkpoint {where} (its dense state and meta, by orbax)"):
      self._mgr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(_without_empty(state)), meta=ocp.args.JsonSave(meta)),
      )
      self._mgr.wait_until_finished()
    checkpoint_files.fault_point("committed", step, self._workdir)
    with write_waits.writing(f"checkpoint {where} (read back to be checked)"):
      self._verify(step, self._read_state(step, state), crc)
    self.committed = step
    self._chain = chain
    self._since_full = 0 if full else self._since_full + 1
    self._rotate()
    self._collect_garbage(primary)
    checkpoint_files.fault_point("collected", step, self._workdir)

  def _write_parts(self, step: int, parts: Dict[str, checkpoint_files.PartWriter]) -> Dict[str, str]:
    """Writes this process's parts of checkpoint ``step``; every process's CRC32s, by file name.

    A process that cannot write its part still joins the gather, so that every process fails the
    save with the same line instead of the others waiting for it."""
    directory = workdir_lib.checkpoint_parts(self._workdir, step)
    mine: Dict[str, Any] = {}
    where = directory
    try:
      if parts:
        os.makedirs(directory, exist_ok=True)
      for name, write in sorted(parts.items()):
        where = os.path.join(directory, name)
        with write_waits.writing(f"checkpoint {self.step_dir(step)} (its part {where})"):
          mine[name] = checkpoint_files.write_part(where, write)
    except Exception as e:
      mine = {"": f"{where}: {checkpoint_files.cause(e)}"}
    every = distributed.allgather_json(mine) if jax.process_count() > 1 else [mine]
    crcs: Dict[str, str] = {}
    for got in every:
      if "" in got:
        raise CheckpointError(f"checkpoint {self.step_dir(step)} could not be written: its part {got['']}")
      crcs.update(got)
    return crcs

  def part_path(self, step: int, meta: Dict[str, Any], name: str) -> str:
    """Where checkpoint ``step``'s part ``name`` is: under ``checkpoint_parts/<step>/``, or, for a
    checkpoint written before parts were (its meta lists none), inside the checkpoint directory."""
    if "parts_crc32" in meta:
      return os.path.join(workdir_lib.checkpoint_parts(self._workdir, step), name)
    return os.path.join(self.step_dir(step), name)

  def _check_parts(self, step: int, meta: Dict[str, Any]) -> None:
    for name, crc in sorted(meta.get("parts_crc32", {}).items()):
      path = os.path.join(workdir_lib.checkpoint_parts(self._workdir, step), name)
      try:
        got = checkpoint_files.file_crc32(path)
      except OSError as e:
        raise CheckpointError(
          f"checkpoint {self.step_dir(step)} is damaged: its part {path} cannot be read "
          f"({e.strerror or type(e).__name__})"
        ) from e
      if got != crc:
        raise CheckpointError(
          f"checkpoint {self.step_dir(step)} is damaged: its part {path} does not match "
          f"its checksum (written {crc}, read {got})"
        )

  def _rotate(self) -> None:
    # Only after the newest checkpoint was read back intact.
    steps = sorted(self._mgr.all_steps())
    for s in steps[: max(0, len(steps) - self.max_to_keep)]:
      self._mgr.delete(s)

  def _read_state(self, step: int, template: Any) -> Any:
    args = ocp.args.Composite(state=ocp.args.StandardRestore(_without_empty(template)))
    return _with_empty(self._mgr.restore(step, args=args).state, template)

  def _verify(self, step: int, state: Any, expected: Optional[Dict[str, str]]) -> None:
    if expected is None:  # written before checksums were recorded
      return
    bad = _first_mismatch(expected, checksums(state))
    if bad:
      raise CheckpointError(f"checkpoint {self.step_dir(step)} is damaged: {bad} does not match its checksum")

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
    # Parts of steps no checkpoint is kept for; those after the newest may be a save under way
    # (or one a crash cut short, which the next save of that step replaces).
    kept = set(self._mgr.all_steps())
    for name in os.listdir(self.parts_directory) if os.path.isdir(self.parts_directory) else []:
      if name.isdigit() and int(name) not in kept and kept and int(name) < max(kept):
        shutil.rmtree(os.path.join(self.parts_directory, name), ignore_errors=True)

  def _read_meta(self, step: int) -> Dict[str, Any]:
    path = self.step_dir(step)
    try:
      meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # orbax raises many types; name the place and keep the cause
      raise CheckpointError(
        f"checkpoint {path}: meta cannot be read ({type(e).__name__}: {checkpoint_files.short(e)})"
      ) from e
    if not isinstance(meta, dict):
      raise CheckpointError(f"checkpoint {path}: meta is damaged: not a JSON object")
    # Checkpoints written before meta checksums have none and are read as before (a damaged
    # meta_crc32 key alone leaves the rest intact, so reading such a meta unchecked is right too).
    if "meta_crc32" in meta:
      got = meta_checksum(meta)
      if meta["meta_crc32"] != got:
        raise CheckpointError(
          f"checkpoint {path} is damaged: its meta does not match its checksum "
          f"(written {meta['meta_crc32']}, read {got})"
        )
    return meta

  def read_dense(self, step: int, state_template: Any) -> Tuple[Any, Dict[str, Any]]:
    """Reads checkpoint ``step``'s dense state (checked against its CRC32s) and meta; no PS.

    Raises:
      CheckpointError: naming the directory, if either is missing, unreadable or damaged.
    """
    path = self.step_dir(step)
    meta = self._read_meta(step)
    self._check_parts(step, meta)
    try:
      state = self._read_state(step, state_template)
    except Exception as e:
      raise CheckpointError(
        f"checkpoint {path} cannot be restored ({type(e).__name__}: {checkpoint_files.short(e)}). It was left as it is; "
        f"move it away to resume from an earlier one, or use a new workdir."
      ) from e
    self._verify(step, state, meta.get("state_crc32"))
    return state, meta

  def all_steps(self) -> List[int]:
    return sorted(self._mgr.all_steps())

  def restore(self, step: int, state_template: Any, ps: RowStore) -> Tuple[Any, Dict[str, Any]]:
    """Loads checkpoint ``step`` into ``ps`` and returns (dense state, meta).

    Raises:
      CheckpointError: naming the directory, if any part is missing or unreadable (remote PS
        servers included: they refuse a damaged snapshot); the files are left as they are.
      ConnectionError: a remote PS server out of reach, which says nothing about the checkpoint.
    """
    path = self.step_dir(step)
    state, meta = self.read_dense(step, state_template)
    chain = list(meta.get("ps_chain", []))
    paths = [os.path.join(self.ps_directory, n) for n in chain]
    try:
      if jax.process_index() == 0:  # remote PS servers: loaded once, then every trainer goes on
        ps.load_snapshot(paths, step=int(step))
      distributed.barrier(f"ps restored at step {step}")
    except ConnectionError as e:
      # A server that answered that the snapshot is damaged or missing was reached: the checkpoint
      # is at fault (and a restore of an older one clears the server's partial tables).
      if getattr(getattr(e, "code", None), "name", None) not in _SNAPSHOT_REFUSED:
        raise  # a PS server out of reach says nothing about the checkpoint
      raise CheckpointError(
        f"checkpoint {path}: its PS snapshot chain {chain} cannot be loaded: {checkpoint_files.short(e)}"
      ) from e
    except (ValueError, OSError) as e:
      raise CheckpointError(
        f"checkpoint {path}: its PS snapshot chain {chain} cannot be loaded: {checkpoint_files.short(e)}"
      ) from e
    self._chain = chain
    self._since_full = len(chain) - 1
    return state, meta

  def restore_newest_intact(
    self, state_template: Any, ps: RowStore, warn: Callable[[str], None]
  ) -> Optional[Tuple[int, Any, Dict[str, Any]]]:
    """Restores the newest checkpoint that reads back intact.

    Damaged newer checkpoints are moved to ``<workdir>/checkpoints_damaged/`` (kept for a
    look, out of the way of new saves), each named in one ``warn`` line.

    Returns:
      ``(step, state, meta)``, or None if the workdir holds no checkpoint.

    Raises:
      CheckpointError: if no checkpoint is intact; then every file is left as it is.
    """
    damaged: List[Tuple[int, CheckpointError]] = []
    for step in sorted(self._mgr.all_steps(), reverse=True):
      try:
        state, meta = self.restore(step, state_template, ps)
      except CheckpointError as e:
        damaged.append((step, e))
        continue
      for s, why in damaged:
        warn(f"{why}; moved to {self._set_aside(s)}, resuming from checkpoint {step}")
      if damaged:
        distributed.barrier(f"damaged checkpoints set aside before step {step}")
        self._mgr.close()
        self._mgr = self._open()  # lists the steps left, as at the start (reload() would read their metadata)
      return step, state, meta
    if len(damaged) == 1:
      raise damaged[0][1]
    if damaged:
      raise CheckpointError(f"no checkpoint in {self.directory} is intact: " + "; ".join(str(e) for _, e in damaged))
    return None

  def _set_aside(self, step: int) -> str:
    dst = os.path.join(self.damaged_directory, str(step))
    n = 1
    while os.path.exists(dst):
      dst, n = os.path.join(self.damaged_directory, f"{step}.{n}"), n + 1
    if jax.process_index() == 0:
      os.makedirs(self.damaged_directory, exist_ok=True)
      os.replace(self.step_dir(step), dst)
      parts = workdir_lib.checkpoint_parts(self._workdir, step)
      if os.path.isdir(parts):  # with the checkpoint, out of the way of the next save of this step
        os.replace(parts, os.path.join(dst, "parts"))
    return dst

  def close(self) -> None:
    """Closes the manager. After a failed save, orbax raises that failure again here (its writing
    thread's error): the save already reported it, so it is logged, not raised a second time."""
    try:
      with write_waits.writing(f"checkpoints {self.directory} (orbax's writes finishing)"):
        self._mgr.close()
    except Exception as e:
      if self._failed is None:
        raise
      logging.warning("closing the checkpoint manager after a failed save: %s", e)
