"""Reproducibility contracts: the host driver, kernel, CUDA, Python and packages a run accepts.

An image pins what is inside it (Python, packages, the CUDA toolkit); the NVIDIA driver and the
kernel come from the host and no image can pin them. A contract states what was validated, and
:func:`check` compares a captured manifest with it, and always with NVIDIA's CUDA toolkit ->
minimum driver table, which needs no contract at all. Example ``contract.yaml``::

    driver: {min: "535.104.05", max: "550"}   # or {validated: ["535.104.05", "550.90.07"]}
    kernel: {min: "5.15"}
    cuda: "12.1"                               # or a list: ["12.1", "12.4"]
    python: "3.11"                             # any 3.11.x; "3.11.7" is exact
    packages: requirements.lock                # relative to this file; or {torch: "2.1.0+cu121"}
    allow_missing: [driver, cuda]              # absent on CPU CI: not a violation

A bound names a version prefix: ``max: "550"`` admits every 550.x driver, ``max: "550.90.07"``
admits 550.90.07 and nothing above it; both ends are inclusive. A contract version is numbers only
(``"3.x"`` or ``"550abc"`` is refused: write ``"3"`` or ``"550"``), with ``-N`` build numbers allowed
for a kernel (``"6.1.0-18"``). Quote versions in YAML: unquoted, ``cuda: 12.10`` would be read as the
number 12.1.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadytrain._io import brief, one_line, read_text
from steadytrain._yamlio import load_yaml
from steadytrain.env import grammar
from steadytrain.env._schema import as_dict
from steadytrain.env.lockfile import canonical_name, parse_lockfile
from steadytrain.errors import UserError

__all__ = [
    "CUDA_MIN_DRIVER",
    "Contract",
    "ContractError",
    "VersionRange",
    "Violation",
    "check",
    "min_driver_for_cuda",
    "parse_version",
]

# CUDA toolkit -> minimum Linux driver. From 11 on, one minimum per major family (minor version
# compatibility); before 11 a toolkit needed the driver it shipped with, or newer.
CUDA_MIN_DRIVER: dict[str, str] = {
    "13": "580",  # shared/facts/cuda_driver_compat.md
    "12": "525.60.13",  # shared/facts/cuda_driver_compat.md
    "11": "450.80.02",  # shared/facts/cuda_driver_compat.md
    "10.2": "440.33",  # NVIDIA CUDA Toolkit release notes, driver table (10.2.89 GA); not in the facts file
    "10.1": "418.39",  # same table (10.1.105 GA); not in the facts file
    "10.0": "410.48",  # same table (10.0.130 GA); not in the facts file
    "9.2": "396.26",  # shared/facts/cuda_driver_compat.md
    "9.0": "384.81",  # shared/facts/cuda_driver_compat.md
}

# version field -> (manifest field, scope, label, example for messages), in report order
_TARGET = {
    "driver": ("host.nvidia_driver", "host", "NVIDIA driver", "535.104.05"),
    "kernel": ("host.kernel", "host", "kernel", "6.1.0"),
    "cuda": ("image.cuda", "image", "CUDA", "12.1"),
    "python": ("image.python", "image", "Python", "3.11"),
}
_CHECKED = tuple(_TARGET)
_LEADING = re.compile(r"[0-9]+(?:\.[0-9]+)*")
# A version written in a contract: every part is compared, so every part is a number.
_CONTRACT_VERSION = re.compile(r"[0-9]+(?:\.[0-9]+)*(?:-[0-9]+)*", re.ASCII)
MAX_PART_DIGITS = 18  # a version part is a small number (dates are 8 digits): longer is not a version


def parse_version(s: str) -> tuple[int, ...]:
    """Numeric key of a version string, so ``"550.90.07" > "535.104.05"`` and ``"10.0" > "9.2"``.

    The rule: the leading dotted run of digits (``550.90.07`` -> 550, 90, 7), then every group of
    the remainder, split at ``-``, ``+``, ``.``, ``_`` and ``~``, that is all digits; groups with
    letters (``amd64``, ``cu121``, ``rc1``, ``generic``) are dropped. Leading zeros do not count.

    Raises:
        ValueError: ``s`` is not a string or does not start with a digit (names the value).

    Example:
        >>> parse_version("6.1.0-18-amd64"), parse_version("2.1.0+cu121")
        ((6, 1, 0, 18), (2, 1, 0))
        >>> parse_version("550.90.07") > parse_version("535.104.05")
        True
    """
    m = _LEADING.match(s.strip()) if isinstance(s, str) else None
    if m is None:
        raise ValueError(f"{brief(s)} is not a version: it must start with a number, like '535.104.05'")
    rest = re.split(r"[-+._~]", s.strip()[m.end() :])
    parts = m.group().split(".") + [g for g in rest if re.fullmatch("[0-9]+", g)]
    if any(len(p) > MAX_PART_DIGITS for p in parts):  # no version has such a part; int() of 5000 digits fails
        raise ValueError(f"{brief(s)} is not a version: a part has more than {MAX_PART_DIGITS} digits")
    return tuple(int(p) for p in parts)


def _key(v: tuple[int, ...], n: int) -> tuple[int, ...]:
    return v[:n] + (0,) * (n - len(v))  # truncate or zero-pad to n parts


def at_least(version: str, bound: str) -> bool:
    """``version >= bound`` numerically, missing parts counting as 0 (``"580.65.06"`` >= ``"580"``)."""
    v, b = parse_version(version), parse_version(bound)
    n = max(len(v), len(b))
    return _key(v, n) >= _key(b, n)


def at_most(version: str, bound: str) -> bool:
    """``version <= bound`` where ``bound`` is a prefix: ``"550.90.07"`` is at most ``"550"``."""
    b = parse_version(bound)
    return _key(parse_version(version), len(b)) <= b


def matches(version: str, spec: str) -> bool:
    """``version`` starts with ``spec``'s parts: ``"3.11.7"`` matches ``"3.11"``, not ``"3.1"``."""
    s = parse_version(spec)
    return _key(parse_version(version), len(s)) == s


