"""``steadytrain data``: validate, infer-schema, provenance, verify.

Library errors (``DatasetError``, ``SchemaError``: both :class:`~steadytrain.errors.UserError`) pass
through to the entry point, which prints them as one line and exits 2. Values from the data (provenance,
file and column names) are shown verbatim: the consoles never read markup, and control characters are
shown escaped (:func:`shown`), never sent to the terminal.
"""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from steadytrain.cli._common import UserError, console


def shown(value: Any) -> str:
    """``str(value)`` with newlines, escape sequences and other control characters shown escaped.

    Example:
        >>> shown("s3://bucket/[/data]" + chr(27) + "[31m")
        's3://bucket/[/data]\\\\x1b[31m'
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))


def parse_shards(spec: str | None, known: list[int] | None = None) -> list[int] | None:
    """``"0-39,47"`` -> ``[0, ..., 39, 47]``; None stays None. With ``known``, every id must be one of them.

    Example:
        >>> parse_shards("0-2,7")
        [0, 1, 2, 7]
    """
    if spec is None:
        return None
    out: list[int] = []
    limit = len(known) if known is not None else 1_000_000  # a range can never hold more ids than exist
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if hi else int(lo)
        except ValueError:
            raise UserError(f"--shards {spec!r}: {part.strip()!r} is not an id or a range: use e.g. 0-39,47") from None
        if first < 0 or last < first:
            raise UserError(f"--shards {spec!r}: {part.strip()!r} is an empty range: use low-high, e.g. 0-39")
        if last - first + 1 + len(out) > limit:
            raise UserError(f"--shards {spec!r}: selects more shards than the dataset has ({limit})")
        out += range(first, last + 1)
    if len(set(out)) < len(out):
        raise UserError(f"--shards {spec!r}: names a shard twice")
    if known is not None and (unknown := sorted(set(out) - set(known))):
        some = ", ".join(map(str, unknown[:5])) + (", ..." if len(unknown) > 5 else "")
        raise UserError(f"--shards {spec!r}: no shard {some} in the dataset (ids {_ids(known)})")
    return out


def _table(title: str, *columns: str) -> Table:
    """A table whose cells fold long values onto more lines, never cutting them short."""
    table = Table(title=shown(title), title_justify="left")
    for col in columns:
        table.add_column(shown(col), overflow="fold")
    return table


def _print(table: Table) -> None:
    """Print a table; into a pipe or a file at its full width, so every value stays on one line, whole."""
    if console.is_terminal:
        console.print(table)
        return
    wide = Console(file=console.file, width=1 << 20, markup=False, highlight=False, emoji=False)
    wide.print(table)


def _ids(ids: list[int]) -> str:
    return f"{min(ids)}..{max(ids)}, {len(ids)} shards" if ids else "none"


@click.group()
def data() -> None:
    """Sharded datasets: validation against a schema, provenance, checksums."""


@data.command("verify")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
def verify_cmd(path: str) -> None:
    """Check every shard's size and sha256 against the index; list leftovers of interrupted writes. Exit 1 if bad."""
    from steadytrain.data import CorruptShardError, open_dataset

    ds = open_dataset(path)
    bad = []
    for sid in ds.shard_ids:
        try:
            ds.verify_shard(sid)
        except CorruptShardError as err:
            bad.append(sid)
            click.echo(f"corrupt: {shown(err)}")
    for name in ds.orphans:
        click.echo(f"orphan: {shown(name)} (not in the index: an interrupted write)")
    click.echo(f"{len(ds.shard_ids) - len(bad)}/{len(ds.shard_ids)} shards verified, {len(ds.orphans)} orphan file(s)")
    if bad:
        raise click.exceptions.Exit(1)


def _odd(value: Any) -> Text:
    return Text(shown(value), style="bold red")


@data.command("provenance")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--shard", type=int, default=None, help="Show where this shard differs from the majority.")
def provenance_cmd(path: str, shard: int | None) -> None:
    """Provenance per shard; fields unlike the majority of shards are highlighted."""
    from steadytrain.data import open_dataset
    from steadytrain.data.provenance import IGNORED, majority_provenance, provenance_differences, provenance_outliers

    ds = open_dataset(path)
    if shard is not None:
        diffs = provenance_differences(ds, shard)
        if not diffs:
            click.echo(f"shard {shard}: provenance like the majority of {len(ds.shards)} shards")
            return
        table = _table(
            f"shard {shard} vs the majority of {len(ds.shards)} shards", "field", f"shard {shard}", "majority"
        )
        for f, (mine, major) in diffs.items():
            table.add_row(shown(f), _odd(mine), shown(major))
        _print(table)
        return
    major = majority_provenance(ds)
    outliers = provenance_outliers(ds)
    fields = [*major, *sorted(IGNORED & {k for s in ds.shards for k in s.provenance})]
    table = _table(f"{path}: {len(ds.shards)} shards, {ds.num_records} records", "shard", "records", *fields)
    for s in ds.shards:
        odd = outliers.get(s.id, {})
        cells = [_odd(s.provenance.get(f)) if f in odd else shown(s.provenance.get(f)) for f in fields]
        table.add_row(str(s.id), str(s.records), *cells)
    _print(table)
    if outliers:
        click.echo(f"{len(outliers)} shard(s) produced unlike the majority: {', '.join(map(str, outliers))}")


@data.command("infer-schema")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--shards", "shards_spec", default=None, help="Shards known to be healthy, e.g. 0-39 (default: all).")
@click.option("--categorical", multiple=True, help="Integer columns to treat as categorical (repeatable).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Where to write the YAML.")
def infer_schema_cmd(path: str, shards_spec: str | None, categorical: tuple[str, ...], output: str) -> None:
    """Infer a schema (types, ranges, vocabularies) from healthy shards."""
    from steadytrain.data import infer_schema, open_dataset

    ds = open_dataset(path)
    shards = parse_shards(shards_spec, ds.shard_ids)
    schema = infer_schema(ds, shards=shards, categorical=list(categorical) or None)
    schema.save(output)
    click.echo(f"wrote a schema of {len(schema.fields)} fields to {shown(output)}", err=True)


@data.command("validate")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--schema", "schema_path", type=click.Path(exists=True, dir_okay=False), help="Schema YAML.")
@click.option("--shards", "shards_spec", default=None, help="Only these shards, e.g. 40-49.")
def validate_cmd(path: str, schema_path: str | None, shards_spec: str | None) -> None:
    """Validate shards against a schema; exit 1 on violations.

    Without --schema, the schema is inferred from the shards whose provenance matches the majority.
    """
    from steadytrain.data import Schema, healthy_shards, infer_schema, open_dataset, validate

    ds = open_dataset(path)
    shards = parse_shards(shards_spec, ds.shard_ids)
    if schema_path is not None:
        schema = Schema.load(schema_path)
    else:
        healthy = healthy_shards(ds)
        schema = infer_schema(ds, shards=healthy)
        click.echo(f"no --schema: inferred from the {len(healthy)} shards whose provenance matches the majority")
    report = validate(ds, schema, shards=shards)
    by_shard = report.by_shard()
    table = _table(f"{path}: validation", "shard", "field", "violation", "count", "first examples")
    for sid, violations in sorted(by_shard.items()):
        for v in violations:
            table.add_row(str(sid), shown(v.field), v.kind, str(v.count), ", ".join(map(str, v.examples)))
    if by_shard:
        _print(table)
        click.echo(f"violations in {len(by_shard)} shard(s): {', '.join(map(str, sorted(by_shard)))}")
        raise click.exceptions.Exit(1)
    click.echo("ok: no violations")
