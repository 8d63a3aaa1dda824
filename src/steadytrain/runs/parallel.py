"""``steadytrain check-parallel``: train the same config on two layouts and say where they first differ.

Both runs start from the same seeded weights and read the same global order of examples (it does not depend on the
world size), so on any correct layout every step's loss, global gradient norm, validation loss and per-layer norms
(``monitor.layers``, every step, one row per module) agree within float tolerance. The check trains each layout in
its own process (``torch.distributed.run`` on this machine for more than one rank), reads both run directories, and
names the first step, metric and layer where they part beyond ``rtol``.

Within a step the comparison follows the computation: the loss (forward), then each layer's gradient norm from the
last layer to the first (the order backward computes them: the first layer met whose gradient differs is where the
backward went wrong; a plan that forgets to all-reduce one layer's gradient is named by that layer), then each
layer's weight and update norms, the global gradient norm, the validation loss. A difference in the loss is a
forward difference: it has no layer (the loss is the model's output).
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from steadytrain._io import brief, present
from steadytrain._text import one_line
from steadytrain.diagnose.layers import layer_order, read_layers
from steadytrain.errors import UserError
from steadytrain.runs.record import load_run
from steadytrain.train.setup.sections import mesh_text, parse_mesh

__all__ = ["ParallelCheck", "check_parallel", "compare_runs", "parse_layout", "relative_difference"]

log = logging.getLogger("steadytrain.runs")

DEFAULT_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}
"""Float tolerance by ``precision``: fp32 reductions in another order agree to ~1e-6 over a few steps; bf16 carries
8 bits of mantissa."""

_LAYER_KEYS = ("param_norm", "update_norm")


@dataclass(frozen=True)
class ParallelCheck:
    """The result: ``agree``, ``steps`` compared, ``max_rel_diff`` over every value compared, ``first_difference``
    (``{step, metric, layer}`` or None), the two layouts and their run directories."""

    agree: bool
    steps: int
    max_rel_diff: float | None
    first_difference: dict[str, Any] | None
    mesh: str
    against: str
    rtol: float
    runs: dict[str, str]
    sentence: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_layout(text: str, option: str) -> tuple[int, int, int]:
    """``replicate=R,shard=S,tp=T`` as ``(R, S, T)``; a UserError naming ``option`` otherwise."""
    try:
        dims = parse_mesh(text)
    except ValueError as err:
        raise UserError(f"{option} {brief(text)}: {err}") from None
    shape = (dims.get("replicate", 1), dims.get("shard", 1), dims.get("tp", 1))
    if min(shape) < 1 or math.prod(shape) > 1024:
        raise UserError(f"{option} {mesh_text(shape)}: each dimension from 1, at most 1024 ranks in all")
    return shape


def relative_difference(a: float | None, b: float | None) -> float:
    """``|a - b| / max(|a|, |b|)`` (0 for equal values, None and None included; inf when only one is a number).

    Example:
        >>> relative_difference(2.0, 2.0), relative_difference(1.0, 2.0), relative_difference(None, 1.0)
        (0.0, 0.5, inf)
    """
    if a is None or b is None:
        return 0.0 if a is b else math.inf
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b))


def _values(run: Path) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, dict[str, Any]]], list[str]]:
    """Per step: the metrics (training and validation rows merged) and each layer's row; the layers in model order."""
    rec = load_run(run)
    steps: dict[int, dict[str, Any]] = {}
    for row in rec.metrics:
        steps.setdefault(int(row["step"]), {}).update(loss=row.get("loss"), grad_norm=row.get("grad_norm"))
    for row in rec.evals:
        steps.setdefault(int(row["step"]), {})["val_loss"] = row.get("val_loss")
    rows = read_layers(run) if present(run / "layers.jsonl") else []
    layers: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if "rollback" not in row:
            layers.setdefault(int(row["step"]), {})[row["layer"]] = row
    return steps, layers, layer_order(rows)


def _step_order(order: list[str]) -> list[tuple[str, str | None]]:
    """``(metric, layer)`` in the order one step computes them (see the module's docstring)."""
    first = [("loss", None)] + [("grad_norm", name) for name in reversed(order)]
    return first + [(key, name) for name in order for key in _LAYER_KEYS] + [("grad_norm", None), ("val_loss", None)]


def _pairs(
    step: int, a: tuple[Any, ...], b: tuple[Any, ...], order: list[str]
) -> list[tuple[str, str | None, Any, Any]]:
    """``(metric, layer, value in a, value in b)`` for everything both runs recorded at ``step``."""
    out = []
    for metric, layer in _step_order(order):
        if layer is None:
            ra, rb = a[0].get(step, {}), b[0].get(step, {})
        else:
            ra, rb = a[1].get(step, {}).get(layer), b[1].get(step, {}).get(layer)
            if ra is None or rb is None:
                continue
        if metric in ra or metric in rb:
            out.append((metric, layer, ra.get(metric), rb.get(metric)))
    return out


def compare_runs(a: Path, b: Path, rtol: float) -> tuple[int, float | None, dict[str, Any] | None]:
    """``(steps compared, largest relative difference, first difference)`` between two runs of one config."""
    va, vb = _values(Path(a)), _values(Path(b))
    common = sorted(set(va[0]) & set(vb[0]))
    order = [name for name in va[2] if name in set(vb[2])]
    worst, first = None, None
    for step in common:
        for metric, layer, x, y in _pairs(step, va, vb, order):
            rel = relative_difference(x, y)
            if math.isfinite(rel):
                worst = rel if worst is None else max(worst, rel)
            if first is None and rel > rtol:
                first = {"step": step, "metric": metric, "layer": layer, "values": [x, y], "rel_diff": rel}
    trained = (max(va[0], default=0), max(vb[0], default=0))
    if first is None and trained[0] != trained[1]:
        step = min(trained) + 1
        first = {"step": step, "metric": "steps", "layer": None, "values": list(trained), "rel_diff": None}
    return len(common), worst, first


