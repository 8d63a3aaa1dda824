"""The sharded dataset format: Parquet shards plus an ``index.json`` that knows how each was made.

A dataset is a directory of ``shard-00047.parquet`` files and ``index.json`` listing, per shard, the
file, record count, sha256, byte size and provenance (``pipeline_version``, ``schema_version``,
``source``, ``created_at``, free-form extras). Every write is atomic: a shard is written to a
temporary file, fsynced and renamed; the index is replaced the same way afterwards. A crash between
the two leaves the previous index intact and the new shard detectable as an orphan.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from steadytrain._check import check_int
from steadytrain._io import write_text_atomic
from steadytrain.errors import UserError

__all__ = ["INDEX", "CorruptShardError", "Dataset", "DatasetError", "DatasetWriter", "ShardInfo", "open_dataset"]

INDEX = "index.json"
FORMAT = "steadytrain-shards"
VERSION = 1
_SHARD_FILE = re.compile(r"shard-(\d+)\.parquet")


class DatasetError(UserError):
    """A dataset directory or its index is malformed; the message names the file and the field."""


class CorruptShardError(DatasetError):
    """A shard's bytes do not match its index entry (checksum, size, or unreadable Parquet)."""

    def __init__(self, shard: int, message: str):
        super().__init__(message)
        self.shard = shard


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the index records it."""

    id: int
    file: str
    records: int
    sha256: str
    bytes: int
    provenance: dict[str, Any] = field(default_factory=dict)


def shard_file(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.parquet"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class Dataset:
    """An opened dataset: its shards, their provenance, checksum verification and reads."""

    def __init__(self, path: str | Path, index: dict[str, Any]):
        self.path = Path(path)
        self.provenance: dict[str, Any] = index.get("provenance") or {}
        self.shards: list[ShardInfo] = [ShardInfo(**s) for s in index["shards"]]
        self._by_id = {s.id: s for s in self.shards}
        self._verified: set[int] = set()

    @property
    def shard_ids(self) -> list[int]:
        return [s.id for s in self.shards]

    @property
    def num_records(self) -> int:
        return sum(s.records for s in self.shards)

    def shard(self, shard_id: int) -> ShardInfo:
        try:
            return self._by_id[shard_id]
        except KeyError:
            raise DatasetError(f"{self.path}: no shard {shard_id} (shards: {_ranges(self.shard_ids)})") from None

    @property
    def orphans(self) -> list[str]:
        """Files in the directory the index does not list: an interrupted write (a temporary file, or a
        shard renamed into place whose index update never happened)."""
        listed = {s.file for s in self.shards} | {INDEX}
        return sorted(
            p.name
            for p in self.path.iterdir()
            if p.is_file() and p.name not in listed and (_SHARD_FILE.fullmatch(p.name) or p.name.startswith("."))
        )

    def verify_shard(self, shard_id: int) -> None:
        """Raise :class:`CorruptShardError` if the shard's size or sha256 differ from the index."""
        info = self.shard(shard_id)
        path = self.path / info.file
        if not path.exists():
            raise CorruptShardError(shard_id, f"shard {shard_id}: {path} is missing")
        size = path.stat().st_size
        if size != info.bytes:
            raise CorruptShardError(
                shard_id, f"shard {shard_id}: {info.file} has {size} bytes, the index says {info.bytes} (truncated?)"
            )
        digest = _sha256(path)
        if digest != info.sha256:
            raise CorruptShardError(
                shard_id, f"shard {shard_id}: {info.file} sha256 {digest[:12]}... != index {info.sha256[:12]}..."
            )
        self._verified.add(shard_id)

    def verify(self, shards: list[int] | None = None) -> None:
        """Check every (or the given) shard's checksum; raises naming the first bad shard."""
        for sid in shards if shards is not None else self.shard_ids:
            self.verify_shard(sid)

    def read_shard(self, shard_id: int, *, verify: bool = True, columns: list[str] | None = None) -> pa.Table:
        """The shard's rows in file order (row i is example index i); verified once per process by default."""
        info = self.shard(shard_id)
        if verify and shard_id not in self._verified:
            self.verify_shard(shard_id)
        try:
            return pq.read_table(self.path / info.file, columns=columns)
        except (OSError, pa.ArrowException) as err:
            raise CorruptShardError(shard_id, f"shard {shard_id}: {info.file} is not readable Parquet: {err}") from err


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "none"
    return f"{min(ids)}..{max(ids)} ({len(ids)})" if len(ids) > 5 else ", ".join(map(str, ids))


