"""``steadytrain spikes report|hunt`` and ``steadytrain demo spike``: parse, call the diagnose library, print."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import click

from steadytrain.cli._common import WholeNumber, run_argument
from steadytrain.cli.nan import _json, _print_hunt, _print_report, demo


@click.group("spikes")
def spikes() -> None:
    """Trace a run's loss spikes to shards and examples."""


@spikes.command("report")
@run_argument
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def report_cmd(run: str, as_json: bool) -> None:
    """Attribute RUN's loss spikes to shards: shard-selective (data first) or spread (LR, clipping, precision)."""
    from steadytrain.diagnose import report
    from steadytrain.diagnose.ledger import SPIKES
    from steadytrain.rundir.layout import open_run_dir

    if not (Path(run) / SPIKES).is_file():  # a directory holding a spike ledger is enough
        open_run_dir(Path(run))
    rep = report(Path(run), SPIKES)
    _json(rep.to_dict()) if as_json else _print_report(rep, flagged="outlying")


@spikes.command("hunt")
@run_argument
@click.option("--shard", type=WholeNumber(0), default=None, help="The shard to look into (from `spikes report`).")
@click.option("--checkpoint", type=click.Path(), default=None, help="The checkpoint whose weights to use.")
@click.option("--step", type=WholeNumber(1), default=None, help="Look into this optimizer step's global batch.")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def hunt_cmd(run: str, shard: int | None, checkpoint: str | None, step: int | None, as_json: bool) -> None:
    """Examples of one shard (or one step) of RUN whose loss is an outlier against healthy shards': their fields
    out of the healthy range, and the shard's provenance difference."""
    from steadytrain.diagnose import hunt
    from steadytrain.rundir.origin import require_replayable
    from steadytrain.runs.replay import run_model

    require_replayable(Path(run), "spikes hunt")  # before the shard checks: an own-loop run cannot be replayed at all
    found = hunt(Path(run), shard, loader=run_model, checkpoint=checkpoint, step=step, kind="spike")
    _json(found.to_dict()) if as_json else _print_hunt(found)


@demo.command("spike")
@click.option(
    "--dir", "root", type=click.Path(file_okay=False), default=None, help="Where to write (default: a temp dir)."
)
def demo_spike(root: str | None) -> None:
    """A shard whose amounts are in cents: the run spikes, rolls back past it and ends close to a clean run;
    the report names the shard, the hunt its examples (2 ranks, gloo)."""
    from steadytrain._text import one_line
    from steadytrain.cli._common import log_handler
    from steadytrain.diagnose.spikedemo import run_demo
    from steadytrain.runs.replay import run_model

    logger = logging.getLogger("steadytrain.diagnose")
    logger.handlers[:], logger.propagate = [log_handler()], False
    logger.setLevel(logging.INFO)
    t0 = time.perf_counter()
    result = run_demo(Path(root) if root else None, loader=run_model)
    ended = "finished" if result.returncode == 0 else f"stopped early (exit {result.returncode})"
    click.echo(f"== training {ended}; run directory {one_line(result.run_dir)}")
    for row in result.rollbacks:
        click.echo(
            f"  step {row['step']}: spike, rolled back to step {row['rollback_to']}, "
            f"global batch(es) {row['skipped_batches']} passed over"
        )
    if result.final_loss is not None and result.clean_loss is not None:
        click.echo(
            f"  final loss (mean of the last 10 steps) {result.final_loss:.4f}; the same data without shard "
            f"{result.bad_shard}: {result.clean_loss:.4f} ({result.final_loss / result.clean_loss - 1:+.1%})"
        )
    click.echo("$ steadytrain spikes report RUN")
    _print_report(result.report, flagged="outlying")
    if result.hunt is not None:
        click.echo(f"$ steadytrain spikes hunt RUN --shard {result.hunt.shard}")
        _print_hunt(result.hunt)
    click.echo(f"\ndemo done in {time.perf_counter() - t0:.0f} s; files under {one_line(result.run_dir.parent)}")
