"""The house rules of the code base, checked by reading its source.

- Imports run one way: a module imports only from its own unit (a top-level module or
  package of ``recsys_jax``) or from a unit in a layer below, and no import cycle exists
  between modules. Imports inside functions count: they run too.
- ``recsys_jax.async_ps`` imports no jax (the PS runs on hosts without accelerators and in
  server processes that must start fast), neither directly nor through what it imports.
- No module uses another module's private names, and ``train.train_and_evaluate`` fits on a screen.
- No test turns a project module that fails to import into a skip (``importorskip`` and the like).
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "recsys_jax"

# Top to bottom. A unit may import units of its own layer or of layers below it.
LAYERS = (
  ("main", "serve", "predict", "launch", "plan"),  # entry points and what only they use
  ("train", "serving"),  # the loop; serving a trained model
  ("training", "online"),  # the parts the loop is assembled from; what online training adds
  ("checkpoint", "checkpoint_files", "write_waits", "data"),
  ("async_ps",),
  ("models", "parallel", "embeddings", "metrics"),
  ("hashing", "workdir", "lazy", "prefetch", "sorting"),  # what the data readers, the PS, training and serving share
)

# Inside async_ps, top to bottom: the store is below the client and the server, which both speak
# the wire format; the kernels are below everything.
ASYNC_PS_LAYERS = (
  ("", "factory", "protocol"),  # the package's public surface; building a PS from a config
  ("client", "server"),
  ("wire",),
  ("store",),  # the in-process PS saves and loads itself through snapshot
  ("snapshot",),  # snapshots on disk and the state they carry: nothing of the store's
  ("optim",),
  ("kernels",),
)
ASYNC_PS_RANK = {unit: len(ASYNC_PS_LAYERS) - i for i, layer in enumerate(ASYNC_PS_LAYERS) for unit in layer}
RANK = {unit: len(LAYERS) - i for i, layer in enumerate(LAYERS) for unit in layer}
NO_JAX = ("jax", "jaxlib", "flax", "optax", "orbax", "chex")


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, known) -> tuple[set[str], set[str]]:
  """(recsys_jax modules, other top-level packages) that a module imports, anywhere in it."""
  ours, others = set(), set()
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: resolve against this module's package
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` imports mod.
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else:
      continue
    for t in targets:
      if t == "recsys_jax" or t.startswith("recsys_jax."):
        while t not in known:  # ``import recsys_jax.x.y as z`` names a module; trim attribute paths
          t = t.rpartition(".")[0]
        ours.add(t)
      else:
        others.add(t.split(".")[0])
  return ours, others


def _graph():
  known = _modules()
  edges, external = {}, {}
  for name, path in known.items():
    edges[name], external[name] = _imports(name, path, known)
    edges[name].discard(name)
  return edges, external


def _unit(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def test_every_unit_has_a_layer():
  units = {_unit(m) for m in _modules()} - {""}
  missing = sorted(units - set(RANK))
  assert not missing, f"recsys_jax units {missing} are in no layer of tests/test_structure.py LAYERS: place them"


def test_imports_run_one_way():
  edges, _ = _graph()
  upward = [
    f"{a} imports {b} ({_unit(b)} is above {_unit(a)})"
    for a, bs in edges.items()
    for b in bs
    if _unit(a) and _unit(b) and RANK.get(_unit(b), 0) > RANK.get(_unit(a), 0)
  ]
  assert not upward, "imports that run upward:\n" + "\n".join(sorted(upward))


def _async_ps_unit(module: str) -> str:
  parts = module.split(".")
  return parts[2] if len(parts) > 2 else ""


def test_inside_async_ps_imports_run_one_way():
  edges, _ = _graph()
  mods = [m for m in edges if _unit(m) == "async_ps"]
  missing = sorted({_async_ps_unit(m) for m in mods} - set(ASYNC_PS_RANK))
  assert not missing, f"async_ps units {missing} are in no layer of tests/test_structure.py ASYNC_PS_LAYERS"
  upward = [
    f"{a} imports {b} ({_async_ps_unit(b) or 'async_ps'} is above {_async_ps_unit(a)})"
    for a in mods
    for b in edges[a]
    if _unit(b) == "async_ps" and ASYNC_PS_RANK[_async_ps_unit(b)] > ASYNC_PS_RANK[_async_ps_unit(a)]
  ]
  assert not upward, "imports inside async_ps that run upward:\n" + "\n".join(sorted(upward))


def test_no_folder_holds_more_than_about_a_dozen_modules():
  crowded = {
    str(d.relative_to(ROOT)): n
    for d in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]
    if (n := len([f for f in d.glob("*.py") if f.name not in ("__init__.py", "__main__.py")])) > 14
  }
  assert not crowded, f"folders with more modules than a reader can hold in mind (split by concept): {crowded}"


def test_no_import_cycle():
  edges, _ = _graph()
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(m: str):
    state[m] = 1
    path.append(m)
    for n in sorted(edges.get(m, ())):
      if state.get(n) == 1:
        cycle = path[path.index(n) :] + [n]
        pytest.fail("import cycle: " + " -> ".join(cycle))
      if n not in state:
        visit(n)
    path.pop()
    state[m] = 2

  for m in sorted(edges):
    if m not in state:
      visit(m)


def test_async_ps_reaches_no_jax_in_its_source():
  edges, external = _graph()
  start = [m for m in edges if _unit(m) == "async_ps"]
  seen, todo = set(start), list(start)
  while todo:
    m = todo.pop()
    bad = sorted(external[m] & set(NO_JAX))
    assert not bad, f"{m} (reached from recsys_jax.async_ps) imports {bad}"
    for n in edges[m] - seen:
      seen.add(n)
      todo.append(n)


def test_importing_async_ps_loads_no_jax():
  names = sorted(m for m in _modules() if _unit(m) == "async_ps")
  code = (
    "import importlib, sys\n"
    f"for m in {names!r}: importlib.import_module(m)\n"
    f"print(sorted({{k.split('.')[0] for k in sys.modules}} & set({NO_JAX!r})))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]", f"importing recsys_jax.async_ps loaded {out.stdout.strip()}"


def _private_uses(path: pathlib.Path, known) -> list[str]:
  """Where a module uses another module's private name: ``from m import _x``, or ``m._x`` on a module
  it imported (``import a.m as m``, ``from a import m``)."""
  tree = ast.parse(path.read_text(), str(path))
  modules, out = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("recsys_jax"):
      for a in node.names:
        if f"{node.module}.{a.name}" in known:
          modules.add(a.asname or a.name)
        elif a.name.startswith("_") and not a.name.startswith("__"):
          out.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import {a.name}")
    elif isinstance(node, ast.Import):
      modules.update(a.asname for a in node.names if a.asname and a.name.startswith("recsys_jax"))
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
      if node.attr.startswith("_") and not node.attr.startswith("__"):
        out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.id}.{node.attr}")
  return out


def test_no_module_uses_another_modules_private_names():
  """A private name is its module's own: another module that needs it gets a public name (split files by
  concept, not by line count; the 450-line limit this replaces bent classes into mixins to fit it)."""
  known = _modules()
  found = [use for path in sorted(PACKAGE.rglob("*.py")) for use in _private_uses(path, known)]
  assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_private_name_finder_sees_each_form(tmp_path):
  f = tmp_path / "m.py"
  f.write_text(
    "from recsys_jax.async_ps import snapshot as s\nfrom recsys_jax.async_ps.store.ps import _x\ns._spec()\n"
  )
  known = _modules()
  path = PACKAGE / "_structure_probe_.py"  # under the package: the finder names paths relative to it
  path.write_text(f.read_text())
  try:
    uses = _private_uses(path, known)
  finally:
    path.unlink()
  assert [u.split(" ", 1)[1] for u in uses] == ["from recsys_jax.async_ps.store.ps import _x", "s._spec"], uses


_CONFIG_NAMES = ("config", "c")  # what the package and the experiments call a run's config


def _config_defaults(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
  """``config.get(key, default)`` (or ``config.<section>.get(...)``, a default by keyword too) in a
  file: a default written where a field is read, beside the one in ``configs/default.py``."""
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"):
      continue
    base = node.func.value
    while isinstance(base, ast.Attribute):
      base = base.value
    if isinstance(base, ast.Name) and base.id in _CONFIG_NAMES and (len(node.args) >= 2 or node.keywords):
      out.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
  return out


MODULE_LINES = 600  # past this a module holds more than one concept: split it by concern
EXPERIMENTS = ROOT / "experiments"
SCRIPT_LINES = 400  # a script measures one thing; what scripts share lives in experiments/harness
EXPERIMENTS_LINES = 6_500  # the benchmarks stay a small share of the code they measure


def _lines(path: pathlib.Path) -> int:
  return len(path.read_text().splitlines())


def test_no_module_is_over_600_lines():
  big = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := _lines(p)) > MODULE_LINES}
  assert not big, f"modules over {MODULE_LINES} lines (split by concern, a class whole in one file): {big}"


def _scripts() -> list[pathlib.Path]:
  return sorted(EXPERIMENTS.glob("*.py"))


def test_experiments_stay_small():
  big = {p.name: n for p in _scripts() if (n := _lines(p)) > SCRIPT_LINES}
  assert not big, f"experiment scripts over {SCRIPT_LINES} lines (move what they share to experiments/harness): {big}"
  total = sum(_lines(p) for p in EXPERIMENTS.rglob("*.py"))
  assert total <= EXPERIMENTS_LINES, f"experiments/ holds {total} lines of Python, over {EXPERIMENTS_LINES}"


def _script_imports(path: pathlib.Path) -> set[str]:
  """Top-level names a script imports, anywhere in it (``import x``, ``from x import y``, importlib's literal)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      names.add(node.module.split(".")[0])
    elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
      if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        names.add(node.args[0].value.split(".")[0])
  return names


def test_no_script_imports_another():
  """Scripts share code through experiments/harness, never by importing each other (and with it,
  each other's absl flags)."""
  scripts = {p.stem for p in _scripts()}
  found = {p.name: sorted(_script_imports(p) & (scripts - {p.stem})) for p in _scripts()}
  found = {k: v for k, v in found.items() if v}
  assert not found, f"scripts importing other scripts (move the shared part to experiments/harness): {found}"


def test_the_script_import_finder_sees_each_form(tmp_path):
  f = tmp_path / "s.py"
  f.write_text("import a\nimport b.c as d\nfrom e import f\nfrom .g import h\nimportlib.import_module('i.j')\n")
  assert _script_imports(f) == {"a", "b", "e", "i"}


def test_config_defaults_live_in_configs_default_only():
  """A field's default is written once, in configs/default.py: the code reads ``config.field``, and
  a config written by an older run gets the fields it lacks from there when it is loaded
  (``run_config.load``). A default repeated at a read drifts from the real one (``hot_every`` read
  0 where the config said 200, ``publish_dense_every_s`` 0.0 where it said 30)."""
  files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "experiments").rglob("*.py"))
  found = [use for path in files for use in _config_defaults(path)]
  assert not found, "config defaults outside configs/default.py:\n" + "\n".join(found)


