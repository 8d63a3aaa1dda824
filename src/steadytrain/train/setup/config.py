"""The training config: typed sections (pydantic v2), YAML in, ``--set key.sub=value`` overrides.

Every field is typed and documented; unknown keys, wrong types and impossible combinations are one
:class:`~steadytrain.errors.UserError` naming the key, the value and the fix. ``model`` is the one
open section: keys other than ``name`` are the model factory's keyword arguments.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from steadytrain._check import MAX_SEQ_LEN
from steadytrain._io import brief
from steadytrain._yamlio import load_yaml, parse_yaml
from steadytrain.errors import UserError
from steadytrain.schedule import MAX_COUNT
from steadytrain.train.setup.sections import (
    CheckpointConfig,
    ClipConfig,
    DistributedConfig,
    EnvConfig,
    MixStepConfig,
    MonitorConfig,
    NonFiniteConfig,
    ProfileConfig,
    Section,
    SourceConfig,
    SpikeConfig,
    check_mixture,
)

__all__ = ["SpikeConfig", "TrainConfig", "apply_overrides", "error_line", "load_config", "resolved_config"]


DEFAULT_EVAL = {"holdout_shards": 2, "every_steps": 25, "max_batches": 32}
"""The embedded default run's validation: 2 shards of its corpus held out, evaluated every 25 steps on
their first 32 micro-batches (512 sequences: a fraction of a second)."""
DEFAULT_USER_EVAL = {"holdout_fraction": 0.05, "every_steps": "auto", "max_batches": 32}
"""A ``data.path`` dataset's validation when the config names no source (``eval.data``, ``eval.holdout_shards``,
``eval.holdout_fraction``; one set to null: none): 5% of it held out, at a cadence under 5% of the run's time."""
_EVAL_SOURCES = ("data", "holdout_shards", "holdout_fraction")
TINY_LM_KEYS = ("dim", "layers", "heads", "seq_len", "vocab_size")
"""tiny-lm's keyword arguments (those of ``steadytrain.train.setup.models.TinyLM``): a misspelt one is refused with
the config, before torch is imported."""


class ModelConfig(Section):
    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)
    name: str = "tiny-lm"
    """``tiny-lm``, ``tabular``, ``package.module:factory`` (its other keys are keyword arguments), or a Hugging Face
    causal LM: ``hf:<model_type>`` (e.g. ``hf:gpt2``; its other keys are the config's settings) or ``hf:<directory>``
    (saved with ``save_pretrained``; never downloaded)."""
    compile: bool = False
    """``torch.compile`` each block of the model (its ``nn.ModuleList``), or the whole model when it has none."""
    compile_fallback: bool = False
    """When compiling fails: train eagerly with a warning (true), or stop with the error (false)."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute blocks' activations in the backward instead of keeping them: every block, or every
    ``ac_every``-th one (``selective``)."""
    ac_every: int = Field(default=2, ge=1, le=1 << 16)
    """``selective``: checkpoint blocks ``i`` with ``i % ac_every == 0``."""
    ac_blocks: str | None = None
    """The attribute holding the model's blocks (an ``nn.ModuleList``, e.g. ``transformer.h``); absent: the
    ``nn.ModuleList`` with the most parameters."""

    @model_validator(mode="after")
    def _tiny_lm_keys(self) -> ModelConfig:
        unknown = sorted(set(self.model_extra or {}) - set(TINY_LM_KEYS)) if self.name == "tiny-lm" else []
        if unknown:
            raise ValueError(
                f"tiny-lm has no key {unknown[0]!r}: give {', '.join(TINY_LM_KEYS)} (or check its spelling)"
            )
        return self

    def kwargs(self) -> dict[str, Any]:
        """The factory's keyword arguments: every key but ``name`` and the speed settings."""
        return dict(self.model_extra or {})


