"""File input and output shared by every layer.

Writes are atomic: a temporary file in the same directory, fsync, rename, fsync of the directory,
so a crash or bad input never leaves a half-written file under the final name. Reads of files a
user names go through :func:`read_text`, :func:`load_json` and :func:`load_yaml`, which turn every
way a file can be wrong (missing, a directory, not UTF-8, too large, malformed, a YAML alias bomb)
into one :class:`~steadytrain.errors.UserError` naming the file. :func:`brief` bounds any value
before it is formatted into a message.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import reprlib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import yaml

from steadytrain.errors import UserError

MAX_TEXT_BYTES = 64 * 1024 * 1024  # config, index, manifest, schema, lockfile: far below this
MAX_YAML_NODES = 1_000_000  # nodes after alias expansion: a real config has a few hundred

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 6
_repr.maxlevel = 3


def brief(value: object) -> str:
    """A short, bounded ``repr`` of ``value`` for error messages (safe on huge or self-nested values).

    Example:
        >>> brief("x" * 1000)[:12], len(brief("x" * 1000)) < 100
        ("'xxxxxxxxxxx", True)
    """
    return _repr.repr(value)


def one_line(value: object) -> str:
    r"""``str(value)`` with newlines and other control characters escaped: a value never starts a new line.

    Example:
        >>> print(one_line("6.1" + chr(10) + "image identical"))
        6.1\nimage identical
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(value))


def utc_now() -> str:
    """The current time in UTC, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not let a directory be opened: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], None], *, replace: bool = True) -> None:
    """Create or replace ``path`` in one step with what ``write(file)`` writes.

    Readers see the old file or the new one, never a mix. With ``replace=False`` an existing file is
    never overwritten (``FileExistsError``), also when another process creates it at the same time.

    Raises:
        UserError: the directory does not exist or is not writable.
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except (FileNotFoundError, NotADirectoryError):
        raise UserError(f"{path}: directory {str(path.parent)!r} does not exist: create it first") from None
    except PermissionError:
        raise UserError(f"{path}: directory {str(path.parent)!r} is not writable") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if path exists: no rename can silently replace a file
            os.unlink(tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) in one step; see :func:`write_atomic`."""
    data = text.encode("utf-8")
    write_atomic(path, lambda f: f.write(data))


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON line and flush it to disk (one ``write`` call: lines from several processes never interleave)."""
    line = (json.dumps(record, allow_nan=False, default=str) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_text(path: str | Path, *, what: str = "file", max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a file a user named, or a :class:`UserError` that says what is wrong with it."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise UserError(f"{path}: is a directory, not a {what}")
        if size > max_bytes:
            raise UserError(f"{path}: {size} bytes is too large for a {what} (at most {max_bytes})")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise UserError(f"{path}: no such {what}") from None
    except PermissionError:
        raise UserError(f"{path}: {what} is not readable (permission denied)") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read the {what} ({err.strerror or err})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: {what} is not UTF-8 text (byte {err.start})") from None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def load_json(path: str | Path, *, what: str = "JSON file") -> Any:
    """Parse a JSON file (strict: no NaN/Infinity), or a :class:`UserError` naming the file and line."""
    text = read_text(path, what=what)
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: {what} is not valid JSON (line {err.lineno}: {err.msg})") from None
    except (ValueError, RecursionError) as err:
        raise UserError(f"{path}: {what} is not valid JSON ({brief(str(err))})") from None


def _count_nodes(value: Any, budget: int) -> int:
    """Nodes of ``value`` with shared (aliased) containers counted each time they appear; stops at ``budget``."""
    stack, seen = [value], 0
    while stack:
        v = stack.pop()
        seen += 1
        if seen > budget:
            break
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return seen


def parse_yaml(text: str, *, source: str, what: str = "YAML file") -> Any:
    """``yaml.safe_load`` with the size after alias expansion bounded (an alias bomb is an error, not a hang)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or "malformed"
        raise UserError(f"{source}: {what} is not valid YAML{where}: {brief(str(problem))}") from None
    except RecursionError:
        raise UserError(f"{source}: {what} nests too deeply") from None
    if _count_nodes(data, MAX_YAML_NODES) > MAX_YAML_NODES:
        raise UserError(f"{source}: {what} expands to more than {MAX_YAML_NODES} values (nested aliases?)")
    return data


def load_yaml(path: str | Path, *, what: str = "YAML file") -> Any:
    """Read and parse a YAML file a user named; every problem is one :class:`UserError` naming the file."""
    return parse_yaml(read_text(path, what=what), source=str(path), what=what)
