"""Diagnosis of NaN divergence: the non-finite ledger, shard attribution with a verdict, isolated replay.

- :mod:`.ledger`: ``nonfinite.jsonl`` (one :class:`~steadytrain.accumulate.NonFiniteEvent` per rank per
  refused step, with the shards and examples in play and which were non-finite locally) and
  ``exposure.json`` (examples seen per shard).
- :func:`report`: events per shard against exposure, a binomial-tail test, and a verdict:
  ``shard-selective`` (inspect the data first) or ``spread`` (learning rate, clipping, precision).
- :func:`hunt`: one shard (or one step's global batch) replayed in one process with hooks on every
  module: the first non-finite module, every bad example (bisection), its schema violations, and how
  the shard's provenance differs from the majority's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steadytrain._lazy import export_lazily

if TYPE_CHECKING:
    from steadytrain.diagnose.hunt import HuntReport, hunt
    from steadytrain.diagnose.ledger import read_exposure, read_ledger
    from steadytrain.diagnose.report import NonFiniteReport, ShardStats, report

__all__ = ["HuntReport", "NonFiniteReport", "ShardStats", "hunt", "read_exposure", "read_ledger", "report"]

# each name's submodule, imported on the name's first use: a ledger read does not import the replay
export_lazily(
    __name__,
    {
        "HuntReport": "hunt",
        "hunt": "hunt",
        "read_exposure": "ledger",
        "read_ledger": "ledger",
        "NonFiniteReport": "report",
        "ShardStats": "report",
        "report": "report",
    },
)