class DataConfig(Section):
    path: str | None = None
    """A dataset directory; absent: the embedded corpus (the Python standard library's source)."""
    schema_file: str | None = Field(default=None, alias="schema")
    """A schema YAML validated at load time; absent: no load-time validation."""
    policy: Literal["raise", "drop", "clamp"] = "raise"
    """What a schema violation does at load time."""
    shuffle_window: int = Field(default=8, ge=1, le=MAX_COUNT)
    """Shards whose rows are shuffled together (memory: this many decoded shards)."""
    seq_len: int = Field(default=128, ge=8, le=MAX_SEQ_LEN)
    """Tokens per sequence of the embedded corpus and tiny-lm's context (``data ingest`` datasets set their own)."""
    num_workers: int | None = Field(default=None, ge=0, le=256)
    """Background worker processes reading micro-batches; absent: 2 on a machine with more than 2 cores, else 0."""
    prefetch: int = Field(default=2, ge=1, le=1 << 16)
    """Micro-batches read ahead by the workers, in all (at least one per worker)."""
    transform: str | None = None
    """``package.module:function`` applied to every micro-batch (dict -> dict of the same length), in the workers."""
    sources: list[SourceConfig] | None = None
    """A mixture: ``[{name, path, weight}, ...]`` instead of ``data.path``; every global batch holds each source's
    weighted share exactly (see docs/data.md, "Mixtures"); ``run.epochs`` counts passes over the largest-weighted."""
    mix_schedule: list[MixStepConfig] | None = None
    """Mixture weights changing during the run: ``[{step, weights: {name: weight}}, ...]``, each from its step on."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_attribute_docstrings=True)

    @model_validator(mode="after")
    def _mixture(self) -> DataConfig:
        check_mixture(self.sources, self.mix_schedule, self.path)
        return self


class BatchConfig(Section):
    micro_batch_size: int = Field(default=16, ge=1, le=MAX_COUNT)
    """Examples per forward/backward on one rank."""
    accumulation_steps: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    """Micro-batches per optimizer step (give this or ``global_batch_size``)."""
    global_batch_size: int | None = Field(default=64, ge=1, le=MAX_COUNT)
    """Examples per optimizer step on all ranks; held constant across world sizes (accumulation derived)."""
    base_lr: float = Field(default=3e-3, gt=0, allow_inf_nan=False)
    """The LR known to work at ``base_batch_size``."""
    base_batch_size: int | None = Field(default=64, ge=1, le=MAX_COUNT)
    """The batch ``base_lr`` was tuned at; absent: ``base_lr`` is used unscaled."""
    scaling: Literal["linear", "sqrt", "none"] = "linear"
    """How the LR follows the effective batch."""
    warmup_steps: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    """Warmup in optimizer steps (give this or ``warmup_ratio``)."""
    warmup_ratio: float | None = Field(default=0.1, ge=0, le=1)
    """Warmup as a fraction of the run's optimizer steps."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """The LR after warmup."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """The LR at the end of decay, as a fraction of the peak."""

    @model_validator(mode="after")
    def _one_of_each(self) -> BatchConfig:
        given = self.model_fields_set
        # A default never conflicts with what the user gave: giving one of a pair drops the other's default.
        if "warmup_steps" in given and "warmup_ratio" not in given:
            object.__setattr__(self, "warmup_ratio", None)
        if "accumulation_steps" in given and "global_batch_size" not in given:
            object.__setattr__(self, "global_batch_size", None)
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ValueError("give batch.warmup_steps or batch.warmup_ratio, not both (set the other to null)")
        return self


Beta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]


class OptimConfig(Section):
    name: Literal["adamw", "sgd", "lars", "lamb"] = "adamw"
    """The optimizer."""
    weight_decay: float = Field(default=0.01, ge=0, allow_inf_nan=False)
    """Weight decay of every parameter not in ``no_decay`` (decoupled for AdamW and LAMB; an L2 term in the
    gradient for SGD and LARS)."""
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    """Adam-type moment decays."""
    momentum: float = Field(default=0.9, ge=0, lt=1)
    """SGD/LARS momentum."""
    eps: float = Field(default=1e-8, gt=0, allow_inf_nan=False)
    """Adam-type denominator epsilon (AdamW, LAMB)."""
    fused: bool | None = None
    """Use the fused kernel (None: when available for the device and optimizer)."""
    no_decay: list[Literal["bias", "norm"]] = ["bias", "norm"]  # noqa: RUF012 (pydantic copies field defaults)
    """Parameters exempt from weight decay, for every optimizer: ``bias`` (named bias), ``norm`` (normalization
    layers' parameters and any other parameter of fewer than 2 dimensions); ``[]`` decays everything."""


