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

from steadytrain._check import MAX_SEQ_LEN, parse_int
from steadytrain.cli._common import UserError, WholeNumber, console


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
            first, last = parse_int(lo), parse_int(hi) if hi else parse_int(lo)  # digits 0-9, as every flag
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
    """Check every shard's size, sha256, and that it decodes to the index's record count. Exit 1 if bad.

    Every row group of every shard is read; files the index does not list (leftovers of interrupted writes)
    are listed as orphans.
    """
    from steadytrain.data import CorruptShardError, open_dataset

    ds = open_dataset(path)
    bad = []
    for sid in ds.shard_ids:
        try:
            ds.verify_shard(sid, decode=True)
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
@click.option("--shard", type=WholeNumber(), default=None, help="Show where this shard differs from the majority.")
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


@data.command("ingest")
@click.argument("sources", nargs=-1, required=True, type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="New (or empty) dataset directory.")
@click.option(
    "--kind", type=click.Choice(["text", "records"]), default=None, help="Default: text for text files or --field."
)
@click.option("--tokenizer", default=None, help="bytes (default) or a tokenizers JSON file (text only).")
@click.option(
    "--seq-len", type=WholeNumber(1, MAX_SEQ_LEN), default=None, help="Tokens per window seen by a model [128]."
)
@click.option("--field", default=None, help="The string field (.jsonl) or column (.csv, .parquet) of each document.")
@click.option("--shard-rows", type=WholeNumber(min=1), default=None, help="Windows [8192] or records [65536].")
@click.option("--workers", type=WholeNumber(1, 1024), default=1, show_default=True, help="Processes; same output.")
@click.option("--pipeline-version", default="1", show_default=True, help="Recorded in every shard's provenance.")
@click.option("--skip-bad", is_flag=True, help="Skip bad lines (counted in provenance) instead of stopping.")
def ingest_cmd(
    sources: tuple[str, ...],
    out: str,
    kind: str | None,
    tokenizer: str | None,
    seq_len: int | None,
    field: str | None,
    shard_rows: int | None,
    workers: int,
    pipeline_version: str,
    skip_bad: bool,
) -> None:
    """Text, JSON lines, CSV or Parquet files (or directories of them; .gz/.zst too) to a sharded dataset.

    Text is .txt and any other UTF-8 file; binary files in a directory are skipped and counted.
    Text becomes windows of seq-len + 1 tokens in a `tokens` column; records stay rows, with a schema.yaml.
    Written aside and renamed into place when complete: a failed or killed ingest leaves nothing at --out.
    """
    import contextlib
    import logging
    import time

    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from steadytrain.cli._common import err_console, log_handler
    from steadytrain.data.ingest import ingest

    logger = logging.getLogger("steadytrain.data")
    logger.handlers[:], logger.propagate = [log_handler("ingest: ")], False
    logger.setLevel(logging.WARNING)  # skipped lines, leftovers of killed ingests; an error stays one line
    options = {"tokenizer": tokenizer, "seq_len": seq_len}
    bar = Progress(BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(), console=err_console)
    task = bar.add_task("ingest", total=None)
    last = [time.monotonic()]
    t0 = last[0]

    def progress(done: int, total: int) -> None:
        if err_console.is_terminal:
            bar.update(task, completed=done, total=total)
        elif time.monotonic() - last[0] >= 10 and done < total:  # not a terminal: a line every 10 s
            last[0] = time.monotonic()
            rate = done / 1e6 / max(last[0] - t0, 1e-9)
            share = f"{done / 1e6:.1f}/{total / 1e6:.1f} MB ({done / max(total, 1):.0%})"
            click.echo(f"ingest: {share}, {rate:.1f} MB/s", err=True)

    with bar if err_console.is_terminal else contextlib.nullcontext():
        result = ingest(
            list(sources),
            out,
            kind=kind,
            field=field,
            shard_rows=shard_rows,
            workers=workers,
            pipeline_version=pipeline_version,
            skip_bad=skip_bad,
            progress=progress,
            **{k: v for k, v in options.items() if v is not None},
        )
    click.echo(shown(result.files))
    tokens = f", {result.tokens} tokens" if result.kind == "text" else ""
    skipped = f", {result.skipped_lines} bad line(s) skipped" if skip_bad else ""
    click.echo(
        f"{shown(result.path)}: {result.shards} shards, {result.rows} {'windows' if tokens else 'records'}{tokens}"
        f"{skipped} from {result.input_bytes / 1e6:.1f} MB in {result.seconds:.1f} s ({result.mb_per_s:.1f} MB/s)"
    )