def _load_index(path: Path) -> dict[str, Any]:
    index_path = path / INDEX
    try:
        index = json.loads(index_path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"{path}: no {INDEX}: not a steadytrain dataset (write one with DatasetWriter)") from None
    except json.JSONDecodeError as err:
        raise DatasetError(f"{index_path}: not valid JSON (line {err.lineno}: {err.msg})") from err
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DatasetError(f"{index_path}: field 'format' must be {FORMAT!r}")
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise DatasetError(f"{index_path}: field 'shards' must be a list")
    for n, s in enumerate(shards):
        missing = [k for k in ("id", "file", "records", "sha256", "bytes") if k not in s]
        if missing:
            raise DatasetError(f"{index_path}: shards[{n}] lacks field(s) {', '.join(missing)}")
    return index


def open_dataset(path: str | Path) -> Dataset:
    """Open a dataset directory written by :class:`DatasetWriter`.

    Raises:
        DatasetError: no index, or a malformed one (the message names the file and field).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> with DatasetWriter(d, provenance={"pipeline_version": "1.0"}) as w:
        ...     _ = w.write_shard([{"x": 1.0}, {"x": 2.0}])
        >>> ds = open_dataset(d); ds.shard_ids, ds.num_records, ds.shards[0].provenance["pipeline_version"]
        ([0], 2, '1.0')
    """
    path = Path(path)
    return Dataset(path, _load_index(path))


class DatasetWriter:
    """Write shards atomically, one at a time, and keep ``index.json`` in step.

    Args:
        path: the dataset directory (created if missing; an existing dataset is appended to).
        provenance: defaults for every shard's provenance (``pipeline_version``, ``schema_version``,
            ``source`` ...); per-shard values override them; ``created_at`` is filled in.
    """

    def __init__(self, path: str | Path, *, provenance: dict[str, Any] | None = None):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.provenance = dict(provenance or {})
        if (self.path / INDEX).exists():
            self._index = _load_index(self.path)
        else:
            self._index = {"format": FORMAT, "version": VERSION, "provenance": self.provenance, "shards": []}

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
        """Write one shard (temporary file, fsync, rename), then the index (the same way).

        Args:
            records: a list of dicts or a ``pyarrow.Table``.
            shard_id: defaults to one more than the largest id so far.
            provenance: this shard's provenance, over the writer's defaults.

        Returns:
            The index entry of the shard.

        Raises:
            DatasetError: the id exists already, or the records are empty or not tabular.
        """
        ids = {s["id"] for s in self._index["shards"]}
        if shard_id is None:
            shard_id = max(ids, default=-1) + 1
        check_int("shard_id", shard_id, 0)
        if shard_id in ids:
            raise DatasetError(f"{self.path}: shard {shard_id} exists already: shards are immutable, use a new id")
        table = records if isinstance(records, pa.Table) else self._table(records)
        name = shard_file(shard_id)
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        try:
            pq.write_table(table, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            info = ShardInfo(
                id=shard_id,
                file=name,
                records=table.num_rows,
                sha256=_sha256(Path(tmp)),
                bytes=os.path.getsize(tmp),
                provenance={**self.provenance, "created_at": _now(), **(provenance or {})},
            )
            os.replace(tmp, self.path / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._index["shards"] = sorted([*self._index["shards"], asdict(info)], key=lambda s: s["id"])
        write_text_atomic(self.path / INDEX, json.dumps(self._index, indent=1) + "\n")
        return info

    def _table(self, records: list[dict[str, Any]]) -> pa.Table:
        if not isinstance(records, list) or not records:
            raise DatasetError(f"{self.path}: write_shard needs a non-empty list of dicts or a pyarrow.Table")
        try:
            return pa.Table.from_pylist(records)
        except (pa.ArrowException, TypeError, AttributeError) as err:
            raise DatasetError(f"{self.path}: records are not tabular ({err})") from err
