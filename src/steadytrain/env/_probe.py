"""Probes that read the machine for a capture: the image, the host, the code (git) and the settings.

Anything absent (no GPU, no git) is ``None``, never an exception. Two rules keep a capture safe on
a machine or repository the user does not fully trust: git runs with every repository setting that
executes code switched off (fsmonitor hooks, hooks, clean filters), and no credential is recorded
(variables whose names look secret are skipped, ``user:password@`` in a URL value is redacted).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

# Environment variable names that may hold a credential: never recorded, not even their names' values.
_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASS(WORD|WD)?|CREDENTIAL|AUTH|PRIVATE|COOKIE|SESSION|SIGNATURE", re.I)
# The userinfo of a URL (``scheme://user:password@host``): greedy up to the authority's last '@'.
_URL_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")
# ``user:password@host`` without a scheme (NCCL_COMM_ID-style values), at the start or after a separator.
_BARE_USERINFO = re.compile(r"(?<![^\s,;=])[^\s,;=/@:]+:[^\s,;=/]*@")
# ``name=value`` where the name looks secret: a URL query (``?token=``), a DSN, an embedded assignment.
_SECRET_PAIR = re.compile(rf"((?:[A-Za-z0-9_.-]*(?:{_SECRET.pattern})[A-Za-z0-9_.-]*)=)[^&;,\s]*", re.I)
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
# Repository settings that make `git status` run a program: an fsmonitor hook, hooks (post-index-change),
# and clean/process filters, whose names are the repository's own (listed by _filter_overrides).
_GIT_LFS = {
    "filter.lfs.clean": "git-lfs clean -- %f",
    "filter.lfs.smudge": "git-lfs smudge -- %f",
    "filter.lfs.process": "git-lfs filter-process",
}
_GIT_SAFE = ("-c", "core.fsmonitor=false", "-c", f"core.hooksPath={os.devnull}", "--no-optional-locks")


def redact(value: str) -> str:
    """``value`` with credentials replaced: the ``user:password@`` of a URL (with or without a scheme) and
    the value of every ``name=value`` whose name looks secret (``?token=...``, ``AWS_SECRET_ACCESS_KEY=...``).

    Example:
        >>> redact("nccl://admin:hunter2@10.0.0.1:29500,eth0")
        'nccl://***@10.0.0.1:29500,eth0'
        >>> redact("admin:hunter2@10.0.0.1:29500"), redact("https://h/x?token=abc&page=2")
        ('***@10.0.0.1:29500', 'https://h/x?token=***&page=2')
    """
    value = _URL_USERINFO.sub(r"\1***@", value)
    value = _BARE_USERINFO.sub("***@", value)
    return _SECRET_PAIR.sub(r"\1***", value)


def _run(args: list[str], cwd: str | None = None, timeout: float = 2.0) -> str | None:
    """Output of a quick command, or None if it is missing, fails or hangs."""
    if shutil.which(args[0]) is None:
        return None
    try:
        out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return None
    return out.stdout.strip()


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
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
    """Every installed distribution and its version; read once per state of the import path (each entry's
    modification time changes when a package is installed, upgraded or removed there)."""
    stamp = tuple((entry, _mtime(entry)) for entry in sys.path)
    if _PACKAGES.get("stamp") != stamp:
        _PACKAGES.update(stamp=stamp, packages=_read_packages())
    return dict(_PACKAGES["packages"])


_PACKAGES: dict[str, Any] = {}
"""The last :func:`_read_packages` and the import path's state it was read in (parsing every ``METADATA`` file
costs ~0.15 s: a process that captures its environment more than once reads it once)."""


def _mtime(entry: str) -> int | None:
    try:
        return os.stat(entry or ".").st_mtime_ns
    except OSError:
        return None


def _read_packages() -> dict[str, str]:
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


def image() -> dict[str, Any]:
    """The ``image`` scope: OS, Python, every installed distribution, torch/CUDA/cuDNN/NCCL."""
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
    try:
        return [
            {"name": n.strip(), "memory_mib": int(m)} for n, m in (line.rsplit(",", 1) for line in out.splitlines())
        ]
    except ValueError:  # an odd nvidia-smi answer ("[N/A]"): unknown, not a failed capture
        return None


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


def host() -> dict[str, Any]:
    """The ``host`` scope: what no image pins (hostname, kernel, NVIDIA driver, GPUs, CPU, container)."""
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


def _filter_overrides(cwd: str) -> list[str]:
    """``-c`` options that blank every clean/smudge/process filter the repository configures.

    Reading the configuration runs nothing; an emptied filter command is skipped by git. Git LFS,
    configured exactly as ``git lfs install`` writes it, is kept: it runs the user's own ``git-lfs``.
    A file under a blanked filter whose stat data is stale may then read as modified (dirty).
    """
    pattern = r"^filter\..*\.(clean|smudge|process)$"
    listed = _run(["git", *_GIT_SAFE, "config", "--null", "--get-regexp", pattern], cwd)
    names: set[str] = set()
    for entry in (listed or "").split("\0"):
        key, _, value = entry.partition("\n")
        if key.startswith("filter.") and _GIT_LFS.get(key) != value:
            names.add(key[len("filter.") : key.rfind(".")])
    out: list[str] = []
    for name in sorted(names):
        for setting in ("clean=", "smudge=", "process=", "required=false"):
            out += ["-c", f"filter.{name}.{setting}"]
    return out


def code(path: str | None) -> dict[str, Any]:
    """The ``code`` scope: commit, dirty flag and branch of the git checkout at ``path`` (or the cwd).

    No program the repository configures runs: fsmonitor and hooks are off, filters blanked, and
    ``status`` neither writes the index nor looks inside submodules (their moved commits still count).
    """
    cwd = str(path or Path.cwd())
    commit = _run(["git", *_GIT_SAFE, "rev-parse", "HEAD"], cwd=cwd)
    if commit is None:
        return {"git_commit": None, "git_dirty": None, "git_branch": None}
    status_args = ["status", "--porcelain", "--untracked-files=no", "--ignore-submodules=dirty"]
    status = _run(["git", *_GIT_SAFE, *_filter_overrides(cwd), *status_args], cwd=cwd)
    branch = _run(["git", *_GIT_SAFE, "rev-parse", "--abbrev-ref", "HEAD"], cwd=cwd)
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None, "git_branch": branch}


def settings() -> dict[str, Any]:
    """The ``settings`` scope: determinism and distributed knobs, secrets skipped and URL credentials redacted."""
    env = {
        k: redact(v)
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
