"""A trainer resuming in a served workdir, for the serving load test (issue 25).

    python tests/helpers/serve_trainer.py WORKDIR ARCHIVE NUM_STEPS CHECKPOINT_EVERY

Resumes the run in WORKDIR (its config.json) with ``max_checkpoints=2`` and
``checkpoint_full_every=2``, so the trainer's rotation deletes checkpoints and the PS snapshots only
they needed while the server reads them. Each checkpoint, once written and read back intact, is
hard-linked into ``ARCHIVE/<step>`` (a workdir of its own: config.json, that checkpoint and its PS
chain, each snapshot linked as soon as it is written) before the trainer rotates anything: the
test's offline reference of every version the
server names. Nothing else of the trainer is changed.
"""

from __future__ import annotations

import os
import shutil
import sys


def _link_tree(src: str, dst: str) -> None:
  for top, _, files in os.walk(src):
    os.makedirs(os.path.join(dst, os.path.relpath(top, src)), exist_ok=True)
    for f in files:
      os.link(os.path.join(top, f), os.path.join(dst, os.path.relpath(top, src), f))


def main(workdir: str, archive: str, num_steps: int, every: int) -> None:
  from recsys_jax import checkpoint, train
  from recsys_jax.async_ps.snapshot import directory as snapshot
  from recsys_jax.training import run_config

  config = run_config.load(workdir)
  with config.unlocked():
    config.num_steps, config.checkpoint_every = num_steps, every
    config.max_checkpoints, config.checkpoint_full_every = 2, 2
    config.eval_every = 0
  rotate, save = checkpoint.Checkpointer._rotate, snapshot.save

  def archived_save(ps, path, *args, **kwargs):
    # Linked as soon as written, before its checkpoint exists: the test deletes the snapshots of
    # the version served, which may be this one a moment after the checkpoint is committed.
    out = save(ps, path, *args, **kwargs)
    _link_tree(path, os.path.join(archive, "_snapshots", os.path.basename(path)))
    return out

  def archived_rotate(self):
    step = max(self.all_steps())
    tmp = os.path.join(archive, f".{step}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _link_tree(os.path.join(self.directory, str(step)), os.path.join(tmp, "checkpoints", str(step)))
    parts = os.path.join(workdir, "checkpoint_parts", str(step))  # the hot set: a part of the checkpoint
    if os.path.isdir(parts):
      _link_tree(parts, os.path.join(tmp, "checkpoint_parts", str(step)))
    for name in self._chain:
      _link_tree(os.path.join(archive, "_snapshots", name), os.path.join(tmp, "ps_snapshots", name))
    shutil.copy(os.path.join(workdir, "config.json"), os.path.join(tmp, "config.json"))
    os.replace(tmp, os.path.join(archive, str(step)))
    rotate(self)

  checkpoint.Checkpointer._rotate, snapshot.save = archived_rotate, archived_save
  train.train_and_evaluate(config, workdir)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
