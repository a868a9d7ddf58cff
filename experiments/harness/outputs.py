"""Where an experiment writes unless told: ``runs/experiments/`` under the current directory (ignored by git).

So running one never overwrites the committed results in ``experiments/results/``; to update those, point its
out flag there (e.g. ``--out=experiments/results/zoo_movielens.json``), as the commands in docs/experiments.md do.

Every file a script writes for its reader (results, plots, logs, saved inputs) is announced by one stdout line
``wrote <absolute path>``, printed here so that the format is one everywhere (tests/e2e/test_experiments.py checks
each such line names a non-empty file). Scratch files a script removes before it exits are not announced.
"""

from __future__ import annotations

import json
import os
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
RUNS = os.path.join("runs", "experiments")


def default(name: str) -> str:
  """The default output path of ``name`` (a file, a folder or a path without its extension)."""
  return os.path.join(RUNS, name)


def wrote(path: str) -> str:
  """Prints ``wrote <absolute path>`` for a file just written; returns the absolute path."""
  path = os.path.abspath(path)
  print(f"wrote {path}", flush=True)
  return path


def _parent(path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def write_json(path: str, obj: Any, indent: int | None = 1) -> str:
  """Writes ``obj`` as one JSON document to ``path`` (making its folder) and announces it."""
  _parent(path)
  with open(path, "w") as f:
    json.dump(obj, f, indent=indent)
  return wrote(path)


def write_text(path: str, text: str, mode: str = "w") -> str:
  """Writes (or with ``mode="a"`` appends) ``text`` to ``path`` (making its folder) and announces it."""
  _parent(path)
  with open(path, mode) as f:
    f.write(text)
  return wrote(path)


def save_figure(fig: Any, path: str, **kwargs: Any) -> str:
  """``fig.savefig(path, **kwargs)`` (making its folder) and announces it."""
  _parent(path)
  fig.savefig(path, **kwargs)
  return wrote(path)


def emit(result: Any, path: str | None = None, mode: str = "w", sort_keys: bool = False) -> None:
  """Prints ``result`` as one JSON line (a script's last word), written (``mode="a"``: appended) to
  ``path`` first if given."""
  line = json.dumps(result, sort_keys=sort_keys)
  if path:
    write_text(path, line + "\n", mode)
  print(line, flush=True)
