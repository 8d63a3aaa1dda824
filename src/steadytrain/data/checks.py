"""Vectorized schema checks, inference from healthy shards, validation reports, and the load-time policies
``raise``, ``drop`` and ``clamp``: one import for all of them.

Every check uses ``pyarrow.compute`` and NumPy: nothing loops over rows in Python. The pieces live in
:mod:`~steadytrain.data.masks` (violation masks), :mod:`~steadytrain.data.infer` (inference),
:mod:`~steadytrain.data.validation` (reports) and :mod:`~steadytrain.data.policy` (load-time policies);
the schema itself (:class:`~steadytrain.data.schema.Schema`, its YAML form) in :mod:`steadytrain.data.schema`.
"""

from __future__ import annotations

from steadytrain.data.infer import infer_schema
from steadytrain.data.masks import check_table
from steadytrain.data.policy import PolicyCounts, apply_policy
from steadytrain.data.validation import UNEXPECTED_COLUMN, FieldViolation, ValidationReport, validate

__all__ = [
    "UNEXPECTED_COLUMN",
    "FieldViolation",
    "PolicyCounts",
    "ValidationReport",
    "apply_policy",
    "check_table",
    "infer_schema",
    "validate",
]
