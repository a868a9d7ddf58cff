"""The README's and docs/ pages' commands do not collide in one workdir: each command that trains names a workdir
(or gets the default ``runs/<config name>``) that no other section's run uses, so following the README and the docs
top to bottom never resumes one section's run with another's settings (the Serving section once found the first
command's 2,000 steps in ``runs/dlrm`` and served step 2000 where it promised step 300)."""

from __future__ import annotations

import glob
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def training_commands(text: str):
  """(line number, args) of every ``python -m recsys_jax.main`` or ``.launch`` command in a markdown text's bash blocks."""
  out, in_bash = [], False
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    line = lines[i]
    if line.startswith("```"):
      in_bash = line.strip() in ("```bash", "```sh")
    elif in_bash:
      start, cmd = i + 1, line.split(" #")[0].rstrip()
      while cmd.endswith("\\") and i + 1 < len(lines):  # a command continued on the next line
        i += 1
        cmd = cmd[:-1] + " " + lines[i].split(" #")[0].strip()
      m = re.search(r"python -m recsys_jax\.(main|launch) .*", cmd)
      if m and "--helpconfig" not in cmd:
        out.append((start, shlex.split(m.group(0).split("&&")[0])))
    i += 1
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
