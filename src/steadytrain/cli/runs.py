"""``steadytrain report|compare|repro|sweep|hangs|ranks|goodput|triage|layers``: parse, call :mod:`.runs`, print."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from steadytrain._text import one_line, short
from steadytrain.cli._common import WholeNumber, run_argument


def _json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, allow_nan=False, default=str))


def _logging() -> None:
    """One-line records on stderr (a run path holding a newline stays on its line)."""
    from steadytrain.cli._common import log_handler

    root = logging.getLogger("steadytrain")
    root.handlers[:], root.propagate = [log_handler()], False
    root.setLevel(logging.INFO)


def _quiet_training() -> None:
    """Training inside repro/sweep logs warnings only; the runs layer says what it does."""
    _logging()
    logging.getLogger("steadytrain.train").setLevel(logging.WARNING)


@contextlib.contextmanager
def _stopped_by_signal() -> Iterator[None]:
    """A Ctrl-C (or SIGTERM) during repro or sweep: one line, and the stop's exit code (130; 75 for SIGTERM)."""
    from steadytrain.train.job.loop import Interrupted

    try:
        yield
    except Interrupted as err:
        click.echo(f"stopped: {one_line(err)}", err=True)
        raise click.exceptions.Exit(err.exit_code) from None


@click.command("report")
@run_argument
def report(run: str) -> None:
    """Write RUN/plots/*.png and RUN/summary.md (loss, LR, grad norm, throughput; plan, environment)."""
    from steadytrain.runs import report as write_report

    _logging()
    rep = write_report(Path(run))
    for name, path in rep.plots.items():
        click.echo(f"{name}: {one_line(path)}")
    for name, why in rep.failed.items():
        click.echo(f"{name}: not drawn ({why})")
    click.echo(f"summary: {one_line(rep.summary)}")
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
    help="Also write both losses overlaid to this new .png file (or over a plot steadytrain wrote there).",
)
def compare(run_a: str, run_b: str, as_json: bool, plot: str | None) -> None:
    """Why two runs differ: config, data, environment by scope, then the first step whose losses differ."""
    from steadytrain.runs import compare as compare_runs

    _logging()
    result = compare_runs(Path(run_a), Path(run_b), plot=plot)
    if as_json:
        _json(result.to_dict())
        return
    click.echo(result.sentence)
    for key, (a, b) in result.config.items():
        click.echo(f"  config {one_line(key)}: {one_line(repr(a))} vs {one_line(repr(b))}")
    for key, value in result.data.items():
        if key not in ("same", "note") and value:
            click.echo(f"  data {key}: {one_line(value)}")
    for scope, diffs in result.env.items():
        for d in (diffs or [])[:10]:
            click.echo(f"  {scope} {one_line(d['path'])}: {one_line(repr(d['a']))} vs {one_line(repr(d['b']))}")
    for line in _time_lines(result.goodput):
        click.echo(line)
    if result.plot is not None:
        click.echo(f"  plot: {one_line(result.plot)}")


def _time_lines(side: dict[str, list[float | None]] | None) -> list[str]:
    """``compare``'s time accounts, A beside B: the goodput, wall and productive time, every cause either has."""
    if side is None:
        return []

    def cell(key: str, x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}" if key == "goodput" else f"{x:.1f} s"

    rows = [k for k, (a, b) in side.items() if k in ("goodput", "wall_s", "productive_s") or (a or 0) + (b or 0) > 0]
    lines = [f"    {k:<19}{cell(k, side[k][0]):>12}{cell(k, side[k][1]):>12}" for k in rows]
    return ["  time account (A vs B):", *lines]


@click.command("repro")
@run_argument
@click.option("--steps", type=WholeNumber(1), default=None, help="Optimizer steps to re-run (default 20).")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Keep the re-run in this new directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the verdict as JSON.")
def repro(run: str, steps: int | None, out: str | None, as_json: bool) -> None:
    """Re-run RUN's first steps here (deterministic) and compare bit for bit.

    Exit 0: reproduced, and this machine compared with the recorded environment; 1: not reproduced, or
    RUN has no env.json to compare with.
    """
    from steadytrain.runs import repro as reproduce

    _quiet_training()
    with _stopped_by_signal():
        result = reproduce(Path(run), steps, out=out)
    _json(result.to_dict()) if as_json else click.echo(result.sentence)
    if not result.validated:
        raise click.exceptions.Exit(1)