class ContractError(UserError):
    """A contract file or mapping that cannot be used: names the file, the field, the value and the fix."""


def min_driver_for_cuda(cuda: str) -> str | None:
    """The minimum Linux NVIDIA driver for a CUDA toolkit version, or None when the table has no entry.

    Args:
        cuda: the toolkit version, e.g. ``"12.1"`` (``torch.version.cuda``).

    Example:
        >>> min_driver_for_cuda("12.1"), min_driver_for_cuda("9.2"), min_driver_for_cuda("8.0")
        ('525.60.13', '396.26', None)
    """
    v = parse_version(cuda)
    key = str(v[0]) if v[0] >= 11 else ".".join(map(str, v[:2]))
    return CUDA_MIN_DRIVER.get(key)


@dataclass(frozen=True, kw_only=True)
class VersionRange:
    """Accepted versions: an inclusive ``min``/``max`` (either optional) or an explicit ``validated`` list."""

    min: str | None = None
    max: str | None = None
    validated: tuple[str, ...] | None = None

    def admits(self, version: str) -> bool:
        """Whether ``version`` lies in the range (or matches one of the validated versions)."""
        if self.validated is not None:
            return any(matches(version, v) for v in self.validated)
        return (self.min is None or at_least(version, self.min)) and (self.max is None or at_most(version, self.max))

    def describe(self) -> str:
        """Human form, e.g. ``>= 535.104.05 and <= 550``."""
        if self.validated is not None:
            return "one of the validated versions " + ", ".join(self.validated)
        return " and ".join(f"{op} {b}" for op, b in ((">=", self.min), ("<=", self.max)) if b is not None)


@dataclass(frozen=True)
class Violation:
    """One way a manifest breaks the contract (or the CUDA -> driver table)."""

    field: str  # dotted manifest path, e.g. "host.nvidia_driver"
    scope: str  # "image" | "host" | "code" | "settings"
    found: Any  # the manifest's value (None when absent)
    expected: str  # human form of what is accepted
    message: str  # one line: what, the value found, and what is accepted

    def __str__(self) -> str:
        return self.message


def _shown(value: object) -> str:
    """A manifest value for a violation message: one line, at most about 80 characters."""
    text = one_line(value)
    return text if len(text) <= 80 else f"{text[:50]}...{text[-20:]} ({len(text)} characters)"


def _fail(source: str, field: str, expected: str, got: object) -> ContractError:
    return ContractError(f"{source}: {field}: expected {expected}, got {brief(got)}")


def _version(source: str, field: str, value: object, example: str) -> str:
    """A contract version: numbers separated by dots (and ``-N`` build numbers), nothing a comparison would drop."""
    hint = f"a version string like {example!r}" + (" (quote it in YAML)" if isinstance(value, int | float) else "")
    if not isinstance(value, str):
        raise _fail(source, field, hint, value)
    if not value.isascii() or _CONTRACT_VERSION.fullmatch(value) is None:
        hint += ", numbers only: a prefix such as '3' admits every 3.x"
        raise _fail(source, field, hint, value)
    if any(len(p) > MAX_PART_DIGITS for p in re.split("[.-]", value)):
        raise _fail(source, field, f"{hint}, each part at most {MAX_PART_DIGITS} digits", value)
    return value


