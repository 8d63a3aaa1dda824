"""Sharded Parquet datasets with per-shard provenance, schema validation and deterministic rank assignment."""

from steadytrain.data.format import (
    INDEX,
    CorruptShardError,
    Dataset,
    DatasetError,
    DatasetWriter,
    ShardInfo,
    open_dataset,
)
from steadytrain.data.sharded import ShardedDataset, assign_shards, collate_examples

__all__ = [
    "INDEX",
    "CorruptShardError",
    "Dataset",
    "DatasetError",
    "DatasetWriter",
    "ShardInfo",
    "ShardedDataset",
    "assign_shards",
    "collate_examples",
    "open_dataset",
]
