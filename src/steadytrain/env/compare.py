"""Compare manifests: every differing field with its scope, a one-line summary, the odd rank out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from steadytrain._io import one_line
from steadytrain._mapping import flatten
from steadytrain.env._schema import SCOPES, as_dict

__all__ = ["NUMERICS", "Difference", "compare_ranks", "diff", "numerics_first", "summarize"]

# Fields that identify a machine or a moment rather than describe it: not compared between ranks.
IDENTITY = {"captured_at", "host.hostname"}

NUMERICS = (
    "image.torch",
    "image.packages.torch",
    "image.cuda",
    "image.cudnn",
    "image.nccl",
    "host.nvidia_driver",
    "host.kernel",
    "image.python",
)
"""The fields that decide a run's numbers, listed before every other difference (in this order): a changed torch,
CUDA or driver must not hide behind thirty changed packages."""
_NUMERIC_PACKAGES = "image.packages.nvidia-"
"""CUDA's own libraries as pip installs them (``nvidia-cudnn-cu12``, ``nvidia-nccl-cu12``...): right after."""


def _rank(path: str) -> int:
    """Where a field comes in a list of differences: :data:`NUMERICS` first, CUDA's pip libraries, then the rest."""
    if path in NUMERICS:
        return NUMERICS.index(path)
    return len(NUMERICS) + (0 if path.startswith(_NUMERIC_PACKAGES) else 1)


def numerics_first(paths: list[Any], path: Any = lambda d: d.path) -> list[Any]:
    """``paths`` (differences, or anything ``path`` takes a dotted path from) with what decides numerics first
    (:data:`NUMERICS`, then CUDA's pip libraries), then the rest in scope order (image, host, code, settings),
    alphabetically within a scope.

    Example:
        >>> numerics_first(["image.packages.numpy", "code.git_commit", "host.nvidia_driver", "image.torch"], str)
        ['image.torch', 'host.nvidia_driver', 'image.packages.numpy', 'code.git_commit']
    """
    scopes = {s: i for i, s in enumerate(SCOPES)}

    def key(item: Any) -> tuple[int, int, str]:
        where = path(item)
        return _rank(where), scopes.get(where.split(".", 1)[0], len(scopes)), where

    return sorted(paths, key=key)


@dataclass(frozen=True)
class Difference:
    """One field that differs between two manifests."""

    path: str
    """Dotted path, e.g. ``host.nvidia_driver`` or ``image.packages.numpy``."""
    scope: str
    a: Any
    b: Any

    def __str__(self) -> str:
        return f"{self.path}: {self.a} -> {self.b}"


def diff(a: Any, b: Any, *, ignore: set[str] | None = None) -> list[Difference]:
    """Every field that differs, with its scope, image first, then host, code, settings; within a scope what decides
    numerics first (:func:`numerics_first`: a changed torch before thirty changed packages), then alphabetically.

    Args:
        a: an ``EnvManifest`` or its ``to_dict()`` form.
        b: the same, compared with ``a``.
        ignore: dotted paths to leave out.

    Raises:
        ManifestError: either manifest is malformed (names the field).

    Example:
        >>> from steadytrain.env import EnvManifest, capture
        >>> m = capture(); other = EnvManifest.from_dict(m.to_dict())
        >>> other.host = {**other.host, "nvidia_driver": "550.90.07"}
        >>> [(d.scope, d.path) for d in diff(m, other)]
        [('host', 'host.nvidia_driver')]
    """
    da, db = as_dict(a), as_dict(b)
    ignore = ignore or set()
    out: list[Difference] = []
    for scope in SCOPES:
        fa, fb = flatten(da.get(scope), scope), flatten(db.get(scope), scope)
        for path in numerics_first(list(fa.keys() | fb.keys()), str):
            if path in ignore:
                continue
            va, vb = fa.get(path), fb.get(path)
            if va != vb:
                out.append(Difference(path, scope, va, vb))
    return out


def summarize(diffs: list[Difference]) -> str:
    """One line: which scopes are identical and what differs, e.g. ``image identical; host differs: ...`` (the
    first three of a scope in :func:`diff`'s order: what decides numerics first)."""
    parts = []
    for scope in SCOPES:
        mine = [d for d in diffs if d.scope == scope]
        if not mine:
            parts.append(f"{scope} identical")
            continue
        shown = ", ".join(
            f"{one_line(d.path.split('.', 1)[1])} {one_line(d.a)} \u2192 {one_line(d.b)}" for d in mine[:3]
        )
        more = f" (+{len(mine) - 3} more)" if len(mine) > 3 else ""
        parts.append(f"{scope} differs: {shown}{more}")
    return "; ".join(parts)


def compare_ranks(manifests: list[Any], scopes: tuple[str, ...] = ("image", "host")) -> dict[int, list[Difference]]:
    """Ranks whose image or host differ from rank 0's (machine identity such as hostname aside)."""
    ref = manifests[0]
    report = {}
    for rank, m in enumerate(manifests[1:], start=1):
        diffs = [d for d in diff(ref, m, ignore=IDENTITY) if d.scope in scopes]
        if diffs:
            report[rank] = diffs
    return report
