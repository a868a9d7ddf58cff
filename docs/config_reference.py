"""The configuration reference page, written from ``configs/default.py`` at every site build.

An mkdocs hook (``hooks:`` in mkdocs.yml): the page ``config-reference.md`` holds a marker that this
replaces with every field, its default and the comments beside it, read by ``configs/fields.py`` (the
same text ``--helpconfig`` prints), so the page cannot go stale. ``python docs/config_reference.py``
prints the generated part.
"""

from __future__ import annotations

import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # mkdocs loads hooks by path; configs/ and recsys_jax/ are imported from the checkout
  sys.path.insert(0, ROOT)

from configs import fields  # noqa: E402

MARKER = "<!-- config-fields -->"


def _cell(text: str) -> str:
  """Text shown as written inside a markdown table cell: ``<workdir>`` is no HTML tag, ``admit_*`` no emphasis."""
  return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def _value(value) -> str:
  shown = value.to_dict() if hasattr(value, "to_dict") else value  # an empty section
  return f"`{_cell(repr(shown))}`"


def markdown() -> str:
  """Every field of ``configs/default.py``, grouped by section in the file's order: a table of
  ``--config.<field>``, default and meaning; then each model's ``config.model.kwargs`` from its class."""
  docs = fields.field_docs()
  config = fields.load(None)
  order = sorted(fields.leaves(config), key=lambda kv: (docs.get(kv[0], (1 << 30, ""))[0], kv[0]))
  out, section = [], None
  for name, value in order:
    head = name.rpartition(".")[0]
    if head != section:
      out.append(f"\n## {head or 'top level'}\n")
      if docs.get(head, (0, ""))[1]:
        out.append(docs[head][1] + "\n")
      out.append("| field | default | meaning |\n| --- | --- | --- |")
      section = head
    text = docs.get(name, (0, ""))[1] or "(no comment in configs/default.py)"
    out.append(f"| `--config.{name}` | {_value(value)} | {_cell(text)} |")
  # Each model's own arguments, as the configs that pick it would set them (model_argument_docs: its class).
  models = sorted(
    {fields.load(p).model.name for p in glob.glob(os.path.join(ROOT, "configs", "*.py")) if _is_config(p)}
  )
  out.append("\n## model.kwargs of each model\n")
  out.append("`config.model.kwargs` goes to the model's constructor; its fields, from each model's class:\n")
  for model in models:
    out.append(f"\n### {model}\n\n| field | meaning |\n| --- | --- |")
    for k, text in sorted(fields.model_argument_docs(model).items()):
      out.append(f"| `--config.model.kwargs.{k}` | {_cell(text)} |")
  return "\n".join(out) + "\n"


def _is_config(path: str) -> bool:
  with open(path, encoding="utf-8") as f:
    return "def get_config(" in f.read()


def on_page_markdown(markdown_text, page, config, files):  # noqa: ARG001 (mkdocs' hook signature)
  if page.file.src_uri != "config-reference.md":
    return markdown_text
  if MARKER not in markdown_text:
    raise ValueError(f"docs/config-reference.md lacks the marker {MARKER} where the generated fields go")
  return markdown_text.replace(MARKER, markdown())


if __name__ == "__main__":
  print(markdown())
