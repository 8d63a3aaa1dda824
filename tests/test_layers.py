"""The layer map in docs/architecture.md, checked against every import in src/steadytrain.

The table's rows are the layers, lowest first: a module may import its own row and the rows above it.
A module belongs to the row with the longest dotted name that prefixes its own; a row that other rows
sit under (``steadytrain``, ``steadytrain.train``) holds only its own ``__init__``. Imports are read with
``ast``, those inside functions included, those under ``if TYPE_CHECKING:`` left out.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = "steadytrain"


class Edge(NamedTuple):
    importer: str
    imported: str
    line: int


# -- the table ---------------------------------------------------------------------------------------


def layer_table(markdown: str) -> list[str]:
    """The package column of the ``package | owns | may import`` table, in row order."""
    lines = markdown.splitlines()
    header = next((i for i, line in enumerate(lines) if _cells(line) == ["package", "owns", "may import"]), None)
    if header is None:
        raise AssertionError("no `| package | owns | may import |` table")
    rows = []
    for line in lines[header + 2 :]:  # header + 1 is the |---| separator
        if not line.lstrip().startswith("|"):
            break
        rows.append(_cells(line)[0].strip("`"))
    return rows


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def row_of(module: str, rows: list[str]) -> int | None:
    """The index of the row ``module`` belongs to (longest dotted prefix), or None."""
    containers = {r for r in rows if any(o.startswith(r + ".") for o in rows)}
    best = None
    for i, row in enumerate(rows):
        holds = module == row or (row not in containers and module.startswith(row + "."))
        if holds and (best is None or len(row) > len(rows[best])):
            best = i
    return best


# -- the imports -------------------------------------------------------------------------------------


def module_name(path: Path) -> tuple[str, bool]:
    """``path``'s dotted module name under ``src``, and whether it is a package ``__init__``."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(node: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth, except in an ``if TYPE_CHECKING:`` body."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child.test):
            for stmt in child.orelse:
                yield from _statements_of(stmt)
            continue
        yield from _statements_of(child)


def _statements_of(node: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _statements(node)


def imports_of(source: str, module: str, is_package: bool, modules: set[str]) -> list[Edge]:
    """The project modules ``source`` (module ``module``) imports at run time. ``from X import n`` is an
    import of ``X.n`` when that is a module, else of ``X``."""
    edges = []
    for stmt in _statements(ast.parse(source)):
        if isinstance(stmt, ast.Import):
            targets = [alias.name for alias in stmt.names]
        else:
            base = stmt.module or ""
            if stmt.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (stmt.level - 1)]
                base = ".".join([*parts, *([stmt.module] if stmt.module else [])])
            subs = [f"{base}.{alias.name}" for alias in stmt.names]
            targets = [s if s in modules else base for s in subs]
        for target in dict.fromkeys(targets):
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                edges.append(Edge(module, target, stmt.lineno))
    return edges


def import_graph(sources: Mapping[str, tuple[str, bool]]) -> dict[str, list[Edge]]:
    """``{module: its imports}`` from ``{module: (source, is_package)}``."""
    modules = set(sources)
    return {m: imports_of(src, m, pkg, modules) for m, (src, pkg) in sources.items()}


def package_sources() -> dict[str, tuple[str, bool]]:
    sources = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        name, is_package = module_name(path)
        sources[name] = (path.read_text(encoding="utf-8"), is_package)
    return sources


# -- the checks --------------------------------------------------------------------------------------


def _layer(module: str, rows: list[str]) -> str:
    i = row_of(module, rows)
    return "no layer" if i is None else f"layer {i + 1} `{rows[i]}`"


def unplaced(graph: Mapping[str, list[Edge]], rows: list[str]) -> list[str]:
    """Modules, and project modules imported, that no row of the table holds."""
    found = [f"{m}: belongs to no row of the layer table" for m in graph if row_of(m, rows) is None]
    for edges in graph.values():
        for e in edges:
            if row_of(e.imported, rows) is None:
                found.append(
                    f"{e.importer} ({_layer(e.importer, rows)}) imports {e.imported} (no layer) at line {e.line}: "
                    f"{e.imported} belongs to no row of the layer table"
                )
    return found


def layer_violations(graph: Mapping[str, list[Edge]], rows: list[str]) -> list[Edge]:
    """The imports of a row below the importer's own."""
    bad = []
    for edges in graph.values():
        for e in edges:
            mine, theirs = row_of(e.importer, rows), row_of(e.imported, rows)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(e)
    return bad


def describe_violation(e: Edge, rows: list[str]) -> str:
    return (
        f"{e.importer} ({_layer(e.importer, rows)}) imports {e.imported} ({_layer(e.imported, rows)}) "
        f"at line {e.line}: a layer may import only its own row and the rows above it"
    )


def mutual_imports(graph: Mapping[str, list[Edge]], rows: list[str]) -> list[str]:
    """Pairs of modules that import each other directly."""
    targets = {m: {e.imported: e.line for e in edges} for m, edges in graph.items()}
    found = []
    for a, imported in targets.items():
        for b, line in imported.items():
            if a < b and a in targets.get(b, {}):
                found.append(
                    f"{a} ({_layer(a, rows)}) imports {b} ({_layer(b, rows)}) at line {line}, and {b} imports {a} "
                    f"at line {targets[b][a]}: two modules must not import each other"
                )
    return found


