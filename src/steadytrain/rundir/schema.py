"""The shape of each run-directory file, checked once, where it is read (by :mod:`steadytrain.runs`, and by a resume).

One check per file type: ``metrics.jsonl`` rows, ``plan.json``, ``config.yaml`` (the keys the
report, the plots and repro use), ``data.json``, ``env.json`` (the manifest's own schema) and
``nonfinite_report.json``. A wrong type, a negative count, a boolean where an integer belongs, a
non-finite number or an absurdly nested value is one :class:`~steadytrain.errors.UserError` naming
the file (and line), the key, the value and the fix, so nothing downstream (a sentence, a plot, a
diff) meets a value it cannot format. Unknown keys are allowed: a newer steadytrain may add some.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from steadytrain._check import check_finite, check_int, check_type
from steadytrain._io import brief, load_json, present, read_jsonl
from steadytrain.errors import UserError
from steadytrain.schedule import DECAYS, MAX_COUNT

__all__ = [
    "MAX_DEPTH",
    "check_config",
    "check_data",
    "check_depth",
    "check_fields",
    "check_metrics_row",
    "check_nonfinite_report",
    "check_plan",
    "check_resume",
    "is_eval_row",
    "is_rollback_row",
    "read_metrics",
    "read_plan",
    "read_resumes",
]

MAX_DEPTH = 32
"""Nesting a run file may have: a real one has 4 levels; deeper is damage or an attack (a recursion bomb)."""

METRICS_FIX = "the metrics log is damaged (edited by hand?): correct or remove that line"
PLAN_FIX = "the batch plan is damaged: restore plan.json (or delete it: the report then says it is missing)"
CONFIG_FIX = "the run's resolved config is damaged: restore config.yaml from a copy of the run"
DATA_FIX = "the data record is damaged: restore data.json (or delete it: compare then reads the dataset now)"


def _path(name: str, value: Any) -> str:
    if "\x00" in check_type(name, value, str):
        raise UserError(f"{name}={brief(value)} is not a path (it holds a NUL byte)")
    return value


def _fraction(name: str, value: Any) -> float:
    if check_finite(name, value, minimum=0.0) > 1.0:
        raise UserError(f"{name}={brief(value)} must be between 0 and 1")
    return value


def _decay(name: str, value: Any) -> str:
    if check_type(name, value, str) not in DECAYS:
        raise UserError(f"{name}={brief(value)} is not a decay: one of {', '.join(DECAYS)}")
    return value


Check = Callable[[str, Any], Any]
KINDS: dict[str, Check] = {
    "count": lambda n, v: check_int(n, v, 0, maximum=MAX_COUNT),
    "positive": lambda n, v: check_int(n, v, 1, maximum=MAX_COUNT),
    "seed": lambda n, v: check_int(n, v, 0, maximum=2**63 - 1),
    "number": check_finite,
    "nonnegative": lambda n, v: check_finite(n, v, minimum=0.0),
    "positive number": lambda n, v: check_finite(n, v, minimum=0.0, strict=True),
    "fraction": _fraction,
    "flag": lambda n, v: check_type(n, v, bool),
    "text": lambda n, v: check_type(n, v, str),
    "path": _path,
    "mapping": lambda n, v: check_type(n, v, dict),
    "decay": _decay,
    "shard list": lambda n, v: [
        check_int(f"{n}[{i}]", s, 0, maximum=MAX_COUNT) for i, s in enumerate(check_type(n, v, list))
    ],
}

# key -> (kind, null allowed); an absent key is always allowed (older runs, optional files)
METRICS: dict[str, tuple[str, bool]] = {
    "loss": ("number", True),
    "lr": ("nonnegative", True),
    "grad_norm": ("nonnegative", True),
    "clipped": ("flag", True),
    "skipped": ("flag", True),
    "items": ("count", True),
    "items_per_s": ("nonnegative", True),
    "elapsed_s": ("nonnegative", True),
    "spike": ("flag", True),
    "tokens_per_s": ("nonnegative", True),
    "flops_per_s": ("nonnegative", True),
    "mfu": ("nonnegative", True),
    "peak_mem_mb": ("nonnegative", True),
    "step_s": ("nonnegative", True),
    "checkpoint_s": ("nonnegative", True),
}
ROLLBACK: dict[str, tuple[str, bool]] = {
    "rollback_to": ("count", False),
    "skipped_batches": ("shard list", False),
    "rollback": ("positive", True),
}
"""A spike's rollback (``spike.policy: rollback``): the step it happened at, the checkpoint's step, the global
batches passed over. Not a training row: the rows after it start again after ``rollback_to``."""
EVAL: dict[str, tuple[str, bool]] = {
    "val_loss": ("number", True),
    "val_items": ("count", False),
    "val_nonfinite": ("count", True),
    "early_stop": ("flag", True),
    "val_time_s": ("nonnegative", True),
}
PLAN: dict[str, tuple[str, bool]] = {
    "micro_batch_size": ("positive", False),
    "accumulation_steps": ("positive", False),
    "world_size": ("positive", False),
    "global_batch_size": ("positive", False),
    "base_lr": ("positive number", True),
    "base_batch_size": ("positive", True),
    "scaling_rule": ("text", True),
    "lr": ("positive number", True),
    "steps_per_epoch": ("count", True),
    "total_steps": ("count", True),
    "warmup_steps": ("count", True),
    "dropped_per_epoch": ("count", True),
    "data": ("path", True),
    "eval_shards": ("shard list", True),
    "eval_records": ("count", True),
}
CONFIG: dict[str, tuple[str, bool]] = {
    "precision": ("text", False),
    "data.path": ("path", True),
    "batch.decay": ("decay", False),
    "batch.min_lr_ratio": ("fraction", False),
    "clip.max_grad_norm": ("positive number", True),
    "clip.clip_value": ("positive number", True),
    "run.name": ("text", False),
    "run.dir": ("path", False),
    "run.seed": ("seed", True),
    "run.deterministic": ("flag", False),
    "eval.patience": ("positive", True),
}
SECTIONS = ("model", "data", "batch", "optim", "clip", "distributed", "nonfinite", "env", "checkpoint", "run")
DATA: dict[str, tuple[str, bool]] = {
    "path": ("path", True),
    "fingerprint": ("text", True),
    "shards": ("count", True),
    "records": ("count", True),
    "provenance": ("mapping", True),
    "outliers": ("mapping", True),
    "outliers_total": ("count", True),
}


def check_fields(
    data: dict[str, Any],
    spec: dict[str, tuple[str, bool]],
    where: str,
    fix: str,
    *,
    required: bool = False,
    kinds: dict[str, Check] = KINDS,
) -> None:
    """Check each key of ``spec`` that ``data`` holds (dotted keys reach into sections) as its kind (a name in
    ``kinds``); ``required``: a key that is absent is an error too."""
    for key, (kind, nullable) in spec.items():
        node: Any = data
        for part in key.split("."):
            node = node.get(part, ...) if isinstance(node, dict) else ...
        if (node is ... and not required) or (node is None and nullable):
            continue
        try:
            if node is ...:
                raise UserError(f"{key} is missing ({kind})")
            if node is None:
                raise UserError(f"{key}=null is not allowed: give a value ({kind})")
            kinds[kind](key, node)
        except UserError as err:
            raise UserError(f"{where}: {err}; {fix}") from None


def check_depth(value: Any, where: str, limit: int = MAX_DEPTH) -> None:
    """Refuse ``value`` nested deeper than ``limit`` (no recursion: safe on the deepest input)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise UserError(f"{where}: nests deeper than {limit} levels: not a file steadytrain wrote (damaged?)")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def is_eval_row(row: dict[str, Any]) -> bool:
    """An evaluation's row (``step``, ``val_loss``, ``val_items``), not a training step's."""
    return "val_loss" in row


