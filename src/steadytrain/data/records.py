"""Pieces of input to documents (``--kind text``) and to typed Arrow rows (``--kind records``).

JSON lines are parsed one by one (a blank line is no record); CSV with the standard ``csv`` module,
one header line per file; Parquet batches are taken as typed. Every bad line goes through
:class:`LineErrors`: an :class:`~steadytrain.data.sources.IngestError` naming ``file:line``, or with
``skip_bad`` a count. Record column types are fixed by the first rows (:func:`first_schema`): a JSON
column by the types of its values there (integers and floats together make floats; a column with only
nulls is a string), a CSV column as ``int64`` if every non-empty value there is an integer, else
``float64`` if every one is a number, else ``string``; an empty CSV value is null. A later row that
does not fit (a float in an integer column, a field the first rows do not have, the wrong number of
CSV fields) is a bad line: nothing is converted silently.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from steadytrain._io import brief
from steadytrain.data.index import RESERVED_COLUMNS
from steadytrain.data.sources import IngestError, Piece, Source, no_such_column

__all__ = ["LineErrors", "documents", "first_schema", "records_table"]

MAX_NOTES = 5  # skipped lines kept for the log, per chunk


class LineErrors:
    """Where a bad line goes: raised as one :class:`IngestError` naming ``file:line``, or counted (``skip``)."""

    def __init__(self, names: Sequence[str], skip: bool):
        self.names, self.skip = names, skip
        self.skipped = 0
        self.notes: list[str] = []

    def __call__(self, source: int, line: int, message: str) -> None:
        where = f"{self.names[source]}:{line}"
        if not self.skip:
            raise IngestError(f"{where}: {message}; fix or remove the line, or pass --skip-bad to skip bad lines")
        self.skipped += 1
        if len(self.notes) < MAX_NOTES:
            self.notes.append(f"{where}: {message}")


class _InLineOrder:
    """Bad lines collected while a piece is read in several passes, then passed on in line order."""

    def __init__(self) -> None:
        self.found: list[tuple[int, int, str]] = []

    def __call__(self, source: int, line: int, message: str) -> None:
        self.found.append((line, source, message))

    def replay(self, bad: LineErrors) -> None:
        for line, source, message in sorted(self.found, key=lambda f: f[0]):
            bad(source, line, message)


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a bool", type(None): "null"}.get(
        type(value), "a number"
    )


def _json_lines(piece: Piece, bad: LineErrors) -> tuple[list[Any], list[int]]:
    """The JSON values of a piece's non-blank lines, with their line numbers."""
    values, lines = [], []
    for n, line in enumerate(piece.data.split(b"\n"), start=piece.first_line):
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
            lines.append(n)
        except UnicodeDecodeError as err:
            bad(piece.source, n, f"not UTF-8 (byte {err.start} of the line)")
        except (ValueError, RecursionError) as err:
            bad(piece.source, n, f"not valid JSON ({brief(getattr(err, 'msg', str(err)))})")
    return values, lines


def _decode(piece: Piece, bad: LineErrors) -> str:
    """A piece as text; a line that is not UTF-8 is bad (skipped: left empty, so line numbers hold)."""
    try:
        return piece.data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    out = []
    for n, line in enumerate(piece.data.split(b"\n"), start=piece.first_line):
        try:
            out.append(line.decode("utf-8"))
        except UnicodeDecodeError as err:
            bad(piece.source, n, f"not UTF-8 (byte {err.start} of the line): re-encode the file as UTF-8")
            out.append("")
    return "\n".join(out)


def documents(piece: Piece, source: Source, field: str | None, text: bool, bad: LineErrors) -> tuple[list, list]:
    """The documents of a piece and whether each ends there: ``(docs, ends)``.

    A ``.txt`` piece is part of one document, which ends with the file; a JSON line's ``field`` is one
    document, as is a CSV or Parquet row's. Documents are ``str`` if ``text`` (the tokenizer needs text), else bytes.

    Raises:
        IngestError: a bad line (without ``skip``), or a CSV or Parquet file without the column ``field``.
    """
    if source.format == "txt":
        return [_decode(piece, bad) if text else piece.data], [piece.last]
    if source.format == "csv":
        header, rows, _ = _csv_records(piece, source, bad, None)
        if field not in header:
            if header:
                raise no_such_column(field, source.name, header)
            return [], []  # an empty file
        col = header.index(field)
        docs = [r[col] for r in rows]
        return (docs if text else [d.encode("utf-8") for d in docs]), [True] * len(docs)
    if source.format == "parquet":
        column = piece.data.column(field)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise IngestError(
                f"{source.name}: column {brief(field)} is {column.type}, not a string: name a text column with --field"
            )
        docs = column.to_pylist()
        for i in [i for i, d in enumerate(docs) if d is None]:
            bad(piece.source, piece.first_line + i, f"column {brief(field)} is null (row {piece.first_line + i})")
        docs = [d for d in docs if d is not None]
    else:
        docs, found = [], _InLineOrder()
        for value, n in zip(*_json_lines(piece, found), strict=True):
            doc = value.get(field) if isinstance(value, dict) else None
            if not isinstance(value, dict):
                found(piece.source, n, f"is {_json_type(value)}, not a JSON object with a {brief(field)} field")
            elif field not in value:
                found(piece.source, n, f"no field {brief(field)} (fields: {brief(sorted(value))}): check --field")
            elif not isinstance(doc, str):
                found(piece.source, n, f"field {brief(field)} is {_json_type(doc)}, not a string")
            else:
                docs.append(doc)
        found.replay(bad)
    return (docs if text else [d.encode("utf-8") for d in docs]), [True] * len(docs)


