"""The ``steadytrain`` command: thin wrappers that parse, build, run and print. No math here."""

from __future__ import annotations

import json
import sys

import click

from steadytrain._io import one_line
from steadytrain.cli.data import data
from steadytrain.cli.env import env
from steadytrain.cli.evaluate import eval_cmd, export_cmd
from steadytrain.cli.nan import demo, nan
from steadytrain.cli.parallel import check_parallel_cmd
from steadytrain.cli.plan import plan
from steadytrain.cli.runs import compare, goodput, hangs, layers, ranks, report, repro, sweep, triage
from steadytrain.cli.spikes import spikes
from steadytrain.cli.train import config_group, train
from steadytrain.errors import UserError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="steadytrain")
def cli() -> None:
    """steadytrain: the parts of PyTorch training that quietly break runs, right by construction."""


cli.add_command(train)
cli.add_command(eval_cmd)
cli.add_command(export_cmd)
cli.add_command(config_group)
cli.add_command(plan)
cli.add_command(env)
cli.add_command(data)
cli.add_command(nan)
cli.add_command(spikes)
cli.add_command(demo)
cli.add_command(report)
cli.add_command(compare)
cli.add_command(repro)
cli.add_command(sweep)
cli.add_command(hangs)
cli.add_command(ranks)
cli.add_command(goodput)
cli.add_command(layers)
cli.add_command(triage)
cli.add_command(check_parallel_cmd)


def wants_json(argv: list[str]) -> bool:
    """Whether ``argv`` runs a command that has a ``--json`` flag with that flag given (before any ``--``):
    its errors are then a JSON object on stdout too, so a script reading stdout always reads JSON."""
    cmd: click.Command = cli
    args = list(argv)
    while isinstance(cmd, click.Group):
        names = [a for a in args if not a.startswith("-")]
        if not names or names[0] not in cmd.commands:
            return False
        cmd, args = cmd.commands[names[0]], args[args.index(names[0]) + 1 :]
    has_flag = any("--json" in getattr(p, "opts", ()) for p in cmd.params)
    return has_flag and "--json" in (args[: args.index("--")] if "--" in args else args)


def _fail(message: str, code: int, as_json: bool) -> int:
    """The error as one line on stderr (and, under ``--json``, as ``{"error": ...}`` on stdout); ``code``."""
    line = one_line(message)
    click.echo(f"error: {line}", err=True)
    if as_json:
        click.echo(json.dumps({"error": line}))
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors (the library's :class:`UserError`, click's usage errors) become one
    line on stderr and exit code 2 (under ``--json``, also ``{"error": "..."}`` on stdout); a real bug
    keeps its traceback."""
    as_json = wants_json(sys.argv[1:] if argv is None else list(argv))
    try:
        rc = cli.main(args=argv, prog_name="steadytrain", standalone_mode=False)
    except click.exceptions.Abort:
        if as_json:
            click.echo(json.dumps({"error": "aborted"}))
        click.echo("aborted", err=True)
        return 130
    except click.exceptions.NoArgsIsHelpError as err:  # `steadytrain env` alone: the group's help, as help
        click.echo(err.ctx.get_help(), err=True)
        return 2
    except click.ClickException as err:
        return _fail(err.format_message(), err.exit_code if err.exit_code in (1, 2) else 2, as_json)
    except UserError as err:
        return _fail(str(err), 2, as_json)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
