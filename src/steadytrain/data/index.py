"""``index.json``: the list of a dataset's shards, read strictly.

Every entry is checked when the index is read: the types of ``id``, ``file``, ``records``, ``sha256``,
``bytes`` and ``provenance``, unique ids, one file per id, and a file that stays inside the dataset
directory (no ``..``, no absolute path, no symlink to elsewhere). Anything else is a
:class:`DatasetError` naming the index file, the entry and the field, so a hand-edited or hostile
index never makes a reader touch a file outside the dataset or read one shard twice.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from steadytrain._io import brief, load_json
from steadytrain.errors import UserError

__all__ = [
    "FORMAT",
    "INDEX",
    "LOCK",
    "RESERVED_COLUMNS",
    "SHARD_FILE",
    "VERSION",
    "CorruptShardError",
    "DatasetError",
    "ShardInfo",
    "check_json",
    "fingerprint",
    "load_index",
    "parse_index",
    "resolve_inside",
    "shard_file",
]

INDEX = "index.json"
LOCK = "index.json.lock"  # held by a DatasetWriter around "choose an id, write the shard, update the index"
FORMAT = "steadytrain-shards"
VERSION = 1
SHARD_FILE = re.compile(r"shard-(\d+)\.parquet")
RESERVED_COLUMNS = ("shard", "index")  # added to every example by ShardedDataset
_ENTRY_KEYS = ("id", "file", "records", "sha256", "bytes", "provenance")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_DEPTH = 100  # nesting of a provenance value


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
    """The file name :class:`~steadytrain.data.DatasetWriter` gives shard ``shard_id``.

    Example:
        >>> shard_file(47)
        'shard-00047.parquet'
    """
    return f"shard-{shard_id:05d}.parquet"


def check_json(value: Any, where: str) -> str:
    """``value`` as strict JSON text, or a :class:`DatasetError` naming the first field that is not JSON.

    Refused: values JSON cannot hold (``datetime``, sets, objects), NaN and ±inf, containers that contain
    themselves, and non-string keys (JSON would turn them into strings, so the value read back would differ
    from the one written).

    Example:
        >>> check_json({"source": "s3://logs", "version": 3}, "provenance")
        '{"source": "s3://logs", "version": 3}'
    """
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        _find_non_json(value, where, set())
        raise DatasetError(f"{where} = {brief(value)} cannot be stored in JSON") from None
    _find_non_json(value, where, set())  # the keys: json.dumps writes 1 as "1"
    return text


def _find_non_json(value: Any, where: str, parents: set[int]) -> None:
    """Raise a :class:`DatasetError` at the first part of ``value`` that JSON cannot hold as it is."""
    if isinstance(value, dict | list | tuple):
        if id(value) in parents:
            raise DatasetError(f"{where} contains itself: it cannot be stored in JSON")
        if len(parents) >= _MAX_DEPTH:
            raise DatasetError(f"{where}: nests more than {_MAX_DEPTH} levels deep")
        parents = parents | {id(value)}
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict) and not isinstance(key, str):
                raise DatasetError(f"{where}: key {brief(key)} is not a string (JSON keys are strings)")
            _find_non_json(item, f"{where}.{key}" if isinstance(value, dict) else f"{where}[{key}]", parents)
    elif not _json_leaf(value):
        raise DatasetError(
            f"{where} = {brief(value)} ({type(value).__name__}) cannot be stored in JSON: use a string, "
            "a finite number, a bool, null, a list or a mapping"
        )


def _json_leaf(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, str | int | bool)


def resolve_inside(root: Path, file: str, where: str) -> Path:
    """The real path of ``root / file``, or a :class:`DatasetError` if it leaves ``root``.

    ``file`` must be relative, without ``..``; once symlinks are resolved it must still lie inside ``root``.
    """
    if not isinstance(file, str) or not file or "\0" in file:
        raise DatasetError(f"{where}: field 'file' = {brief(file)} must be a non-empty file name")
    pure = PurePosixPath(file)
    if pure.is_absolute() or os.path.isabs(file) or ".." in pure.parts:
        raise DatasetError(
            f"{where}: field 'file' = {brief(file)} leaves the dataset directory: use a path relative to it"
        )
    real_root = root.resolve()
    real = (root / file).resolve()
    if real == real_root or not real.is_relative_to(real_root):
        raise DatasetError(
            f"{where}: field 'file' = {brief(file)} resolves outside the dataset directory {str(root)!r} "
            "(a symlink?): shard files must lie inside it"
        )
    return real


def _int_field(entry: dict[str, Any], key: str, where: str) -> int:
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DatasetError(f"{where}: field {key!r} = {brief(value)} must be an integer >= 0")
    return value


def _parse_entry(root: Path, n: int, entry: Any, index_path: Path) -> tuple[ShardInfo, Path]:
    where = f"{index_path}: shards[{n}]"
    if not isinstance(entry, dict):
        raise DatasetError(f"{where} = {brief(entry)} must be a mapping with fields {', '.join(_ENTRY_KEYS)}")
    if missing := [k for k in _ENTRY_KEYS[:5] if k not in entry]:
        raise DatasetError(f"{where} lacks field(s) {', '.join(missing)}")
    if unknown := sorted(str(k) for k in entry if k not in _ENTRY_KEYS):
        raise DatasetError(f"{where}: unknown field {brief(unknown[0])} (expected {', '.join(_ENTRY_KEYS)})")
    shard_id = _int_field(entry, "id", where)
    where = f"{where} (id {shard_id})"
    records, size = _int_field(entry, "records", where), _int_field(entry, "bytes", where)
    sha = entry["sha256"]
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise DatasetError(f"{where}: field 'sha256' = {brief(sha)} must be 64 lowercase hex digits")
    provenance = entry.get("provenance", {})
    if not isinstance(provenance, dict):
        raise DatasetError(f"{where}: field 'provenance' = {brief(provenance)} must be a mapping")
    real = resolve_inside(root, entry["file"], where)
    return ShardInfo(shard_id, entry["file"], records, sha, size, provenance), real


def parse_index(root: Path, index: Any, index_path: Path) -> tuple[dict[str, Any], list[ShardInfo]]:
    """The dataset provenance and the shards of an index read from ``index_path``; every field checked.

    Raises:
        DatasetError: a malformed field, a duplicate id, two ids naming one file, or a file outside ``root``;
            the message names the index file, the entry and the field.
    """
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DatasetError(f"{index_path}: field 'format' must be {FORMAT!r}")
    version = index.get("version", VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version > VERSION:
        raise DatasetError(
            f"{index_path}: field 'version' = {brief(version)}: this steadytrain reads version {VERSION} (upgrade it?)"
        )
    provenance = index.get("provenance", {})
    if provenance is None:
        provenance = {}
    if not isinstance(provenance, dict):
        raise DatasetError(f"{index_path}: field 'provenance' = {brief(provenance)} must be a mapping")
    entries = index.get("shards")
    if not isinstance(entries, list):
        raise DatasetError(f"{index_path}: field 'shards' must be a list")
    parsed = [_parse_entry(root, n, s, index_path) for n, s in enumerate(entries)]
    shards = [s for s, _ in parsed]
    ids: dict[int, int] = {}
    files: dict[str, int] = {}
    for n, (s, real) in enumerate(parsed):
        if s.id in ids:
            raise DatasetError(f"{index_path}: shards[{n}]: id {s.id} is listed twice (also shards[{ids[s.id]}])")
        ids[s.id] = n
        key = os.path.normcase(str(real))  # the real file: a second name or a symlink for it is the same file
        if key in files:
            raise DatasetError(
                f"{index_path}: shards[{n}] (id {s.id}): file {brief(s.file)} is also shard {shards[files[key]].id}'s: "
                "one file per shard"
            )
        files[key] = n
    return provenance, shards


def load_index(root: Path) -> dict[str, Any]:
    """The raw ``index.json`` of dataset directory ``root`` (checked with :func:`parse_index` by the caller).

    Raises:
        DatasetError: no index, or one that is not a UTF-8 JSON file.
    """
    index_path = root / INDEX
    if not root.is_dir():
        raise DatasetError(f"{root}: not a directory: a dataset is a directory with an {INDEX}")
    if not index_path.exists() and not index_path.is_symlink():
        raise DatasetError(f"{root}: no {INDEX}: not a steadytrain dataset (write one with DatasetWriter)")
    try:
        return load_json(index_path, what="dataset index")
    except DatasetError:
        raise
    except UserError as err:  # the reader's message (names the file) as the dataset error callers catch
        raise DatasetError(str(err)) from None


def fingerprint(shards: list[ShardInfo]) -> str:
    """A short digest of which shards (ids and contents) a reader sees; equal for equal data.

    Example:
        >>> s = ShardInfo(0, "shard-00000.parquet", 2, "0" * 64, 10)
        >>> fingerprint([s]) == fingerprint([s]), fingerprint([s]) == fingerprint([])
        (True, False)
    """
    entries = sorted([s.id, s.sha256, s.records] for s in shards)
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]
