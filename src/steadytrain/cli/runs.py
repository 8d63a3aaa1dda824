"""``steadytrain report|compare|repro|sweep``: parse, call :mod:`steadytrain.runs`, print."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import click


def _json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, allow_nan=False, default=str))


def _quiet_training() -> None:
    """Training inside repro/sweep logs warnings only; the runs layer says what it does."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("steadytrain")
    root.handlers[:], root.propagate = [handler], False
    root.setLevel(logging.INFO)
    logging.getLogger("steadytrain.train").setLevel(logging.WARNING)


@click.command("report")
@click.argument("run", type=click.Path(file_okay=False))
def report(run: str) -> None:
    """Write RUN/plots/*.png and RUN/summary.md (loss, LR, grad norm, throughput; plan, environment)."""
    from steadytrain.runs import report as write_report

    rep = write_report(Path(run))
    for name, path in rep.plots.items():
        click.echo(f"{name}: {path}")
    click.echo(f"summary: {rep.summary}")
    if rep.failed:
        raise click.exceptions.Exit(1)


@click.command("compare")
@click.argument("run_a", type=click.Path(file_okay=False))
@click.argument("run_b", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default=None,
    help="Where to write both losses overlaid (default compare-A-vs-B.png here).",
)
def compare(run_a: str, run_b: str, as_json: bool, plot: str | None) -> None:
    """Why two runs differ: config, data, environment by scope, then the first step whose losses differ."""
    from steadytrain.runs import compare as compare_runs

    where = plot or f"compare-{Path(run_a).resolve().name}-vs-{Path(run_b).resolve().name}.png"
    result = compare_runs(Path(run_a), Path(run_b), plot=where)
    if as_json:
        _json(result.to_dict())
        return
    click.echo(result.sentence)
    for key, (a, b) in result.config.items():
        click.echo(f"  config {key}: {a!r} vs {b!r}")
    for key, value in result.data.items():
        if key not in ("same", "note") and value:
            click.echo(f"  data {key}: {value}")
    for scope, diffs in result.env.items():
        for d in (diffs or [])[:10]:
            click.echo(f"  {scope} {d['path']}: {d['a']!r} vs {d['b']!r}")
    click.echo(f"  plot: {result.plot}")


@click.command("repro")
@click.argument("run", type=click.Path(file_okay=False))
@click.option("--steps", type=click.IntRange(1), default=None, help="Optimizer steps to re-run (default 20).")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Keep the re-run in this new directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as JSON.")
def repro(run: str, steps: int | None, out: str | None, as_json: bool) -> None:
    """Re-run RUN's first steps here (deterministic) and compare bit for bit; exit 0 reproduced, 1 not."""
    from steadytrain.runs import repro as reproduce

    _quiet_training()
    result = reproduce(Path(run), steps, out=out)
    _json(result.to_dict()) if as_json else click.echo(result.sentence)
    if not result.reproduced:
        raise click.exceptions.Exit(1)


@click.command("sweep")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--factors", default="0.25,0.5,1,2,4", show_default=True, help="Multiples of the linear LR estimate.")
@click.option("--steps", type=click.IntRange(1), default=50, show_default=True, help="Optimizer steps per trial.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key.")
@click.option(
    "--sweep-dir", type=click.Path(file_okay=False), default=None, help="Where the trials go (default runs/sweep-NAME)."
)
def sweep(config: str | None, factors: str, steps: int, overrides: tuple[str, ...], sweep_dir: str | None) -> None:
    """Short runs at LR = factor x the linear-scaling estimate: a table, loss against LR, the best factor."""
    from steadytrain.runs import sweep as run_sweep
    from steadytrain.runs.sweep import parse_factors
    from steadytrain.train.config import load_config

    chosen = parse_factors(factors)
    cfg = load_config(config, list(overrides))
    _quiet_training()
    where = Path(sweep_dir) if sweep_dir else Path(cfg.run.dir) / f"sweep-{cfg.run.name}"
    result = run_sweep(cfg, chosen, steps, where)
    click.echo((where / "sweep.md").read_text() if (where / "sweep.md").exists() else result.sentence, nl=False)
