"""Capture the environment in four scopes (image, host, code, settings), diff two captures, compare ranks.

``image`` is what a container image pins; ``host`` is what it does not (kernel, NVIDIA driver, GPUs,
CPU); ``code`` is the git state; ``settings`` are the determinism and distributed knobs in effect.
Anything absent (no GPU, no git) is ``None``, never an exception; no credential is ever recorded.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from steadytrain._io import write_text_atomic
from steadytrain.errors import UserError

__all__ = [
    "SCOPES",
    "Difference",
    "EnvManifest",
    "ManifestError",
    "capture",
    "compare_ranks",
    "diff",
    "gather_manifests",
    "summarize",
]

SCHEMA = 1
SCOPES = ("image", "host", "code", "settings")
# Environment variable names that may hold a credential: never recorded, not even their names' values.
_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASS(WORD|WD)?|CREDENTIAL|AUTH|PRIVATE|COOKIE|SESSION|SIGNATURE", re.I)
# Knobs recorded when set: determinism, threading, device visibility, and every NCCL_*/TORCH_NCCL_*.
_SETTINGS_ENV = (
    "CUBLAS_WORKSPACE_CONFIG",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONHASHSEED",
    "CUDA_LAUNCH_BLOCKING",
    "TORCH_CUDNN_V8_API_DISABLED",
)
_SETTINGS_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_")
# Fields that identify a machine or a moment rather than describe it: not compared between ranks.
_IDENTITY = {"captured_at", "host.hostname"}


class ManifestError(UserError):
    """A manifest file or dict is malformed; the message names the file and the field."""


def _run(args: list[str], cwd: str | None = None, timeout: float = 2.0) -> str | None:
    """Output of a quick command, or None if it is missing, fails or hangs."""
    if shutil.which(args[0]) is None:
        return None
    try:
        out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


# -- image -----------------------------------------------------------------------------------------


def _os_release() -> dict | None:
    text = _read("/etc/os-release")
    if text is None:
        return None
    fields = dict(re.findall(r'^([A-Z_]+)="?([^"\n]*)"?$', text, re.M))
    return {"id": fields.get("ID"), "version_id": fields.get("VERSION_ID"), "pretty_name": fields.get("PRETTY_NAME")}


def _packages() -> dict[str, str]:
    pkgs: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            pkgs[canonicalize_name(name)] = dist.version
    return dict(sorted(pkgs.items()))


def _cudnn_string(v: int | None) -> str | None:
    """cuDNN's integer version as dotted: 8902 -> 8.9.2 (v8: M*1000+m*100+p), 90100 -> 9.1.0 (v9+: M*10000+m*100+p)."""
    if not v:
        return None
    major, rest = (v // 10000, v % 10000) if v >= 10000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _torch_image() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": None, "cuda": None, "cudnn": None, "nccl": None}
    cudnn = nccl = None
    try:
        cudnn = _cudnn_string(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
    except Exception:  # a broken CUDA install must not stop a capture
        cudnn = None
    try:
        if torch.version.cuda and torch.distributed.is_nccl_available():
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:
        nccl = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn, "nccl": nccl}


def _image() -> dict[str, Any]:
    return {"os": _os_release(), "python": platform.python_version(), "packages": _packages(), **_torch_image()}


# -- host ------------------------------------------------------------------------------------------


def _nvidia_driver() -> str | None:
    text = _read("/proc/driver/nvidia/version")
    if text:
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", text)
        if m:
            return m.group(1)
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def _gpus() -> list[dict] | None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [
            {
                "name": torch.cuda.get_device_name(i),
                "memory_mib": torch.cuda.get_device_properties(i).total_memory >> 20,
            }
            for i in range(torch.cuda.device_count())
        ]
    out = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    if not out:
        return None
    return [{"name": n.strip(), "memory_mib": int(m)} for n, m in (line.rsplit(",", 1) for line in out.splitlines())]


def _cpu() -> dict[str, Any]:
    model = None
    text = _read("/proc/cpuinfo") or ""
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    if m:
        model = m.group(1).strip()
    return {"model": model or platform.processor() or None, "count": os.cpu_count(), "arch": platform.machine()}


def _container() -> dict[str, Any] | None:
    runtime = None
    cgroup = _read("/proc/1/cgroup") or ""
    if os.environ.get("KUBERNETES_SERVICE_HOST") or "kubepods" in cgroup:
        runtime = "kubernetes"
    elif Path("/.dockerenv").exists() or "docker" in cgroup:
        runtime = "docker"
    elif Path("/run/.containerenv").exists():
        runtime = "podman"
    elif os.environ.get("container"):  # noqa: SIM112 - systemd/podman set it lower-case
        runtime = os.environ["container"]  # noqa: SIM112
    tag = os.environ.get("STEADYTRAIN_IMAGE_TAG")
    digest = os.environ.get("STEADYTRAIN_IMAGE_DIGEST")
    if runtime is None and tag is None and digest is None:
        return None
    return {"runtime": runtime, "image_tag": tag, "image_digest": digest}


def _host() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "nvidia_driver": _nvidia_driver(),
        "gpus": _gpus(),
        "cpu": _cpu(),
        "container": _container(),
        "platform": platform.platform(),
    }


