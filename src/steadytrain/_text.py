"""Text shaping shared by every layer: bounded values in messages, one-line values, inert Markdown.

:func:`brief` bounds any value before it is formatted into a message; :func:`one_line` keeps a
value from starting a new line; :func:`short` is :func:`one_line` cut to a width (a name in a table,
a plot's label or a sentence: a 200 KB layer name must not pad every row); :func:`error_text` keeps the
lines of an exception that name the problem; :func:`md` is the one way a value a user controls enters
Markdown (``summary.md``, ``sweep.md``): run names, paths, config values, provenance and error messages
may hold a newline (a new heading), ``<img onerror=...>`` (raw HTML, which renderers pass through), ``|``
(a new table cell) or ``[x](javascript:...)`` (a link); :func:`md` makes them inert text.
"""

from __future__ import annotations

import re
import reprlib

__all__ = ["SHORT", "brief", "error_text", "md", "one_line", "short"]

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


SHORT = 60
"""The most characters :func:`short` keeps of a name by default: a table's column stays readable."""


def short(value: object, limit: int = SHORT) -> str:
    r"""``value`` on one line (:func:`one_line`), at most ``limit`` characters: a longer one keeps its start and its
    end (where names differ: ``model.layers.11.attn.weight``) around ``...``.

    Example:
        >>> short("model." + "x" * 100 + ".layers.11.weight", 40)
        'model.xxxxxx...xxxxxxxx.layers.11.weight'
        >>> short("ok" + chr(10) + "name")
        'ok\\nname'
    """
    text = one_line(value)
    if len(text) <= limit:
        return text
    keep = max(limit - 3, 2)
    head = keep // 3
    return text[:head] + "..." + text[len(text) - (keep - head) :]


def error_text(err: BaseException, limit: int = 400) -> str:
    r"""An exception's message as one bounded line that keeps what names the problem.

    torch's "Error(s) in loading state_dict for Lin:" is only a heading: the lines after it name the
    parameter and both shapes. Lines are joined with ``; `` (blank ones dropped), control characters
    escaped, and the result cut at ``limit`` characters.

    Example:
        >>> err = RuntimeError("Error(s) in loading state_dict for Lin:\n\tsize mismatch for weight: [2] vs [3].")
        >>> error_text(err)
        'Error(s) in loading state_dict for Lin: size mismatch for weight: [2] vs [3].'
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    text = lines[0] + (" " if lines[0].endswith(":") else "; ") + "; ".join(lines[1:]) if len(lines) > 1 else lines[0]
    text = one_line(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_SPECIAL = set("\\`*_{}[]#!|~")
_LINE_START = re.compile(r"^(\s*\d{0,9})([-+=.)])(?=\s|$)")  # "- x", "1. x", "2) x": a list item when first
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}


def md(value: object) -> str:
    r"""``value`` as inert Markdown text on one line (renders as the characters it holds).

    Example:
        >>> md("ok\n## INJECTED <img src=x onerror=alert(1)>")
        'ok\\\\n\\#\\# INJECTED &lt;img src=x onerror=alert(1)&gt;'
        >>> md("runs/lr-0.5"), md("1. x"), md("0.003"), md("- x")
        ('runs/lr-0.5', '1\\. x', '0.003', '\\- x')
    """
    text = "".join(_ENTITIES.get(c) or (f"\\{c}" if c in _SPECIAL else c) for c in one_line(value))
    return _LINE_START.sub(lambda m: m.group(1) + "\\" + m.group(2), text, count=1)