def _run_argv(config: str | None, overrides: list[str], shape: tuple[int, int, int], run_dir: Path) -> list[str]:
    n = math.prod(shape)
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"] if n > 1 else []
    sets = [x for o in [*overrides, f"distributed.mesh={mesh_text(shape)}"] for x in ("--set", o)]
    return [sys.executable, *launcher, "-m", "steadytrain", "train", *([config] if config else []),
            "--run-dir", str(run_dir), *sets]  # fmt: skip


def _last_error(log_path: Path) -> str:
    """The training's own one-line error (the last ``error:`` line of its log), else its last line."""
    lines = [one_line(x.strip()) for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
    errors = [x[x.index("error:") + len("error:") :].strip() for x in lines if "error:" in x]
    text = (errors or lines or ["(no output)"])[-1]
    return text if len(text) <= 300 else text[:297] + "..."


def _train(config: str | None, overrides: list[str], shape: tuple[int, int, int], run_dir: Path) -> None:
    """Train one layout in its own process(es), its output in ``run_dir``.log; a UserError with its error line."""
    log_path = run_dir.with_name(run_dir.name + ".log")
    log.info("check-parallel: training %s (%d rank(s)); log: %s", mesh_text(shape), math.prod(shape), log_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as out:
        done = subprocess.run(
            _run_argv(config, overrides, shape, run_dir), stdout=out, stderr=subprocess.STDOUT, env=env, check=False
        )
    if done.returncode:
        raise UserError(
            f"check-parallel: training on {mesh_text(shape)} failed (exit {done.returncode}): {_last_error(log_path)} "
            f"(whole log: {log_path})"
        )


def _sentence(steps: int, worst: float | None, first: dict[str, Any] | None, mesh: str, against: str) -> str:
    if first is None:
        shown = "0" if not worst else f"{worst:.2g}"
        return f"{mesh} and {against} agree over {steps} steps (largest relative difference {shown})"
    where = f"{first['metric']}" + (f" of layer {first['layer']}" if first["layer"] else "")
    a, b = (f"{v:.6g}" if isinstance(v, float) else str(v) for v in first["values"])
    return f"{mesh} and {against} first differ at step {first['step']}: {where} ({a} on {mesh}, {b} on {against})"


def _claim(out: Path) -> None:
    """Make ``out`` this check's own: a new or empty directory, claimed by creating ``.check-parallel`` in it
    exclusively (two checks started together into one directory: the second is refused, not interleaved)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {brief(str(out))} is a file: give a new directory")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {brief(str(out))} is not empty: give a new directory (a check never overwrites one)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / ".check-parallel", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise UserError(
            f"--out {brief(str(out))} was just claimed by another check-parallel: give each check its own directory"
        ) from None
    except OSError as err:
        where = brief(str(out))
        raise UserError(f"--out {where}: cannot create it ({err.strerror}): give a writable directory") from None
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")


def check_parallel(
    config: str | None,
    overrides: list[str],
    mesh: tuple[int, int, int],
    against: tuple[int, int, int],
    steps: int,
    out: Path,
    rtol: float | None = None,
) -> ParallelCheck:
    """Train ``steps`` steps of the config on ``mesh`` and on ``against`` under ``out`` and compare them."""
    from steadytrain.train.setup.config import load_config
    from steadytrain.train.setup.pieces import check_model_args

    if mesh == against:
        raise UserError(f"--mesh and --against are both {mesh_text(mesh)}: compare two different layouts")
    if rtol is not None and not 0 < rtol <= 1:  # NaN too: nothing is ever above a NaN tolerance
        raise UserError(f"--rtol {rtol}: give a relative tolerance above 0 and at most 1 (e.g. 1e-4)")
    mine = next((o for o in overrides if o.partition("=")[0].strip().startswith("distributed.mesh")), None)
    if mine is not None:
        raise UserError(
            f"--set {brief(mine)}: check-parallel sets each run's distributed.mesh from --mesh and --against: "
            "give the layouts there"
        )
    forced = [
        f"run.max_steps={steps}", "run.log_every=1", "monitor.layers=norms", "monitor.every_steps=1",
        "monitor.group=module",
    ]  # fmt: skip
    load_config(config, [*overrides, *forced])  # the file's own distributed.mesh too: replaced below, still checked
    for shape in (mesh, against):  # a wrong key or value, a strategy or model the layout cannot take: before training
        cfg = load_config(config, [*overrides, *forced, f"distributed.mesh={mesh_text(shape)}"])
        check_model_args(cfg)  # on the meta device; tiny-lm's heads over tp, transformers' plan
    tol = rtol if rtol is not None else DEFAULT_RTOL.get(cfg.precision, 1e-4)
    _claim(out)
    names = {"mesh": mesh_text(mesh), "against": mesh_text(against)}
    dirs = {key: out / name.replace(",", "_").replace("=", "") for key, name in names.items()}
    for key, shape in (("mesh", mesh), ("against", against)):
        _train(config, [*overrides, *forced], shape, dirs[key])
    n, worst, first = compare_runs(dirs["mesh"], dirs["against"], tol)
    return ParallelCheck(
        agree=first is None,
        steps=n,
        max_rel_diff=worst,
        first_difference=first,
        mesh=names["mesh"],
        against=names["against"],
        rtol=tol,
        runs={k: str(v) for k, v in dirs.items()},
        sentence=_sentence(n, worst, first, names["mesh"], names["against"]),
    )
