"""The inputs of ``steadytrain data ingest``: files found in a fixed order, read in pieces with line numbers.

``SRC`` arguments are files or directories (walked recursively, hidden names and steadytrain
datasets inside them skipped, files sorted by their path inside the directory) of ``.txt``,
``.jsonl``, ``.csv`` and ``.parquet``; the first three may be ``.gz`` or ``.zst`` compressed
(pyarrow decompresses them). A file of any other name is text if it is UTF-8 throughout without a
NUL byte (``.md``, ``.py``, ``README``; decompressed first if ``.gz`` or ``.zst``); any other file is
binary: inside a directory skipped and counted, named on its own an error. A text, JSON-lines or CSV
file is read as a stream in pieces of about :data:`PIECE_BYTES`, each cut after a newline (in a CSV
file, after a newline outside quotes), so memory stays bounded whatever the size of the file; each
piece knows the number of its first line, so an error names ``file:line``. A Parquet file is read in
record batches. Pieces are grouped into :class:`Chunk` s of about :data:`CHUNK_BYTES`: the unit of
work ingest hands to a worker, fixed by the input alone and never by the number of workers.
"""

from __future__ import annotations

import codecs
import logging
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from steadytrain._io import brief
from steadytrain.data.format import _sha256
from steadytrain.data.index import INDEX
from steadytrain.errors import UserError

log = logging.getLogger(__name__)

__all__ = [
    "CHUNK_BYTES",
    "FORMATS",
    "PIECE_BYTES",
    "Chunk",
    "IngestError",
    "Piece",
    "Source",
    "describe",
    "files_summary",
    "find_sources",
    "iter_chunks",
    "no_such_column",
]

PIECE_BYTES = 1 << 20  # a piece of a text file: cut after the last newline in about this many bytes
CHUNK_BYTES = 1 << 20  # pieces (of one file or of many small ones) handed to a worker at once
PARQUET_BATCH_ROWS = 65_536
FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".csv": "csv", ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")  # never the start of UTF-8: 0xFF and 0xFE are not UTF-8
NEWLINE = b"\n"
_KNOWN = ".txt, .jsonl, .csv, .parquet (the first three also .gz or .zst)"
KIND_NAMES = {"txt": "text", "jsonl": "jsonl", "csv": "csv", "parquet": "parquet"}  # as counted in summaries


class IngestError(UserError):
    """Input that cannot be ingested: the message names the file (and line) and the fix."""


@dataclass(frozen=True)
class Source:
    """One input file."""

    path: Path
    """The file to open."""
    name: str
    """As given on the command line, joined with the path inside a given directory: shown and recorded."""
    format: str
    """``txt``, ``jsonl``, ``csv`` or ``parquet``."""
    compression: str | None
    """``gzip``, ``zstd`` or None."""
    size: int
    """Bytes on disk."""


@dataclass
class Piece:
    """Whole lines of one file (a Parquet record batch as a table), with the number of the first one."""

    source: int
    """Index of the file in the list of sources."""
    data: bytes | pa.Table
    first_line: int
    """1-based line (Parquet: row) number of the first line in its file."""
    last: bool
    """The end of its file: in a text file, where the document ends."""
    header: bytes = b""
    """A CSV file's header record, passed on to every piece after the first."""


@dataclass
class Chunk:
    """Pieces in input order, about :data:`CHUNK_BYTES` of input: one unit of work."""

    pieces: list[Piece] = field(default_factory=list)
    done_bytes: int = 0
    """Bytes on disk of all sources read up to the end of this chunk (for progress)."""
    nbytes: int = 0
    """Bytes of data in the pieces."""

    def add(self, piece: Piece, done_bytes: int) -> None:
        self.pieces.append(piece)
        self.nbytes += len(piece.data) if isinstance(piece.data, bytes) else piece.data.nbytes
        self.done_bytes = done_bytes