def is_rollback_row(row: Any) -> bool:
    """A spike rollback's row (``step``, ``rollback_to``, ``skipped_batches``)."""
    return isinstance(row, dict) and "rollback_to" in row


def check_metrics_row(row: Any, where: str, after: int) -> dict[str, Any]:
    """One ``metrics.jsonl`` row: an integer ``step`` above ``after`` (the previous row of its kind: training
    step or evaluation), typed metrics."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: {brief(row)} is not a metrics row (a JSON object); {METRICS_FIX}")
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= MAX_COUNT:
        got = "missing" if "step" not in row else brief(step)
        raise UserError(f"{where}: step={got} must be an integer optimizer step >= 1; {METRICS_FIX}")
    if step <= after:
        raise UserError(f"{where}: step {step} follows step {after}: steps must increase; {METRICS_FIX}")
    spec = ROLLBACK if is_rollback_row(row) else EVAL if is_eval_row(row) else METRICS
    check_fields(row, spec, where, METRICS_FIX)
    if spec is ROLLBACK and row["rollback_to"] >= step:
        raise UserError(f"{where}: rollback_to={row['rollback_to']} is not before step {step}; {METRICS_FIX}")
    return row


def check_plan(plan: dict[str, Any], where: str) -> dict[str, Any]:
    """``plan.json``: positive batch factors that multiply to the global batch, a finite LR, step counts >= 0."""
    check_depth(plan, where)
    check_fields(plan, PLAN, where, PLAN_FIX)
    factors = [plan.get(k) for k in ("micro_batch_size", "accumulation_steps", "world_size")]
    total = plan.get("global_batch_size")
    if None not in factors and total is not None and math.prod(factors) != total:
        micro, accum, world = factors
        raise UserError(
            f"{where}: global_batch_size={total} != micro {micro} x accumulation {accum} x world {world}; {PLAN_FIX}"
        )
    warmup, total = plan.get("warmup_steps"), plan.get("total_steps")
    if warmup is not None and total is not None and warmup > total:
        raise UserError(f"{where}: warmup_steps={warmup} exceeds total_steps={total}; {PLAN_FIX}")
    return plan


def read_plan(path: Path) -> dict[str, Any]:
    """``plan.json`` checked (:func:`check_plan`), for a reader that trusts its values; ``{}`` when there is none."""
    if not present(path):
        return {}
    plan = load_json(path, what="batch plan")
    if not isinstance(plan, dict):
        raise UserError(f"{path}: {brief(plan)} is not a batch plan (a JSON object); {PLAN_FIX}")
    return check_plan(plan, str(path))


def check_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """``config.yaml``: sections are mappings; the keys read here have their types; every number finite."""
    check_depth(config, where)
    for section in SECTIONS:
        if config.get(section) is not None and not isinstance(config[section], dict):
            got = brief(config[section])
            raise UserError(f"{where}: section {section!r}={got} must be a mapping of keys; {CONFIG_FIX}")
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:  # YAML allows .nan, .inf and non-string keys; a resolved config never holds them
        name, node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise UserError(f"{where}: {name}={node} is not a finite number; {CONFIG_FIX}")
        if isinstance(node, dict):
            for key, child in node.items():
                if not isinstance(key, str):
                    raise UserError(f"{where}: key {brief(key)} under {name or 'the top'} is not a name; {CONFIG_FIX}")
                stack.append((f"{name}.{key}" if name else key, child))
        elif isinstance(node, list):
            stack.extend((f"{name}[{i}]", child) for i, child in enumerate(node))
    check_fields(config, CONFIG, where, CONFIG_FIX)
    return config


def check_data(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data.json``: fingerprint text, counts >= 0, provenance and outliers as mappings."""
    check_depth(data, where)
    check_fields(data, DATA, where, DATA_FIX)
    return data


