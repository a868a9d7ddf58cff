"""Where an experiment writes unless told: ``runs/experiments/`` under the current directory (ignored by git).

So running one never overwrites the committed results in ``experiments/results/``; to update those, point its
out flag there (e.g. ``--out=experiments/results/zoo_movielens.json``), as experiments/README.md's commands do.
"""

from __future__ import annotations

import os

RUNS = os.path.join("runs", "experiments")


def default(name: str) -> str:
  """The default output path of ``name`` (a file, a folder or a path without its extension)."""
  return os.path.join(RUNS, name)
