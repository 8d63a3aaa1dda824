"""The small sections of the training config (:mod:`steadytrain.train.setup.config` composes them with the larger ones):
clipping, distribution, non-finite steps, loss spikes, environment contract, checkpoints, profiling. Every field
has a one-line docstring (the generated reference reads them) and is validated by pydantic, after the one rule for
numbers of every section (:mod:`steadytrain.train.setup.typed`: text, a flag or a fraction is not a number)."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from steadytrain._check import parse_int
from steadytrain._text import brief
from steadytrain.schedule import MAX_COUNT
from steadytrain.train.setup.typed import Section

__all__ = [
    "CheckpointConfig",
    "ClipConfig",
    "DistributedConfig",
    "EnvConfig",
    "MeshConfig",
    "MixStepConfig",
    "NonFiniteConfig",
    "ProfileConfig",
    "Section",
    "SourceConfig",
    "SpikeConfig",
    "check_mixture",
]


class ClipConfig(Section):
    max_grad_norm: float | None = Field(default=1.0, gt=0, allow_inf_nan=False)
    """Global L2-norm clipping threshold (over every parameter, on all ranks)."""
    clip_value: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Element-wise clamp to [-clip_value, clip_value] (a different algorithm)."""


SOURCE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""A source's name: it becomes metric keys (``loss/<name>``), plot labels and table cells."""


_NAME_RULE = "give 1 to 64 letters, digits, '_', '.' or '-', the first a letter or digit"


def _yaml_word(value: Any) -> str:
    """How a value YAML read as something other than text is shown, and why (``2023``, ``yes``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (YAML reads yes/no/on/off/true/false unquoted as a flag)"
    kind = "number" if isinstance(value, int | float) else type(value).__name__
    return f"{brief(value)} (YAML reads it unquoted as a {kind})"


def _source_name(value: Any) -> str:
    """``value`` if it is a valid source name, else a ValueError naming it and the rule."""
    if not isinstance(value, str):
        raise ValueError(f"{_yaml_word(value)} is not a source name: quote it, or {_NAME_RULE}")
    if not re.fullmatch(SOURCE_NAME, value):
        raise ValueError(f"{brief(value)} is not a source name: {_NAME_RULE} (it becomes metric keys loss/<name>)")
    return value


class SourceConfig(Section):
    name: str = Field(pattern=SOURCE_NAME)
    """The source's name in metrics (``loss/<name>``), reports and messages: letters, digits, ``_.-``."""
    path: str = Field(min_length=1)
    """Its dataset directory (``data ingest`` output), with its own schema and provenance."""
    weight: float = Field(gt=0, allow_inf_nan=False)
    """Its share of every global batch, relative to the other sources' weights."""

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, value: Any) -> Any:
        return _source_name(value)

    @field_validator("weight", mode="before")
    @classmethod
    def _weight(cls, value: Any) -> Any:
        """0 or less is a mistake a schedule's 0 does not excuse: say what the weight is for."""
        if isinstance(value, int | float) and not isinstance(value, bool) and value <= 0:
            raise ValueError(
                f"{value!r} is not a weight > 0: data.sources weights apply from step 1 (remove a source to leave it "
                "out; a data.mix_schedule weight of 0 leaves it out from a later step)"
            )
        return value


class MixStepConfig(Section):
    step: int = Field(ge=1, le=MAX_COUNT)
    """The first optimizer step these weights apply to, from 2 (as ``metrics.jsonl`` counts; step 1 is data.sources)."""
    weights: dict[str, float]
    """Every source's weight from that step on (``{name: weight}``; 0 leaves a source out; one > 0)."""

    @field_validator("weights", mode="before")
    @classmethod
    def _no_flag_or_odd_name(cls, value: Any) -> Any:
        """A name YAML read as a number or flag, and ``true``/``false`` as a weight, are mistakes (pydantic would
        refuse the first without saying why and take the second as 1 or 0)."""
        for name, weight in value.items() if isinstance(value, dict) else ():
            if not isinstance(name, str):
                raise ValueError(f"{_yaml_word(name)} is not a source name: quote it as data.sources names it")
            if isinstance(weight, bool):
                raise ValueError(f"the weight of {name!r} is {str(weight).lower()}, a flag: give a number")
        return value


MESH_DIMS = ("replicate", "shard", "tp")


def mesh_text(shape: tuple[int, int, int]) -> str:
    """``replicate=R,shard=S,tp=T``: how a shape is written on the command line and in messages (what
    :func:`parse_mesh` reads).

    Example:
        >>> mesh_text((1, 2, 2))
        'replicate=1,shard=2,tp=2'
    """
    return ",".join(f"{n}={v}" for n, v in zip(MESH_DIMS, shape, strict=True))


