"""Reproducible environments: what the image pins, what the host adds, and a contract checked at start.

An image pins what is inside it (OS, Python, packages, CUDA toolkit, cuDNN). The NVIDIA driver and
the kernel come from the host and still change results or stop a run. The manifest records both,
in separate scopes, so a diff says at a glance which side changed; the contract holds the validated
host range and is checked before training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steadytrain._lazy import export_lazily

if TYPE_CHECKING:
    from steadytrain.env.build import canonical_name, dockerfile, image_tag, lockfile, parse_lockfile
    from steadytrain.env.contract import (
        CUDA_MIN_DRIVER,
        Contract,
        ContractError,
        VersionRange,
        Violation,
        check,
        min_driver_for_cuda,
        parse_version,
    )
    from steadytrain.env.manifest import (
        SCOPES,
        Difference,
        EnvManifest,
        ManifestError,
        capture,
        compare_ranks,
        diff,
        gather_manifests,
        summarize,
    )
    from steadytrain.env.seeding import seed_everything

__all__ = [
    "CUDA_MIN_DRIVER",
    "SCOPES",
    "Contract",
    "ContractError",
    "Difference",
    "EnvManifest",
    "ManifestError",
    "VersionRange",
    "Violation",
    "canonical_name",
    "capture",
    "check",
    "compare_ranks",
    "diff",
    "dockerfile",
    "gather_manifests",
    "image_tag",
    "lockfile",
    "min_driver_for_cuda",
    "parse_lockfile",
    "parse_version",
    "seed_everything",
    "summarize",
]

_WHERE = {
    **dict.fromkeys(("canonical_name", "dockerfile", "image_tag", "lockfile", "parse_lockfile"), "build"),
    **dict.fromkeys(("CUDA_MIN_DRIVER", "Contract", "ContractError", "VersionRange", "Violation", "check"), "contract"),
    **dict.fromkeys(("min_driver_for_cuda", "parse_version"), "contract"),
    **dict.fromkeys(("SCOPES", "Difference", "EnvManifest", "ManifestError", "capture", "compare_ranks"), "manifest"),
    **dict.fromkeys(("diff", "gather_manifests", "summarize"), "manifest"),
    "seed_everything": "seeding",
}
# each name's submodule, imported on the name's first use: reading a manifest does not import the image builder
export_lazily(__name__, _WHERE)