def check_nonfinite_report(value: Any, where: str) -> str | None:
    """The sentence of ``nonfinite_report.json`` (written at the end of training), or None."""
    if not isinstance(value, dict) or not isinstance(value.get("sentence"), str | None):
        raise UserError(
            f"{where}: not a non-finite report (a JSON object with a 'sentence' string): "
            "delete it and run `steadytrain nan report RUN` to see the verdict"
        )
    return value.get("sentence")


RESUME_FIX = "the resume record is damaged (edited by hand?): correct or remove that line"


def check_resume(row: Any, where: str) -> dict[str, Any]:
    """One line of ``resumes.jsonl``: ``step`` (>= 1), ``world_size`` (>= 1), ``changes`` ``{key: [old, new]}``."""
    try:
        check_depth(row, where)
        check_type("line", row, dict)
        check_int("step", row.get("step"), 1, maximum=MAX_COUNT)
        check_int("world_size", row.get("world_size"), 1, maximum=MAX_COUNT)
        for key, pair in check_type("changes", row.get("changes", {}), dict).items():
            if not isinstance(pair, list) or len(pair) != 2:
                raise UserError(f"changes.{brief(key)}={brief(pair)} must be [old, new]")
    except UserError as err:
        raise UserError(f"{where}: {err}; {RESUME_FIX}") from None
    return row


def read_metrics(
    path: Path, rollbacks: list[dict[str, Any]] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training rows and the evaluation rows of ``metrics.jsonl`` (a torn last line skipped), each
    checked; the steps of each kind increase. Spike rollbacks' rows are checked and appended to
    ``rollbacks`` when given (in file order: a rollback's step may come again after it)."""
    rows: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
    for n, row in read_jsonl(path, what="metrics log"):
        if is_rollback_row(row):
            checked = check_metrics_row(row, f"{path}: line {n}", 0)
            if rollbacks is not None:
                rollbacks.append(checked)
            continue
        kind = rows[1] if isinstance(row, dict) and is_eval_row(row) else rows[0]
        kind.append(check_metrics_row(row, f"{path}: line {n}", kind[-1]["step"] if kind else 0))
    return rows


def read_resumes(path: Path) -> list[dict[str, Any]]:
    """Every line of ``resumes.jsonl`` (a torn last line skipped), each checked."""
    return [check_resume(row, f"{path}: line {n}") for n, row in read_jsonl(path, what="resume record")]
