"""The lockfile: ``name==version`` for every distribution of a manifest's image, and its parser.

Every name is a PEP 508 name and every version a PEP 440 version (checked with ``packaging``'s own
patterns) before it is written, so a manifest cannot add a pip option (``--extra-index-url``) or a
second requirement to the file; the header comments carry only checked values.
"""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name as canonical_name

from steadytrain._io import brief
from steadytrain.env import grammar
from steadytrain.env._schema import as_dict, source_of
from steadytrain.errors import UserError

__all__ = ["canonical_name", "lockfile", "parse_lockfile", "requirement_closure"]


def _pins(image: dict[str, Any], where: str) -> dict[str, str]:
    """Canonical name -> version for the image's packages, each checked; two spellings of one name refused."""
    out: dict[str, str] = {}
    for raw, version in (image.get("packages") or {}).items():
        name = canonical_name(grammar.dist_name(f"{where}: image.packages name", raw))
        version = grammar.pep440_version(f"{where}: image.packages.{raw}", version)
        if name in out:
            raise UserError(f"{where}: image.packages names {name} twice (under two spellings): keep one")
        out[name] = version
    return out


def _header(d: dict[str, Any], where: str) -> list[str]:
    image, host = d.get("image") or {}, d.get("host") or {}
    stack = grammar.image_stack(image, where)
    pretty = (image.get("os") or {}).get("pretty_name")
    pretty = grammar.comment_text(f"{where}: image.os.pretty_name", pretty) if pretty else None
    platform = grammar.comment_text(f"{where}: host.platform", host["platform"]) if host.get("platform") else None
    where = " ".join(x for x in (platform, f"({pretty})" if pretty else None) if x)
    torch_line = f"# torch {stack['torch'] or 'none'}, cuda {stack['cuda'] or 'none'}"
    return [
        "# steadytrain lockfile",
        f"# python {stack['python'] or 'unknown'}" + (f", {where}" if where else ""),
        torch_line + (f", cudnn {stack['cudnn']}" if stack["cudnn"] else ""),
    ]


def lockfile(manifest: Any, *, only: set[str] | None = None, exclude: set[str] | None = None) -> str:
    """``name==version`` for every distribution in the manifest's image, sorted, under a provenance header.

    Pass ``exclude={"steadytrain"}`` (the project itself) for a Dockerfile that installs the project
    from its source: that version is not on any index.

    Args:
        manifest: an ``EnvManifest`` or its ``to_dict()`` form.
        only: keep just these distributions (any spelling of the names).
        exclude: drop these distributions.

    Raises:
        UserError: ``only`` names a distribution the manifest does not have; a package name that is not
            PEP 508, a version that is not PEP 440, or a header value that breaks its grammar (names the field).

    Example:
        >>> m = {"image": {"python": "3.11.7", "packages": {"torch": "2.13.0+cpu", "numpy": "2.4.6"}}}
        >>> print(lockfile(m), end="")
        # steadytrain lockfile
        # python 3.11.7
        # torch none, cuda none
        numpy==2.4.6
        torch==2.13.0+cpu
    """
    d, where = as_dict(manifest), source_of(manifest)
    packages = _pins(d.get("image") or {}, where)
    if only is not None:
        wanted = {canonical_name(n) for n in only}
        if wanted - packages.keys():
            missing = brief(sorted(wanted - packages.keys()))
            raise UserError(f"only={missing} are not installed in the manifest's image")
        packages = {k: v for k, v in packages.items() if k in wanted}
    for name in exclude or ():
        packages.pop(canonical_name(name), None)
    lines = _header(d, where) + [f"{name}=={packages[name]}" for name in sorted(packages)]
    return "\n".join(lines) + "\n"


def _pin(line: str) -> tuple[str, str] | str:
    """``(canonical name, version)`` of a pin line, or what is wrong with it (never the line itself)."""
    name, sep, version = line.partition("==")
    if not sep:
        return "not a pin 'name==version'"
    try:
        name = canonical_name(grammar.dist_name("name", name.strip()))
    except UserError:
        return "the name before '==' is not a distribution name (PEP 508)"
    try:
        return name, grammar.pep440_version("version", version.strip())
    except UserError:
        return f"the version of {name} is not a PEP 440 version"


def parse_lockfile(text: str) -> dict[str, str]:
    """The pins of a lockfile: canonical name -> exact version. Comments and blank lines are ignored.

    Messages say which line is wrong and how, without quoting it: a file named by mistake (a key, a
    password file) never has its content printed.

    Raises:
        UserError: a line that is not ``name==version``, or a name pinned twice (names the line number).

    Example:
        >>> parse_lockfile("# header\\nNumPy==2.4.6\\ntorch==2.1.0+cu121  # from the cu121 index\\n")
        {'numpy': '2.4.6', 'torch': '2.1.0+cu121'}
    """
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split(" #")[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        pin = _pin(line)
        if isinstance(pin, str):
            raise UserError(f"lockfile line {n}: {pin}; every line must be 'name==version' or a '#' comment")
        name, version = pin
        if name in out:
            raise UserError(f"lockfile line {n}: {name} is pinned twice ({out[name]} and {version})")
        out[name] = version
    return out


def requirement_closure(roots: tuple[str, ...] | list[str]) -> set[str]:
    """Canonical names of ``roots`` and every installed distribution they require, transitively.

    Markers are evaluated for this interpreter; extras are not followed.

    Raises:
        KeyError: a root is not installed (the key is the root's name).
        UserError: a root is not a distribution name (PEP 508), or an installed distribution declares
            a requirement that is not PEP 508.
    """
    for root in roots:  # '' or a path is not a name: importlib.metadata would raise or search the path
        grammar.dist_name("root", root)
    seen: set[str] = set()
    todo = [(r, True) for r in roots]
    while todo:
        name, is_root = todo.pop()
        key = canonical_name(name)
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            if is_root:
                raise KeyError(name) from None
            continue  # an optional or platform-specific requirement that is not installed
        seen.add(key)
        for spec in dist.requires or []:
            try:
                req = Requirement(spec)
            except InvalidRequirement:
                raise UserError(f"installed distribution {key} declares an invalid requirement {brief(spec)}") from None
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append((req.name, False))
    return seen
