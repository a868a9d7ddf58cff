"""The README's and docs/ pages' commands do not collide in one workdir: each command that trains names a workdir
(or gets the default ``runs/<config name>``) that no other section's run uses, so following the README and the docs
top to bottom never resumes one section's run with another's settings (the Serving section once found the first
command's 2,000 steps in ``runs/dlrm`` and served step 2000 where it promised step 300)."""

from __future__ import annotations

import glob
import os

from tests.helpers.doc_commands import bash_commands

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def training_commands(text: str):
  """(line number, args) of every ``python -m recsys_jax.main`` or ``.launch`` command in a markdown text's bash blocks."""
  out = []
  for c in bash_commands(text):
    words = c.args
    for i in range(len(words) - 2):
      if words[i : i + 2] == ["python", "-m"] and words[i + 2] in ("recsys_jax.main", "recsys_jax.launch"):
        args = words[i:]
        args = args[: args.index("&&")] if "&&" in args else args
        if "--helpconfig" not in args:
          out.append((c.line, args))
        break
  return out


def workdir(args) -> str:
  given = [a.split("=", 1)[1] for a in args if a.startswith("--workdir=")]
  config = next(a.split("=", 1)[1] for a in args if a.startswith("--config="))
  return given[0] if given else os.path.join("runs", os.path.splitext(os.path.basename(config))[0])


def documented_commands():
  """(file:line, args) of every training command in README.md and docs/**/*.md."""
  pages = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
  )
  out = []
  for page in pages:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
      out += [(f"{page}:{line}", args) for line, args in training_commands(f.read())]
  return out


def test_each_readme_run_has_a_workdir_of_its_own():
  runs = documented_commands()
  assert len(runs) >= 5, runs  # the main job, MovieLens, the mesh, the launcher, serving at least
  assert any(where.startswith("docs/serving.md:") for where, _ in runs), runs  # the docs are read too
  seen = {}
  for line, args in runs:
    # The same run reading its data from another place is one run (the README offers both).
    key = tuple(a for a in args if not a.startswith("--config.data.path="))
    w = workdir(args)
    if w in seen and seen[w][1] != key:
      raise AssertionError(f"{line} trains in {w}, which {seen[w][0]} trains in with other settings")
    seen.setdefault(w, (line, key))
