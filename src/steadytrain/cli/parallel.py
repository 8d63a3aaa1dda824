"""``steadytrain check-parallel``: parse, call :func:`steadytrain.runs.parallel.check_parallel`, print."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import click

from steadytrain._text import one_line
from steadytrain.cli._common import Number, WholeNumber


@click.command("check-parallel")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--mesh", required=True, metavar="replicate=R,shard=S,tp=T", help="The layout to check (R*S*T ranks).")
@click.option(
    "--against",
    default="replicate=1,shard=1,tp=1",
    show_default=True,
    metavar="replicate=R,shard=S,tp=T",
    help="The layout it must train like (default: one rank).",
)
@click.option("--steps", type=WholeNumber(1, 100_000), default=10, show_default=True, help="Optimizer steps each.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key.")
@click.option(
    "--rtol",
    type=Number(0, 1, min_open=True),
    default=None,
    help="Relative tolerance (default 1e-4 in fp32, 2e-2 in bf16/fp16).",
)
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Where both runs go (a new directory).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def check_parallel_cmd(
    config: str | None, mesh: str, against: str, steps: int, overrides: tuple[str, ...], rtol: float | None,
    out: str | None, as_json: bool,
) -> None:  # fmt: skip
    """Train CONFIG (default: the embedded one) for --steps steps on --mesh and on --against from the same weights and
    data; report the first step, metric and layer where they differ beyond float tolerance, or that they agree.
    Exit code 1 when they differ."""
    from steadytrain.cli._common import log_handler
    from steadytrain.runs.parallel import check_parallel, parse_layout

    root = logging.getLogger("steadytrain")
    root.handlers[:], root.propagate = [log_handler()], False
    root.setLevel(logging.INFO)
    shape, other = parse_layout(mesh, "--mesh"), parse_layout(against, "--against")
    where = Path(out) if out else Path("runs") / f"check-parallel-{time.strftime('%Y%m%d-%H%M%S')}"
    result = check_parallel(config, list(overrides), shape, other, steps, where, rtol)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        click.echo(("agree: " if result.agree else "differ: ") + one_line(result.sentence))
        click.echo(f"runs: {one_line(result.runs['mesh'])} and {one_line(result.runs['against'])}")
    if not result.agree:
        raise click.exceptions.Exit(1)
