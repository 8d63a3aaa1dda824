"""``steadytrain data``: validate, infer-schema, provenance, verify."""

from __future__ import annotations

import click
from rich.table import Table

from steadytrain.cli._common import UserError, console


def _open(path: str):
    from steadytrain.data import DatasetError, open_dataset

    try:
        return open_dataset(path)
    except DatasetError as err:
        raise UserError(str(err)) from err


def parse_shards(spec: str | None) -> list[int] | None:
    """``"0-39,47"`` -> ``[0, ..., 39, 47]``; None stays None."""
    if spec is None:
        return None
    out: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise UserError(f"--shards {spec!r}: use ids and ranges like 0-39,47") from None
    return out


@click.group()
def data() -> None:
    """Sharded datasets: validation against a schema, provenance, checksums."""


@data.command("verify")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
def verify_cmd(path: str) -> None:
    """Check every shard's size and sha256 against the index; list leftovers of interrupted writes. Exit 1 if bad."""
    from steadytrain.data import CorruptShardError

    ds = _open(path)
    bad = []
    for sid in ds.shard_ids:
        try:
            ds.verify_shard(sid)
        except CorruptShardError as err:
            bad.append(sid)
            click.echo(f"corrupt: {err}")
    for name in ds.orphans:
        click.echo(f"orphan: {name} (not in the index: an interrupted write)")
    click.echo(f"{len(ds.shard_ids) - len(bad)}/{len(ds.shard_ids)} shards verified, {len(ds.orphans)} orphan file(s)")
    if bad:
        raise click.exceptions.Exit(1)


@data.command("provenance")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--shard", type=int, default=None, help="Show where this shard differs from the majority.")
def provenance_cmd(path: str, shard: int | None) -> None:
    """Provenance per shard; fields unlike the majority of shards are highlighted."""
    from steadytrain.data.provenance import IGNORED, majority_provenance, provenance_differences, provenance_outliers

    ds = _open(path)
    if shard is not None:
        try:
            diffs = provenance_differences(ds, shard)
        except KeyError:
            raise UserError(f"{path}: no shard {shard}") from None
        if not diffs:
            click.echo(f"shard {shard}: provenance like the majority of {len(ds.shards)} shards")
            return
        table = Table(title=f"shard {shard} vs the majority of {len(ds.shards)} shards", title_justify="left")
        for col in ("field", f"shard {shard}", "majority"):
            table.add_column(col)
        for f, (mine, major) in diffs.items():
            table.add_row(f, f"[bold red]{mine}[/]", str(major))
        console.print(table)
        return
    major = majority_provenance(ds)
    outliers = provenance_outliers(ds)
    fields = [*major, *sorted(IGNORED & {k for s in ds.shards for k in s.provenance})]
    table = Table(title=f"{path}: {len(ds.shards)} shards, {ds.num_records} records", title_justify="left")
    for col in ("shard", "records", *fields):
        table.add_column(col)
    for s in ds.shards:
        odd = outliers.get(s.id, {})
        cells = [f"[bold red]{s.provenance.get(f)}[/]" if f in odd else str(s.provenance.get(f)) for f in fields]
        table.add_row(str(s.id), str(s.records), *cells)
    console.print(table)
    if outliers:
        click.echo(f"{len(outliers)} shard(s) produced unlike the majority: {', '.join(map(str, outliers))}")


@data.command("infer-schema")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--shards", "shards_spec", default=None, help="Shards known to be healthy, e.g. 0-39 (default: all).")
@click.option("--categorical", multiple=True, help="Integer columns to treat as categorical (repeatable).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Where to write the YAML.")
def infer_schema_cmd(path: str, shards_spec: str | None, categorical: tuple[str, ...], output: str) -> None:
    """Infer a schema (types, ranges, vocabularies) from healthy shards."""
    from steadytrain.data import DatasetError, infer_schema

    ds = _open(path)
    try:
        schema = infer_schema(ds, shards=parse_shards(shards_spec), categorical=list(categorical) or None)
    except (DatasetError, KeyError) as err:
        raise UserError(str(err)) from err
    schema.save(output)
    click.echo(f"wrote a schema of {len(schema.fields)} fields to {output}", err=True)


@data.command("validate")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--schema", "schema_path", type=click.Path(exists=True, dir_okay=False), help="Schema YAML.")
@click.option("--shards", "shards_spec", default=None, help="Only these shards, e.g. 40-49.")
def validate_cmd(path: str, schema_path: str | None, shards_spec: str | None) -> None:
    """Validate shards against a schema; exit 1 on violations.

    Without --schema, the schema is inferred from the shards whose provenance matches the majority.
    """
    from steadytrain.data import Schema, SchemaError, infer_schema, validate
    from steadytrain.data.provenance import provenance_outliers

    ds = _open(path)
    if schema_path is not None:
        try:
            schema = Schema.load(schema_path)
        except SchemaError as err:
            raise UserError(str(err)) from err
    else:
        odd = provenance_outliers(ds)
        healthy = [s for s in ds.shard_ids if s not in odd] or ds.shard_ids
        schema = infer_schema(ds, shards=healthy)
        click.echo(f"no --schema: inferred from the {len(healthy)} shards whose provenance matches the majority")
    report = validate(ds, schema, shards=parse_shards(shards_spec))
    by_shard = report.by_shard()
    table = Table(title=f"{path}: validation", title_justify="left")
    for col in ("shard", "field", "violation", "count", "first examples"):
        table.add_column(col)
    for sid, violations in sorted(by_shard.items()):
        for v in violations:
            table.add_row(str(sid), v.field, v.kind, str(v.count), ", ".join(map(str, v.examples)))
    if by_shard:
        console.print(table)
        click.echo(f"violations in {len(by_shard)} shard(s): {', '.join(map(str, sorted(by_shard)))}")
        raise click.exceptions.Exit(1)
    click.echo("ok: no violations")