def parse_mesh(text: str) -> dict[str, int]:
    """``"replicate=2,shard=4,tp=1"`` as a dict (a dimension left out is 1); a ValueError names what is wrong.

    Example:
        >>> parse_mesh("shard=2, tp=2")
        {'shard': 2, 'tp': 2}
    """
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in MESH_DIMS:
            raise ValueError(f"{part!r} is not one of replicate=R, shard=S, tp=T (e.g. replicate=2,shard=4)")
        if name in out:
            raise ValueError(f"{name} is given twice")
        try:  # the rule of every integer flag: int() would take 2_0 and other scripts' digits
            out[name] = parse_int(value.strip())
        except ValueError as err:
            raise ValueError(f"{name}={err}") from None
    if not out:
        raise ValueError("no dimension given: write replicate=R,shard=S,tp=T")
    return out


class MeshConfig(Section):
    replicate: int = Field(default=1, ge=1, le=1 << 20)
    """Replicas of the whole model (across nodes, for HSDP); gradients are all-reduced over them."""
    shard: int = Field(default=1, ge=1, le=1 << 20)
    """Ranks the parameters, gradients and optimizer state are sharded over (FSDP2, within a node for HSDP)."""
    tp: int = Field(default=1, ge=1, le=1 << 20)
    """Tensor-parallel degree: ranks that split each layer's matrices (the model's ``tp_plan``); they read the same
    micro-batches."""

    @classmethod
    def of(cls, value: Any) -> Any:
        """A mesh as the config gives it: a mapping, ``"replicate=R,shard=S,tp=T"``, or null; a ValueError naming
        the two forms for anything else (``mesh: 4`` is not a mesh)."""
        if isinstance(value, str):
            return parse_mesh(value)
        if value is None or isinstance(value, dict | MeshConfig):
            return value
        shown = str(value).lower() if isinstance(value, bool) else brief(value)
        raise ValueError(
            f'{shown} is not a mesh: give {{replicate: R, shard: S, tp: T}} or "replicate=R,shard=S,tp=T" '
            "(a dimension left out is 1)"
        )

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.replicate, self.shard, self.tp

    @property
    def ranks(self) -> int:
        """``replicate x shard x tp``: the world size the mesh is for."""
        return self.replicate * self.shard * self.tp


WATCHDOG_S = (1.0, 86400.0)
"""The bounds of ``distributed.watchdog_s`` other than 0 (off), in seconds: a second, a day."""


_FITS = {
    "ddp": "ddp replicates the whole model (shard=1, tp=1)",
    "fsdp": "fsdp shards without replicas (replicate=1)",
    "hsdp": "hsdp needs replicate >= 2 and shard >= 2",
}


