"""A package's public names imported on first use, so importing one of its submodules does not import them all.

A package calls :func:`export_lazily` with where each name of its ``__all__`` lives; its module-level
``__getattr__`` (PEP 562) then imports that submodule when the name is first read (``from pkg import name``
included) and keeps the value. A public name that is also a submodule's (``steadytrain.runs.report``, the
function, beside ``steadytrain/runs/report.py``) stays the public value even once that submodule was imported on
its own, as when the package imported every name at once.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping
from typing import Any

__all__ = ["export_lazily"]


class _LazyPackage(types.ModuleType):
    """A package whose public names load on first use (see :func:`export_lazily`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in self.__dict__.get("_lazy_where", {}):
            return  # the import system binding a submodule of the same name: the public name keeps its value
        super().__setattr__(name, value)


def export_lazily(package: str, where: Mapping[str, str]) -> None:
    """Give ``package`` (its ``__name__``) a module-level ``__getattr__`` and ``__dir__`` that import each public
    name from its submodule (``where``: name -> submodule, relative) on first use.

    Example:
        >>> import steadytrain.diagnose.report  # the submodule first: the package's name is still the function
        >>> from steadytrain.diagnose import read_ledger, report
        >>> read_ledger.__module__, report.__module__, callable(report)
        ('steadytrain.diagnose.ledger', 'steadytrain.diagnose.report', True)
    """
    module = sys.modules[package]

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        module.__dict__[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(module.__dict__) | set(where))

    module.__dict__.update(_lazy_where=dict(where), __getattr__=__getattr__, __dir__=__dir__)
    module.__class__ = _LazyPackage
