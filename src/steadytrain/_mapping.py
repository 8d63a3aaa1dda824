"""Nested mappings as flat dotted keys: how configs, manifests and run records are compared."""

from __future__ import annotations

from typing import Any

__all__ = ["flatten"]


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{"a.b": leaf}``; lists and empty mappings are leaves.

    Example:
        >>> flatten({"batch": {"base_lr": 0.01, "betas": [0.9, 0.95]}, "precision": "fp32", "x": {}})
        {'batch.base_lr': 0.01, 'batch.betas': [0.9, 0.95], 'precision': 'fp32', 'x': {}}
        >>> flatten(None, "host"), flatten({})
        ({'host': None}, {})
    """
    if not isinstance(value, dict) or (not value and prefix):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, child in value.items():
        out.update(flatten(child, f"{prefix}.{key}" if prefix else str(key)))
    return out
