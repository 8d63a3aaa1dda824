"""Sharded Parquet datasets with per-shard provenance, schema validation and deterministic rank assignment."""

from __future__ import annotations

from typing import TYPE_CHECKING

from steadytrain._lazy import export_lazily

if TYPE_CHECKING:
    from steadytrain.data.batched import BatchedDataset, global_batch
    from steadytrain.data.checks import (
        FieldViolation,
        PolicyCounts,
        ValidationReport,
        apply_policy,
        check_table,
        infer_schema,
        validate,
    )
    from steadytrain.data.evalset import EvalSet, holdout_shards
    from steadytrain.data.format import (
        INDEX,
        CorruptShardError,
        Dataset,
        DatasetError,
        DatasetWriter,
        ShardInfo,
        open_dataset,
    )
    from steadytrain.data.holdout import RowFilter, holdout_records
    from steadytrain.data.ingest import IngestError, IngestResult, ingest
    from steadytrain.data.loader import DataWorkerError, MicroBatchLoader
    from steadytrain.data.mixture import MixedDataset
    from steadytrain.data.provenance import (
        healthy_shards,
        majority_provenance,
        provenance_differences,
        provenance_outliers,
    )
    from steadytrain.data.sampler import GlobalSampler
    from steadytrain.data.schema import POLICIES, FieldSpec, Schema, SchemaError, SchemaViolationError
    from steadytrain.data.sharded import ShardedDataset, assign_shards, collate_examples

__all__ = [
    "INDEX",
    "POLICIES",
    "BatchedDataset",
    "CorruptShardError",
    "DataWorkerError",
    "Dataset",
    "DatasetError",
    "DatasetWriter",
    "EvalSet",
    "FieldSpec",
    "FieldViolation",
    "GlobalSampler",
    "IngestError",
    "IngestResult",
    "MicroBatchLoader",
    "MixedDataset",
    "PolicyCounts",
    "RowFilter",
    "Schema",
    "SchemaError",
    "SchemaViolationError",
    "ShardInfo",
    "ShardedDataset",
    "ValidationReport",
    "apply_policy",
    "assign_shards",
    "check_table",
    "collate_examples",
    "global_batch",
    "healthy_shards",
    "holdout_records",
    "holdout_shards",
    "infer_schema",
    "ingest",
    "majority_provenance",
    "open_dataset",
    "provenance_differences",
    "provenance_outliers",
    "validate",
]

# each name's submodule, imported on the name's first use: reading a run file (``sourcemap``) imports no torch
export_lazily(
    __name__,
    {
        "INDEX": "format",
        "POLICIES": "schema",
        "BatchedDataset": "batched",
        "CorruptShardError": "format",
        "DataWorkerError": "loader",
        "Dataset": "format",
        "DatasetError": "format",
        "DatasetWriter": "format",
        "EvalSet": "evalset",
        "FieldSpec": "schema",
        "FieldViolation": "checks",
        "GlobalSampler": "sampler",
        "IngestError": "ingest",
        "IngestResult": "ingest",
        "MicroBatchLoader": "loader",
        "MixedDataset": "mixture",
        "PolicyCounts": "checks",
        "RowFilter": "holdout",
        "Schema": "schema",
        "SchemaError": "schema",
        "SchemaViolationError": "schema",
        "ShardInfo": "format",
        "ShardedDataset": "sharded",
        "ValidationReport": "checks",
        "apply_policy": "checks",
        "assign_shards": "sharded",
        "check_table": "checks",
        "collate_examples": "sharded",
        "global_batch": "batched",
        "healthy_shards": "provenance",
        "holdout_records": "holdout",
        "holdout_shards": "evalset",
        "infer_schema": "checks",
        "ingest": "ingest",
        "majority_provenance": "provenance",
        "open_dataset": "format",
        "provenance_differences": "provenance",
        "provenance_outliers": "provenance",
        "validate": "checks",
    },
)
