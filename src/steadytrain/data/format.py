"""The sharded dataset format: Parquet shards plus an ``index.json`` that knows how each was made.

A dataset is a directory of ``shard-00047.parquet`` files and ``index.json`` listing, per shard, the
file, record count, sha256, byte size and provenance (``pipeline_version``, ``schema_version``,
``source``, ``created_at``, free-form extras). Every write is atomic: a shard is serialized and checked
in memory, then created under its final name without ever replacing a file, and the index is
replaced the same way afterwards. A crash between the two leaves the previous index intact and the
new shard detectable as an orphan. Writers hold an inter-process lock (``index.json.lock``) while they
choose an id, create the shard and update the index, and re-read the index under it, so several
writers (processes, ranks, or two writers in one process) never lose or overwrite a shard.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import filelock
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from steadytrain._check import check_int
from steadytrain._io import brief, ensure_dir, utc_now, write_atomic, write_text_atomic
from steadytrain.data.index import (
    FORMAT,
    INDEX,
    LOCK,
    RESERVED_COLUMNS,
    SHARD_FILE,
    VERSION,
    CorruptShardError,
    DatasetError,
    ShardInfo,
    check_json,
    fingerprint,
    load_index,
    parse_index,
    resolve_inside,
    shard_file,
)

__all__ = ["INDEX", "CorruptShardError", "Dataset", "DatasetError", "DatasetWriter", "ShardInfo", "open_dataset"]

LOCK_TIMEOUT_S = 600.0  # a writer holds the lock only to link one shard and rewrite the index


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Dataset:
    """An opened dataset: its shards, their provenance, checksum verification and reads.

    Raises:
        DatasetError: a malformed index (see :func:`~steadytrain.data.index.parse_index`).
    """

    def __init__(self, path: str | Path, index: dict[str, Any]):
        self.path = Path(path)
        self.provenance, self.shards = parse_index(self.path, index, self.path / INDEX)
        self._by_id = {s.id: s for s in self.shards}
        self._verified: set[int] = set()

    @property
    def shard_ids(self) -> list[int]:
        return [s.id for s in self.shards]

    @property
    def num_records(self) -> int:
        return sum(s.records for s in self.shards)

    def shard(self, shard_id: int) -> ShardInfo:
        """The index entry of ``shard_id``; a :class:`DatasetError` naming the known ids if there is none."""
        try:
            return self._by_id[shard_id]
        except (KeyError, TypeError):
            raise DatasetError(f"{self.path}: no shard {brief(shard_id)} (shards: {_ranges(self.shard_ids)})") from None

    def fingerprint(self, shards: list[int] | None = None) -> str:
        """A digest of the given shards' (default: all) ids and checksums: it changes when the data does."""
        return fingerprint([self.shard(s) for s in shards] if shards is not None else self.shards)

    def file_path(self, shard_id: int) -> Path:
        """The real path of the shard's file; a :class:`DatasetError` if it lies outside the dataset directory."""
        info = self.shard(shard_id)
        return resolve_inside(self.path, info.file, f"{self.path / INDEX}: shard {shard_id}")

    @property
    def orphans(self) -> list[str]:
        """Files in the directory the index does not list: an interrupted write (a temporary file, or a
        shard renamed into place whose index update never happened)."""
        listed = {os.path.normpath(s.file) for s in self.shards} | {INDEX, LOCK}
        return sorted(
            p.name
            for p in self.path.iterdir()
            if p.is_file() and p.name not in listed and (SHARD_FILE.fullmatch(p.name) or p.name.startswith("."))
        )

    def verify_shard(self, shard_id: int, *, decode: bool = False) -> None:
        """Raise :class:`CorruptShardError` if the shard's size or sha256 differ from the index; with ``decode``,
        also if it does not read: its Parquet footer and every row group are decoded (one at a time) and the rows
        counted against the index's ``records`` (a checksum recomputed over a damaged file still fails here)."""
        info = self.shard(shard_id)
        path = self.file_path(shard_id)
        if not path.exists():
            raise CorruptShardError(shard_id, f"shard {shard_id}: {self.path / info.file} is missing")
        if not path.is_file():
            raise CorruptShardError(shard_id, f"shard {shard_id}: {self.path / info.file} is not a regular file")
        try:
            size = path.stat().st_size
            digest = _sha256(path) if size == info.bytes else ""
        except OSError as err:
            raise CorruptShardError(
                shard_id, f"shard {shard_id}: {info.file} cannot be read ({err.strerror})"
            ) from None
        if size != info.bytes:
            raise CorruptShardError(
                shard_id, f"shard {shard_id}: {info.file} has {size} bytes, the index says {info.bytes} (truncated?)"
            )
        if digest != info.sha256:
            raise CorruptShardError(
                shard_id, f"shard {shard_id}: {info.file} sha256 {digest[:12]}... != index {info.sha256[:12]}..."
            )
        if decode:
            self._decode(info, path)
        self._verified.add(shard_id)

    def _decode(self, info: ShardInfo, path: Path) -> None:
        """Read every row group of a shard; a :class:`CorruptShardError` if one fails or the rows differ in number."""
        rows = 0
        try:
            pf = pq.ParquetFile(str(path), filesystem=pafs.LocalFileSystem())
            for i in range(pf.num_row_groups):
                rows += pf.read_row_group(i).num_rows
        except (OSError, pa.ArrowException) as err:
            raise self._unreadable(info, path, err) from None
        if rows != info.records or pf.metadata.num_rows != info.records:
            raise CorruptShardError(
                info.id, f"shard {info.id}: {info.file} holds {rows} records, the index says {info.records}"
            )

    def verify(self, shards: list[int] | None = None, *, decode: bool = False) -> None:
        """Check every (or the given) shard's checksum (and with ``decode`` that it reads); raises naming the first
        bad shard."""
        for sid in shards if shards is not None else self.shard_ids:
            self.verify_shard(sid, decode=decode)

    def read_shard(self, shard_id: int, *, verify: bool = True, columns: list[str] | None = None) -> pa.Table:
        """The shard's rows in file order (row i is example index i); verified once per process by default."""
        info = self.shard(shard_id)
        if verify and shard_id not in self._verified:
            self.verify_shard(shard_id)
        path = self.file_path(shard_id)
        try:
            # A local file, never a URI pyarrow would interpret. (Not a Python file object: reading one
            # through Arrow's threads can abort the interpreter at exit.)
            return pq.read_table(str(path), columns=columns, filesystem=pafs.LocalFileSystem())
        except (OSError, pa.ArrowException) as err:
            raise self._unreadable(info, path, err) from None

    def read_schema(self, shard_id: int, *, verify: bool = True) -> pa.Schema:
        """The shard's Arrow schema, from its Parquet footer alone (verified once per process by default)."""
        info = self.shard(shard_id)
        if verify and shard_id not in self._verified:
            self.verify_shard(shard_id)
        path = self.file_path(shard_id)
        try:
            return pq.read_schema(str(path), filesystem=pafs.LocalFileSystem())
        except (OSError, pa.ArrowException) as err:
            raise self._unreadable(info, path, err) from None

    def _unreadable(self, info: ShardInfo, path: Path, err: Exception) -> CorruptShardError:
        if not path.exists():
            return CorruptShardError(info.id, f"shard {info.id}: {self.path / info.file} is missing")
        return CorruptShardError(info.id, f"shard {info.id}: {info.file} is not readable Parquet: {brief(str(err))}")


