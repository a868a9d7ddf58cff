"""A package's public names loaded on first use (PEP 562), so importing one of its modules does not import the rest."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Dict, List, Tuple, Union

Where = Union[str, Tuple[str, str]]
"""The module a public name comes from, or (module, its name there) where the two differ."""


def exports(package: str, public: Dict[str, Where]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
  """``__getattr__`` and ``__dir__`` for ``package`` (its ``__name__``) serving ``public``'s names.

  A name is imported from its module on first use and kept in the package's namespace; any other
  name is an AttributeError, so ``from package import submodule`` still imports the submodule.
  """

  def __getattr__(name: str) -> Any:
    where = public.get(name)
    if where is None:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(module), attr)
    setattr(sys.modules[package], name, value)
    return value

  def __dir__() -> List[str]:
    return sorted(set(vars(sys.modules[package])) | set(public))

  return __getattr__, __dir__
