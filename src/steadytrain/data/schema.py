"""Dataset schemas: what each column may hold, inferred from healthy shards, checked before and while data is loaded.

A NaN in a distributed run was traced to one shard in 200, written by a newer pipeline after a schema change: a
categorical value outside the vocabulary indexed an invalid embedding row. A :class:`Schema` states per column the
type, the numeric range, whether NaN is allowed, the vocabulary of a categorical and whether values may be null.
:func:`infer_schema` derives one from shards known to be healthy, :func:`validate` checks shards before training, and
:func:`apply_policy` enforces it on every table as it is loaded (``raise``, ``drop`` or ``clamp``). Every check is
vectorized (``pyarrow.compute`` and NumPy): nothing loops over rows in Python.

Types are named as pyarrow names them, with floats by width and lists by item type: ``int64``, ``float32``,
``string``, ``bool``, ``list<float32>``, ``fixed_size_list<float32>[4]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from steadytrain._io import brief, read_text, write_text_atomic
from steadytrain._yamlio import dump_yaml, load_yaml
from steadytrain.errors import UserError

__all__ = ["KINDS", "POLICIES", "FieldSpec", "Schema", "SchemaError", "SchemaViolationError", "dtype_name"]

KINDS = ("missing", "wrong_type", "non_finite", "out_of_range", "unexpected_category")
POLICIES = ("raise", "drop", "clamp")
SIDECAR_THRESHOLD = 50  # Schema.save writes longer vocabularies to <schema-stem>.<field>.vocab.txt
MAX_DTYPE_CHARS = 200  # a type name; bounds the nesting the parser recurses through
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_TOKEN = re.compile(r"[\w.+-]{1,40}")  # a vocabulary line that may be quoted back in a message
_FIELD_KEYS = ("dtype", "min", "max", "allow_nan", "vocabulary", "required")
_INT = re.compile(r"u?int(8|16|32|64)")
_NUMERIC = re.compile(r"u?int(8|16|32|64)|float(16|32|64)")
_LIST = re.compile(r"(large_list|list)<(?:\w+:\s*)?(.+)>")
_FIXED = re.compile(r"fixed_size_list<(?:\w+:\s*)?(.+)>\[(\d+)\]")
_VOCAB_TYPES = {"int": (int, "an integer"), "str": (str, "a string"), "bool": (bool, "true or false")}
_PARSE = {"int": int, "str": str, "bool": {"true": True, "false": False}.__getitem__}


class SchemaError(UserError):
    """A schema that cannot be used; the message names the file, the field, the value and what was expected."""


class SchemaViolationError(ValueError):
    """An example breaks the schema under the ``raise`` policy; the message names shard, example, field and value."""

    def __init__(self, message: str, *, shard: int, example: int, field: str, kind: str, value: Any):
        super().__init__(message)
        self.shard, self.example, self.field, self.kind, self.value = shard, example, field, kind, value


def dtype_name(t: pa.DataType) -> str:
    """The name a schema uses for a pyarrow type: floats by width, lists by item type, dictionaries by value type.

    Example:
        >>> dtype_name(pa.float32()), dtype_name(pa.list_(pa.float64())), dtype_name(pa.string())
        ('float32', 'list<float64>', 'string')
    """
    if pa.types.is_dictionary(t):
        return dtype_name(t.value_type)
    if pa.types.is_floating(t):
        return f"float{t.bit_width}"
    if pa.types.is_fixed_size_list(t):
        return f"fixed_size_list<{dtype_name(t.value_type)}>[{t.list_size}]"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"{'large_' if pa.types.is_large_list(t) else ''}list<{dtype_name(t.value_type)}>"
    return str(t)


def _normalize_dtype(name: str) -> str | None:
    """Canonical form of a dtype name (pyarrow aliases such as ``double`` accepted); None if it names no type."""
    name = name.strip()
    if m := _FIXED.fullmatch(name):
        return None if (inner := _normalize_dtype(m[1])) is None else f"fixed_size_list<{inner}>[{m[2]}]"
    if m := _LIST.fullmatch(name):
        return None if (inner := _normalize_dtype(m[2])) is None else f"{m[1]}<{inner}>"
    try:
        return dtype_name(pa.type_for_alias(name))
    except (ValueError, KeyError):  # parametrised types without an alias (struct<...>, decimal128(9, 2)): verbatim
        return name if re.search(r"[<(]", name) else None


def _leaf_name(dtype: str) -> str:
    while m := (_FIXED.fullmatch(dtype) or _LIST.fullmatch(dtype)):
        dtype = m[1] if m.re is _FIXED else m[2]
    return dtype


@dataclass
class FieldSpec:
    """What one column may hold.

    Attributes:
        dtype: type name as :func:`dtype_name` writes it (``int64``, ``float32``, ``string``, ``list<float32>``).
        min: inclusive lower bound of numeric values (of every element, for list types); None for none.
        max: inclusive upper bound, likewise.
        allow_nan: whether NaN may appear in a float field. ±inf never may.
        vocabulary: allowed values of a categorical (string, bool or integer) field; None allows any.
        required: whether the column must be present and free of nulls.

    Example:
        >>> FieldSpec("string", vocabulary=["en", "de"]).to_dict()
        {'dtype': 'string', 'vocabulary': ['en', 'de']}
    """

    dtype: str
    min: int | float | None = None
    max: int | float | None = None
    allow_nan: bool = False
    vocabulary: list[Any] | None = None
    required: bool = True

    def to_dict(self) -> dict[str, Any]:
        """The entries that differ from the defaults, as written to YAML."""
        defaults = {"min": None, "max": None, "allow_nan": False, "vocabulary": None, "required": True}
        d: dict[str, Any] = {"dtype": self.dtype}
        d.update({k: getattr(self, k) for k, default in defaults.items() if getattr(self, k) != default})
        if self.vocabulary is not None:
            d["vocabulary"] = list(self.vocabulary)
        return d


@dataclass
class Schema:
    """Field specs by column name, saved as YAML.

    In YAML a vocabulary is an inline list or the path of a file with one value per line, relative to the YAML
    file's directory; :meth:`save` writes vocabularies of more than 50 values to ``<stem>.<field>.vocab.txt``.

    Example:
        >>> schema = Schema.from_dict({"fields": {"lang": {"dtype": "string", "vocabulary": ["en", "de"]}}})
        >>> schema.fields["lang"].required
        True
    """

    fields: dict[str, FieldSpec] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (vocabularies inline) for YAML or JSON."""
        return {"fields": {name: spec.to_dict() for name, spec in self.fields.items()}}

    @classmethod
    def from_dict(cls, d: Any, source: str | Path | None = None) -> Schema:
        """Parse and check a schema dict; ``source`` names it in errors and anchors relative vocabulary files."""
        where = str(source) if source is not None else "schema"
        base = Path(source).parent if source is not None else Path.cwd()
        if not isinstance(d, dict) or not isinstance(d.get("fields"), dict):
            raise SchemaError(f"{where}: expected a mapping with a 'fields' mapping of column names, got {_short(d)}")
        if extra := sorted(str(k) for k in d if k not in ("fields", "version")):
            raise SchemaError(f"{where}: unknown top-level key {brief(extra[0])} (expected 'fields')")
        for name in d["fields"]:
            if not isinstance(name, str):
                raise SchemaError(
                    f"{where}: field name {brief(name)} is a {type(name).__name__}, not a string: "
                    "quote it in YAML (column names are strings)"
                )
        return cls({name: _parse_field(where, base, name, spec) for name, spec in d["fields"].items()})

    def save(self, path: str | Path) -> None:
        """Write the schema as YAML (atomically), large vocabularies to sidecar files next to it.

        A sidecar is named ``<stem>.<field>.vocab.txt``; a field name that is not a plain file name (``a/b``,
        ``a?b``, ``..``, non-ASCII, very long) or that would clash with another field's sidecar (also on a
        case-insensitive file system) gets a sanitized name plus a digest of the field name, so every field
        has its own sidecar and none lies outside the schema's directory.
        """
        path = Path(path)
        d = self.to_dict()
        used: set[str] = set()
        for name, spec in d["fields"].items():
            vocab = spec.get("vocabulary")
            if vocab is not None and len(vocab) > SIDECAR_THRESHOLD and all(_line_safe(v) for v in vocab):
                sidecar = path.with_name(f"{path.stem}.{_sidecar_part(name, used)}.vocab.txt")
                write_text_atomic(sidecar, "".join(f"{_vocab_str(v)}\n" for v in vocab))
                spec["vocabulary"] = sidecar.name
        write_text_atomic(path, dump_yaml(d))

    @classmethod
    def load(cls, path: str | Path) -> Schema:
        """Read a schema written by :meth:`save` (or by hand); malformed content raises :class:`SchemaError`."""
        try:
            d = load_yaml(path, what="schema")
        except SchemaError:
            raise
        except UserError as err:  # the reader's message (names the file), as the error schema callers catch
            raise SchemaError(str(err)) from None
        return cls.from_dict(d, source=Path(path))


