"""The grammar of every value the env layer writes into a generated file, checked before it is written.

A Dockerfile and a requirements file are line-oriented languages: a newline, a quote, ``$(...)`` or
a backtick inside a value would add an instruction, a pip option or a shell command. So no value
from a manifest or an argument goes into a generated file unless it matches its grammar here:
Docker image references, tags and digests (the ``distribution/reference`` grammar), git object
names, PEP 440 versions and PEP 508 distribution names (``packaging``'s own patterns), dotted
numeric versions and ISO 8601 times. Free text (an OS name in a comment) must be one printable
ASCII line without a backslash. Every check is ASCII-only and a full match, so a trailing newline, a
Unicode digit or a look-alike letter never slips through; the error names the field, shows the
value with :func:`~steadytrain._io.brief` (escaped, bounded) and says what is expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from packaging.version import VERSION_PATTERN

from steadytrain._io import brief
from steadytrain.errors import UserError

__all__ = [
    "ImageReference",
    "comment_text",
    "digest",
    "dist_name",
    "dotted_version",
    "git_commit",
    "image_reference",
    "image_stack",
    "pep440_version",
    "python_version",
    "repository",
    "tag",
    "timestamp",
]

_A = re.ASCII
# distribution/reference: path components are lower-case alphanumerics joined by '.', '_', '__' or '-'s
_NAME_PART = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*", _A)
_DOMAIN = re.compile(
    r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]+)?", _A
)
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", _A)
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}", _A)
_COMMIT = re.compile(r"[0-9a-f]{4,64}", _A)  # SHA-1 (40) or SHA-256 (64) object name, or an abbreviation
_PEP440 = re.compile(VERSION_PATTERN, re.VERBOSE | re.IGNORECASE)
_PEP508_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?", _A)
_DOTTED = re.compile(r"[0-9]+(?:\.[0-9]+)*", _A)
_PYTHON = re.compile(r"[0-9]+\.[0-9]+(?:\.[0-9]+)?(?:(?:a|b|rc)[0-9]+)?\+?", _A)  # platform.python_version()
_TIMESTAMP = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]+)?(?:Z|[+-][0-9]{2}:[0-9]{2})?", _A
)
_COMMENT = re.compile(r"[ -\[\]-~]{0,200}", _A)  # printable ASCII except the backslash, at most 200
MAX_REFERENCE = 255


def _check(field: str, value: object, pattern: re.Pattern[str], expected: str) -> str:
    """``value`` if it is an ASCII string that fully matches ``pattern``, else a :class:`UserError`."""
    if not isinstance(value, str) or not value.isascii() or pattern.fullmatch(value) is None:
        raise UserError(f"{field}={brief(value)} is not {expected}")
    return value


def tag(field: str, value: object) -> str:
    """A Docker tag: ``[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}``.

    Example:
        >>> tag("version", "v2.3.1-cpu")
        'v2.3.1-cpu'
    """
    return _check(
        field, value, _TAG, "a Docker tag: letters, digits, '_', '.', '-' (at most 128, no leading '.' or '-')"
    )


def digest(field: str, value: object) -> str:
    """A content digest: ``sha256:`` and 64 lower-case hex digits."""
    return _check(field, value, _DIGEST, "a digest: 'sha256:' followed by 64 lower-case hex digits")


def repository(field: str, value: object) -> str:
    """A Docker repository name without tag or digest: ``[registry[:port]/]path/components``.

    Example:
        >>> repository("name", "registry.example.com:5000/ml-team/training")
        'registry.example.com:5000/ml-team/training'
    """
    fix = (
        "a Docker repository name: lower-case letters, digits and '.', '_', '-' between them, "
        "'/' between path components (an optional registry host first), no tag"
    )
    if not isinstance(value, str) or not value.isascii() or len(value) > MAX_REFERENCE:
        raise UserError(f"{field}={brief(value)} is not {fix}")
    parts = value.split("/")
    has_domain = len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost")
    if has_domain and _DOMAIN.fullmatch(parts[0]) is None:
        raise UserError(f"{field}={brief(value)} is not {fix}")
    if not all(_NAME_PART.fullmatch(p) for p in parts[1 if has_domain else 0 :]):
        raise UserError(f"{field}={brief(value)} is not {fix}")
    return value


@dataclass(frozen=True)
class ImageReference:
    """A parsed, validated image reference ``repository[:tag][@digest]``."""

    repository: str
    tag: str | None = None
    digest: str | None = None

    def __str__(self) -> str:
        return self.repository + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")


def image_reference(field: str, value: object, *, allow_digest: bool = True) -> ImageReference:
    """Parse ``repository[:tag][@digest]``; a ``:`` before the last ``/`` is a registry port, not a tag.

    Raises:
        UserError: any part breaks its grammar, or a digest where ``allow_digest`` is False.

    Example:
        >>> str(image_reference("base", "python:3.11.7-slim"))
        'python:3.11.7-slim'
        >>> image_reference("base", "localhost:5000/py").tag is None
        True
    """
    if not isinstance(value, str):
        raise UserError(f"{field}={brief(value)} is not an image reference like 'python:3.11.7-slim'")
    ref, at, dig = value.partition("@")
    if at and not allow_digest:
        raise UserError(f"{field}={brief(value)} must not carry a digest: give repository:tag")
    head, _, last = ref.rpartition("/")
    name_tag: str | None = None
    if ":" in last:
        last, name_tag = last.split(":", 1)
    repository(
        f"{field} (repository part)" if name_tag is not None or at else field, f"{head}/{last}" if head else last
    )
    if name_tag is not None:
        tag(f"{field} (tag part)", name_tag)
    if at:
        digest(f"{field} (digest part)", dig)
    return ImageReference(f"{head}/{last}" if head else last, name_tag, dig or None)


def git_commit(field: str, value: object) -> str:
    """A git object name: 4 to 64 lower-case hex digits."""
    return _check(field, value, _COMMIT, "a git commit: 4 to 64 lower-case hex digits")


def pep440_version(field: str, value: object) -> str:
    """A PEP 440 version (``packaging``'s pattern, no surrounding space).

    Example:
        >>> pep440_version("torch", "2.1.0+cu121")
        '2.1.0+cu121'
    """
    return _check(field, value, _PEP440, "a PEP 440 version like '2.1.0' or '2.1.0+cu121'")


def dist_name(field: str, value: object) -> str:
    """A PEP 508 distribution name: ASCII letters and digits, with '.', '_', '-' inside."""
    return _check(field, value, _PEP508_NAME, "a distribution name (PEP 508): letters, digits, '.', '_', '-'")


def dotted_version(field: str, value: object) -> str:
    """Digits separated by dots, like ``12.1`` (CUDA) or ``8.9.2`` (cuDNN)."""
    return _check(field, value, _DOTTED, "a dotted numeric version like '12.1'")


def python_version(field: str, value: object) -> str:
    """What ``platform.python_version()`` returns: ``3.11.7``, ``3.13.0rc1``, ``3.14.0a1+``."""
    return _check(field, value, _PYTHON, "a Python version like '3.11.7'")


def timestamp(field: str, value: object) -> str:
    """An ISO 8601 date and time, like ``2026-12-02T10:24:34+00:00``."""
    return _check(field, value, _TIMESTAMP, "an ISO 8601 time like '2026-12-02T10:24:34+00:00'")


def comment_text(field: str, value: object) -> str:
    """Free text allowed in a generated comment: one printable ASCII line, no backslash, at most 200."""
    return _check(field, value, _COMMENT, "one line of printable ASCII text without '\\' (at most 200 characters)")


def image_stack(image: dict, where: str = "manifest") -> dict[str, str | None]:
    """The manifest image's ``python``, ``torch``, ``cuda`` and ``cudnn``, each checked against its grammar.

    Absent values are ``None``; a present one that is not a version is a :class:`UserError` naming
    ``where`` (the manifest's file) and the field.

    Example:
        >>> image_stack({"python": "3.11.7", "torch": "2.1.0+cu121", "cuda": "12.1"})["cuda"]
        '12.1'
    """
    checks = {"python": python_version, "torch": pep440_version, "cuda": dotted_version, "cudnn": dotted_version}
    return {k: None if image.get(k) is None else check(f"{where}: image.{k}", image[k]) for k, check in checks.items()}