def _versions(source: str, field: str, value: object) -> tuple[str, ...]:
    items, ex = (value if isinstance(value, list) else [value]), _TARGET[field][3]
    if not items:
        raise _fail(source, field, f"a version string like {ex!r} or a non-empty list of them", value)
    return tuple(_version(source, field, v, ex) for v in items)


def _range(source: str, field: str, value: object, *, validated_ok: bool) -> VersionRange:
    keys = {"min", "max", "validated"} if validated_ok else {"min", "max"}
    shape = "a mapping with min and/or max" + (", or with validated: [...]" if validated_ok else "")
    if not isinstance(value, Mapping) or not value or set(value) - keys:
        raise _fail(source, field, shape, value)
    ex = _TARGET[field][3]
    if "validated" in value:
        if set(value) != {"validated"}:
            raise _fail(source, field, "either validated: [...] or min/max, not both", dict(value))
        vs = value["validated"]
        if not isinstance(vs, list) or not vs:
            raise _fail(source, f"{field}.validated", f"a non-empty list of version strings like {ex!r}", vs)
        return VersionRange(validated=tuple(_version(source, f"{field}.validated", v, ex) for v in vs))
    lo = _version(source, f"{field}.min", value["min"], ex) if "min" in value else None
    hi = _version(source, f"{field}.max", value["max"], ex) if "max" in value else None
    if lo is not None and hi is not None and not at_most(lo, hi):
        raise _fail(source, field, "min <= max", dict(value))
    return VersionRange(min=lo, max=hi)


def _lockfile(source: str, value: str, base_dir: Path | None) -> dict[str, str]:
    path = Path(value) if Path(value).is_absolute() else (base_dir or Path.cwd()) / value
    try:
        text = read_text(path, what="lockfile")
    except UserError as e:  # missing, a directory, not UTF-8: read_text names the file and the problem
        raise ContractError(f"{source}: packages: cannot read lockfile {brief(value)}: {e}") from None
    try:
        return parse_lockfile(text)
    except UserError as e:  # says which line is wrong, never what it holds
        raise ContractError(f"{source}: packages: lockfile {path}: {e}") from None


def _packages(source: str, value: object, base_dir: Path | None) -> dict[str, str]:
    if isinstance(value, str):
        return _lockfile(source, value, base_dir)
    if not isinstance(value, Mapping):
        raise _fail(source, "packages", "a lockfile path or a mapping of name -> version", value)
    out: dict[str, str] = {}
    for name, ver in value.items():
        try:
            grammar.dist_name("name", name)
        except UserError:
            raise _fail(source, "packages", "distribution names (PEP 508) as keys", name) from None
        try:
            grammar.pep440_version("version", ver)
        except UserError:
            expected = "an exact version string (PEP 440) like '2.1.0' (quote it in YAML)"
            raise _fail(source, f"packages.{name}", expected, ver) from None
        out[canonical_name(name)] = ver
    return out


@dataclass(frozen=True, kw_only=True)
class Contract:
    """What a run accepts. Every field is optional; an empty contract still applies the CUDA -> driver table."""

    driver: VersionRange | None = None  # host NVIDIA driver: range or validated list
    kernel: VersionRange | None = None  # host kernel release: range
    cuda: tuple[str, ...] | None = None  # allowed CUDA toolkits in the image ("12" admits every 12.x)
    python: tuple[str, ...] | None = None  # allowed Pythons ("3.11" admits every 3.11.x)
    packages: Mapping[str, str] | None = None  # canonical name -> exact version
    allow_missing: frozenset[str] = frozenset()  # fields whose absence (e.g. no driver on CPU CI) is fine
    source: str = "<dict>"  # where it came from, for messages

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, source: str = "<dict>", base_dir: Path | None = None) -> Contract:
        """Validate a parsed contract; ``base_dir`` resolves a relative lockfile path (default: the cwd).

        Raises:
            ContractError: unknown field or wrong type; the message names source, field, value and the fix.

        Example:
            >>> c = Contract.from_dict({"driver": {"min": "525.60.13"}, "cuda": "12.1"})
            >>> c.driver.describe(), c.cuda
            ('>= 525.60.13', ('12.1',))
        """
        d = {} if d is None else d
        if not isinstance(d, Mapping):
            # the type, not the content: a file named as a contract by mistake is never quoted
            got = type(d).__name__
            raise ContractError(f"{source}: (top level): expected a mapping of contract fields, got a {got}")
        fields = (*_CHECKED, "packages", "allow_missing")
        for key in d:
            if key not in fields:
                shown = key if isinstance(key, str) and key.isidentifier() and len(key) <= 40 else brief(key)
                raise ContractError(f"{source}: {shown}: unknown contract field; expected one of {', '.join(fields)}")
        kw: dict[str, Any] = {"source": source}
        for name in ("driver", "kernel"):
            if d.get(name) is not None:
                kw[name] = _range(source, name, d[name], validated_ok=name == "driver")
        for name in ("cuda", "python"):
            if d.get(name) is not None:
                kw[name] = _versions(source, name, d[name])
        if d.get("packages") is not None:
            kw["packages"] = _packages(source, d["packages"], base_dir)
        missing = d.get("allow_missing") or []
        if not isinstance(missing, list) or any(not isinstance(m, str) or m not in _CHECKED for m in missing):
            raise _fail(source, "allow_missing", f"a list drawn from {', '.join(_CHECKED)}", missing)
        return cls(**kw, allow_missing=frozenset(missing))

    @classmethod
    def load(cls, path: str | Path) -> Contract:
        """Read a YAML contract; a relative ``packages`` lockfile is resolved beside it.

        Raises:
            ContractError: missing, a directory, not UTF-8, invalid YAML (or an alias bomb), or an invalid field.

        Example:
            >>> Contract.load("no-such-contract.yaml")
            Traceback (most recent call last):
            ...
            steadytrain.env.contract.ContractError: no-such-contract.yaml: no such contract
        """
        path = Path(path)
        try:
            data = load_yaml(path, what="contract")
        except UserError as e:
            raise ContractError(str(e)) from None
        return cls.from_dict(data, source=str(path), base_dir=path.parent)


