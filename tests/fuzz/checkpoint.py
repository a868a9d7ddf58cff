"""Fuzz target 'checkpoint': restoring damaged checkpoints and PS snapshots.

Setup (once per worker) writes real checkpoints of ``configs/tiny.py``'s job with
``checkpoint.Checkpointer``: steps 1 and 2, the dense state and the PS changed in between,
once with full PS snapshots only (``full_every=1``) and once with step 2 an incremental
snapshot on top of step 1's full one (``full_every=2``); and a RemotePS-layout snapshot
(``remote.json`` + ``server-0``) of the step-2 PS. Every value saved is kept in memory.

An input picks a layout and one file of the newest step (its orbax files under
``checkpoints/2`` and its PS snapshot under ``ps_snapshots``), or of the RemotePS snapshot, and
damages it: cut at a random point, random bits flipped, zeroed, or deleted; sometimes a file of
step 1 too. Then a fresh PS restores it:

- checkpoints: ``Checkpointer.restore_newest_intact``. Correct: it returns step 2 with every
  dense array, every PS row and slot and the meta equal to what was saved (damage that changes
  nothing read), or step 1 equal to step 1's saved values, with step 2 named in one warning
  line and moved to ``checkpoints_damaged/``; or, only when step 1 was damaged too, it raises
  ``CheckpointError`` in one line naming the checkpoints. Anything else (another exception,
  values that differ, a warning of several lines) is a crash.
- RemotePS snapshots, the path a PS server restores from: ``snapshot_chain.load_into`` and
  ``ShardService.restore``. Correct: the rows equal the saved ones, or a ``ValueError`` /
  ``FileNotFoundError`` (a ``ServiceError`` for the service) naming the snapshot directory.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Any, Dict, List

import numpy as np
from hypothesis import strategies as st

from .harness import Crash, Target, clear_error

LAYOUTS = ("full", "chain", "remote")


def _files(root: str) -> List[str]:
  """The files under ``root`` in an order that is the same for every setup: orbax names its data
  files by random hashes, so they are ordered by their place with the hash left out, then size."""
  out = []
  for d, _, names in os.walk(root):
    out += [os.path.relpath(os.path.join(d, n), root) for n in names]
  return sorted(out, key=lambda f: (re.sub(r"[0-9a-f]{32}", "#", f), os.path.getsize(os.path.join(root, f)), f))


def damage(path: str, how: str, k: int, flips: List[int]) -> None:
  """Damages one file in place: 'cut' at k, 'flip' bits, 'zero' it, or 'delete' it."""
  if how == "delete":
    os.remove(path)
    return
  with open(path, "rb") as f:
    data = bytearray(f.read())
  if how == "cut":
    data = data[: k % (len(data) + 1)] if data else data
  elif how == "zero":
    data = bytearray(len(data))
  elif how == "flip" and data:
    for bit in flips:
      data[(bit // 8) % len(data)] ^= 1 << (bit % 8)
  with open(path, "wb") as f:
    f.write(bytes(data))


def _tree_np(tree) -> List[np.ndarray]:
  import jax

  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def ps_rows(ps) -> Dict[str, Dict[str, np.ndarray]]:
  """Every table's arrays, rows sorted by id (shard order does not matter)."""
  out = {}
  for t, arrays in ps.snapshot().items():
    order = np.argsort(arrays["ids"], kind="stable")
    out[t] = {k: np.asarray(v)[order] for k, v in arrays.items() if k != "deleted"}
  return out


def same_rows(a, b) -> str:
  """'' if two ``ps_rows`` are equal, else what differs."""
  if sorted(a) != sorted(b):
    return f"tables {sorted(a)} != {sorted(b)}"
  for t in a:
    if sorted(a[t]) != sorted(b[t]):
      return f"table {t}: arrays {sorted(a[t])} != {sorted(b[t])}"
    for k in a[t]:
      if a[t][k].shape != b[t][k].shape or not np.array_equal(a[t][k], b[t][k], equal_nan=True):
        return f"table {t}: {k} differs"
  return ""


