"""Compare manifests: every differing field with its scope, a one-line summary, the odd rank out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from steadytrain._io import one_line
from steadytrain._mapping import flatten
from steadytrain.env._schema import SCOPES, as_dict

__all__ = ["Difference", "compare_ranks", "diff", "summarize"]

# Fields that identify a machine or a moment rather than describe it: not compared between ranks.
IDENTITY = {"captured_at", "host.hostname"}


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
    """Every field that differs, with its scope, image first, then host, code, settings.

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
        for path in sorted(fa.keys() | fb.keys()):
            if path in ignore:
                continue
            va, vb = fa.get(path), fb.get(path)
            if va != vb:
                out.append(Difference(path, scope, va, vb))
    return out


def summarize(diffs: list[Difference]) -> str:
    """One line: which scopes are identical and what differs, e.g. ``image identical; host differs: ...``."""
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
