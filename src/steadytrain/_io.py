"""File input and output shared by every layer.

Writes are atomic: a temporary file in the same directory, fsync, rename, fsync of the directory,
so a crash or bad input never leaves a half-written file under the final name. Reads of files a
user names go through :func:`read_text`, :func:`load_json` (and :func:`steadytrain._yamlio.load_yaml`), which
turn every way a file can be wrong (missing, a directory, not UTF-8, too large, malformed)
into one :class:`~steadytrain.errors.UserError` naming the file. :func:`brief` bounds any value
before it is formatted into a message.
"""

from __future__ import annotations

import codecs
import datetime as _dt
import json
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from steadytrain._json import parse_json
from steadytrain._text import brief, one_line
from steadytrain.errors import UserError

__all__ = [
    "append_jsonl",
    "brief",
    "ensure_dir",
    "load_json",
    "one_line",
    "present",
    "read_jsonl",
    "read_log_bytes",
    "read_text",
    "utc_now",
    "write_atomic",
    "write_text_atomic",
]

MAX_TEXT_BYTES = 64 * 1024 * 1024  # config, index, manifest, schema, lockfile: far below this
MAX_LOG_BYTES = 1024 * 1024 * 1024  # metrics.jsonl of a very long run (about 200 bytes per step)

log = logging.getLogger("steadytrain")


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


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symbolic link",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` would, racing other threads' file creation)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _output_path(given: str | Path, replace: bool) -> Path:
    """Where a write to ``given`` lands: a symlink's target (``replace``), never a device, FIFO or directory."""
    path = Path(given)
    if path.name in ("", ".", "..") or os.fspath(given).endswith(("/", os.sep)):
        raise UserError(f"output path {brief(os.fspath(given))} is not a file name: name the file to write")
    if replace and path.is_symlink():
        resolved = Path(os.path.realpath(path))
        if resolved.is_symlink():  # realpath gives up on a loop and returns a link
            raise UserError(f"{path}: is a symbolic link that loops (too many levels of symbolic links)")
        path = resolved
    try:
        mode = path.lstat().st_mode
    except OSError:
        return path  # absent (created), or its directory is wrong (mkstemp says which)
    if not stat.S_ISREG(mode) and not (stat.S_ISLNK(mode) and not replace):
        raise UserError(f"{path}: not a regular file ({_kind(mode)}): writing would replace it; name a file")
    return path


def _cannot_create(path: Path, err: OSError) -> UserError:
    if isinstance(err, FileNotFoundError | NotADirectoryError):
        return UserError(f"{path}: directory {str(path.parent)!r} does not exist: create it first")
    if isinstance(err, PermissionError):
        return UserError(f"{path}: directory {str(path.parent)!r} is not writable")
    return UserError(f"{path}: cannot create a file in {str(path.parent)!r} ({err.strerror or err})")


def ensure_dir(path: str | Path, what: str, *, error: type[UserError] = UserError) -> Path:
    """``path`` as a directory, created with its parents when missing; otherwise one ``error`` naming ``what``.

    Example:
        >>> import tempfile, os
        >>> ensure_dir(os.path.join(tempfile.mkdtemp(), "a", "b"), "--dir").is_dir()
        True
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise error(f"{what} {brief(str(path))}: it or a parent is a file, not a directory") from None
    except OSError as err:
        raise error(f"{what} {brief(str(path))}: cannot be created ({err.strerror or err})") from None
    return path


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], None], *, replace: bool = True) -> None:
    """Create or replace ``path`` in one step with what ``write(file)`` writes.

    Readers see the old file or the new one, never a mix. With ``replace=False`` an existing file is
    never overwritten (``FileExistsError``), also when another process creates it at the same time.
    A symlink is followed (its target is replaced); a device, FIFO, socket or directory is never
    replaced. A new file gets the usual mode (``0o666`` less the umask), a replaced one keeps its mode.

    Raises:
        UserError: the name is not a file name, names something that is not a regular file, the
            directory does not exist or is not writable, or the write fails (disk full: names the file).
    """
    given, path = Path(path), _output_path(path, replace)
    try:
        mode = stat.S_IMODE(path.stat().st_mode) if replace else None
    except OSError:
        mode = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        if path == given:
            raise _cannot_create(path, err) from None
        # dangling, or /dev/stdout -> /proc/self/fd/1 -> pipe:[...]
        where = f"is a symbolic link to {one_line(path)}, where no file can be created"
        raise UserError(f"{given}: {where} ({err.strerror or err})") from None
    try:
        os.fchmod(fd, mode if mode is not None else 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if path exists: no rename can silently replace a file
            os.unlink(tmp)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if (isinstance(err, FileExistsError) and not replace) or not isinstance(err, OSError):
            raise
        raise UserError(f"{path}: cannot write the file ({err.strerror or err}); nothing was written") from None
    _fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) in one step; see :func:`write_atomic`."""
    data = text.encode("utf-8")
    write_atomic(path, lambda f: f.write(data))