class EvalConfig(Section):
    data: str | None = None
    """A validation dataset directory (same format as ``data.path``); or ``holdout_shards``/``holdout_fraction``."""
    holdout_shards: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    """Shards of the training dataset held out for validation (chosen from ``run.seed``, never trained on)."""
    holdout_fraction: float | None = Field(default=None, gt=0, lt=1)
    """A fraction of the training data held out for validation (chosen from ``run.seed``, never trained on): whole
    shards (``floor(fraction x shards)``) when that is at least one, else that fraction of the records; none, said at
    start, when the rest would not fill a global batch. A ``data.path`` dataset with none of ``eval.data``,
    ``eval.holdout_shards``, ``eval.holdout_fraction`` holds out ``0.05``, evaluated as the embedded default run is
    (set one of them to ``null`` for no validation)."""
    every_steps: Annotated[int, Field(ge=1, le=MAX_COUNT)] | Literal["auto"] | None = None
    """Optimizer steps between evaluations (the last step always evaluates); ``auto`` (a ``data.path`` dataset's
    default): a round number keeping evaluation under 5% of the run's wall time, said at start. Absent: the end only."""
    max_batches: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    """Evaluate the first ``max_batches x micro_batch_size`` validation examples (absent: all of them)."""
    micro_batch_size: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    """Examples per forward pass of the evaluation (absent: ``batch.micro_batch_size``)."""
    patience: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    """Stop when the validation loss has not improved for this many evaluations (absent: never)."""

    @property
    def enabled(self) -> bool:
        return any(getattr(self, k) is not None for k in _EVAL_SOURCES)

    @model_validator(mode="after")
    def _one_source(self) -> EvalConfig:
        given = [k for k in _EVAL_SOURCES if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give {' or '.join(given)}, not both (set the other to null)")
        return self


class RunConfig(Section):
    name: str = Field(default="default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
    """The run's name: its directory under ``dir``."""
    dir: str = "runs"
    """Where run directories go."""
    seed: int = Field(default=0, ge=0, lt=2**63)
    """Seeds the initial weights, the data order and the held-out shards (the same on every rank)."""
    deterministic: bool = False
    """Deterministic algorithms (slower; what ``repro`` uses)."""
    max_steps: int | None = Field(default=200, ge=1, le=MAX_COUNT)
    """Stop after this many optimizer steps (None: ``epochs`` decides)."""
    epochs: int = Field(default=1, ge=1, le=MAX_COUNT)
    """Passes over the data when ``max_steps`` is None."""
    log_every: int = Field(default=10, ge=1, le=MAX_COUNT)
    """Optimizer steps between log lines (and host reads of the metrics)."""
    peak_flops: float | None = Field(default=None, ge=1e6, le=1e18, allow_inf_nan=False)
    """Dense peak FLOP/s of one device, for ``mfu`` (absent: the table of known GPUs; none on a CPU)."""
    profile: ProfileConfig | None = None
    """A ``torch.profiler`` trace of optimizer steps ``{start_step, steps}`` per rank (absent: none)."""
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers rank 0 mirrors ``metrics.jsonl``, the config and the environment to (``[]``: none);
    a tracker whose package is missing, or that fails, is one warning and the run goes on (see docs/trackers.md)."""
    stop_deadline_s: float = Field(default=25.0, ge=1, le=3600, allow_inf_nan=False)
    """Seconds from a preemption (SIGTERM, SIGUSR1) to the process's exit, whatever it is doing: within them it stops
    with a checkpoint and exits 75 (requeue me); past them it exits 75 at once, the previous checkpoint the latest.
    Below the scheduler's grace: Slurm's KillWait (30 s) or ``--signal``'s lead time (see docs/slurm.md)."""
    callbacks: list[str] | None = None
    """Your code at each step end, evaluation and checkpoint: ``[package.module:factory, ...]``, each factory
    returning an object with ``on_step_end(run)``, ``on_evaluate(run, row)``, ``on_checkpoint(run, step)``
    (see docs/library.md, "Callbacks")."""
    mlflow_uri: str | None = Field(default=None, min_length=1)
    """``mlflow``'s tracking store: a ``sqlite:``/``file:``/``http(s):`` URI or a path (``*.db``: SQLite, else a
    file-store directory); absent: ``MLFLOW_TRACKING_URI`` when set, else the SQLite store ``RUN/mlflow.db``."""

    @field_validator("mlflow_uri")
    @classmethod
    def _a_store(cls, uri: str | None) -> str | None:
        if uri is not None and any(ord(c) < 32 or ord(c) == 127 for c in uri):
            raise ValueError("holds a control character (a newline?): give one URI or path on one line")
        if uri is not None and uri.lower().startswith(("http:", "https:")) and not uri.split(":", 1)[1].strip("/"):
            raise ValueError("names no host: give the tracking server as http(s)://HOST:PORT")
        return uri


class TrainConfig(Section):
    """Everything a run needs; the defaults are the embedded default run. Where a key takes a number it must be one,
    written in digits 0-9 as YAML 1.2 reads them (``10``, ``0.5``, ``3e-4``): text (``'10'``, and ``2_0``, ``0x10``,
    ``1:30``, which are text here), ``true``/``false``, a float for an integer (``3.0``, ``1e3``), NaN and the
    infinities are refused (see docs/training.md, "The config")."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    batch: BatchConfig = BatchConfig()
    optim: OptimConfig = OptimConfig()
    clip: ClipConfig = ClipConfig()
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype for forward passes (fp16 adds a GradScaler)."""
    distributed: DistributedConfig = DistributedConfig()
    nonfinite: NonFiniteConfig = NonFiniteConfig()
    spike: SpikeConfig = SpikeConfig()
    monitor: MonitorConfig = MonitorConfig()
    env: EnvConfig = EnvConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    run: RunConfig = RunConfig()

    @model_validator(mode="before")
    @classmethod
    def _spike_off(cls, data: Any) -> Any:
        """``spike: off`` (YAML: false) turns the whole section off."""
        if isinstance(data, dict) and data.get("spike") is False:
            return {**data, "spike": {"policy": "off"}}
        return data

    @model_validator(mode="after")
    def _default_validation(self) -> TrainConfig:
        # Part of the data is held out unless the config says otherwise, so `steadytrain train` shows both curves:
        # 2 shards of the embedded corpus, 5% of a user's dataset (how: decided on the dataset, see setup.holdout).
        e = self.eval
        if e.enabled:
            return self
        given = {k: getattr(e, k) for k in e.model_fields_set}
        if not e.model_fields_set & set(_EVAL_SOURCES):
            defaults = DEFAULT_EVAL if self.data.path is None and self.data.sources is None else DEFAULT_USER_EVAL
            object.__setattr__(self, "eval", EvalConfig(**{**defaults, **given}))
        elif others := sorted(k for k, v in given.items() if v is not None):
            raise ValueError(
                f"eval.{others[0]} is set but there is no validation set: give eval.data (a dataset directory), "
                "eval.holdout_shards (shards of the training data to hold out) or eval.holdout_fraction"
            )
        return self

    @model_validator(mode="after")
    def _skip_reachable(self) -> TrainConfig:
        """``spike.skip_batches`` that can never roll back: set for another policy, or beyond every step."""
        sp, steps = self.spike, self.run.max_steps
        if sp.skip_batches != 1 and sp.policy != "rollback":  # 1: the default, in every resolved config.yaml
            raise ValueError(
                f"spike.skip_batches={sp.skip_batches} is used only by spike.policy=rollback (here {sp.policy}): "
                "no batch would be skipped; set spike.policy=rollback, or remove spike.skip_batches"
            )
        if sp.policy == "rollback" and steps is not None and sp.skip_batches > steps:  # a spike at S needs S >= it
            raise ValueError(
                f"spike.skip_batches={sp.skip_batches} reaches back before the start from every one of the run's "
                f"{steps} steps (run.max_steps): no spike could roll back; give at most {steps}"
            )
        return self

    @model_validator(mode="after")
    def _clip_one(self) -> TrainConfig:
        if "clip_value" in self.clip.model_fields_set and "max_grad_norm" not in self.clip.model_fields_set:
            object.__setattr__(self.clip, "max_grad_norm", None)
        if self.clip.max_grad_norm is not None and self.clip.clip_value is not None:
            raise ValueError("give clip.max_grad_norm or clip.clip_value, not both (set the other to null)")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data (YAML/JSON-ready), keys as a user writes them."""
        return self.model_dump(mode="json", by_alias=True)


def error_line(err: ValidationError, source: str) -> str:
    """One line for pydantic's first error: the key path, the value and what to do."""
    e = err.errors(include_url=False)[0]
    key = ".".join(str(p) for p in e["loc"]) or "(top level)"
    if e["type"] == "extra_forbidden":
        return f"{source}: unknown key {key!r}: remove it or check its spelling (steadytrain config show lists them)"
    value = f"={brief(e['input'])}" if e["type"] not in ("missing", "value_error") and e["loc"] else ""
    msg = e["msg"].removeprefix("Value error, ")
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{source}: {key}{value}: {msg}{more}" if e["loc"] else f"{source}: {msg}{more}"


def _parse_set(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if sep and key and (digit := next((p for p in key.split(".") if p.isdigit()), None)) is not None:
        whole = key.split(f".{digit}")[0]
        raise UserError(f"--set {brief(item)}: {whole} is a list: set it whole (--set '{whole}=[...]')")
    if not sep or not key or any(not part.isidentifier() for part in key.split(".")):
        raise UserError(f"--set {brief(item)}: use key.sub=value, e.g. --set batch.micro_batch_size=8")
    return key.split("."), parse_yaml(raw, source=f"--set {key}", what="value") if raw else None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``data`` with each ``key.sub=value`` set (values parsed as YAML: ``8``, ``null``, ``[0.9, 0.99]``).

    Example:
        >>> apply_overrides({"batch": {"micro_batch_size": 16}}, ["batch.micro_batch_size=8", "run.name=x"])
        {'batch': {'micro_batch_size': 8}, 'run': {'name': 'x'}}
    """
    out = copy.deepcopy(data)
    for item in overrides:
        path, value = _parse_set(item)
        node = out
        for i, part in enumerate(path[:-1]):
            if node.get(part) is None:  # absent, or null (a saved run's `mesh: null`): the key starts the section
                node[part] = {}
            child = node[part]
            if not isinstance(child, dict):
                whole = ".".join(path[: i + 1])
                raise UserError(
                    f"--set {'.'.join(path)}: {whole} is {brief(child)}, not a section: "
                    f"set it whole (--set {whole}=...)"
                )
            node = child
        node[path[-1]] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """The config from a YAML file (or the embedded default) with ``--set`` overrides applied.

    Raises:
        UserError: an unreadable file, an unknown key, a wrong type, an impossible combination.
    """
    source = str(path) if path is not None else "default config"
    data = load_yaml(path, what="config") if path is not None else {}
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(
            f"{source}: a config is a mapping of sections (model, data, batch, ...), not {type(data).__name__}"
        )
    data = apply_overrides(data, list(overrides))
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as err:
        raise UserError(error_line(err, source)) from None


_PATHS = (("data", "path"), ("data", "schema"), ("env", "contract"))
"""Config keys that name files: stored absolute, so the run resumes and compares from any directory."""


def resolved_config(cfg: TrainConfig) -> dict[str, Any]:
    """``cfg`` as plain data with the paths it names made absolute (what ``config.yaml`` holds)."""
    out = cfg.to_dict()
    if cfg.eval.enabled and cfg.eval.micro_batch_size is None:  # the validation set stays the same size if
        out["eval"]["micro_batch_size"] = cfg.batch.micro_batch_size  # a resume changes the training micro batch
    for section, key in _PATHS:
        if out[section].get(key):
            out[section][key] = str(Path(out[section][key]).resolve())
    for source in out["data"].get("sources") or ():
        source["path"] = str(Path(source["path"]).resolve())
    return out
