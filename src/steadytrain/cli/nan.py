"""``steadytrain nan report|hunt`` and ``steadytrain demo nan``: parse, call the diagnose library, print."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from steadytrain._text import one_line, short
from steadytrain.cli._common import WholeNumber, run_argument


def _json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, allow_nan=False, default=str))


def _print_report(rep: Any, limit: int = 5, flagged: str = "non-finite") -> None:
    click.echo(one_line(rep.sentence))  # a host name from the ledger may hold a newline or a terminal escape
    rows = [s for s in rep.shards if s.events][:limit]
    for s in rows:
        rate = f"{s.rate:.3g}" if s.rate is not None else "n/a"
        seen = "exposure not recorded" if s.exposures is None else f"{s.exposures} examples seen"
        name = short(rep.shard_name(s.shard))  # a mixture's "web shard 3 (id 7)": a source name from sources.json
        click.echo(
            f"  {name}: {s.events} step(s), {s.nonfinite} {flagged} losses "
            f"(chance: {s.expected:g}), {seen}, rate {rate}, p = {s.p_value:.2g}"
        )
    if rep.ranks:
        click.echo(f"  local {flagged} losses by rank: " + ", ".join(f"rank {r}: {n}" for r, n in rep.ranks.items()))
    for spike in (rep.layers or [])[:limit]:  # spikes: each layer's grad norm against its own median before
        top = [x for x in spike["layers"] if x["ratio"] is not None][:3]
        if top:
            ratios = ", ".join(f"{short(x['layer'])} {x['ratio']:.3g}x" for x in top)
            click.echo(f"  step {spike['step']}: grad norm against the layer's median before it: {ratios}")


def _print_hunt(h: Any) -> None:
    click.echo(h.sentence)
    if h.checkpoint is not None:
        click.echo(f"  checkpoint: {h.checkpoint} (step {h.checkpoint_step})")
    elif h.checkpoint_step == 0:
        click.echo("  weights: the run's initial weights (rebuilt from run.seed), as before step 1")
    if h.note:
        click.echo(f"  note: {h.note}")
    if h.step is not None:
        click.echo(f"  step {h.step} {'reproduces' if h.reproduced else 'does not reproduce'} on one process")
    if h.kind != "spike":
        click.echo(f"  first module: {h.first_module}  stage: {h.stage}")
    click.echo(f"  examples (shard {h.shard}): {h.examples}")
    for f in h.fields[:10]:
        click.echo(f"  example {f['example']}: {f['field']} = {f['value']!r} ({f['kind']})")
    if len(h.fields) > 10:
        click.echo(f"  ... {len(h.fields) - 10} more field violations (--json lists all)")
    for key, (mine, major) in h.provenance_diff.items():
        click.echo(f"  provenance {key}: {mine!r} (majority: {major!r})")


@click.group("nan")
def nan() -> None:
    """Diagnose non-finite (NaN/inf) steps of a run."""


@nan.command("report")
@run_argument
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def report_cmd(run: str, as_json: bool) -> None:
    """Attribute RUN's non-finite steps to shards: shard-selective (data first) or spread (LR, clipping, precision)."""
    from steadytrain.diagnose import report
    from steadytrain.diagnose.ledger import LEDGER
    from steadytrain.rundir.layout import open_run_dir

    if not (Path(run) / LEDGER).is_file():  # a directory holding a ledger (a loop of one's own) is enough
        open_run_dir(Path(run))  # else it must be a run directory: "no non-finite step" of `runs/` would be a lie
    rep = report(Path(run))
    _json(rep.to_dict()) if as_json else _print_report(rep)


@nan.command("hunt")
@run_argument
@click.option("--shard", type=WholeNumber(0), default=None, help="The shard to replay (from `nan report`).")
@click.option("--checkpoint", type=click.Path(), default=None, help="The checkpoint whose weights to use.")
@click.option("--step", type=WholeNumber(1), default=None, help="Replay this optimizer step's global batch.")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def hunt_cmd(run: str, shard: int | None, checkpoint: str | None, step: int | None, as_json: bool) -> None:
    """Replay one shard (or one step) of RUN in this process: module, examples, fields, provenance."""
    from steadytrain.diagnose import hunt
    from steadytrain.rundir.origin import read_origin, require_replayable
    from steadytrain.runs.replay import run_model

    if read_origin(Path(run)) is not None:  # a run of steadytrain.Run: its own model and examples, as recorded
        from steadytrain.runs.ownreplay import own_loop_hunt

        found = own_loop_hunt(Path(run), shard, step, checkpoint)
    else:
        require_replayable(Path(run), "nan hunt")
        found = hunt(Path(run), shard, loader=run_model, checkpoint=checkpoint, step=step)
    _json(found.to_dict()) if as_json else _print_hunt(found)


@click.group("demo")
def demo() -> None:
    """Demonstrations that run end to end on this machine."""


@demo.command("nan")
@click.option(
    "--dir", "root", type=click.Path(file_okay=False), default=None, help="Where to write (default: a temp dir)."
)
@click.option(
    "--variant",
    type=click.Choice(["shard", "lr", "both"]),
    default="both",
    show_default=True,
    help="shard: shard 47 from a later pipeline; lr: clean data, learning rate far too high.",
)
@click.option("--shards", type=WholeNumber(16, 10_000), default=200, show_default=True, help="Shards to write.")
def demo_nan(root: str | None, variant: str, shards: int) -> None:
    """The seed's scenario: a NaN from shard 47's new category, found by report and hunt (2 ranks, gloo)."""
    from steadytrain.cli._common import log_handler
    from steadytrain.diagnose.demo import run_demo

    logger = logging.getLogger("steadytrain.diagnose")
    logger.handlers[:], logger.propagate = [log_handler()], False
    logger.setLevel(logging.INFO)
    where = Path(root) if root else Path(tempfile.mkdtemp(prefix="steadytrain-demo-nan-"))
    variants = ("shard", "lr") if variant == "both" else (variant,)
    t0 = time.perf_counter()
    from steadytrain.runs.replay import run_model

    for result in run_demo(where, loader=run_model, variants=variants, shards=shards):
        ended = "finished" if result.returncode == 0 else f"stopped early (exit {result.returncode})"
        click.echo(f"\n== {result.variant}: training {ended}; run directory {one_line(result.run_dir)}")
        click.echo("$ steadytrain nan report RUN")
        _print_report(result.report)
        if result.hunt is not None:
            click.echo(f"$ steadytrain nan hunt RUN --shard {result.hunt.shard}")
            _print_hunt(result.hunt)
    click.echo(f"\ndemo done in {time.perf_counter() - t0:.0f} s; files under {one_line(where)}")