def _csv_records(piece: Piece, source: Source, bad: LineErrors, names: list[str] | None) -> tuple[list, list, list]:
    """``(header, rows, line numbers)`` of a CSV piece; a file's header is checked against ``names`` when given.

    The header is the piece's first record in the first piece of a file, else the one the reader passed on.
    """
    reader = csv.reader(io.StringIO(_decode(piece, bad), newline=""))
    if piece.first_line == 1:
        header = next(reader, [])
        if names is not None and sorted(header) != sorted(names):
            raise IngestError(
                f"{source.name}:1: the header {brief(header)} differs from the columns of the first rows "
                f"{brief(names)}: give every CSV file the same columns"
            )
    else:
        header = next(csv.reader(io.StringIO(piece.header.decode("utf-8", "replace"), newline="")), [])
    rows, lines, prev = [], [], reader.line_num
    while True:
        line = piece.first_line + prev
        try:
            record = next(reader)
        except StopIteration:
            break
        except csv.Error as err:
            bad(piece.source, line, f"not valid CSV ({err})")
            prev = reader.line_num
            continue
        prev = reader.line_num
        if not record:
            continue  # a blank line
        if len(record) != len(header):
            bad(piece.source, line, f"{len(record)} fields, the header has {len(header)}")
            continue
        rows.append(record)
        lines.append(line)
    return header, rows, lines


def _column_type(values: list[Any]) -> pa.DataType:
    """A JSON column's type from its first values: their common type, else the first non-null one's."""
    try:
        t = pa.array(values).type
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        try:
            t = pa.array([next(v for v in values if v is not None)]).type
        except (pa.ArrowException, TypeError, ValueError, OverflowError):  # e.g. an integer beyond 64 bits
            t = pa.string()
    return pa.string() if pa.types.is_null(t) else t


def _csv_type(values: list[str]) -> pa.DataType:
    """``int64`` if every non-empty value is an integer, else ``float64`` if every one is a number, else string."""
    arr = pa.array([v for v in values if v], pa.string())
    for t in (pa.int64(), pa.float64()):
        try:
            pc.cast(arr, t)
            return t
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue
    return pa.string()


def first_schema(piece: Piece, source: Source, passed: LineErrors | None = None) -> pa.Schema | None:
    """The record columns and their types, from the good rows of a piece; None if it has none.

    Bad lines are passed over here (noted in ``passed``, a skipping :class:`LineErrors` for ``[source.name]``):
    they are reported (or skipped) when the piece is read for its rows.

    Raises:
        IngestError: a column is named ``shard`` or ``index`` (every example read back carries those), or
            twice, or the rows have no fields.
    """
    passed = LineErrors([source.name], skip=True) if passed is None else passed
    piece = dataclasses.replace(piece, source=0)
    if source.format == "parquet":
        schema, rows = piece.data.schema.remove_metadata(), piece.data.num_rows
    elif source.format == "jsonl":
        values, lines = _json_lines(piece, passed)
        for value, n in zip(values, lines, strict=True):
            if not isinstance(value, dict):
                passed(0, n, f"is {_json_type(value)}, not a JSON object")
        rows = [v for v in values if isinstance(v, dict)]
        names = list(dict.fromkeys(k for r in rows for k in r))
        schema = pa.schema([(k, _column_type([r.get(k) for r in rows])) for k in names])
    else:
        header, rows, _ = _csv_records(piece, source, passed, None)
        schema = pa.schema([(k, _csv_type([r[i] for r in rows])) for i, k in enumerate(header)])
    if not rows:
        return None
    if not schema.names:
        raise IngestError(f"{source.name}: the first rows have no fields: records need at least one column")
    if reserved := [c for c in RESERVED_COLUMNS if c in schema.names]:
        raise IngestError(
            f"{source.name}: column {reserved[0]!r} is reserved (every example read back carries its 'shard' and "
            "'index'): rename the column in the input"
        )
    if len(set(schema.names)) < len(schema.names):
        raise IngestError(f"{source.name}: a column name appears twice: column names must be unique")
    return schema


