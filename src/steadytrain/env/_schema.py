"""The manifest's shape: which fields are strings, numbers, flags, objects; checked wherever one is read.

Every consumer of a manifest (the lockfile, the Dockerfile, the image tag, the contract check, the
diff) takes it through :func:`as_dict`, so a manifest with a number where a string belongs, a list
where an object belongs or a ``null`` scope is one :class:`ManifestError` naming the field, never a
traceback deep inside a generator. Unknown fields are allowed (a newer capture may add some);
what a value *means* (a version, a commit) is checked where it is written (:mod:`.grammar`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from steadytrain._io import brief
from steadytrain.errors import UserError

SCHEMA = 1
SCOPES = ("image", "host", "code", "settings")


class ManifestError(UserError):
    """A manifest file or dict is malformed; the message names the file and the field."""


def _is(*types: type | None) -> Callable[[Any], bool]:
    wanted = tuple(type(None) if t is None else t for t in types)
    return lambda v: isinstance(v, wanted) and not (isinstance(v, bool) and bool not in wanted)


_OPT_STR = ("a string or null", _is(str, None))
_OPT_OBJ = ("an object or null", _is(dict, None))
# dotted path ("*" = every key or item) -> (what is expected, test); parents before children
_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "schema": ("an integer", _is(int)),
    "captured_at": ("a string", _is(str)),
    "image.os": _OPT_OBJ,
    "image.os.*": _OPT_STR,
    "image.python": _OPT_STR,
    "image.packages": ("an object mapping distribution names to version strings", _is(dict)),
    "image.packages.*": ("a version string", _is(str)),
    "image.torch": _OPT_STR,
    "image.cuda": _OPT_STR,
    "image.cudnn": _OPT_STR,
    "image.nccl": _OPT_STR,
    "host.hostname": _OPT_STR,
    "host.kernel": _OPT_STR,
    "host.nvidia_driver": _OPT_STR,
    "host.platform": _OPT_STR,
    "host.gpus": ("a list of objects or null", _is(list, None)),
    "host.gpus.*": ("an object with name and memory_mib", _is(dict)),
    "host.gpus.*.name": _OPT_STR,
    "host.gpus.*.memory_mib": ("an integer or null", _is(int, None)),
    "host.cpu": _OPT_OBJ,
    "host.cpu.model": _OPT_STR,
    "host.cpu.count": ("an integer or null", _is(int, None)),
    "host.cpu.arch": _OPT_STR,
    "host.container": _OPT_OBJ,
    "host.container.*": _OPT_STR,
    "code.git_commit": _OPT_STR,
    "code.git_dirty": ("true, false or null", _is(bool, None)),
    "code.git_branch": _OPT_STR,
    "settings.env": ("an object mapping variable names to strings", _is(dict)),
    "settings.env.*": ("a string", _is(str)),
}


def _json(value: Any) -> str:
    """``value`` as a JSON reader would name it, bounded: null, true, 3.11, 'text', [...]."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return brief(value)


def _matches(value: Any, parts: list[str], prefix: str) -> Iterator[tuple[str, Any]]:
    """(path, value) for every field under ``value`` that ``parts`` names; absent fields yield nothing."""
    if not parts:
        yield prefix, value
        return
    head, rest = parts[0], parts[1:]
    if isinstance(value, dict):
        keys = list(value) if head == "*" else [head] if head in value else []
        items = [(k, value[k]) for k in keys]
    elif isinstance(value, list) and head == "*":
        items = list(enumerate(value))
    else:
        return
    for key, child in items:
        if not isinstance(key, str | int):
            raise ManifestError(f"{prefix}: key {brief(key)} is not a string")
        yield from _matches(child, rest, f"{prefix}.{key}")


def validate(d: Any, *, source: str = "<dict>", complete: bool = True) -> dict[str, Any]:
    """``d`` if it has the manifest's shape, else a :class:`ManifestError` naming source, field and value.

    Args:
        d: a parsed manifest (``EnvManifest.to_dict()`` form).
        source: the file or rank it came from, for messages.
        complete: all four scopes must be present (a file); else absent scopes are allowed (a partial dict).

    Example:
        >>> validate({"image": {"python": 3.11}}, complete=False)
        Traceback (most recent call last):
        ...
        steadytrain.env._schema.ManifestError: <dict>: field 'image.python' must be a string or null, got 3.11
    """
    if not isinstance(d, dict):
        raise ManifestError(f"{source}: expected a JSON object with {', '.join(SCOPES)}, got {type(d).__name__}")
    for scope in SCOPES:
        if (complete or scope in d) and not isinstance(d.get(scope), dict):
            got = "missing" if scope not in d else _json(d[scope])
            raise ManifestError(f"{source}: field '{scope}' must be an object, got {got}")
    for path, (expected, ok) in _FIELDS.items():
        scope, *rest = path.split(".")
        for where, value in _matches(d.get(scope), rest, scope) if scope in d else ():
            if not ok(value):
                raise ManifestError(f"{source}: field '{where}' must be {expected}, got {_json(value)}")
    if d.get("schema", SCHEMA) != SCHEMA:
        raise ManifestError(f"{source}: schema {d['schema']} is not supported (this steadytrain reads {SCHEMA})")
    return d


def source_of(manifest: Any) -> str:
    """Where a manifest came from, for messages: its file (``EnvManifest.load``), its rank, or ``manifest``."""
    return getattr(manifest, "source", None) or "manifest"


def as_dict(manifest: Any) -> dict[str, Any]:
    """The plain-dict form of a manifest (an ``EnvManifest`` or its ``to_dict()``), its shape checked.

    Scopes may be absent (a partial dict describing only an image, say); present ones are validated.

    Raises:
        ManifestError: a field of the wrong type (names it).
    """
    d = manifest.to_dict() if hasattr(manifest, "to_dict") else manifest
    return validate(d, source=source_of(manifest), complete=False)
