"""Validation reports: every row of the chosen shards checked against a schema, violations by shard and kind."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from steadytrain.data.masks import check_table
from steadytrain.data.schema import Schema

if TYPE_CHECKING:  # any object with ``shard_ids`` and ``read_shard(id) -> pa.Table`` will do
    from steadytrain.data.format import Dataset

__all__ = ["UNEXPECTED_COLUMN", "FieldViolation", "ValidationReport", "validate"]

UNEXPECTED_COLUMN = "unexpected_column"  # a column the schema does not know: drift, reported by validate only


@dataclass
class FieldViolation:
    """One field's violations of one kind in one shard; ``examples`` are the first 10 example indices."""

    shard: int
    field: str
    kind: str
    count: int
    examples: list[int]


@dataclass
class ValidationReport:
    """What :func:`validate` found: the violations and the records checked per shard."""

    violations: list[FieldViolation] = dataclasses.field(default_factory=list)
    records_checked: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def shards_with_violations(self) -> list[int]:
        return sorted({v.shard for v in self.violations})

    def by_shard(self) -> dict[int, list[FieldViolation]]:
        out: dict[int, list[FieldViolation]] = {}
        for v in self.violations:
            out.setdefault(v.shard, []).append(v)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "records_checked": dict(self.records_checked),
            "violations": [asdict(v) for v in self.violations],
        }

    def __str__(self) -> str:
        lines = [
            f"{sum(self.records_checked.values())} records in {len(self.records_checked)} shards checked: "
            + ("ok" if self.ok else f"violations in shards {self.shards_with_violations}")
        ]
        lines += [
            f"  shard {v.shard}: field {v.field!r} {v.kind} x{v.count} (examples {v.examples})" for v in self.violations
        ]
        return "\n".join(lines)


def validate(dataset: Dataset, schema: Schema, shards: list[int] | None = None) -> ValidationReport:
    """Check every row of the given shards (default: all) against the schema.

    Besides the kinds of :func:`~steadytrain.data.masks.check_table`, a column the schema does not know is
    reported as ``unexpected_column`` (every row; drift such as a column added by a newer pipeline).

    Example:
        >>> import pyarrow as pa
        >>> from types import SimpleNamespace
        >>> from steadytrain.data.schema import FieldSpec
        >>> schema = Schema({"lang": FieldSpec("string", vocabulary=["en", "de"])})
        >>> shards = {0: pa.table({"lang": ["en", "de"]}), 47: pa.table({"lang": ["en", "fr-CA", "fr-CA"]})}
        >>> report = validate(SimpleNamespace(shard_ids=[0, 47], read_shard=shards.get), schema)
        >>> report.shards_with_violations, report.violations[0].kind, report.violations[0].examples
        ([47], 'unexpected_category', [1, 2])
    """
    report = ValidationReport()
    for sid in dict.fromkeys(dataset.shard_ids if shards is None else shards):
        table = dataset.read_shard(sid)
        report.records_checked[sid] = table.num_rows
        for name, kinds in check_table(table, schema).items():
            for kind, mask in kinds.items():
                idx = np.flatnonzero(mask)
                report.violations.append(FieldViolation(sid, name, kind, len(idx), idx[:10].tolist()))
        for name in table.column_names:
            if name not in schema.fields:
                n = table.num_rows
                report.violations.append(FieldViolation(sid, name, UNEXPECTED_COLUMN, n, list(range(min(n, 10)))))
    return report