def append_jsonl(path: str | Path, *records: dict[str, Any], sync: bool = True) -> None:
    """Append JSON lines in one ``write`` (lines from several processes never interleave) and flush them to disk
    (``sync=False``: left to the kernel, which keeps them through a kill of the process; a caller that must have
    them on disk before a later write, such as a checkpoint, syncs then).

    Values must be JSON: NaN and infinities are refused (``ValueError``) before anything is written.
    """
    data = "".join(json.dumps(r, allow_nan=False, default=str) + "\n" for r in records).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _special_file(path: Path, mode: int, what: str) -> UserError:
    if stat.S_ISDIR(mode):
        return UserError(f"{path}: is a directory, not a {what}")
    return UserError(f"{path}: not a regular file ({_kind(mode)}): name a {what} saved in a file")


def _read_fd(fd: int, path: Path, what: str, max_bytes: int, first: bytes = b"") -> bytes:
    """``first`` and the rest of ``fd``, at most ``max_bytes`` (a growing file or procfs cannot get past it)."""
    chunks, total = [first], len(first)
    while total <= max_bytes:
        chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > max_bytes:
        raise UserError(f"{path}: more than {max_bytes} bytes is too large for a {what}")
    return b"".join(chunks)


def present(path: str | Path) -> bool:
    """Whether ``path`` names anything, a symlink to nothing or a loop too: an optional run file that is present
    is read (a broken link is then one error naming it), never taken as absent and written over or past."""
    return os.path.lexists(path)


def _read_bytes(path: Path, what: str, max_bytes: int) -> bytes:
    """The bytes of a file a user named (see :func:`read_text`), or a :class:`UserError` naming it."""
    try:
        mode = path.stat().st_mode  # before opening: opening some devices has effects
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise _special_file(path, mode, what)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO: no wait for a writer
        try:
            st = os.fstat(fd)  # what was opened, not what the name pointed to a moment ago
            if stat.S_ISFIFO(st.st_mode):
                try:
                    first = os.read(fd, 1 << 16)
                except BlockingIOError:  # a writer is there and has not written yet: wait for it
                    first = None
                if first == b"":
                    kind = "a FIFO nothing writes to"
                    raise UserError(f"{path}: not a regular file ({kind}): name a {what} saved in a file")
                os.set_blocking(fd, True)
                data = _read_fd(fd, path, what, max_bytes, first or b"")
            elif stat.S_ISREG(st.st_mode):
                if st.st_size > max_bytes:
                    raise UserError(f"{path}: {st.st_size} bytes is too large for a {what} (at most {max_bytes})")
                os.set_blocking(fd, True)
                data = _read_fd(fd, path, what, max_bytes)
            else:
                raise _special_file(path, st.st_mode, what)
        finally:
            os.close(fd)
    except FileNotFoundError:
        link = f"a symbolic link to {brief(os.readlink(path))}, which does not exist" if path.is_symlink() else ""
        raise UserError(f"{path}: {link or 'no such ' + what}") from None
    except PermissionError:
        raise UserError(f"{path}: {what} is not readable (permission denied)") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read the {what} ({err.strerror or err})") from None
    return data


def read_log_bytes(path: str | Path, *, what: str) -> bytes:
    """The bytes of a log the project appends to (at most :data:`MAX_LOG_BYTES`), for a reader that parses its lines
    its own way; a :class:`UserError` naming the file when it cannot be read."""
    return _read_bytes(Path(path), what, MAX_LOG_BYTES)