def _format_of(name: str) -> tuple[str, str | None] | None:
    stem, ext = os.path.splitext(name.lower())
    compression = COMPRESSIONS.get(ext)
    if compression is not None:
        stem, ext = os.path.splitext(stem)
    fmt = FORMATS.get(ext)
    if fmt is None or (fmt == "parquet" and compression is not None):
        return None
    return fmt, compression


def _is_utf8_text(path: Path, name: str, compression: str | None) -> bool:
    """Whether a file (decompressed) is UTF-8 throughout without a NUL byte; read up to the first byte that is not."""
    decode = codecs.getincrementaldecoder("utf-8")().decode
    try:
        raw = pa.OSFile(str(path), "r")
    except OSError as err:
        raise IngestError(f"{brief(name)}: cannot be read ({brief(str(err))})") from None
    stream = pa.CompressedInputStream(raw, compression) if compression else raw
    try:
        while block := stream.read(PIECE_BYTES):
            if b"\0" in block:
                return False
            decode(block)
        decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    except (OSError, pa.ArrowException) as err:
        if compression:  # not data of that compression (or corrupt): not text ingest can read
            return False
        raise IngestError(f"{brief(name)}: cannot be read ({brief(str(err))})") from None
    finally:
        stream.close()
    return True


def _classify(path: Path, name: str) -> tuple[str, str | None] | None:
    """``(format, compression)`` by the extension, else ``("txt", ...)`` for UTF-8 text; None for a binary file."""
    if (kind := _format_of(name)) is not None:
        return kind
    compression = COMPRESSIONS.get(os.path.splitext(name.lower())[1])
    return ("txt", compression) if _is_utf8_text(path, name, compression) else None


def _walk(root: Path, given: str, binary: list[str]) -> list[Source]:
    """The usable files under ``root``, sorted by their path inside it; hidden names and datasets skipped,
    binary files' names appended to ``binary``."""
    if (root / INDEX).is_file():
        raise IngestError(
            f"{brief(given)}: is a steadytrain dataset already ({INDEX}): train on it with data.path={given}"
        )
    found = []
    for here, dirs, files in os.walk(root, onerror=_raise_walk_error):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not _is_dataset(Path(here, d))]
        for f in files:
            full = Path(here, f)
            if f.startswith(".") or not full.is_file():  # never opened: a FIFO would block
                continue
            name = os.path.join(given, full.relative_to(root).as_posix())
            if (kind := _classify(full, name)) is None:
                binary.append(name)
                continue
            found.append(Source(full, name, *kind, full.stat().st_size))
    return sorted(found, key=lambda s: s.path.relative_to(root).as_posix())


def _is_dataset(path: Path) -> bool:
    """Whether ``path`` is a steadytrain dataset (say, an earlier ingest's --out inside this SRC): skipped."""
    if not (path / INDEX).is_file():
        return False
    log.warning("%s: skipped, a steadytrain dataset (%s) inside the input directory", brief(str(path)), INDEX)
    return True


def _raise_walk_error(err: OSError) -> None:
    raise IngestError(f"{err.filename}: cannot be listed ({err.strerror or err})")


def find_sources(paths: Sequence[str | os.PathLike[str]], *, binary: list[str] | None = None) -> list[Source]:
    """The input files named by ``paths`` (files, or directories walked recursively), in a fixed order.

    Binary files inside directories are skipped; their names are appended to ``binary`` if given.

    Raises:
        IngestError: no path given, a missing path, a binary file named on its own, a directory without
            usable files, something that is not a regular file, or one file named twice.

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "b.txt"), "w").write("hi")
        >>> [s.format for s in find_sources([d])]
        ['txt']
    """
    if not paths:
        raise IngestError(f"no input: name files or directories of {_KNOWN}")
    out: list[Source] = []
    binary = [] if binary is None else binary
    for given in map(os.fspath, paths):
        path = Path(given)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise IngestError(f"{brief(given)}: no such file or directory") from None
        except OSError as err:
            raise IngestError(f"{brief(given)}: cannot be read ({err.strerror or err})") from None
        if stat.S_ISDIR(mode):
            before = len(binary)
            found = _walk(path, given, binary)
            if not found:
                skipped = f" ({len(binary) - before} binary file(s) skipped)" if len(binary) > before else ""
                raise IngestError(f"{brief(given)}: no {_KNOWN} files nor other UTF-8 text in this directory{skipped}")
            out += found
        elif not stat.S_ISREG(mode):
            raise IngestError(f"{brief(given)}: not a regular file: name files or directories")
        elif (kind := _classify(path, given)) is None:
            raise IngestError(f"{brief(given)}: not a file ingest reads: binary (not UTF-8 text); use text or {_KNOWN}")
        else:
            out.append(Source(path, given, *kind, path.stat().st_size))
    seen: dict[str, str] = {}
    for s in out:
        real = os.path.realpath(s.path)
        if real in seen:
            raise IngestError(f"{brief(s.name)}: named twice (also as {brief(seen[real])}): name each file once")
        seen[real] = s.name
    return out


