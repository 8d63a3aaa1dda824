"""YAML files a user names, read strictly: the size after alias expansion bounded (an alias bomb is an error, not a
hang), a key given twice refused, every problem one :class:`~steadytrain.errors.UserError` naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from steadytrain._io import read_text
from steadytrain._text import brief
from steadytrain.errors import UserError

__all__ = ["MAX_YAML_NODES", "load_yaml", "parse_yaml"]

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


def load_yaml(path: str | Path, *, what: str = "YAML file") -> Any:
    """Read and parse a YAML file a user named; every problem is one :class:`UserError` naming the file."""
    return parse_yaml(read_text(path, what=what), source=str(path), what=what)
