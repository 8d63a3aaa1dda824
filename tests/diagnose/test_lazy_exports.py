"""The packages whose public names load on first use (``steadytrain._lazy``): importing the package imports none of
its submodules, and every name of ``__all__`` is still importable from it, as the value its submodule defines,
whichever is imported first. Each case runs in a fresh interpreter, where ``sys.modules`` shows what was imported."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

PACKAGES = ["steadytrain.accumulate", "steadytrain.diagnose", "steadytrain.env", "steadytrain.runs"]

PROBE = """
import importlib, pkgutil, sys, types
name = {name!r}
pkg = importlib.import_module(name)
print(sorted(m for m in sys.modules if m.startswith(name + ".")))
if {submodules_first!r}:  # every submodule on its own first: the import system binds their names on the package
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(name + "." + info.name)
values = {{n: getattr(pkg, n) for n in pkg.__all__}}
print(sorted(n for n, v in values.items() if isinstance(v, types.ModuleType)))
exec("from " + name + " import " + ", ".join(pkg.__all__), ns := {{}})
print(sorted(n for n in pkg.__all__ if ns[n] is not values[n]), sorted(set(pkg.__all__) - set(dir(pkg))))
"""


@functools.cache  # one fresh interpreter per case: two tests read the same probe's lines
def _probe(name: str, submodules_first: bool) -> tuple[str, ...]:
    code = PROBE.format(name=name, submodules_first=submodules_first)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return tuple(proc.stdout.splitlines())


@pytest.mark.parametrize("name", PACKAGES)
def test_importing_the_package_imports_none_of_its_submodules(name):
    assert _probe(name, False)[0] == "[]"


@pytest.mark.parametrize("submodules_first", [False, True])
@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_is_its_value_never_a_submodule(name, submodules_first):
    _, modules, differ_and_missing = _probe(name, submodules_first)
    assert modules == "[]"  # e.g. steadytrain.runs.report is the function even after the module is imported
    assert differ_and_missing == "[] []"  # `from package import name` gives the same value; dir() lists them all


def test_a_name_and_its_submodule_of_the_same_name_stay_apart():
    """``report`` and ``hunt`` name a function and the submodule defining it: both stay reachable."""
    code = (
        "import sys, steadytrain.diagnose.report; from steadytrain.diagnose import report, hunt; "
        "m = sys.modules['steadytrain.diagnose.report']; "
        "print(callable(report), report is m.report, hunt is sys.modules['steadytrain.diagnose.hunt'].hunt)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["True", "True", "True"], proc.stderr