def files_summary(sources: Sequence[Source], binary: Sequence[str]) -> str:
    """How many files were read, by kind, and how many binary ones skipped.

    Example:
        >>> files_summary([Source(Path("a.md"), "a.md", "txt", None, 1)] * 2, ["b.png"])
        'read 2 files (2 text); skipped 1 binary'
    """
    counts = {kind: 0 for kind in KIND_NAMES.values()}
    for s in sources:
        counts[KIND_NAMES[s.format]] += 1
    kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
    read = f"read {len(sources)} file{'s' if len(sources) != 1 else ''} ({kinds})"
    return read + (f"; skipped {len(binary)} binary" if binary else "")


def no_such_column(field: str, name: str, columns: Sequence[str]) -> IngestError:
    """The error for ``--field`` naming a column that file ``name`` does not have, listing those it has."""
    shown = ", ".join(brief(c) for c in columns[:20]) + (f", ... ({len(columns)} in all)" if len(columns) > 20 else "")
    return IngestError(
        f"--field {brief(field)}: {name} has no column {brief(field)} (columns: {shown or 'none'}): name one of them"
    )


def describe(source: Source) -> dict[str, Any]:
    """``{path, size, sha256}`` of a source as recorded in shard provenance (reads the whole file)."""
    try:
        digest = _sha256(source.path)
    except OSError as err:
        raise IngestError(f"{brief(source.name)}: cannot be read ({err.strerror or err})") from None
    return {"path": source.name, "size": source.size, "sha256": digest}


def _cut(data: bytes, fmt: str) -> int:
    """Where a piece of ``data`` ends: after its last newline (CSV: one outside quotes); 0 if there is none."""
    pos = data.rfind(b"\n")
    if fmt != "csv" or pos < 0:
        return pos + 1
    quotes = data.count(b'"', 0, pos)  # RFC 4180: a newline ends a record iff an even number of quotes precede it
    while pos >= 0 and quotes % 2:
        prev = data.rfind(b"\n", 0, pos)
        quotes -= data.count(b'"', max(prev, 0), pos)
        pos = prev
    return pos + 1


def _header_end(data: bytes) -> int:
    """Where a CSV file's first record (the header) ends: after its first newline outside quotes."""
    pos = data.find(b"\n")
    while pos >= 0 and data.count(b'"', 0, pos) % 2:
        pos = data.find(b"\n", pos + 1)
    return pos + 1 if pos >= 0 else len(data)


def _utf8_cut(data: bytes, at: int) -> int:
    """``at`` moved back to the start of a UTF-8 character (a piece of text never splits one)."""
    for back in range(min(4, at)):
        if data[at - back] & 0xC0 != 0x80:
            return at - back
    return at


def _read(stream: pa.NativeFile, source: Source, line: int) -> bytes:
    """The next block of a file; corrupt compressed data is an :class:`IngestError` naming about where."""
    try:
        return stream.read(PIECE_BYTES)
    except (OSError, pa.ArrowException) as err:
        what = f"corrupt or truncated {source.compression} data" if source.compression else "read error"
        raise IngestError(
            f"{source.name}:{line}: {what} ({brief(str(err))}): check the file (`gzip -t`, `zstd -t`) or leave it out"
        ) from None