class CheckpointTarget(Target):
  name = "checkpoint"
  deadline_s = 60.0  # an orbax restore takes ~1 s alone and up to 10 s on a loaded 2-core machine

  def __init__(self, small: bool = False):
    self.small = small
    """A three-array dense state and two small tables instead of the tiny job's (the tests' quick run)."""

  def setup(self, workdir: str) -> None:
    import jax

    from configs import tiny
    from recsys_jax.async_ps.snapshot import chain as snapshot_chain
    from recsys_jax.async_ps.snapshot import directory as snapshot
    from recsys_jax.checkpoint import Checkpointer
    from recsys_jax.training import job as job_lib

    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    config = tiny.get_config()
    config.data.vocab_sizes = (50, 20, 8)
    self.seed = config.seed
    if self.small:
      import jax.numpy as jnp

      from recsys_jax.embeddings.specs import TableSpec

      self.tables = [TableSpec(name="user", dim=4), TableSpec(name="item", dim=2, optimizer="adam")]
      self.template = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(4), "step": jnp.zeros((), jnp.int32)}
      ps = self._fresh_ps()
    else:
      job = job_lib.build_job(config)
      self.tables, self.template, ps = job.tables, job.state, job.ps
    rng = np.random.default_rng(0)
    self.saved: Dict[int, Dict[str, Any]] = {}
    self.templates = {}

    def touch(scale):
      for t in self.tables:
        ids = rng.choice(40, 12, replace=False).astype(np.uint64)
        ps.lookup(t.name, ids)
        ps.apply(t.name, ids, rng.normal(size=(12, t.dim)).astype(np.float32) * scale)

    for layout, full_every in (("full", 1), ("chain", 2)):
      d = os.path.join(workdir, layout)
      ckpt = Checkpointer(d, max_to_keep=3, full_every=full_every)
      state = self.template
      for step in (1, 2):
        touch(step)
        state = jax.tree.map(lambda x, s=step: x + s if hasattr(x, "dtype") and x.dtype.kind == "f" else x, state)
        meta = {
          "data_position": step,
          "batch_size": 256,
          "data": "synthetic",
          "reader_position": {"batch": step},
        }
        ckpt.save(step, state, ps, meta)
        full_meta = ckpt._read_meta(step)
        self.saved.setdefault(layout, {})[step] = {"state": _tree_np(state), "rows": ps_rows(ps), "meta": full_meta}
      ckpt.close()
      self.templates[layout] = d
    d = os.path.join(workdir, "remote", "snap")
    os.makedirs(d)
    snapshot.save(ps, os.path.join(d, "server-0"))
    import json

    with open(os.path.join(d, snapshot_chain.MANIFEST), "w") as f:
      json.dump(
        {
          "format": snapshot_chain.FORMAT,
          "num_servers": 1,
          "step": 2,
          "incremental": False,
          "parts": ["server-0"],
          "rows": {},
          "meta": {},
        },
        f,
      )
    self.saved["remote"] = {2: {"rows": ps_rows(ps)}}
    self.templates["remote"] = os.path.join(workdir, "remote")
    # Which files each input may damage (relative to the copied template).
    self.latest, self.older = {}, {}
    for layout in ("full", "chain"):
      root = self.templates[layout]
      files = _files(root)
      step2 = [f for f in files if f.startswith(os.path.join("checkpoints", "2") + os.sep)]
      snap2 = self.saved[layout][2]["meta"]["ps_chain"][-1]
      step2 += [f for f in files if f.startswith(os.path.join("ps_snapshots", snap2) + os.sep)]
      self.latest[layout] = step2
      self.older[layout] = [f for f in files if f.startswith(os.path.join("checkpoints", "1") + os.sep)]
    self.latest["remote"] = _files(self.templates["remote"])
    self.older["remote"] = []

  def strategy(self):
    return st.fixed_dictionaries(
      {
        "layout": st.sampled_from(LAYOUTS),
        "file": st.integers(0, 10**6),
        "how": st.sampled_from(["cut", "flip", "flip", "zero", "delete"]),
        "k": st.integers(0, 10**6),
        "flips": st.lists(st.integers(0, 10**7), min_size=1, max_size=4),
        "older": st.one_of(
          st.none(), st.none(), st.none(), st.tuples(st.integers(0, 10**6), st.sampled_from(["cut", "zero", "delete"]))
        ),
      }
    )

  def run(self, case) -> str:
    layout = case["layout"]
    d = tempfile.mkdtemp(dir=self.workdir)
    try:
      root = os.path.join(d, "w")
      shutil.copytree(self.templates[layout], root)
      files = self.latest[layout]
      target = files[case["file"] % len(files)]
      damage(os.path.join(root, target), case["how"], case["k"], case["flips"])
      older = None
      if case["older"] is not None and self.older[layout]:
        older = self.older[layout][case["older"][0] % len(self.older[layout])]
        damage(os.path.join(root, older), case["older"][1], case["k"], case["flips"])
      if layout == "remote":
        return self._remote(root, target)
      return self._checkpoint(layout, root, target, older)
    finally:
      shutil.rmtree(d, ignore_errors=True)

  def _fresh_ps(self):
    from recsys_jax.async_ps.store.ps import ParameterServer

    return ParameterServer(self.tables, seed=self.seed)

  def _checkpoint(self, layout: str, root: str, target: str, older) -> str:
    from recsys_jax.checkpoint import Checkpointer, CheckpointError

    warnings: List[str] = []
    ckpt = Checkpointer(root, max_to_keep=3, full_every=1 if layout == "full" else 2)
    ps = self._fresh_ps()
    try:
      got = ckpt.restore_newest_intact(self.template, ps, warn=warnings.append)
    except Exception as e:  # noqa: BLE001 - classified here
      clear_error(e, [CheckpointError], [os.path.join(root, "checkpoints")], f"restore ({target} damaged)")
      if older is None:
        raise Crash(f"restore ({target} damaged): CheckpointError although step 1 is intact: {str(e)[:300]}") from None
      if "\n" in str(e):
        raise Crash(f"restore: CheckpointError of several lines: {str(e)[:300]!r}") from None
      return "clear"
    finally:
      ckpt.close()
    if got is None:
      raise Crash(f"restore ({target} damaged): found no checkpoint at all")
    step, state, meta = got
    saved = self.saved[layout][step]
    for i, (a, b) in enumerate(zip(_tree_np(state), saved["state"], strict=True)):
      if a.shape != b.shape or not np.array_equal(a, b):
        raise Crash(f"restore ({target} damaged): step {step}: dense leaf {i} differs from the saved one")
    why = same_rows(ps_rows(ps), saved["rows"])
    if why:
      raise Crash(f"restore ({target} damaged): step {step}: PS {why}")
    if meta != saved["meta"]:
      keys = sorted(k for k in set(meta) | set(saved["meta"]) if meta.get(k) != saved["meta"].get(k))
      raise Crash(f"restore ({target} damaged): step {step}: meta differs from the saved one in {keys}")
    if step == 2:
      if warnings:
        raise Crash(f"restore ({target} damaged): step 2 restored intact but warned: {warnings}")
      return "accepted"
    if len(warnings) != 1 or "\n" in warnings[0]:
      raise Crash(f"restore ({target} damaged): step 1 restored; expected one warning line, got {warnings}")
    if os.path.join(root, "checkpoints", "2") not in warnings[0]:
      raise Crash(f"restore ({target} damaged): the warning does not name checkpoints/2: {warnings[0][:300]}")
    if os.path.exists(os.path.join(root, "checkpoints", "2")) or not os.path.isdir(
      os.path.join(root, "checkpoints_damaged", "2")
    ):
      raise Crash(f"restore ({target} damaged): checkpoint 2 was not moved to checkpoints_damaged/")
    return "clear"

  def _remote(self, root: str, target: str) -> str:
    from recsys_jax.async_ps.server.service import ServiceError, ShardService
    from recsys_jax.async_ps.snapshot import chain as snapshot_chain
    from recsys_jax.embeddings.specs import TableSpec  # noqa: F401

    snap = os.path.join(root, "snap")
    want = self.saved["remote"][2]["rows"]
    outcome = "accepted"
    ps = self._fresh_ps()
    try:
      snapshot_chain.load_into(ps, [snap])
      why = same_rows(ps_rows(ps), want)
      if why:
        raise Crash(f"load_into ({target} damaged): {why}")
    except Crash:
      raise
    except Exception as e:  # noqa: BLE001 - classified here
      clear_error(e, [ValueError, FileNotFoundError], [snap], f"load_into ({target} damaged)")
      outcome = "clear"
    service = ShardService()
    service.configure(
      self.tables, {"seed": self.seed, "num_workers": 1, "staleness": 0, "shard_index": 0, "num_shards": 1}
    )
    try:
      links = snapshot_chain.snapshot_parts([snap])
      service.restore(links, 3)
      why = same_rows(ps_rows(service.ps), want)
      if why:
        raise Crash(f"ShardService.restore ({target} damaged): {why}")
    except Crash:
      raise
    except Exception as e:  # noqa: BLE001 - classified here
      clear_error(e, [ServiceError, ValueError, FileNotFoundError], [snap], f"ShardService.restore ({target} damaged)")
      outcome = "clear"
    return outcome