def test_the_config_default_finder_sees_each_form(tmp_path):
  f = tmp_path / "m.py"
  f.write_text(
    "config.get('a', 1)\nconfig.ps.get('b', default=2)\nc.data.get('c', 3)\nconfig.get('d')\nrows.get('e', 4)\n"
  )
  uses = [u.split(" ", 1)[1] for u in _config_defaults(f, tmp_path)]
  assert uses == ["config.get('a', 1)", "config.ps.get('b', default=2)", "c.data.get('c', 3)"], uses


def test_train_and_evaluate_fits_on_a_screen():
  tree = ast.parse((PACKAGE / "train.py").read_text())
  (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train_and_evaluate"]
  lines = fn.end_lineno - fn.lineno + 1
  assert lines < 80, f"train.train_and_evaluate is {lines} lines: move what is not the loop into recsys_jax/training"


def test_the_graph_sees_real_imports():
  # The walker itself: a module that imports nothing of ours would make every check vacuous.
  edges, external = _graph()
  assert "recsys_jax.training.job" in edges["recsys_jax.train"]
  assert "recsys_jax.async_ps.store.ps" in edges["recsys_jax.async_ps.factory"]
  assert "recsys_jax.async_ps.client.remote" in edges["recsys_jax.async_ps.factory"]  # imported inside a function
  assert "recsys_jax.embeddings.specs" in edges["recsys_jax.async_ps.store.ps"]
  assert "jax" in external["recsys_jax.train"] or "jax" in external["recsys_jax.training.steps"]
  assert os.path.basename(__file__) == "test_structure.py"


_OURS = ("recsys_jax", "configs", "experiments", "tests")
_SKIPS = ("skip", "xfail", "importorskip")


def _is_ours(module) -> bool:
  return isinstance(module, str) and module.split(".")[0] in _OURS + tuple(
    p.stem for p in (ROOT / "tests").rglob("*.py")
  )


def _skips_on_missing_project_modules(tree: ast.AST) -> list[int]:
  """Lines where a test file turns a project module that fails to import into a skip or xfail:
  ``pytest.importorskip("recsys_jax...")``, a ``try`` importing one with an ``except ImportError``,
  or an ``if ...find_spec(...)`` that skips."""
  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "importorskip":
      if node.args and _is_ours(getattr(node.args[0], "value", None)):
        lines.append(node.lineno)
    elif isinstance(node, ast.Try):
      caught = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
      imports = [n for s in node.body for n in ast.walk(s) if isinstance(n, (ast.Import, ast.ImportFrom))]
      names = [a.name for n in imports if isinstance(n, ast.Import) for a in n.names]
      names += [n.module for n in imports if isinstance(n, ast.ImportFrom) and not n.level]
      if caught & {"ImportError", "ModuleNotFoundError", "Exception"} and any(map(_is_ours, names)):
        lines.append(node.lineno)
    elif isinstance(node, ast.If) and "find_spec" in ast.unparse(node.test):
      called = {getattr(n.func, "attr", "") for s in node.body for n in ast.walk(s) if isinstance(n, ast.Call)}
      if called & set(_SKIPS):
        lines.append(node.lineno)
  return lines


def test_no_test_skips_a_project_module_that_fails_to_import():
  """A broken import in the project must fail the suite, not skip the tests that would show it."""
  found = {}
  for path in sorted((ROOT / "tests").rglob("*.py")):
    lines = _skips_on_missing_project_modules(ast.parse(path.read_text(), str(path)))
    if lines:
      found[str(path.relative_to(ROOT))] = lines
  assert not found, f"skips on a project module's import (file: lines): {found}"


def test_the_skip_finder_sees_each_form():
  forms = [
    'scorer = pytest.importorskip("recsys_jax.serving.scorer")',
    "try:\n  from recsys_jax.serving import scorer\nexcept ImportError:\n  pytest.skip('no scorer')",
    "if importlib.util.find_spec('recsys_jax.async_ps.server') is None:\n  pytest.xfail('not yet')",
  ]
  for src in forms:
    assert _skips_on_missing_project_modules(ast.parse(src)) == [1], src
  fine = 'np = pytest.importorskip("numpy")\ntry:\n  import tqdm\nexcept ImportError:\n  tqdm = None'
  assert _skips_on_missing_project_modules(ast.parse(fine)) == []


def test_tests_mirror_the_package():
  """A folder of tests/ is named after a unit of recsys_jax (a subpackage, or a top-level module such as
  launch or plan) or is e2e/ (whole runs), helpers/ (modules the tests share, no tests) or fuzz/ (the fuzzer,
  a test tool run as ``python -m tests.fuzz``: its targets cut across units, as e2e's runs do); each is a
  package, so two test files of one name in two folders do not collide under pytest."""
  units = {p.stem for p in PACKAGE.iterdir() if (p.is_dir() and p.name != "__pycache__") or p.suffix == ".py"}
  folders = [p for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name not in ("__pycache__", "corpus")]
  stray = sorted(p.name for p in folders if p.name not in units | {"e2e", "helpers", "fuzz"})
  assert not stray, f"tests/ folders named after no unit of recsys_jax: {stray} (tests mirror the package)"
  no_init = [str(p.relative_to(ROOT)) for p in [ROOT / "tests", *folders] if not (p / "__init__.py").exists()]
  assert not no_init, f"test folders without __init__.py: {no_init}"
  assert not list((ROOT / "tests" / "helpers").glob("test_*.py")), "tests/helpers/ holds shared modules, not tests"
