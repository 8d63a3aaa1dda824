"""``steadytrain data ingest``: text, JSON lines, CSV and Parquet files to a sharded dataset, crash-safely.

The input is read as a stream in chunks of about 1 MiB (:mod:`~steadytrain.data.sources`); each chunk
is tokenized (``--kind text``, :mod:`~steadytrain.data.tokenize`) or parsed into typed rows (``--kind
records``, :mod:`~steadytrain.data.records`), in this process or, with ``workers > 1``, in a pool of
forked processes with at most ``2 * workers`` chunks in flight, taken back in input order; the chunks
are fixed by the input alone, so the shards are byte-identical for any number of workers, and the
first bad line in input order is the one reported. Outputs are cut into shards
(:mod:`~steadytrain.data.pack`) written by a :class:`~steadytrain.data.DatasetWriter` into a hidden
directory next to ``out`` (``.NAME.ingest-PID-RANDOM``), renamed to ``out`` only when complete: a failed
ingest removes it; a killed one leaves it, and never anything under ``out``. Of two ingests to one
directory at once, one wins the rename and the other fails, keeping nothing.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from steadytrain._check import MAX_SEQ_LEN, check_int
from steadytrain._io import _fsync_dir, brief, ensure_dir
from steadytrain._text import one_line
from steadytrain._version import __version__
from steadytrain.data.format import open_dataset
from steadytrain.data.infer import infer_schema
from steadytrain.data.pack import AsideWriter, Output, ShardPacker
from steadytrain.data.records import LineErrors, documents, first_schema, records_table
from steadytrain.data.sources import Chunk, IngestError, Source, files_summary, find_sources, iter_chunks
from steadytrain.data.tokenize import BYTES, ByteTokenizer, FileTokenizer, load_tokenizer

__all__ = ["DEFAULT_SHARD_ROWS", "IngestError", "IngestResult", "ingest"]

log = logging.getLogger(__name__)

KINDS = ("text", "records")
DEFAULT_SHARD_ROWS = {"text": 8192, "records": 65_536}  # text: 8192 windows of 129 tokens, 1M tokens a shard
SCHEMA_FILE = "schema.yaml"


@dataclass(frozen=True)
class IngestResult:
    """What an ingest wrote."""

    path: Path
    kind: str
    shards: int
    rows: int
    """Windows (text) or records."""
    tokens: int
    """Tokens of the documents, end-of-document tokens included, padding not (0 for records)."""
    pad_tokens: int
    skipped_lines: int
    input_bytes: int
    seconds: float
    files: str = ""
    """Files read, by kind, and binary ones skipped: ``read 39 files (36 text, 2 jsonl, 1 csv); skipped 2 binary``."""
    binary_files: tuple[str, ...] = ()
    """Binary (not UTF-8 text) files skipped inside the input directories."""

    @property
    def mb_per_s(self) -> float:
        """Input megabytes (on disk) per second."""
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)


@dataclass
class _Job:
    """What a worker needs to turn a chunk into an :class:`Output`."""

    kind: str
    sources: list[Source]
    field: str | None
    skip_bad: bool
    tokenizer: ByteTokenizer | FileTokenizer | None = None
    schema: pa.Schema | None = None
    binary: tuple[str, ...] = ()  # binary files skipped inside the input directories

    def run(self, chunk: Chunk) -> Output:
        bad = LineErrors([s.name for s in self.sources], self.skip_bad)
        if self.kind == "text":
            docs: list[Any] = []
            ends: list[bool] = []
            owners: list[int] = []
            for p in chunk.pieces:
                d, e = documents(p, self.sources[p.source], self.field, self.tokenizer.needs_text, bad)
                docs += d
                ends += e
                owners += [p.source] * len(d)
            tokens, counts = self.tokenizer.encode_counts(docs, ends)
            return Output(tokens, list(zip(owners, counts, strict=True)), bad.skipped, bad.notes)
        tables = [records_table(p, self.sources[p.source], self.schema, bad) for p in chunk.pieces]
        counts = [(p.source, t.num_rows) for p, t in zip(chunk.pieces, tables, strict=True)]
        return Output(pa.concat_tables(tables) if tables else None, counts, bad.skipped, bad.notes)


_WORKER_JOB: _Job | None = None


def _init_worker(job: _Job) -> None:
    """In each worker, once: the tokenizer loaded afresh; Ctrl-C is for the parent, which stops the pool."""
    global _WORKER_JOB
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if job.tokenizer is not None:
        job.tokenizer = job.tokenizer.worker_copy()
    _WORKER_JOB = job


def _run_in_worker(chunk: Chunk) -> Output:
    assert _WORKER_JOB is not None
    return _WORKER_JOB.run(chunk)


def _outputs(job: _Job, chunks: Iterator[Chunk], workers: int) -> Iterator[tuple[Chunk, Output]]:
    """Every chunk with its output, in input order; a read error is raised in its place in that order."""
    if workers == 1:
        for chunk in chunks:
            yield chunk, job.run(chunk)
        return
    pool = ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("fork"), initializer=_init_worker, initargs=(job,)
    )
    pending: deque[tuple[Chunk | None, Future | IngestError]] = deque()
    try:
        while True:
            try:
                chunk = next(chunks, None)
            except IngestError as err:  # the reader failed here: earlier chunks' errors come first
                pending.append((None, err))
                chunk = None
            if chunk is not None:
                pending.append((chunk, pool.submit(_run_in_worker, chunk)))
            while pending and (chunk is None or len(pending) >= 2 * workers):
                done, result = pending.popleft()
                if isinstance(result, IngestError):
                    raise result
                yield done, result.result()
            if chunk is None:
                return
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _resolve_kind(sources: list[Source], kind: str | None, field: str | None) -> str:
    """``--kind``, or its default: text for text files or with ``--field``, else records; combinations checked."""
    if kind is not None and kind not in KINDS:
        raise IngestError(f"--kind {brief(kind)}: use text or records")
    kind = kind or ("text" if field is not None or any(s.format == "txt" for s in sources) else "records")
    for s in sources:
        if kind == "text" and s.format != "txt" and field is None:
            raise IngestError(
                f"{s.name}: text from .{s.format} needs --field NAME (the string field or column holding each "
                "document), or --kind records to keep the rows as they are"
            )
        if kind == "records" and s.format == "txt":
            raise IngestError(f"{s.name}: is text, not records: ingest it with --kind text (the default for text)")
    if kind == "records" and field is not None:
        raise IngestError("--field names the text field of --kind text: leave it out with --kind records")
    return kind


def _check_out(out: str | os.PathLike[str]) -> Path:
    """``out`` as an absolute path that is absent or an empty directory; its parent created."""
    path = Path(os.path.abspath(out))
    if path.parent == path:
        raise IngestError(f"--out {brief(os.fspath(out))}: name a new directory for the dataset")
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise IngestError(f"--out {path}: exists and is not a directory: name a new directory")
        if any(path.iterdir()):
            raise IngestError(f"--out {path}: exists and is not empty: name a new directory, or remove this one")
    ensure_dir(path.parent, "--out parent directory", error=IngestError)
    asides = [p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.ingest-")]
    if leftovers := sorted(name for name in asides if not _alive(name)):
        log.warning("%s: leftovers of interrupted ingests (remove them): %s", path.parent, ", ".join(leftovers))
    return path


def _alive(aside: str) -> bool:
    """Whether the ingest that made directory ``aside`` (``.NAME.ingest-PID-RANDOM``) still runs on this machine."""
    try:
        os.kill(int(aside.rsplit("-", 2)[-2]), 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _aside(out: Path) -> Path:
    """A new hidden directory next to ``out`` (same file system: the final rename is atomic)."""
    aside = out.with_name(f".{out.name}.ingest-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        aside.mkdir()  # the usual mode (0o777 less the umask): it becomes the dataset directory
    except OSError as err:
        raise IngestError(f"--out {out}: cannot create {aside.name} next to it ({err.strerror or err})") from None
    return aside


def _publish(aside: Path, out: Path) -> None:
    """Rename the complete dataset to ``out``: fails (keeping nothing) if ``out`` was filled meanwhile."""
    try:
        os.rename(aside, out)  # replaces an absent or empty directory, never a full one
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise IngestError(
                f"--out {out}: was filled by someone else while this ingest ran (another ingest to the same "
                "directory?): nothing of this ingest was kept"
            ) from None
        raise IngestError(f"--out {out}: cannot rename the finished dataset into place ({err.strerror})") from None
    _fsync_dir(out.parent)


def _first_schema(sources: list[Source]) -> pa.Schema:
    """The record schema, from the first piece with good rows (read by a reader of its own).

    Raises:
        IngestError: no good rows at all: naming the first bad line if there was one.
    """
    first_bad = ""
    for chunk in iter_chunks(sources):
        for p in chunk.pieces:
            passed = LineErrors([sources[p.source].name], skip=True)
            schema = first_schema(p, sources[p.source], passed)
            if schema is not None:
                return schema
            first_bad = first_bad or next(iter(passed.notes), "")
    bad = f": no line is a record, the first: {first_bad}: fix the input" if first_bad else ": nothing to write"
    raise IngestError(f"no records in the input ({len(sources)} file(s)){bad}")


def _provenance(kind: str, tokenizer: Any, seq_len: int, pipeline_version: str) -> dict[str, Any]:
    common = {"pipeline_version": pipeline_version, "steadytrain_version": __version__}
    if kind == "records":
        return {"kind": kind, **common}
    tok = tokenizer.provenance()
    return {"kind": kind, "tokenizer": tok, "seq_len": seq_len, "dtype": str(tokenizer.dtype), **common}


def _write(
    aside: Path,
    job: _Job,
    *,
    seq_len: int,
    shard_rows: int,
    workers: int,
    provenance: dict[str, Any],
    progress: Callable[[int, int], None] | None,
) -> ShardPacker:
    """Read, process and pack every chunk into shards under ``aside``."""
    sources = job.sources
    total = sum(s.size for s in sources)
    columns = [job.field] if job.kind == "text" and job.field is not None else None
    if job.kind == "records":
        job.schema = _first_schema(sources)
    chunks = iter_chunks(sources, parquet_columns=columns)
    width = seq_len + 1 if job.kind == "text" else None
    eod = job.tokenizer.eod if job.tokenizer is not None else 0
    writer = AsideWriter(aside, provenance=provenance)
    packer = ShardPacker(writer, sources, shard_rows=shard_rows, width=width, eod=eod, skip_bad=job.skip_bad)
    shown = 0
    for chunk, out in _outputs(job, chunks, workers):
        packer.add(out)
        for note in out.notes[: max(0, 5 - shown)]:
            log.warning("skipped %s", note)
            shown += 1
        if progress is not None:
            progress(chunk.done_bytes, total)
    packer.close()
    if packer.shards == 0:
        skipped = f": all {packer.skipped} line(s) were bad (--skip-bad): check --field" if packer.skipped else ""
        raise IngestError(f"no {'documents' if width else 'records'} in the input ({len(sources)} file(s)){skipped}")
    writer.finish()
    if progress is not None:
        progress(total, total)
    return packer


def _prepare(
    sources: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    kind: str | None,
    tokenizer: str | os.PathLike[str],
    seq_len: int,
    field: str | None,
    shard_rows: int | None,
    workers: int,
    skip_bad: bool,
) -> tuple[_Job, Path, int]:
    """Everything checked before anything is written: the arguments, the inputs, the tokenizer, ``out``."""
    check_int("seq_len", seq_len, 1, maximum=MAX_SEQ_LEN)  # the bound of the training config's data.seq_len
    check_int("workers", workers, 1, maximum=1024)
    binary: list[str] = []
    found = find_sources(sources, binary=binary)
    kind = _resolve_kind(found, kind, field)
    shard_rows = check_int("shard_rows", DEFAULT_SHARD_ROWS[kind] if shard_rows is None else shard_rows, 1)
    if kind == "records" and (os.fspath(tokenizer) != BYTES or seq_len != 128):
        raise IngestError("--tokenizer and --seq-len are for --kind text: leave them out with --kind records")
    tok = load_tokenizer(tokenizer) if kind == "text" else None
    path = _check_out(out)
    log.info("ingesting %d file(s), %.1f MB, as %s into %s", len(found), sum(s.size for s in found) / 1e6, kind, path)
    return _Job(kind, found, field, skip_bad, tok, binary=tuple(sorted(binary))), path, shard_rows


def ingest(
    sources: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    kind: str | None = None,
    tokenizer: str | os.PathLike[str] = BYTES,
    seq_len: int = 128,
    field: str | None = None,
    shard_rows: int | None = None,
    workers: int = 1,
    pipeline_version: str = "1",
    skip_bad: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> IngestResult:
    """Turn files of text, JSON lines, CSV or Parquet into a sharded dataset at ``out``.

    Args:
        sources: files, or directories walked recursively (see :func:`~steadytrain.data.sources.find_sources`).
        out: the dataset directory: absent or empty; written aside and renamed into place when complete.
        kind: ``text`` (documents -> windows of ``seq_len + 1`` tokens in a ``tokens`` column) or ``records``
            (rows as they are, plus ``schema.yaml``). Default: text for .txt files or with ``field``, else records.
        tokenizer: ``"bytes"`` or the path of a Hugging Face ``tokenizers`` JSON file (text only; kept in the
            dataset as ``tokenizer.json``, for a model trained on it).
        seq_len: tokens a model sees per window (each window holds ``seq_len + 1``: inputs and next-token targets).
        field: the string field (JSON lines) or column (CSV, Parquet) holding each document (text only).
        shard_rows: windows or records per shard (default 8192 windows, 65536 records).
        workers: processes that tokenize or parse; the shards are byte-identical for any number.
        pipeline_version: recorded in provenance: bump it when the way the input is made changes.
        skip_bad: skip bad lines (counted as ``skipped_lines`` in provenance) instead of stopping at the first.
        progress: called as ``progress(bytes_done, bytes_total)`` (bytes on disk) after every chunk.

    Returns:
        What was written (shards, rows, tokens, bytes, seconds).

    Raises:
        IngestError: bad input, named by ``file:line`` with the fix; nothing is left under ``out``.

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "a.txt"), "w").write("hello world")
        >>> r = ingest([d], os.path.join(d, "ds"), seq_len=4); (r.shards, r.rows, r.tokens, r.pad_tokens)
        (1, 3, 12, 3)
    """
    t0 = time.perf_counter()
    job, path, shard_rows = _prepare(sources, out, kind, tokenizer, seq_len, field, shard_rows, workers, skip_bad)
    if not isinstance(pipeline_version, str) or not pipeline_version:
        raise IngestError(f"pipeline_version={brief(pipeline_version)} must be a non-empty string")
    prov = _provenance(job.kind, job.tokenizer, seq_len, pipeline_version)
    aside = _aside(path)
    try:
        packer = _write(
            aside, job, seq_len=seq_len, shard_rows=shard_rows, workers=workers, provenance=prov, progress=progress
        )
        if job.kind == "records":
            infer_schema(open_dataset(aside)).save(aside / SCHEMA_FILE)
        if job.tokenizer is not None:
            job.tokenizer.save(aside)  # a tokenizers file is kept: a model trained on this data exports it
        _publish(aside, path)
    except BaseException:
        shutil.rmtree(aside, ignore_errors=True)
        raise
    if packer.skipped:
        log.warning("skipped %d bad line(s) (--skip-bad): see skipped_lines in the shards' provenance", packer.skipped)
    if binary := job.binary:
        shown = ", ".join(one_line(b) for b in binary[:5]) + (", ..." if len(binary) > 5 else "")
        log.warning("skipped %d binary (not UTF-8 text) file(s): %s", len(binary), shown)
    pad = packer.rows * packer.width - packer.tokens if job.kind == "text" else 0
    return IngestResult(
        path=path,
        kind=job.kind,
        shards=packer.shards,
        rows=packer.rows,
        tokens=packer.tokens,
        pad_tokens=pad,
        skipped_lines=packer.skipped,
        input_bytes=sum(s.size for s in job.sources),
        seconds=time.perf_counter() - t0,
        files=files_summary(job.sources, binary),
        binary_files=binary,
    )