class DistributedConfig(Section):
    strategy: Literal["ddp", "fsdp", "hsdp"] | None = None
    """DDP (``{replicate: W}``, the default), FSDP2 (``fully_shard``, ``{shard: W}``) or HSDP (replicate across
    nodes, shard within: needs ``mesh``) under torchrun. With ``mesh`` given the mesh decides: leave it out."""
    mesh: MeshConfig | None = None
    """The device mesh ``{replicate: R, shard: S, tp: T}`` (or ``"replicate=R,shard=S,tp=T"``), ``R*S*T`` = world
    size: HSDP and FSDP2 x tensor parallel on one ``DeviceMesh``. The data-parallel degree is ``R*S``. Default: as
    ``strategy`` says."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto``: NCCL on GPU, gloo on CPU."""
    fsdp_param_dtype: Literal["bf16", "fp32"] | None = None
    """FSDP2 mixed precision: the dtype parameters are gathered in for compute (default: bf16 with
    ``precision: bf16``, else fp32, no policy)."""
    fsdp_reduce_dtype: Literal["bf16", "fp32"] = "fp32"
    """FSDP2 mixed precision: the dtype gradients are reduce-scattered in (fp32: exact sums across ranks)."""

    @field_validator("mesh", mode="before")
    @classmethod
    def _mesh_text(cls, value: Any) -> Any:
        return MeshConfig.of(value)

    @model_validator(mode="after")
    def _strategy_fits_mesh(self) -> DistributedConfig:
        """A strategy given beside a mesh must be the mesh's: ``ddp`` replicates only, ``fsdp`` does not replicate,
        ``hsdp`` replicates and shards."""
        m, s = self.mesh, self.strategy
        if m is None:
            if s == "hsdp":
                raise ValueError(
                    "strategy=hsdp needs mesh: {replicate: R, shard: S} (e.g. R nodes of S GPUs each), or another "
                    "strategy (ddp, fsdp, or null)"
                )
            return self
        if s is None:
            return self
        wrong = {
            "ddp": m.shard > 1 or m.tp > 1,
            "fsdp": m.replicate > 1,
            "hsdp": m.replicate < 2 or m.shard < 2,
        }[s]
        if wrong:
            raise ValueError(
                f"strategy={s} does not fit mesh {mesh_text(m.shape)}: "
                f"{_FITS[s]}, or leave strategy out (the mesh decides)"
            )
        return self

    parity_every_steps: int = Field(default=100, ge=0, le=MAX_COUNT)
    """Every this many optimizer steps the replicas (DDP's, or HSDP's of each shard) compare a checksum of their
    parameters (one small all-gather; 0 = off): a rank whose values differ is recorded in ``RUN/parity.jsonl``."""
    on_parity: Literal["warn", "stop"] = "stop"
    """What a disagreement does: ``warn``, or ``stop`` with every replica made equal to an agreeing rank's and a
    checkpoint."""
    watchdog_s: float | None = Field(default=None, ge=0, le=86400, allow_inf_nan=False)
    """Seconds without progress on any rank before the job is called hung: every rank writes its threads' stacks
    under ``RUN/hangs/``, the rank that is behind is named, and the ranks exit (code 75) for a restart to take
    over. Default: 600 under torchrun (more than one rank), else off; 0 = off; else 1 to 86400 (a day). A step's
    evaluation, checkpoint and a rank's first step (compile) count as progress."""

    @field_validator("watchdog_s", mode="before")
    @classmethod
    def _watchdog_bounds(cls, value: Any) -> Any:
        """0 (off) or 1 s to a day, said with why (the field's bounds are the backstop and the reference's)."""
        number = (isinstance(value, float) and math.isfinite(value)) or type(value) is int  # exact against floats
        if not number or value == 0 or WATCHDOG_S[0] <= value <= WATCHDOG_S[1]:
            return value  # text, flags, NaN, inf: the rule for numbers and pydantic say what is wrong
        low, high = WATCHDOG_S
        why = (
            f"under {low:g} s a healthy job is called hung: a rank's heartbeat changes once a step, so any step, "
            "data read or collective that takes longer ends the run"
            if value < low
            else f"over a day ({high:g} s) a hung job holds its devices that long before the restart takes over"
        )
        raise ValueError(f"{brief(value)} is out of bounds: give 0 (off) or {low:g} to {high:g} seconds: {why}")


class NonFiniteConfig(Section):
    policy: Literal["skip", "raise"] = "skip"
    """On a non-finite step: skip it on every rank (recorded), or stop."""
    max_consecutive_skips: int = Field(default=10, ge=1, le=MAX_COUNT)
    """Stop (exit non-zero, report written) after this many skipped steps in a row."""


class SpikeConfig(Section):
    policy: Literal["off", "warn", "skip", "rollback"] = "warn"
    """On a loss spike: nothing (``off``), record it (``warn``), refuse the update on every rank (``skip``), or
    restore the latest checkpoint before it and continue without its batches (``rollback``)."""
    metric: Literal["loss", "grad_norm", "both"] = "loss"
    """What is watched: the global step loss, the global gradient norm, or both (either fires)."""
    window: int = Field(default=50, ge=2, le=100_000)
    """Previous optimizer steps the median and MAD are over; nothing is flagged before this many."""
    threshold: float = Field(default=40.0, ge=0, allow_inf_nan=False)
    """A spike exceeds the window's median by more than this many median absolute deviations ... (clean runs
    measured here reach 16: bench/spike_stats.py)"""
    min_ratio: float = Field(default=2.0, ge=0, allow_inf_nan=False)
    """... and is at least this many times the median, 1 or more (a flat curve's tiny MAD alone does not make a
    spike)."""
    skip_batches: int = Field(default=1, ge=1, le=MAX_COUNT)
    """``rollback`` only: global batches skipped, those of the steps that ended at the spike (at most
    ``run.max_steps``)."""
    max_rollbacks: int = Field(default=3, ge=1, le=MAX_COUNT)
    """``rollback``: stop the run (exit non-zero, report written) at the spike that would need one more."""

    @field_validator("policy", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML reads an unquoted ``off`` as false: ``spike.policy: off`` means the policy ``off``."""
        if value is True:
            raise ValueError(
                "true (YAML reads on/yes/true as a flag) is not a policy: give off, warn, skip or rollback"
            )
        return "off" if value is False else value

    @field_validator("min_ratio")
    @classmethod
    def _ratio(cls, value: float) -> float:
        if value < 1:
            raise ValueError(
                f"{value:g} is below 1: a spike is at least min_ratio times the median, which below 1 adds nothing "
                "to the threshold; give 1 to judge by spike.threshold alone, or more (the default 2)"
            )
        return value


class MonitorConfig(Section):
    layers: Literal["off", "norms"] = "norms"
    """Per-layer health in ``layers.jsonl``: gradient, weight and update norms per layer (``norms``), or none."""
    every_steps: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    """Record the layers every this many optimizer steps (default: ``run.log_every``); refused steps always."""
    group: Literal["auto", "module", "parameter"] = "auto"
    """A layer is: each block of the model's main ``ModuleList`` plus each other top-level part (embeddings,
    final norm, head) (``auto``); each module that holds parameters (``module``); each parameter."""

    @field_validator("layers", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML reads an unquoted ``off`` as false: ``monitor.layers: off`` means ``off``."""
        if value is True:
            raise ValueError("true (YAML reads on/yes/true as a flag) is not a setting: give off or norms")
        return "off" if value is False else value