def _version_violations(d: Mapping, c: Contract) -> list[Violation]:
    out: list[Violation] = []
    for name, (field, scope, label, _) in _TARGET.items():
        rule, value = getattr(c, name), (d.get(scope) or {}).get(field.split(".")[1])
        if rule is None:
            continue
        expected = rule.describe() if isinstance(rule, VersionRange) else " or ".join(rule)
        if value is None:
            if name not in c.allow_missing:
                msg = f"{label} is required by the contract ({expected}) but absent on this machine"
                out.append(Violation(field, scope, None, expected, f"{msg}; add {name!r} to allow_missing if expected"))
            continue
        note = ""
        try:
            ok = rule.admits(value) if isinstance(rule, VersionRange) else any(matches(value, v) for v in rule)
        except ValueError:
            ok, note = False, " (not a comparable version)"
        if not ok:
            msg = f"{label} {_shown(value)}{note} is outside the contract: expected {expected}"
            out.append(Violation(field, scope, value, expected, msg))
    return out


def _cuda_table_violation(cuda: str | None, driver: str | None) -> Violation | None:
    if not cuda or not driver:
        return None
    try:
        need = min_driver_for_cuda(cuda)
        if need is None or at_least(driver, need):
            return None
    except ValueError:
        return None  # no comparable versions: nothing the table can say
    major = parse_version(cuda)[0]
    family = f"{major}.x" if major >= 11 else cuda
    driver_s, cuda_s = _shown(driver), _shown(cuda)
    msg = f"NVIDIA driver {driver_s} is too old for CUDA {cuda_s} in the image: CUDA {family} needs driver >= {need}"
    return Violation("host.nvidia_driver", "host", driver, f">= {need}", msg)


def check(manifest: Any, contract: Contract | Mapping[str, Any] | None = None) -> list[Violation]:
    """Every way ``manifest`` breaks ``contract``, plus the CUDA -> minimum driver table (always applied).

    Args:
        manifest: an ``EnvManifest`` or its ``to_dict()`` form.
        contract: a :class:`Contract`, a mapping for :meth:`Contract.from_dict`, or None (table only).

    Returns:
        The violations (driver, kernel, CUDA, Python, the table, then packages by name); empty when all is well.

    Example:
        >>> m = {"image": {"cuda": "12.1"}, "host": {"nvidia_driver": "520.61.05"}}
        >>> print(check(m)[0])
        NVIDIA driver 520.61.05 is too old for CUDA 12.1 in the image: CUDA 12.x needs driver >= 525.60.13
    """
    d = as_dict(manifest)
    c = contract if isinstance(contract, Contract) else Contract.from_dict(contract)
    image, host = d.get("image") or {}, d.get("host") or {}
    out = _version_violations(d, c)
    if table := _cuda_table_violation(image.get("cuda"), host.get("nvidia_driver")):
        out.append(table)
    installed = {canonical_name(k): v for k, v in (image.get("packages") or {}).items()}
    for name, want in sorted((c.packages or {}).items()):
        have = installed.get(name)
        if have != want:
            state = "not installed" if have is None else f"installed at {_shown(have)}"
            msg = f"package {name} is {state}; the contract pins {name}=={want}"
            out.append(Violation(f"image.packages.{name}", "image", have, f"=={want}", msg))
    return out
