"""What each config field means, read from the comments of ``configs/default.py`` (``--helpconfig``).

The comments there are the one description of the fields: a field's text is the comment block just above
its assignment plus the comment at the end of its line, so nothing here can drift from them. A section
(``c.data = ml_collections.ConfigDict()``) gets its own text the same way.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import os
import tokenize
from typing import Dict, Iterator, Optional, Tuple

import ml_collections

DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")


def _dotted(node: ast.expr) -> Optional[str]:
  """'c.data.path' -> 'data.path' for an attribute chain on the name ``c``; None otherwise."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  return ".".join(reversed(parts)) if isinstance(node, ast.Name) and node.id == "c" and parts else None


def field_docs(path: str = DEFAULT) -> Dict[str, Tuple[int, str]]:
  """Every field (and section) assigned in ``path`` -> (line of its first assignment, its comments' text)."""
  with open(path, encoding="utf-8") as f:
    src = f.read()
  comments: Dict[int, Tuple[str, bool]] = {}  # line -> (text, whether the comment is the whole line)
  for tok in tokenize.generate_tokens(io.StringIO(src).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = (tok.string.lstrip("#").strip(), not tok.line[: tok.start[1]].strip())
  docs: Dict[str, Tuple[int, str]] = {}
  assigns = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Assign) and len(n.targets) == 1]
  for node in sorted(assigns, key=lambda n: n.lineno):
    name = _dotted(node.targets[0])
    if name is None:
      continue
    block, line = [], node.lineno - 1
    while line in comments and comments[line][1]:
      block.insert(0, comments[line][0])
      line -= 1
    trailing = [comments[i][0] for i in range(node.lineno, node.end_lineno + 1) if i in comments and not comments[i][1]]
    text = " ".join(block + trailing)
    if name in docs:  # assigned twice (a field read by two data sets): both texts
      first, before = docs[name]
      docs[name] = (first, f"{before} {text}".strip())
    else:
      docs[name] = (node.lineno, text)
  return docs


def leaves(config: ml_collections.ConfigDict, prefix: str = "") -> Iterator[Tuple[str, object]]:
  """(dotted name, value) of every field; a non-empty ConfigDict is a section, walked into."""
  for key in config.keys():
    value = config[key]
    name = f"{prefix}{key}"
    if isinstance(value, ml_collections.ConfigDict) and len(value):
      yield from leaves(value, name + ".")
    else:
      yield name, value


def load(path: Optional[str]) -> ml_collections.ConfigDict:
  """``get_config()`` of a config file (the defaults for None)."""
  spec = importlib.util.spec_from_file_location("_config_for_help", path or DEFAULT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def model_argument_docs(model: str) -> Dict[str, str]:
  """A model's constructor arguments (``config.model.kwargs``) -> the docstring under each in its class, with
  its default: the models' own text, so a model's fields mean the same in --helpconfig as in its code."""
  import dataclasses
  import inspect
  import textwrap

  from recsys_jax import models

  if model not in models.names():
    return {}
  takes = models.arguments(model)
  body = ast.parse(textwrap.dedent(inspect.getsource(models.get(model)))).body[0].body
  texts = {}
  for node, after in zip(body, body[1:]):
    doc = getattr(after, "value", None)
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(doc, ast.Constant):
      texts[node.target.id] = " ".join(str(doc.value).split())
  return {
    k: f"{texts.get(k, '(undocumented)')} ({model}'s argument; "
    + ("required)" if arg.default is dataclasses.MISSING else f"its default {arg.default!r})")
    for k, arg in takes.items()
  }


def describe(path: Optional[str] = None) -> str:
  """Every field of the config at ``path`` (default.py for None): ``--config.<field>=<value>`` and its meaning,
  in default.py's order, each section headed by its own text."""
  from recsys_jax import models

  docs = field_docs()
  line, text = docs["model.name"]
  docs["model.name"] = (line, f"{text} The models: {', '.join(models.names())}.")
  config = load(path)
  for k, text in model_argument_docs(config.model.name).items():
    docs.setdefault(f"model.kwargs.{k}", (docs.get("model.kwargs", (1 << 30, ""))[0], text))
  fields = sorted(leaves(config), key=lambda kv: (docs.get(kv[0], (1 << 30, ""))[0], kv[0]))
  lines = [f"Config fields ({path or 'configs/default.py'}; set any with --config.<field>=<value>):"]
  section = None
  for name, value in fields:
    head = name.rpartition(".")[0]
    if head != section:
      lines.append(f"\n[{head or 'top level'}] {docs.get(head, (0, ''))[1]}".rstrip())
    section = head
    shown = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value  # an empty section
    lines.append(f"  --config.{name}={shown!r}")
    lines.append(
      f"      {docs.get(name, (0, '(not in configs/default.py)'))[1] or '(no comment in configs/default.py)'}"
    )
  return "\n".join(lines)
