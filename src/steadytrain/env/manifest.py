"""Capture the environment in four scopes (image, host, code, settings); save, load and gather manifests.

``image`` is what a container image pins; ``host`` is what it does not (kernel, NVIDIA driver, GPUs,
CPU); ``code`` is the git state; ``settings`` are the determinism and distributed knobs in effect.
Anything absent (no GPU, no git) is ``None``, never an exception; no credential is ever recorded.
The probes live in :mod:`._probe`, the shape check in :mod:`._schema`, diffs in :mod:`.compare`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadytrain._io import load_json, utc_now, write_text_atomic
from steadytrain.env import _probe
from steadytrain.env._schema import (
    SCHEMA,
    SCOPES,
    ManifestError,
    as_dict,  # noqa: F401 - its home before the split
    validate,
)
from steadytrain.env.compare import Difference, compare_ranks, diff, summarize
from steadytrain.env.lockfile import requirement_closure  # noqa: F401 - its home before the split
from steadytrain.errors import UserError

__all__ = [
    "SCOPES",
    "Difference",
    "EnvManifest",
    "ManifestError",
    "capture",
    "compare_ranks",
    "diff",
    "gather_manifests",
    "summarize",
]


@dataclass
class EnvManifest:
    """One capture: four scopes of plain JSON data. See :func:`capture`."""

    image: dict[str, Any]
    host: dict[str, Any]
    code: dict[str, Any]
    settings: dict[str, Any]
    captured_at: str = field(default_factory=utc_now)
    schema: int = SCHEMA
    source: str | None = field(default=None, repr=False, compare=False)
    """Where it was read from (a file, a rank), for messages; not part of the manifest."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable dict with top-level ``image``, ``host``, ``code``, ``settings``."""
        return {"schema": self.schema, "captured_at": self.captured_at, **{s: getattr(self, s) for s in SCOPES}}

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> EnvManifest:
        """Build from :meth:`to_dict` output.

        Raises:
            ManifestError: a missing or ``null`` scope, or a field of the wrong type (names source and field).
        """
        d = validate(d, source=source, complete=True)
        fields = {s: d[s] for s in SCOPES}
        return cls(**fields, captured_at=d.get("captured_at", ""), schema=d.get("schema", SCHEMA), source=source)

    def save(self, path: str | Path) -> None:
        """Write JSON atomically (temporary file, fsync, rename): a crash never leaves half a manifest."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> EnvManifest:
        """Read a saved manifest.

        Raises:
            ManifestError: missing, a directory, not UTF-8, malformed JSON or fields (names the file).
        """
        try:
            data = load_json(path, what="manifest")
        except ManifestError:
            raise
        except UserError as err:
            raise ManifestError(str(err)) from None
        return cls.from_dict(data, source=str(path))


def capture(code_path: str | Path | None = None) -> EnvManifest:
    """Record the environment: image, host, code (git at ``code_path`` or the cwd) and settings.

    Reads files and installed-package metadata (no ``pip freeze``); imports torch if it is installed.
    Never raises for something absent, never records an environment variable that looks like a
    credential nor the password in a URL, never runs a program the git repository configures.

    Example:
        >>> m = capture()
        >>> sorted(m.to_dict())
        ['captured_at', 'code', 'host', 'image', 'schema', 'settings']
    """
    image = _probe.image()  # imports torch first, so settings see it
    code = _probe.code(str(code_path) if code_path else None)
    return EnvManifest(image=image, host=_probe.host(), code=code, settings=_probe.settings())


def gather_manifests(manifest: EnvManifest | None = None, group: Any = None) -> list[EnvManifest] | None:
    """Every rank captures; rank 0 receives all manifests (others get None). Uses torch's gather_object."""
    import torch.distributed as dist

    manifest = manifest or capture()
    if not (dist.is_available() and dist.is_initialized()):
        return [manifest]
    rank = dist.get_rank(group)
    out: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.gather_object(manifest.to_dict(), out, dst=dst, group=group)  # rank 0 compares every rank's environment
    return [EnvManifest.from_dict(d, source=f"rank {r}") for r, d in enumerate(out)] if out is not None else None
