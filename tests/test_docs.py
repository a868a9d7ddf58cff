"""The documentation holds together: the mkdocs site builds in strict mode (a broken link or anchor, a page
missing from the nav's files, an API reference that no longer resolves, a config-reference hook that fails: each
fails the build), every relative link of the README points at a file of the checkout, and the README opens with
the two commands `.ci/run` and a newcomer run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(*parts: str) -> str:
  with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
    return f.read()


def test_the_site_builds_in_strict_mode(tmp_path):
  r = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
  # The generated reference holds every field of configs/default.py, with the comment beside it.
  page = (tmp_path / "site" / "config-reference" / "index.html").read_text(encoding="utf-8")
  assert "--config.data.name" in page and "Seeds parameter init, PS row init" in page, page[:2000]


def relative_links(text: str):
  """Targets of the markdown links ``[..](target)`` that are not URLs or in-page anchors, outside code blocks."""
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
      yield target


def test_every_relative_link_of_the_readme_resolves():
  links = list(relative_links(read("README.md")))
  assert len(links) > 10, links  # the README is a front page: it links into docs/
  missing = [t for t in links if not os.path.exists(os.path.join(ROOT, t.split("#")[0]))]
  assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_opens_with_the_commands_ci_runs():
  """The README's first two bash blocks: the main job, and the test suite exactly as `.ci/run` runs it (whose pip
  is quiet)."""
  blocks = re.findall(r"```bash\n(.*?)\n```", read("README.md"), flags=re.S)
  main_job, suite = blocks[0].strip(), blocks[1].strip()
  setup = "python3 -m venv .venv && . .venv/bin/activate && pip install -r requirements.txt -e ."
  assert main_job == f"{setup} && python -m recsys_jax.main --config=configs/dlrm.py"
  assert suite == f"{setup} && ruff check . && python -m pytest -q"
  assert suite.replace("pip install -r", "pip install -q -r") in read(".ci", "run").splitlines()
  assert read("README.md").index(blocks[1]) < 1000  # at the very top
