"""Checkpoint rotation, directly: which steps a Checkpointer keeps, and what it keeps for them.

A ``Checkpointer`` with ``max_to_keep`` = K keeps the K newest checkpoints after every save (never
the newest before it is verified), the PS snapshots their chains need (a full snapshot every
``full_every`` saves, incremental ones in between), and the parts of the kept steps only; each
kept step restores to exactly the dense state, PS rows and parts saved at it, also after the
workdir is reopened (a resume) and the rotation goes on there.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from recsys_jax import checkpoint as checkpoint_lib
from recsys_jax.async_ps.store.ps import ParameterServer
from recsys_jax.embeddings.specs import TableSpec

SPECS = [TableSpec(name="t", dim=4)]
STEPS = (10, 20, 30, 40, 50, 60, 70, 80)


def _rows(ps):
  snap = ps.snapshot()["t"]
  order = np.argsort(snap["ids"], kind="stable")
  return {k: np.asarray(v)[order] for k, v in snap.items() if k != "deleted"}


def _state(step):
  return {"w": jnp.arange(6, dtype=jnp.float32) * step, "b": jnp.full((2,), step, jnp.int32)}


def _part(step):
  return f"hot set of step {step}".encode()


def _listing(path):
  return sorted(os.listdir(path)) if os.path.isdir(path) else []


def _check_kept(workdir, ckpt, saved, keep, chains):
  """The kept steps are the ``keep`` newest saved; their chains' snapshots and their parts only;
  each restores to what was saved at it."""
  want = sorted(saved)[-keep:]
  assert ckpt.all_steps() == want
  assert sorted(int(n) for n in _listing(os.path.join(workdir, "checkpoints")) if n.isdigit()) == want
  needed = sorted({name for s in want for name in chains[s]})
  assert _listing(os.path.join(workdir, "ps_snapshots")) == needed
  assert _listing(os.path.join(workdir, "checkpoint_parts")) == sorted(str(s) for s in want)
  for s in want:
    ps = ParameterServer(SPECS, seed=1)
    try:
      state, meta = ckpt.restore(s, _state(0), ps)
      assert meta["step"] == s and meta["ps_chain"] == chains[s]
      for k in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(state[k]), np.asarray(_state(s)[k]))
      got = _rows(ps)
      assert got.keys() == saved[s].keys()
      for k in got:
        np.testing.assert_array_equal(got[k], saved[s][k], err_msg=f"step {s}: {k}")
      with open(ckpt.part_path(s, meta, "p0"), "rb") as f:
        assert f.read() == _part(s)
    finally:
      ps.close()


@pytest.mark.parametrize("keep,full_every", [(2, 3), (1, 1), (3, 2)])
def test_rotation_keeps_the_newest_steps_and_what_they_need(tmp_path, keep, full_every):
  workdir = str(tmp_path / "run")
  ps = ParameterServer(SPECS, seed=0)
  rng = np.random.default_rng(0)
  saved, chains = {}, {}
  since_full = None  # saves since the last full snapshot; None: none yet
  chain = []

  def save(ckpt, step):
    nonlocal since_full, chain
    ids = rng.integers(0, 50, 8).astype(np.uint64)  # rows created and changed between saves
    ps.lookup("t", ids)
    ps.apply("t", np.unique(ids), rng.normal(size=(len(np.unique(ids)), 4)).astype(np.float32))
    full = since_full is None or since_full + 1 >= full_every
    name = f"{step:010d}-{'full' if full else 'incr'}"
    chain = [name] if full else chain + [name]
    since_full = 0 if full else since_full + 1
    ckpt.save(step, _state(step), ps, {"note": step}, parts={"p0": lambda f: f.write(_part(step))})
    saved[step], chains[step] = _rows(ps), list(chain)

  try:
    ckpt = checkpoint_lib.Checkpointer(workdir, max_to_keep=keep, full_every=full_every)
    for step in STEPS[:5]:
      save(ckpt, step)
      _check_kept(workdir, ckpt, saved, keep, chains)
    ckpt.close()
    # A resume: a new Checkpointer on the workdir restores the newest step and rotates on from there.
    ckpt = checkpoint_lib.Checkpointer(workdir, max_to_keep=keep, full_every=full_every)
    newest = STEPS[4]
    ps.close()
    ps = ParameterServer(SPECS, seed=0)
    ckpt.restore(newest, _state(0), ps)
    chain = chains[newest]
    since_full = len(chain) - 1
    for step in STEPS[5:]:
      save(ckpt, step)
      _check_kept(workdir, ckpt, saved, keep, chains)
    ckpt.close()
  finally:
    ps.close()
