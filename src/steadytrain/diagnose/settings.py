"""What a replay needs of a run besides its model: :class:`ReplaySettings`.

The training side builds them (:func:`steadytrain.runs.replay.run_model` reads the run's config, plan and
metrics); :func:`~steadytrain.diagnose.hunt.hunt` only reads them, so diagnose never imports train.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from steadytrain.data import Schema
    from steadytrain.data.holdout import RowFilter
    from steadytrain.data.transform import Transform

__all__ = ["ReplaySettings"]


@dataclass(frozen=True)
class ReplaySettings:
    """A run's data and batch settings, and which weights the replayed model holds.

    Example:
        >>> s = ReplaySettings(Path("d"), 0, global_batch_size=8, micro_batch_size=2, shuffle_window=8, policy="drop")
        >>> s.spike_rule, s.checkpoint_step, s.skipped_batches
        ({'threshold': 30.0, 'min_ratio': 3.0}, None, [])
    """

    data: Path
    """The dataset directory the run trained on."""
    seed: int
    global_batch_size: int
    micro_batch_size: int
    shuffle_window: int
    policy: str
    """The run's load-time policy (``data.policy``: raise, drop or clamp)."""
    schema: Schema | None = None
    """The run's schema (``data.schema``); None: one is inferred from the shards when needed."""
    transform: Transform | None = None
    """The run's ``data.transform``, as training applied it."""
    shards: list[int] | None = None
    """The training shards when some were held out for validation; None: every shard."""
    rows: RowFilter | None = None
    """The training side's rows when records of the shards were held out for validation; None: every row."""
    checkpoint: str | None = None
    """The checkpoint whose weights the model holds; None with ``checkpoint_step`` 0: the run's initial weights."""
    checkpoint_step: int | None = None
    """The optimizer step after which the weights were taken (0: the initial weights; None: the model as given)."""
    note: str | None = None
    """None when the weights are exactly those wanted; else what they are instead."""
    spike_threshold: float = 30.0
    """The run's ``spike.threshold``: what an outlying loss is."""
    spike_min_ratio: float = 3.0
    """The run's ``spike.min_ratio``."""
    skipped_batches: list[int] = field(default_factory=list)
    """The global batches spike rollbacks passed over: step ``s`` trained on the ``s``-th of the others."""
    mixture: Any = None
    """A mixture run's (``data.sources``) replays: ``mixture.batch(b)`` is global batch ``b`` (0-based) as the run
    read it, ``mixture.source(settings, shard)`` the settings of the source a mixture shard id is from, its own id
    there and the source's name;
    None: one dataset, read from ``data``."""

    @property
    def spike_rule(self) -> dict[str, float]:
        """The keyword arguments of :func:`~steadytrain.diagnose.outliers.loss_outliers`."""
        return {"threshold": self.spike_threshold, "min_ratio": self.spike_min_ratio}