def _text_pieces(index: int, source: Source) -> Iterator[tuple[Piece, int]]:
    """Pieces of a text, JSON-lines or CSV file with the bytes read from disk so far.

    One block is read ahead, so a file that fits in a piece is one piece, whole (a tokenizer sees the text
    it would see in one call), and only a larger file is cut.
    """
    raw = pa.OSFile(str(source.path), "r")
    stream = pa.CompressedInputStream(raw, source.compression) if source.compression else raw
    line, carry, header = 1, b"", b""
    try:
        block = _read(stream, source, line)
        if block.startswith(_UTF16_BOMS):
            raise IngestError(
                f"{brief(source.name)}: is UTF-16 (or UTF-32) text, not UTF-8: convert it "
                f"(`iconv -f UTF-16 -t UTF-8 FILE > FILE.utf8`) or leave it out"
            )
        if block.startswith(_BOM):  # an encoding mark, not text: never a token nor part of a column name
            block = block[len(_BOM) :]
        while True:
            ahead = _read(stream, source, line + carry.count(NEWLINE) + block.count(NEWLINE)) if block else b""
            data = carry + block if carry else block
            if not ahead:  # the end of the file: the rest is its last piece
                yield Piece(index, data, line, last=True, header=header), raw.tell()
                return
            cut = _cut(data, source.format)
            if cut == 0 and source.format == "txt" and len(data) >= PIECE_BYTES:  # no newline: cut anyway
                cut = _utf8_cut(data, len(data) - 1)
            block = ahead
            if cut == 0:  # a line longer than a piece: read on (a JSON or CSV record is parsed whole)
                carry = data
                continue
            piece, carry = data[:cut], data[cut:]
            yield Piece(index, piece, line, last=False, header=header), raw.tell()
            if line == 1 and source.format == "csv":
                header = piece[: _header_end(piece)]
            line += piece.count(NEWLINE)
    finally:
        stream.close()


def _parquet_pieces(index: int, source: Source, columns: list[str] | None) -> Iterator[tuple[Piece, int]]:
    """Record batches of a Parquet file as tables, with an estimate of the bytes read from disk so far."""
    try:
        pf = pq.ParquetFile(str(source.path))
        names = pf.schema_arrow.names
        if missing := [c for c in columns or [] if c not in names]:
            raise no_such_column(missing[0], source.name, names)
        total = max(pf.metadata.num_rows, 1)
        row = 1
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            piece = Piece(index, pa.Table.from_batches([batch]), row, last=False)
            row += batch.num_rows
            yield piece, source.size * (row - 1) // total
    except (OSError, pa.ArrowException) as err:
        raise IngestError(f"{source.name}: not readable Parquet ({brief(str(err))}): check the file") from None


def iter_chunks(sources: Sequence[Source], *, parquet_columns: list[str] | None = None) -> Iterator[Chunk]:
    """Every source's pieces in order, grouped into chunks of about :data:`CHUNK_BYTES`.

    A Parquet record batch is a chunk of its own. ``parquet_columns`` reads only those columns.

    Raises:
        IngestError: a file cannot be read (corrupt compressed data, unreadable Parquet); raised when the
            reader gets there, after every chunk before it was yielded.
    """
    chunk, before = Chunk(), 0
    for index, source in enumerate(sources):
        if source.format == "parquet":
            pieces = _parquet_pieces(index, source, parquet_columns)
        else:
            pieces = _text_pieces(index, source)
        for piece, done in pieces:
            table = isinstance(piece.data, pa.Table)
            if table and chunk.pieces:
                yield chunk
                chunk = Chunk()
            chunk.add(piece, before + done)
            if chunk.nbytes >= CHUNK_BYTES or table:
                yield chunk
                chunk = Chunk()
        before += source.size
    if chunk.pieces:
        yield chunk
