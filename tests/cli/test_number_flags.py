"""One parser for number options (issue 47, "One rule for numbers"): every integer option of every command reads
digits 0-9 with an optional sign, as the mesh parser and the config do; ``int()`` alone took ``٣`` as 3 and ``1_0``
as 10, ``float()`` also ``nan``, ``inf`` and ``1_0``."""

from __future__ import annotations

import click
import pytest

from steadytrain.cli import cli as root
from steadytrain.errors import UserError
from steadytrain.train.setup.sections import parse_mesh
from tests.cli_utils import assert_user_error

BAD_INTEGERS = ["٣", "1_0", "0x10", "1e3", "3.0", "+-3", "３", "2 0"]  # ３: full-width 3


def _params(group: click.Group = root, path: str = "steadytrain"):
    """``(command path, parameter)`` for every parameter of every command, depth first."""
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _params(cmd, f"{path} {name}")
        else:
            yield from ((f"{path} {name}", p) for p in cmd.params)


def test_every_number_option_of_every_command_reads_digits_only():
    numeric = [(where, p) for where, p in _params() if isinstance(p.type, click.types._NumberParamTypeBase)]
    assert len(numeric) > 20  # the walk finds them: --step, --steps, --shard, --nproc, plan's options...
    for where, p in numeric:
        for text in ("٣", "1_0"):
            with pytest.raises(click.BadParameter, match="digits 0-9"):
                p.type.convert(text, p, None)
        fits = p.type.max if p.type.max is not None else (p.type.min or 0) + 1  # digits still work
        assert p.type.convert(str(int(fits)), p, None) == int(fits), (where, p.name)


@pytest.mark.parametrize("command", ["triage", "layers"])
@pytest.mark.parametrize("text", ["٣", "1_0", "0x10", "1e3"])
def test_step_is_written_in_digits(tmp_path, cli, command, text):
    # triage replayed step 3 for `--step ٣` and step 10 for `--step 1_0`
    r = cli(command, "--step", text, tmp_path)
    assert_user_error(r, "'--step'", f"{text!r} is not a whole number", "digits 0-9")


@pytest.mark.parametrize("text", BAD_INTEGERS)
def test_an_integer_option_and_a_mesh_refuse_the_same_texts(text):
    from steadytrain.cli._common import WholeNumber

    for flag_text in (text, f" {text}", ""):  # a flag's value is not stripped (a mesh's items are, at commas)
        with pytest.raises(click.BadParameter, match="whole number"):
            WholeNumber().convert(flag_text, None, None)
    with pytest.raises(ValueError, match="whole number"):
        parse_mesh(f"shard={text}")
    assert WholeNumber().convert("+2", None, None) == parse_mesh("shard=+2")["shard"] == 2


def test_a_shard_range_is_written_in_digits():
    from steadytrain.cli.data import parse_shards

    assert parse_shards("0-2,7") == [0, 1, 2, 7]
    for spec in ("1_0", "٣", "0-1_0", "0x1"):
        with pytest.raises(UserError, match="is not an id or a range"):
            parse_shards(spec)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--base-lr", "٣e-3"], ["'--base-lr'", "is not a number", "digits 0-9"]),  # was 0.003
        (["--base-lr", "1_0"], ["'--base-lr'", "'1_0' is not a number"]),  # was 10.0
        (["--base-lr", "inf"], ["'--base-lr'", "'inf' is not a number"]),
        (["--micro-batch-size", "3_2"], ["'--micro-batch-size'", "'3_2' is not a whole number"]),  # was 32
        (["--world-size", "0x2"], ["'--world-size'", "'0x2' is not a whole number"]),
        (["--epochs", "1e3"], ["'--epochs'", "'1e3' is not a whole number"]),
    ],
)
def test_plan_reads_its_numbers_by_the_same_rule(cli, args, words):
    base = ["plan", "--micro-batch-size", "32", "--base-lr", "1e-3", "--base-batch-size", "256"]
    assert_user_error(cli(*base, *args), *words)