def _stat_key(path: Path) -> tuple[int, ...] | None:
    """What identifies one version of a file replaced by rename; None if there is none."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "none"
    return f"{min(ids)}..{max(ids)} ({len(ids)})" if len(ids) > 5 else ", ".join(map(str, ids))


def open_dataset(path: str | Path) -> Dataset:
    """Open a dataset directory written by :class:`DatasetWriter`.

    Raises:
        DatasetError: no index, or a malformed one (the message names the file, the entry and the field).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> with DatasetWriter(d, provenance={"pipeline_version": "1.0"}) as w:
        ...     _ = w.write_shard([{"x": 1.0}, {"x": 2.0}])
        >>> ds = open_dataset(d); ds.shard_ids, ds.num_records, ds.shards[0].provenance["pipeline_version"]
        ([0], 2, '1.0')
    """
    path = Path(path)
    return Dataset(path, load_index(path))


class DatasetWriter:
    """Write shards atomically, one at a time, and keep ``index.json`` in step; safe with concurrent writers.

    Args:
        path: the dataset directory (created if missing; an existing dataset is appended to).
        provenance: defaults for every shard's provenance (``pipeline_version``, ``schema_version``,
            ``source`` ...); per-shard values override them; ``created_at`` is filled in. Values must be
            JSON (strings, finite numbers, bools, null, lists, mappings).

    Raises:
        DatasetError: the directory cannot be created, an existing index is malformed, or the provenance
            is not JSON.
    """

    def __init__(self, path: str | Path, *, provenance: dict[str, Any] | None = None):
        self.path = Path(path)
        if provenance is not None and not isinstance(provenance, dict):
            raise DatasetError(f"{self.path}: provenance = {brief(provenance)} must be a mapping")
        self.provenance = dict(provenance or {})
        check_json(self.provenance, f"{self.path}: provenance")
        ensure_dir(self.path, "dataset directory", error=DatasetError)
        if (self.path / INDEX).exists():
            Dataset(self.path, load_index(self.path))  # refuse a malformed index now, not at the first shard
        self._lock = filelock.FileLock(str(self.path / LOCK), timeout=LOCK_TIMEOUT_S)
        self._cache: tuple[tuple[int, ...] | None, dict[str, Any]] | None = None  # (stat of index.json, its content)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        return None  # every shard is already durable: nothing to flush or roll back

    def write_shard(
        self,
        records: list[dict[str, Any]] | pa.Table,
        *,
        shard_id: int | None = None,
        provenance: dict[str, Any] | None = None,
    ) -> ShardInfo:
        """Write one shard, then the index, each in one step, under the dataset's writer lock.

        Everything that can be refused (records, columns, provenance, Parquet serialization) is checked
        before a file is created. Under the lock the index is re-read, the id chosen, the shard created
        (never replacing an existing file) and the index replaced.

        Args:
            records: a list of dicts or a ``pyarrow.Table``; no column may be named ``shard`` or ``index``.
            shard_id: defaults to one more than the largest id in the index (skipping any id whose file exists
                unindexed, left by an interrupted write).
            provenance: this shard's provenance, over the writer's defaults.

        Returns:
            The index entry of the shard.

        Raises:
            DatasetError: the id or its file exists already, the records are empty (no rows or no columns),
                not tabular or use a reserved column, or the provenance is not JSON.
        """
        if shard_id is not None:
            check_int("shard_id", shard_id, 0)
        table = records if isinstance(records, pa.Table) else self._table(records)
        self._check_columns(table)
        if provenance is not None and not isinstance(provenance, dict):
            raise DatasetError(f"{self.path}: provenance = {brief(provenance)} must be a mapping")
        prov = {**self.provenance, "created_at": utc_now(), **(provenance or {})}
        check_json(prov, f"{self.path}: provenance")
        data = self._serialize(table)
        digest = hashlib.sha256(data).hexdigest()
        try:
            with self._lock:
                return self._commit(data, digest, table.num_rows, shard_id, prov)
        except filelock.Timeout:
            raise DatasetError(
                f"{self.path}: another writer has held {LOCK} for {LOCK_TIMEOUT_S:.0f} s: is it stuck?"
            ) from None

    def _commit(
        self, data: pa.Buffer, digest: str, num_rows: int, shard_id: int | None, prov: dict[str, Any]
    ) -> ShardInfo:
        """Under the lock: re-read the index, choose the id, create the shard, replace the index."""
        index = self._current_index()
        ids = {s["id"] for s in index["shards"]}
        explicit = shard_id is not None
        if shard_id is None:
            shard_id = max(ids, default=-1) + 1
        if shard_id in ids:
            raise DatasetError(f"{self.path}: shard {shard_id} exists already: shards are immutable, use a new id")
        while True:
            name = shard_file(shard_id)
            try:
                write_atomic(self.path / name, lambda f: f.write(data), replace=False)
                break
            except FileExistsError:  # not in the index: an interrupted write's shard; never replaced
                if explicit:
                    raise DatasetError(
                        f"{self.path}: {name} exists but is not in the index (left by an interrupted write?): "
                        "remove it or use another shard id"
                    ) from None
                shard_id += 1
        info = ShardInfo(id=shard_id, file=name, records=num_rows, sha256=digest, bytes=data.size, provenance=prov)
        new = {**index, "shards": sorted([*index["shards"], asdict(info)], key=lambda s: s["id"])}
        write_text_atomic(self.path / INDEX, json.dumps(new, indent=1, allow_nan=False) + "\n")
        self._cache = (_stat_key(self.path / INDEX), new)
        return info

    def _current_index(self) -> dict[str, Any]:
        """The index as it is on disk now (under the lock), checked; parsed again only when it changed."""
        key = _stat_key(self.path / INDEX)
        if key is None:
            return {"format": FORMAT, "version": VERSION, "provenance": self.provenance, "shards": []}
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]  # nobody replaced it since this writer wrote or read it
        index = load_index(self.path)
        Dataset(self.path, index)  # checked: a malformed index is never extended
        self._cache = (key, index)
        return index

    def _serialize(self, table: pa.Table) -> pa.Buffer:
        """The Parquet bytes of the shard, in memory: a table that cannot be written fails before any file exists."""
        sink = pa.BufferOutputStream()
        try:
            pq.write_table(table, sink)
        except (pa.ArrowException, TypeError, ValueError) as err:
            raise DatasetError(f"{self.path}: the records cannot be written as Parquet: {brief(str(err))}") from None
        return sink.getvalue()

    def _check_columns(self, table: pa.Table) -> None:
        names = table.column_names
        if not names:
            raise DatasetError(f"{self.path}: the table has no columns: a shard holds at least one column")
        if table.num_rows == 0:
            raise DatasetError(f"{self.path}: the table has no rows: a shard holds at least one record")
        if reserved := [c for c in RESERVED_COLUMNS if c in names]:
            raise DatasetError(
                f"{self.path}: column {reserved[0]!r} is reserved: every example read back carries its "
                "'shard' and 'index' (row in the shard); rename the column"
            )
        if dup := sorted({c for c in names if names.count(c) > 1}):
            raise DatasetError(f"{self.path}: column {brief(dup[0])} appears twice: column names must be unique")

    def _table(self, records: list[dict[str, Any]]) -> pa.Table:
        if not isinstance(records, list) or not records:
            raise DatasetError(f"{self.path}: write_shard needs a non-empty list of dicts or a pyarrow.Table")
        try:
            return pa.Table.from_pylist(records)
        except (pa.ArrowException, TypeError, AttributeError, ValueError, OverflowError) as err:
            raise DatasetError(f"{self.path}: records are not tabular ({brief(str(err))})") from None
