"""YAML files a user names, read strictly: the size after alias expansion bounded (an alias bomb is an error, not a
hang), a key given twice refused, every problem one :class:`~steadytrain.errors.UserError` naming the file.

Numbers are read by one rule, the one every flag and the mesh parser use (:data:`steadytrain._check.INT_TEXT`,
:data:`~steadytrain._check.FLOAT_TEXT`, as YAML 1.2's core schema reads them): ``10`` and ``-3`` are integers (``017``
is 17), ``0.5``, ``.5``, ``3e-4`` and ``1e3`` floats, ``.inf``/``.nan`` too (a config refuses them). YAML 1.1's other
forms, which ``yaml.safe_load`` reads as numbers, are text here: ``2_0`` (20), ``0x10`` (16), ``0b101``, ``1:30``
(90), and ``017`` is not octal. :func:`dump_yaml` quotes the text that this rule would read as a number."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from steadytrain._check import FLOAT_TEXT, INT_TEXT
from steadytrain._io import read_text
from steadytrain._text import brief
from steadytrain.errors import UserError

__all__ = ["MAX_YAML_NODES", "dump_yaml", "load_yaml", "parse_yaml"]

MAX_YAML_NODES = 1_000_000  # nodes after alias expansion: a real config has a few hundred


def _count_nodes(value: Any, budget: int) -> int:
    """Nodes of ``value`` with shared (aliased) containers counted each time they appear; stops at ``budget``."""
    stack, seen = [value], 0
    while stack:
        v = stack.pop()
        seen += 1
        if seen > budget:
            break
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return seen


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_SPECIAL = r"[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"


def _add_numbers(cls: Any) -> None:
    """Resolve :data:`INT_TEXT` as an int and :data:`FLOAT_TEXT` (and ``.inf``, ``.nan``) as a float in ``cls``."""
    cls.add_implicit_resolver(_INT, re.compile(rf"(?:{INT_TEXT})\Z"), list("-+0123456789"))
    cls.add_implicit_resolver(_FLOAT, re.compile(rf"(?:{FLOAT_TEXT}|{_SPECIAL})\Z"), list("-+.0123456789"))


def _plain_numbers(cls: Any) -> Any:
    """``cls`` (a loader class) with YAML 1.1's number resolvers replaced by :data:`INT_TEXT` and
    :data:`FLOAT_TEXT` (the integer first: ``10`` is an int, not a float)."""
    cls.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in rules if tag not in (_INT, _FLOAT)]
        for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    _add_numbers(cls)
    return cls


@_plain_numbers
class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (safe_load keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base' may be overridden: not a duplicate
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base class says so
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {brief(key)} is given twice in one mapping", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """A plain integer in base 10 (``017`` is 17: YAML 1.1 reads it as octal 15)."""
        value = self.construct_scalar(node)
        return int(value) if re.fullmatch(INT_TEXT, value) else super().construct_yaml_int(node)


_StrictLoader.add_constructor(_INT, _StrictLoader.construct_yaml_int)


class _Dumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that also quotes the text :class:`_StrictLoader` reads as a number (``'1e3'``): what it
    writes reads back the same here and under ``yaml.safe_load`` (which reads ``2_0`` as 20: quoted too)."""


_add_numbers(_Dumper)


def parse_yaml(text: str, *, source: str, what: str = "YAML file") -> Any:
    """``yaml.safe_load`` with the size after alias expansion bounded (an alias bomb is an error, not a hang).

    A key given twice in one mapping is an error, not a silent override.
    """
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: builds plain data only
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or "malformed"
        raise UserError(f"{source}: {what} is not valid YAML{where}: {brief(str(problem))}") from None
    except RecursionError:
        raise UserError(f"{source}: {what} nests too deeply") from None
    if _count_nodes(data, MAX_YAML_NODES) > MAX_YAML_NODES:
        raise UserError(f"{source}: {what} expands to more than {MAX_YAML_NODES} values (nested aliases?)")
    return data


def dump_yaml(data: Any, *, allow_unicode: bool = True) -> str:
    """``data`` as YAML that :func:`parse_yaml` reads back as ``data`` (keys in their order; Unicode as is, or
    escaped with ``allow_unicode=False``).

    Example:
        >>> dump_yaml({"name": "1e3", "lr": 0.001})
        "name: '1e3'\\nlr: 0.001\\n"
    """
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=allow_unicode)


def load_yaml(path: str | Path, *, what: str = "YAML file") -> Any:
    """Read and parse a YAML file a user named; every problem is one :class:`UserError` naming the file."""
    return parse_yaml(read_text(path, what=what), source=str(path), what=what)
