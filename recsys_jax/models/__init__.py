"""The model zoo: Flax modules that map dense features and pooled embeddings to logits.

Every model is called as ``model.apply({'params': params}, dense,
embeddings, sequences=None)`` and returns float32 logits [B]; none of them sees an id.

- ``dense``: float32 [B, num_dense]; num_dense may be 0.
- ``embeddings``: feature name -> float32 [B, D_f] pooled embeddings. Widths may differ,
  except where a model's interaction needs them equal (DLRM's dot products, DeepFM's FM),
  which then raises a ValueError naming the features and widths.
- ``sequences``: None, or feature name -> (float32 [B, L, D], bool mask [B, L], True at real
  items). DIN attends over its ``history``; everything else (and every other model) treats a
  sequence as one more pooled feature of the same name, its masked mean
  (``pool_sequences``).

Models with the class attribute ``linear_terms = True`` (DeepFM, Wide & Deep) also need a
per-id scalar weight per pooled feature ``f``: the trainer adds a dim-1 feature
``f + LINEAR_SUFFIX`` (its own table), so ``embeddings`` holds those [B, 1] keys too; the
model raises a ValueError if they are missing.

Models are deterministic (no dropout, no batch norm, only a ``params`` collection), and
every parameter carries logical axis names (kernels ('embed', 'mlp'), biases ('mlp',)) for
``config.mesh.rules``. Pick one with ``config.model.name``; its constructor arguments come
from ``config.model.kwargs``.

The convention: the model named ``x`` is the module ``recsys_jax.models.x``, whose module-level
``MODEL`` is its class; a module without ``MODEL`` (``layers``) is a helper, not a model. Nothing
lists the models by hand: ``names`` scans the package (and the directories in the environment
variable ``RECSYS_JAX_MODELS_PATH``, for models kept outside it), ``get`` imports one, and
``arguments`` reads its constructor arguments from its dataclass fields. docs/models.md shows
a model added as one module plus one config.
"""

import dataclasses
import importlib
import os
import pkgutil
import typing
from typing import Any, Dict, List, NamedTuple, Type

import flax.linen as nn

from recsys_jax.models.layers import LINEAR_SUFFIX, MLP, pool_sequences, split_linear

# The public entry points first: the API reference lists the names in this order.
__all__ = [
  "get",
  "names",
  "arguments",
  "Argument",
  "PATH_VARIABLE",
  "LINEAR_SUFFIX",
  "MLP",
  "pool_sequences",
  "split_linear",
]

PATH_VARIABLE = "RECSYS_JAX_MODELS_PATH"
"""Directories (``os.pathsep``-separated) searched for model modules after the package's own."""

_PACKAGE_PATH = list(__path__)


def _search_path() -> List[str]:
  """The package's directory, then those in ``RECSYS_JAX_MODELS_PATH`` as it is now: set into
  ``__path__``, so that ``recsys_jax.models.<name>`` imports from them as from the package."""
  extra = [os.path.abspath(p) for p in os.environ.get(PATH_VARIABLE, "").split(os.pathsep) if p]
  __path__[:] = _PACKAGE_PATH + [p for p in extra if p not in _PACKAGE_PATH]
  return list(__path__)


def _modules() -> set:
  """The names of the plain modules on the search path (models and helpers alike)."""
  return {m.name for m in pkgutil.iter_modules(_search_path()) if not m.ispkg and not m.name.startswith("_")}


def _declared(module_name: str):
  """The ``MODEL`` of ``recsys_jax.models.<module_name>``, or None for a helper module."""
  module = importlib.import_module(f"{__name__}.{module_name}")
  return getattr(module, "MODEL", None)


def names() -> List[str]:
  """The names of every model, sorted: the modules on the search path that declare ``MODEL``."""
  return sorted(n for n in _modules() if _declared(n) is not None)


def get(name: str) -> Type[nn.Module]:
  """The class of the model ``name`` (``recsys_jax.models.<name>.MODEL``).

  Raises:
    ValueError: no module of that name declares ``MODEL``; the line names the models there are.
  """
  cls = _declared(name) if isinstance(name, str) and name in _modules() else None
  if cls is None:
    raise ValueError(f"unknown model {name!r}; choose one of {names()}")
  return cls


class Argument(NamedTuple):
  """One constructor argument of a model: its type (the annotation resolved) and its default
  (``dataclasses.MISSING`` for a required one)."""

  type: Any
  default: Any


def arguments(name: str) -> Dict[str, Argument]:
  """The constructor arguments of the model ``name`` (what ``config.model.kwargs`` may set): its
  dataclass fields, less flax's own ``parent`` and ``name``, in declaration order.

  Raises:
    ValueError: ``name`` is no model (as ``get``).
  """
  cls = get(name)
  hints = typing.get_type_hints(cls)
  return {
    f.name: Argument(hints[f.name], f.default)
    for f in dataclasses.fields(cls)
    if f.init and f.name not in ("parent", "name")
  }