@click.command("sweep")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--factors", default="0.25,0.5,1,2,4", show_default=True, help="Multiples of the linear LR estimate.")
@click.option("--steps", type=WholeNumber(1), default=50, show_default=True, help="Optimizer steps per trial.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key.")
@click.option(
    "--sweep-dir", type=click.Path(file_okay=False), default=None, help="Where the trials go (default runs/sweep-NAME)."
)
def sweep(config: str | None, factors: str, steps: int, overrides: tuple[str, ...], sweep_dir: str | None) -> None:
    """Short runs at LR = factor x the linear-scaling estimate: a table, loss against LR, the best factor."""
    from steadytrain.runs import sweep as run_sweep
    from steadytrain.runs.sweep import parse_factors
    from steadytrain.train.setup.config import load_config

    chosen = parse_factors(factors)
    cfg = load_config(config, list(overrides))
    _quiet_training()
    where = Path(sweep_dir) if sweep_dir else Path(cfg.run.dir) / f"sweep-{cfg.run.name}"
    with _stopped_by_signal():
        result = run_sweep(cfg, chosen, steps, where)
    click.echo((where / "sweep.md").read_text() if (where / "sweep.md").exists() else result.sentence, nl=False)


@click.command("hangs")
@run_argument
@click.option("--json", "as_json", is_flag=True, help="Print JSON (a list of hangs).")
def hangs(run: str, as_json: bool) -> None:
    """List the hangs the watchdog recorded in RUN: step, the stuck ranks, their phase, host and frame."""
    from steadytrain.runs.hangs import hang_lines, read_hangs

    found = read_hangs(Path(run))
    if as_json:
        _json(found)
        return
    for line in hang_lines(run, found):
        click.echo(line)


@click.command("ranks")
@run_argument
@click.option("--json", "as_json", is_flag=True, help="Print the stragglers as JSON.")
def ranks(run: str, as_json: bool) -> None:
    """Name a rank that is consistently slower than the others (RUN/ranks.jsonl), with what it cost the job, and
    list the replicas that disagreed (RUN/parity.jsonl)."""
    from steadytrain.runs.ranks import stragglers

    rep = stragglers(Path(run))
    if as_json:
        _json(rep.to_dict())
        return
    click.echo(one_line(rep.sentence))
    for rank, ms in sorted(rep.ranks.items()):
        click.echo(f"  rank {rank}: {ms:.2f} ms per step of its own (data + forward, median)")
    for p in rep.parity:
        more, on = len(p["tensors"]) - 5, f" on {short(p['host'])}" if p.get("host") else ""
        tensors = ", ".join(map(short, p["tensors"][:5])) + (f" and {more} more (--json lists all)" if more > 0 else "")
        click.echo(one_line(f"replicas disagreed at step {p['step']}: rank {p['rank']}{on}: {tensors}"))


@click.command("triage")
@run_argument
@click.option(
    "--step", type=WholeNumber(), required=True, help="The refused optimizer step to replay (nan report lists them)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the verdict and the replays as JSON.")
def triage(run: str, step: int, as_json: bool) -> None:
    """Replay a refused step as variants (recorded, without the suspects, from an earlier state, twice): data, model
    state, or not reproducible (the machine)."""
    from steadytrain.runs.triage import triage as run_triage

    _logging()
    found = run_triage(Path(run), step)
    if as_json:
        _json(found.to_dict())
        return
    click.echo(f"{found.verdict}: step {found.step}: {one_line(found.note)}")
    for r in found.replays:
        loss = "n/a" if r["loss"] is None else f"{r['loss']:.6g}"
        extra = f", bitwise equal: {r['bitwise_equal']}" if "bitwise_equal" in r else ""
        finite = "n/a (not replayed)" if r["finite"] is None else r["finite"]
        click.echo(f"  {r['variant']}: loss {loss}, finite {finite}{extra}")


@click.command("layers")
@run_argument
@click.option("--step", type=WholeNumber(1), default=None, help="The monitored step to show (default: the last).")
@click.option("--json", "as_json", is_flag=True, help='Print {"step": S, "layers": [rows]} as JSON.')
def layers(run: str, step: int | None, as_json: bool) -> None:
    """Per-layer norms of one monitored step of RUN (RUN/layers.jsonl): grad norm, param norm, update norm, update
    ratio."""
    from steadytrain.runs.layers import layer_step, table_lines

    found = layer_step(Path(run), step)
    if as_json:
        _json(found)
        return
    for line in table_lines(found):
        click.echo(line)


@click.command("goodput")
@run_argument
@click.option("--json", "as_json", is_flag=True, help="Print the account as JSON (the keys of RUN/goodput.json).")
def goodput(run: str, as_json: bool) -> None:
    """Where RUN's time went, over every attempt (RUN/timeline.jsonl): the share that trained steps that count, and
    the rest by cause (startup, compile, data wait, checkpoints, evaluation, lost progress, skipped steps, restart
    gaps, hangs, stragglers, other)."""
    from steadytrain.runs.goodput import goodput as account
    from steadytrain.runs.goodput import goodput_lines

    found = account(Path(run))
    if as_json:
        _json(found.to_dict())
        return
    for line in goodput_lines(found):
        click.echo(one_line(line))