def _fits(value: Any, target: pa.DataType, from_text: bool) -> bool:
    """Whether one value converts to ``target`` without change (a CSV value: ``from_text``)."""
    try:
        if from_text:
            pc.cast(pa.array([value or None], pa.string()), target)
            return True
        return _convert([value], target) is not None
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return False


def _convert(values: list[Any], target: pa.DataType) -> pa.Array | None:
    """JSON values as an array of ``target``; None when one does not fit (a float, a string in an int column)."""
    arr = pa.array(values)
    t = arr.type
    if t == target:
        return arr
    numeric = pa.types.is_integer(t) and pa.types.is_floating(target)
    nested = pa.types.is_nested(t) and pa.types.is_nested(target)
    if not (pa.types.is_null(t) or numeric or nested):
        return None
    return arr.cast(target)  # a safe cast: an integer beyond 2**53 or a changed nested value raises


def _columns(rows: list, names: list[str], schema: pa.Schema, from_text: bool) -> list[pa.Array] | None:
    out = []
    for k, t in zip(schema.names, schema.types, strict=True):
        if from_text:
            i = names.index(k)
            arr = pa.array([r[i] or None for r in rows], pa.string())
            out.append(arr if t == pa.string() else pc.cast(arr, t))
        else:
            out.append(_convert([r.get(k) for r in rows], t))
        if out[-1] is None:
            return None
    return out


def records_table(piece: Piece, source: Source, schema: pa.Schema, bad: LineErrors) -> pa.Table:
    """A piece's rows as a table of ``schema``; rows that do not fit it are bad lines.

    Raises:
        IngestError: a bad line (without ``skip``), or a Parquet file whose columns differ from ``schema``.
    """
    if source.format == "parquet":
        table = piece.data
        if sorted(table.column_names) != sorted(schema.names):
            raise IngestError(
                f"{source.name}: columns {brief(table.column_names)} differ from the first rows' "
                f"{brief(schema.names)}: give every file the same columns"
            )
        try:
            return table.select(schema.names).cast(schema)
        except (pa.ArrowException, TypeError, ValueError) as err:
            raise IngestError(f"{source.name}: column types differ from the first rows' ({brief(str(err))})") from None
    found = _InLineOrder()  # the first bad line is the one reported, whichever check finds it
    table = _rows_table(piece, source, schema, found)
    found.replay(bad)
    return table


def _rows_table(piece: Piece, source: Source, schema: pa.Schema, bad: _InLineOrder) -> pa.Table:
    """:func:`records_table` of a JSON-lines or CSV piece; bad lines go to ``bad`` in any order."""
    from_text = source.format == "csv"
    if from_text:
        names, rows, lines = _csv_records(piece, source, bad, schema.names)
    else:
        names, (rows, lines) = schema.names, _json_lines(piece, bad)
        rows, lines = _objects(rows, lines, piece.source, set(names), bad)
    try:
        columns = _columns(rows, names, schema, from_text)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        columns = None
    if columns is None:  # the slow path, only when a row does not fit: find it, line by line
        keep = []
        for row, n in zip(rows, lines, strict=True):
            values = [row[names.index(k)] if from_text else row.get(k) for k in schema.names]
            misfit = next((i for i, v in enumerate(values) if not _fits(v, schema.types[i], from_text)), None)
            if misfit is None:
                keep.append(row)
                continue
            k, v, t = schema.names[misfit], values[misfit], schema.types[misfit]
            bad(piece.source, n, f"field {brief(k)} = {brief(v)} does not fit the type of the first rows ({t})")
        columns = _columns(keep, names, schema, from_text)
    return pa.Table.from_arrays(columns, schema=schema)


def _objects(values: list, lines: list, source: int, names: set[str], bad: LineErrors) -> tuple[list, list]:
    """The JSON objects whose fields are all columns of the first rows; anything else is a bad line."""
    rows, kept = [], []
    for value, n in zip(values, lines, strict=True):
        if not isinstance(value, dict):
            bad(source, n, f"is {_json_type(value)}, not a JSON object")
        elif not value.keys() <= names:
            extra = next(k for k in value if k not in names)
            bad(source, n, f"field {brief(extra)} is not in the first rows: put a row with it first, or drop it")
        else:
            rows.append(value)
            kept.append(n)
    return rows, kept