# -- the tests on the package ------------------------------------------------------------------------


@functools.cache  # read once for the tests below, which only read it
def _rows_and_graph() -> tuple[list[str], dict[str, list[Edge]]]:
    rows = layer_table(DOC.read_text(encoding="utf-8"))
    return rows, import_graph(package_sources())


def test_table_lists_each_package_once() -> None:
    rows = layer_table(DOC.read_text(encoding="utf-8"))
    assert len(rows) > 10, rows
    assert all(r == PACKAGE or r.startswith(PACKAGE + ".") for r in rows), rows
    assert len(set(rows)) == len(rows), [r for r in rows if rows.count(r) > 1]


def test_every_module_belongs_to_a_layer() -> None:
    rows, graph = _rows_and_graph()
    assert len(graph) > 100  # the whole package was read
    problems = unplaced(graph, rows)
    assert not problems, "\n".join(problems)


def test_no_module_imports_a_lower_layer() -> None:
    rows, graph = _rows_and_graph()
    bad = layer_violations(graph, rows)
    assert not bad, "\n".join(describe_violation(e, rows) for e in bad)


def test_no_two_modules_import_each_other() -> None:
    rows, graph = _rows_and_graph()
    problems = mutual_imports(graph, rows)
    assert not problems, "\n".join(problems)


# -- the checker against planted violations ---------------------------------------------------------

_ROWS = ["steadytrain", "steadytrain.errors", "steadytrain.clip", "steadytrain.train", "steadytrain.train.job"]
_TABLE = "\n".join(
    ["# Layers", "", "| package | owns | may import |", "|---|---|---|"]
    + [f"| `{r}` | something | nothing |" for r in _ROWS]
    + ["", "| other | table |", "|---|---|", "| `steadytrain.nope` | x |"]
)


def test_the_table_is_read_in_order() -> None:
    assert layer_table(_TABLE) == _ROWS
    assert row_of("steadytrain.train.job.loop", _ROWS) == 4
    assert row_of("steadytrain.train.job", _ROWS) == 4
    assert row_of("steadytrain.clipper", _ROWS) is None  # a prefix of names, not of strings
    assert row_of("steadytrain.train", _ROWS) == 3
    assert row_of("steadytrain.train.other", _ROWS) is None  # `steadytrain.train` holds only its __init__
    assert row_of("steadytrain.other", _ROWS) is None


def test_a_planted_violation_is_caught() -> None:
    sources = {
        "steadytrain.errors": ("", False),
        "steadytrain.clip": (
            "from typing import TYPE_CHECKING\n"
            "from steadytrain.errors import UserError\n"
            "if TYPE_CHECKING:\n"
            "    from steadytrain.train.job.loop import train\n"  # types only: allowed
            "def f():\n"
            "    from .train.job import loop\n",  # at run time, inside a function: a violation
            False,
        ),
        "steadytrain.train.job": ("", True),
        "steadytrain.train.job.loop": ("import steadytrain.clip\nimport torch\n", False),
        "steadytrain.train.extra": ("", False),
    }
    graph = import_graph(sources)
    assert graph["steadytrain.clip"] == [
        Edge("steadytrain.clip", "steadytrain.errors", 2),
        Edge("steadytrain.clip", "steadytrain.train.job.loop", 6),
    ]
    bad = layer_violations(graph, _ROWS)
    assert bad == [Edge("steadytrain.clip", "steadytrain.train.job.loop", 6)]
    message = describe_violation(bad[0], _ROWS)
    for part in ("steadytrain.clip", "layer 3 `steadytrain.clip`", "steadytrain.train.job.loop", "layer 5"):
        assert part in message, message
    cycles = mutual_imports(graph, _ROWS)
    assert len(cycles) == 1 and "steadytrain.clip (layer 3" in cycles[0], cycles
    assert "steadytrain.train.job.loop (layer 5 `steadytrain.train.job`)" in cycles[0], cycles
    assert unplaced(graph, _ROWS) == ["steadytrain.train.extra: belongs to no row of the layer table"]


def test_a_clean_graph_passes() -> None:
    sources = {
        "steadytrain.errors": ("", False),
        "steadytrain.clip": ("from steadytrain import errors\nfrom steadytrain.errors import UserError\n", False),
        "steadytrain.train.job": ("from steadytrain.train.job.loop import train\n", True),
        "steadytrain.train.job.loop": ("from ...clip import f\nfrom . import state\n", False),
        "steadytrain.train.job.state": ("from steadytrain.train.job import files\n", False),
    }
    graph = import_graph(sources)
    assert [e.imported for e in graph["steadytrain.clip"]] == ["steadytrain.errors", "steadytrain.errors"]
    loop = {e.imported for e in graph["steadytrain.train.job.loop"]}
    assert loop == {"steadytrain.clip", "steadytrain.train.job.state"}
    assert [e.imported for e in graph["steadytrain.train.job.state"]] == ["steadytrain.train.job"]  # not a module
    assert layer_violations(graph, _ROWS) == []
    assert unplaced(graph, _ROWS) == []
    assert mutual_imports(graph, _ROWS) == []
    graph["steadytrain.train.job.loop"].append(Edge("steadytrain.train.job.loop", "steadytrain.train.job", 3))
    assert len(mutual_imports(graph, _ROWS)) == 1  # a package __init__ and its own module count too