class EnvConfig(Section):
    contract: str | None = None
    """A reproducibility contract checked on every rank at start."""
    on_violation: Literal["fail", "warn"] = "fail"
    """What a broken ``contract`` does at start: ``fail`` (exit 2 before any step) or ``warn`` and go on."""


class CheckpointConfig(Section):
    every_steps: int = Field(default=100, ge=1, le=MAX_COUNT)
    """Optimizer steps between checkpoints (one is also written at the end)."""
    keep_last: int = Field(default=2, ge=1, le=MAX_COUNT)
    """Checkpoints kept; older ones are removed."""
    keep_best: bool = False
    """Also keep the checkpoint of the best validation loss (one is written at that step)."""
    async_: bool = Field(default=True, alias="async")
    """Write checkpoints in the background: the loop waits only for the copy of the state to host memory."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_attribute_docstrings=True)


class ProfileConfig(Section):
    start_step: int = Field(ge=1, le=MAX_COUNT)
    """The first optimizer step profiled (1-based, as ``metrics.jsonl`` counts)."""
    steps: int = Field(default=2, ge=1, le=MAX_COUNT)
    """Optimizer steps profiled from ``start_step``: ``RUN/profile/rank{r}-steps{a}-{b}.pt.trace.json``."""


def check_mixture(sources: list[SourceConfig] | None, schedule: list[MixStepConfig] | None, path: str | None) -> None:
    """A ValueError naming what is wrong with ``data.sources`` and ``data.mix_schedule`` (names, weights, steps)."""
    from steadytrain._check import exact_weight

    if schedule is not None and sources is None:
        raise ValueError("data.mix_schedule needs data.sources: give the sources it weights")
    if sources is None:
        return
    if path is not None:
        raise ValueError("give data.path (one dataset) or data.sources (a mixture), not both (set data.path to null)")
    if not sources:
        raise ValueError("data.sources is empty: give at least one {name, path, weight}, or use data.path")
    names = [s.name for s in sources]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"data.sources: the name {dup[0]!r} is given twice: give each source its own name")
    for s in sources:
        exact_weight(f"data.sources {s.name} weight", s.weight)
    last = 0
    for entry in schedule or ():
        if entry.step == 1:
            raise ValueError(
                "data.mix_schedule step 1: step 1's weights are data.sources' weights: give them there (a schedule "
                "changes them from step 2 on)"
            )
        if entry.step <= last:
            raise ValueError(f"data.mix_schedule: step {entry.step} comes after step {last}: list steps in order")
        last = entry.step
        if unknown := sorted(set(entry.weights) - set(names)):
            raise ValueError(
                f"data.mix_schedule step {entry.step}: no source named {unknown[0]!r} (sources: {', '.join(names)})"
            )
        if missing := [n for n in names if n not in entry.weights]:
            raise ValueError(f"data.mix_schedule step {entry.step}: give a weight for {missing[0]!r} (0 leaves it out)")
        for n in names:
            exact_weight(f"data.mix_schedule step {entry.step} weight of {n}", entry.weights[n], zero=True)
        if not any(entry.weights[n] > 0 for n in names):
            raise ValueError(f"data.mix_schedule step {entry.step}: every weight is 0: give one source a weight > 0")