def _sidecar_part(name: str, used: set[str]) -> str:
    """A file-name part for field ``name``'s sidecar: the name itself when plain and unused, else made unique."""
    part = name if _SAFE_NAME.fullmatch(name) and name not in (".", "..") else ""
    if not part or part.casefold() in used:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        part = f"{re.sub(r'[^A-Za-z0-9_-]', '_', name)[:40]}-{digest}"
        while part.casefold() in used:  # only on a digest collision
            part += "_"
    used.add(part.casefold())
    return part


def _short(value: Any) -> str:
    return brief(value)


def _line_safe(v: Any) -> bool:
    return not isinstance(v, str) or (v != "" and "\n" not in v and "\r" not in v)


def _vocab_str(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def _parse_field(where: str, base: Path, name: str, spec: Any) -> FieldSpec:
    def err(what: str) -> SchemaError:
        return SchemaError(f"{where}: field {brief(name)}: {what}")

    if not isinstance(spec, dict):
        raise err(f"expected a mapping with at least a 'dtype', got {_short(spec)}")
    if unknown := [k for k in spec if k not in _FIELD_KEYS]:
        raise err(f"unknown key {brief(unknown[0])} (expected one of {', '.join(_FIELD_KEYS)})")
    raw = spec.get("dtype")
    ok = isinstance(raw, str) and len(raw) <= MAX_DTYPE_CHARS
    if (dtype := _normalize_dtype(raw) if ok else None) is None:
        raise err(
            f"'dtype' = {brief(raw)} is not a type name (expected e.g. 'int64', 'float32', 'string', 'list<float32>')"
        )
    leaf = _leaf_name(dtype)
    for key in ("min", "max"):
        if (v := spec.get(key)) is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise err(f"{key!r} = {brief(v)} is not a finite number (expected an int, a float or null)")
        if not _NUMERIC.fullmatch(leaf):
            raise err(f"{key!r} = {brief(v)} is set but dtype {dtype!r} is not numeric")
        lo, hi = _range(leaf)  # a bound the type cannot hold is a typo, and pyarrow cannot compare with it
        if not lo <= v <= hi:
            raise err(f"{key!r} = {brief(v)} is outside the range of {leaf}, [{lo}, {hi}]: use a value inside it")
    if spec.get("min") is not None and spec.get("max") is not None and spec["min"] > spec["max"]:
        raise err(f"'min' = {brief(spec['min'])} is above 'max' = {brief(spec['max'])}")
    for key in ("allow_nan", "required"):
        if key in spec and not isinstance(spec[key], bool):
            raise err(f"{key!r} = {brief(spec[key])} is not a boolean (expected true or false)")
    vocab = spec.get("vocabulary")
    if vocab is not None:
        vocab = _parse_vocabulary(err, base, vocab, dtype)
    return FieldSpec(
        dtype, spec.get("min"), spec.get("max"), spec.get("allow_nan", False), vocab, spec.get("required", True)
    )


def _parse_vocabulary(err: Any, base: Path, vocab: Any, dtype: str) -> list[Any]:
    """A field's vocabulary: an inline list, or the values of the file it names; every value of the field's type."""
    leaf = _leaf_name(dtype)
    kind = "int" if _INT.fullmatch(leaf) else "str" if leaf in ("string", "large_string") else leaf
    if kind not in ("int", "str", "bool"):
        raise err(f"'vocabulary' is set but dtype {dtype!r} is not categorical (expected string, bool or integer)")
    vtype, expected = _VOCAB_TYPES[kind]
    if isinstance(vocab, str):
        vocab = _read_vocabulary(err, base, vocab, kind, expected)
    elif not isinstance(vocab, list):
        raise err(f"'vocabulary' = {_short(vocab)} is neither a list nor a file path")
    if bad := [v for v in vocab if not isinstance(v, vtype) or isinstance(v, bool) != (kind == "bool")]:
        hint = " (quote it in YAML)" if kind == "str" else ""
        raise err(f"'vocabulary' value {brief(bad[0])} is not {expected} as dtype {dtype!r} requires{hint}")
    lo, hi = _range(leaf) if kind == "int" else (0, 0)
    if kind == "int" and (bad := [v for v in vocab if not lo <= v <= hi]):
        bits = np.iinfo(leaf).bits
        raise err(f"'vocabulary' value {brief(bad[0])} does not fit in {leaf} (a {bits}-bit integer, [{lo}, {hi}])")
    return vocab


def _range(leaf: str) -> tuple[int | float, int | float]:
    """The values a numeric type holds: ``(lowest, highest)``; floats up to their largest finite value.

    Example:
        >>> _range("uint8"), _range("float16")
        ((0, 255), (-65504.0, 65504.0))
    """
    if _INT.fullmatch(leaf):
        info = np.iinfo(leaf)
        return int(info.min), int(info.max)
    top = float(np.finfo(leaf).max)
    return -top, top


def _read_vocabulary(err: Any, base: Path, name: str, kind: str, expected: str) -> list[Any]:
    """The values of a vocabulary file, one per line. A bad line is quoted back only if it looks like a value:
    a file that is not a vocabulary (a key, a password file) is never echoed into a message or a log."""
    path = base / name
    try:
        text = read_text(path, what="vocabulary file")
    except UserError as e:
        raise err(
            f"'vocabulary' = {brief(name)}: cannot read it ({e}); expected a file of values, one per line, "
            "relative to the schema file"
        ) from None
    values: list[Any] = []
    for lineno, line in enumerate((line.rstrip("\r") for line in text.split("\n")), 1):
        try:
            values += [_PARSE[kind](line)] if line else []
        except (KeyError, ValueError):
            shown = repr(line) if _TOKEN.fullmatch(line) else f"a line of {len(line)} characters"
            raise err(
                f"'vocabulary' file {path}, line {lineno}: {shown} is not {expected} (is this a vocabulary file?)"
            ) from None
    return values