# -- code and settings -----------------------------------------------------------------------------


def _code(path: str | None) -> dict[str, Any]:
    cwd = str(path or Path.cwd())
    commit = _run(["git", "rev-parse", "HEAD"], cwd=cwd)
    if commit is None:
        return {"git_commit": None, "git_dirty": None, "git_branch": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd)
    branch = _run(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=cwd)
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None, "git_branch": branch}


def _settings() -> dict[str, Any]:
    env = {
        k: v
        for k, v in os.environ.items()
        if (k in _SETTINGS_ENV or k.startswith(_SETTINGS_PREFIXES)) and not _SECRET.search(k)
    }
    out: dict[str, Any] = {"env": dict(sorted(env.items()))}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()
        out["deterministic_warn_only"] = torch.is_deterministic_algorithms_warn_only_enabled()
        out["cudnn_benchmark"] = torch.backends.cudnn.benchmark
        out["cudnn_deterministic"] = torch.backends.cudnn.deterministic
        out["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        out["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        out["num_threads"] = torch.get_num_threads()
    return out


# -- the manifest ----------------------------------------------------------------------------------


@dataclass
class EnvManifest:
    """One capture: four scopes of plain JSON data. See :func:`capture`."""

    image: dict[str, Any]
    host: dict[str, Any]
    code: dict[str, Any]
    settings: dict[str, Any]
    captured_at: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    schema: int = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable dict with top-level ``image``, ``host``, ``code``, ``settings``."""
        return {"schema": self.schema, "captured_at": self.captured_at, **{s: getattr(self, s) for s in SCOPES}}

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> EnvManifest:
        """Build from :meth:`to_dict` output; a missing or mistyped scope raises :class:`ManifestError`."""
        if not isinstance(d, dict):
            raise ManifestError(f"{source}: expected a JSON object with {', '.join(SCOPES)}, got {type(d).__name__}")
        for scope in SCOPES:
            if not isinstance(d.get(scope), dict):
                got = "missing" if scope not in d else type(d[scope]).__name__
                raise ManifestError(f"{source}: field '{scope}' must be an object, got {got}")
        if not isinstance(d["image"].get("packages", {}), dict):
            raise ManifestError(f"{source}: field 'image.packages' must map names to versions")
        return cls(
            **{s: d[s] for s in SCOPES}, captured_at=str(d.get("captured_at", "")), schema=int(d.get("schema", SCHEMA))
        )

    def save(self, path: str | Path) -> None:
        """Write JSON atomically (temporary file, fsync, rename): a crash never leaves half a manifest."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> EnvManifest:
        """Read a saved manifest; malformed JSON or fields raise :class:`ManifestError` naming the file."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ManifestError(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from err
        except OSError as err:
            raise ManifestError(f"{path}: cannot read ({err.strerror})") from err
        return cls.from_dict(data, source=str(path))


def as_dict(manifest: EnvManifest | dict[str, Any]) -> dict[str, Any]:
    """The plain-dict form of a manifest, whether given an :class:`EnvManifest` or its ``to_dict()``."""
    return manifest.to_dict() if hasattr(manifest, "to_dict") else manifest


def capture(code_path: str | Path | None = None) -> EnvManifest:
    """Record the environment: image, host, code (git at ``code_path`` or the cwd) and settings.

    Reads files and installed-package metadata (no ``pip freeze``); imports torch if it is installed.
    Never raises for something absent, never records an environment variable that looks like a
    credential.

    Example:
        >>> m = capture()
        >>> sorted(m.to_dict())
        ['captured_at', 'code', 'host', 'image', 'schema', 'settings']
    """
    image = _image()  # imports torch first, so settings see it
    return EnvManifest(
        image=image, host=_host(), code=_code(str(code_path) if code_path else None), settings=_settings()
    )


# -- diff ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    """One field that differs between two manifests."""

    path: str
    """Dotted path, e.g. ``host.nvidia_driver`` or ``image.packages.numpy``."""
    scope: str
    a: Any
    b: Any

    def __str__(self) -> str:
        return f"{self.path}: {self.a} -> {self.b}"


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    # Packages and env knobs are compared key by key; other dicts too; lists as whole values.
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = value


def diff(a: EnvManifest | dict, b: EnvManifest | dict, *, ignore: set[str] | None = None) -> list[Difference]:
    """Every field that differs, with its scope, image first, then host, code, settings.

    Example:
        >>> m = capture(); other = EnvManifest.from_dict(m.to_dict())
        >>> other.host = {**other.host, "nvidia_driver": "550.90.07"}
        >>> [(d.scope, d.path) for d in diff(m, other)]
        [('host', 'host.nvidia_driver')]
    """
    da, db = as_dict(a), as_dict(b)
    ignore = ignore or set()
    out: list[Difference] = []
    for scope in SCOPES:
        fa: dict[str, Any] = {}
        fb: dict[str, Any] = {}
        _flatten(da.get(scope), scope, fa)
        _flatten(db.get(scope), scope, fb)
        for path in sorted(fa.keys() | fb.keys()):
            if path in ignore:
                continue
            va, vb = fa.get(path), fb.get(path)
            if va != vb:
                out.append(Difference(path, scope, va, vb))
    return out


def summarize(diffs: list[Difference]) -> str:
    """One line: which scopes are identical and what differs, e.g. ``image identical; host differs: ...``."""
    parts = []
    for scope in SCOPES:
        mine = [d for d in diffs if d.scope == scope]
        if not mine:
            parts.append(f"{scope} identical")
            continue
        shown = ", ".join(f"{d.path.split('.', 1)[1]} {d.a} \u2192 {d.b}" for d in mine[:3])
        more = f" (+{len(mine) - 3} more)" if len(mine) > 3 else ""
        parts.append(f"{scope} differs: {shown}{more}")
    return "; ".join(parts)


# -- ranks -----------------------------------------------------------------------------------------


def gather_manifests(manifest: EnvManifest | None = None, group: Any = None) -> list[EnvManifest] | None:
    """Every rank captures; rank 0 receives all manifests (others get None). Uses torch's gather_object."""
    import torch.distributed as dist

    manifest = manifest or capture()
    if not (dist.is_available() and dist.is_initialized()):
        return [manifest]
    rank = dist.get_rank(group)
    out: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.gather_object(manifest.to_dict(), out, dst=dst, group=group)
    return [EnvManifest.from_dict(d, source=f"rank {r}") for r, d in enumerate(out)] if out is not None else None


def compare_ranks(
    manifests: list[EnvManifest], scopes: tuple[str, ...] = ("image", "host")
) -> dict[int, list[Difference]]:
    """Ranks whose image or host differ from rank 0's (machine identity such as hostname aside)."""
    ref = manifests[0]
    report = {}
    for rank, m in enumerate(manifests[1:], start=1):
        diffs = [d for d in diff(ref, m, ignore=_IDENTITY) if d.scope in scopes]
        if diffs:
            report[rank] = diffs
    return report


def requirement_closure(roots: tuple[str, ...] | list[str]) -> set[str]:
    """Canonical names of ``roots`` and every installed distribution they require, transitively.

    Markers are evaluated for this interpreter; extras are not followed.

    Raises:
        KeyError: a root is not installed (the key is the root's name).
    """
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [(r, True) for r in roots]
    while todo:
        name, is_root = todo.pop()
        key = canonicalize_name(name)
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            if is_root:
                raise KeyError(name) from None
            continue  # an optional or platform-specific requirement that is not installed
        seen.add(key)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append((req.name, False))
    return seen
