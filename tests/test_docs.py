"""The documentation holds together: the mkdocs site builds in strict mode (a broken link or anchor, a page
missing from the nav's files, an API reference that no longer resolves, a config-reference hook that fails: each
fails the build), every relative link of the README points at a file of the checkout, and the README opens with
the two commands `.ci/run` and a newcomer run."""

from __future__ import annotations

import html as htmlmod
import os
import re
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(*parts: str) -> str:
  with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
    return f.read()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  """The site, built once in strict mode into a temporary directory."""
  out = tmp_path_factory.mktemp("docs") / "site"
  r = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
  return out


def test_the_site_builds_in_strict_mode(site):
  # The generated reference holds every field of configs/default.py, with the comment beside it.
  page = (site / "config-reference" / "index.html").read_text(encoding="utf-8")
  assert "--config.data.name" in page and "Seeds parameter init, PS row init" in page, page[:2000]


API_PAGES = sorted(f[: -len(".md")] for f in os.listdir(os.path.join(ROOT, "docs", "api")) if f.endswith(".md"))
SPHINX_ROLE = re.compile(r":(?:class|mod|meth|func|attr|data|obj|exc):")


def page_text(html: str) -> str:
  """What a reader sees of a page: its HTML without tags and scripts, entities decoded."""
  html = re.sub(r"<(script|style)\b.*?</\1>", "", html, flags=re.S)
  return htmlmod.unescape(re.sub(r"<[^>]+>", "", html))


@pytest.mark.parametrize("name", API_PAGES)
def test_api_pages_show_no_sphinx_roles(site, name):
  """The docstrings are Markdown (mkdocstrings renders them so): a Sphinx role such as :class:`X` would show
  verbatim. Write ``X`` instead, or a cross-reference [X][recsys_jax.module.X] to an object the site documents."""
  text = page_text((site / "api" / name / "index.html").read_text(encoding="utf-8"))
  found = sorted({text[max(0, m.start() - 40) : m.end() + 40].replace("\n", " ") for m in SPHINX_ROLE.finditer(text)})
  assert not found, f"api/{name}: {len(found)} raw Sphinx roles, e.g. {found[:5]}"


# The first object each API page documents (after the modules' own text): the public entry point.
ENTRY_POINTS = {
  "checkpoints": "recsys_jax.checkpoint.Checkpointer",
  "data": "recsys_jax.data.readers.build_reader",
  "models": "recsys_jax.models.get",
  "parameter-server": "recsys_jax.async_ps.factory.build_ps",
  "serving": "recsys_jax.serving.scorer.load_scorer",
  "train": "recsys_jax.train.train_and_evaluate",
}


def is_module(path: str) -> bool:
  base = os.path.join(ROOT, *path.split("."))
  return os.path.exists(base + ".py") or os.path.exists(os.path.join(base, "__init__.py"))


@pytest.mark.parametrize("name", API_PAGES)
def test_api_pages_open_with_their_entry_point(site, name):
  html = (site / "api" / name / "index.html").read_text(encoding="utf-8")
  objects = [i for i in re.findall(r'<h\d id="(recsys_jax[\w.]*)" class="doc doc-heading"', html) if not is_module(i)]
  assert objects and objects[0] == ENTRY_POINTS[name], f"api/{name} opens with {objects[:3]}"


def test_the_top_bar_is_grouped():
  """The nav's top level is a few sections (the theme shows each as one entry of the top bar), not every page."""
  nav = yaml.safe_load(read("mkdocs.yml"))["nav"]
  assert len(nav) <= 6, [next(iter(e)) for e in nav]


def test_code_blocks_scroll_sideways(site):
  """A long command in a code block scrolls within the page's column rather than running off the page."""
  assert 'href="css/extra.css"' in (site / "index.html").read_text(encoding="utf-8")
  css = re.sub(r"/\*.*?\*/", "", (site / "css" / "extra.css").read_text(encoding="utf-8"), flags=re.S)
  css = re.sub(r"\s+", " ", css)
  assert re.search(r"(^|\}) ?pre \{[^}]*overflow-x: auto", css) and re.search(r"pre code \{[^}]*white-space: pre;", css)


def test_docstrings_hold_no_sphinx_roles():
  """The same for every module, on the API pages or not yet: the docstrings are Markdown."""
  found = []
  for d, _, files in os.walk(os.path.join(ROOT, "recsys_jax")):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(d, f)
        with open(path, encoding="utf-8") as fh:
          found += [f"{os.path.relpath(path, ROOT)}:{n}" for n, line in enumerate(fh, 1) if SPHINX_ROLE.search(line)]
  assert not found, found


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