def read_text(path: str | Path, *, what: str = "file", max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a file a user named, or a :class:`UserError` that says what is wrong with it.

    A regular file is read up to ``max_bytes``; a pipe is read to its end (``<(command)`` works) but a
    FIFO nothing writes to is refused rather than waited on; a device, socket or directory is refused
    without being opened, so naming ``/dev/zero`` or a terminal never hangs.
    """
    path = Path(path)
    data = _read_bytes(path, what, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: {what} is not UTF-8 text (byte {err.start})") from None


def load_json(path: str | Path, *, what: str = "JSON file") -> Any:
    """Parse a JSON file, or a :class:`UserError` naming the file (and line).

    Strict: no NaN/Infinity, no number that overflows to infinity, no key twice in one object.
    """
    return parse_json(read_text(path, what=what), str(path), what)


def _torn(line: bytes) -> bool:
    """Whether ``line`` can be the start of a record cut short by a kill: a JSON object as the project writes them
    (``json.dumps``: ``{`` first, no control character), with at most a multi-byte character cut at its end."""
    if not line.startswith(b"{") or any(b < 0x20 or b == 0x7F for b in line):
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(line, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _parse_line(line: bytes, where: str, what: str) -> Any:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{where}: {what} line is not UTF-8 text (byte {err.start} of the line)") from None
    return parse_json(text, where, what)


def read_jsonl(path: str | Path, *, what: str = "JSON-lines file") -> list[tuple[int, Any]]:
    r"""``(line number, value)`` of every line of a JSON-lines log the project appends to; ``[]`` if absent.

    The one reader of the project's JSON-lines files (``metrics.jsonl``, ``nonfinite.jsonl``, ``spikes.jsonl``,
    ``resumes.jsonl``): a line that is not UTF-8 or not JSON is a :class:`UserError` naming ``file:line``. The
    one rule for a torn record: the last line, when no newline ends it (a kill in the middle of its write: each
    record is written with its newline in one ``write``) and it can be the start of a record (:func:`_torn`:
    a ``{`` and no control characters; binary garbage cannot), is skipped with a warning. Any other malformed
    line, a complete last one too, is an error. Lines are parsed as strictly as :func:`load_json`. Whether a
    value is an object of the right shape is the caller's check (it names the file, line and key).

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "m.jsonl")
        >>> _ = open(p, "w").write('{"step": 1}\n{"step": 2}\n{"st')
        >>> read_jsonl(p)
        [(1, {'step': 1}), (2, {'step': 2})]
    """
    path = Path(path)
    if not present(path):
        return []
    lines = _read_bytes(path, what, MAX_LOG_BYTES).split(b"\n")
    last = max((n for n, line in enumerate(lines, start=1) if line.strip()), default=0)
    last = last if last == len(lines) else 0  # a newline after it: the line was written whole
    out = []
    for n, line in enumerate(lines, start=1):
        if line.strip() and (value := _record(line, path, n, what, last=n == last)) is not _TORN:
            out.append((n, value))
    return out


_TORN = object()
"""What :func:`_record` gives for a torn last line (skipped, with a warning)."""


def _record(line: bytes, path: Path, n: int, what: str, *, last: bool) -> Any:
    """Line ``n``'s value, by :func:`read_jsonl`'s one rule: ``_TORN`` for a torn last line (warned), else an error
    for a malformed line."""
    try:
        return _parse_line(line, f"{path}:{n}", what)
    except UserError:
        if not last or not _torn(line):
            raise
        log.warning("%s: line %d is cut short (the writer was killed mid-write?): skipped", path, n)
        return _TORN


def rewrite_jsonl(path: str | Path, keep: Callable[[Any], bool] | None, *, what: str = "JSON-lines file") -> None:
    """Keep the lines of a JSON-lines log whose value ``keep`` accepts, in one atomic replace, a line at a time (a
    log may be larger than :data:`MAX_LOG_BYTES`, the most read whole). Lines are checked as :func:`read_jsonl`
    checks them (a torn last line is dropped with a warning); kept lines are copied byte for byte. Absent: nothing.
    ``keep=None``: every line checked so, nothing written (before a resume changes any file of the run).
    """
    path = Path(path)
    if not present(path):
        return
    if not path.is_file():
        raise UserError(f"{path}: not a regular file: move it aside (the run appends its {what} there)")

    def copy(out: IO[bytes] | None) -> None:
        with path.open("rb") as src:
            for n, line in enumerate(src, start=1):
                whole = line.endswith(b"\n")
                body = line[:-1] if whole else line
                value = _record(body, path, n, what, last=not whole) if body.strip() else _TORN
                if out is not None and value is not _TORN and keep(value):
                    out.write(body + b"\n")

    if keep is None:
        copy(None)
    else:
        write_atomic(path, copy)
