"""Sharded Parquet datasets with per-shard provenance, schema validation and deterministic rank assignment."""

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
