"""Reproducible images from a manifest: the lockfile, the image tag and the Dockerfile.

The image pins what lives inside it: the base OS (by tag, and by digest when given), Python, every
distribution at its exact version (installed with ``--no-deps``, so nothing is re-resolved) and the
code at a commit. The host's NVIDIA driver and kernel cannot be pinned by an image; the generated
entrypoint runs ``steadytrain env check`` against the contract before anything else.
"""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath
from typing import Any

from packaging.utils import canonicalize_name as canonical_name

from steadytrain.env.manifest import as_dict

__all__ = ["canonical_name", "dockerfile", "image_tag", "lockfile", "parse_lockfile"]

_PIN = re.compile(r"([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*==\s*([A-Za-z0-9][A-Za-z0-9.+!_-]*)")
_NAME_PART = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")  # Docker repository path component
_DOMAIN = re.compile(
    r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]+)?"
)
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"(?:sha256:)?([0-9a-f]{64})")
_CONTEXT_PATH = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_./-]*")


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def lockfile(manifest: Any, *, only: set[str] | None = None, exclude: set[str] | None = None) -> str:
    """``name==version`` for every distribution in the manifest's image, sorted, under a provenance header.

    Pass ``exclude={"steadytrain"}`` (the project itself) for a Dockerfile that installs the project
    from its source: that version is not on any index.

    Args:
        manifest: an ``EnvManifest`` or its ``to_dict()`` form.
        only: keep just these distributions (any spelling of the names).
        exclude: drop these distributions.

    Raises:
        ValueError: ``only`` names a distribution the manifest does not have.

    Example:
        >>> m = {"image": {"python": "3.11.7", "packages": {"torch": "2.13.0+cpu", "numpy": "2.4.6"}}}
        >>> print(lockfile(m), end="")
        # steadytrain lockfile
        # python 3.11.7
        # torch none, cuda none
        numpy==2.4.6
        torch==2.13.0+cpu
    """
    d = as_dict(manifest)
    image, host = d.get("image") or {}, d.get("host") or {}
    packages = {canonical_name(k): v for k, v in (image.get("packages") or {}).items()}
    if only is not None:
        wanted = {canonical_name(n) for n in only}
        if wanted - packages.keys():
            raise ValueError(f"only={sorted(wanted - packages.keys())} are not installed in the manifest's image")
        packages = {k: v for k, v in packages.items() if k in wanted}
    for name in exclude or ():
        packages.pop(canonical_name(name), None)
    pretty = ((image.get("os") or {}).get("pretty_name")) or None
    where = " ".join(x for x in (host.get("platform"), f"({pretty})" if pretty else None) if x)
    torch_line = f"# torch {image.get('torch') or 'none'}, cuda {image.get('cuda') or 'none'}"
    lines = ["# steadytrain lockfile", f"# python {image.get('python') or 'unknown'}" + (f", {where}" if where else "")]
    lines.append(torch_line + (f", cudnn {image['cudnn']}" if image.get("cudnn") else ""))
    lines += [f"{name}=={packages[name]}" for name in sorted(packages)]
    return "\n".join(lines) + "\n"


def parse_lockfile(text: str) -> dict[str, str]:
    """The pins of a lockfile: canonical name -> exact version. Comments and blank lines are ignored.

    Raises:
        ValueError: a line that is not ``name==version``, or a name pinned twice (names the line number).

    Example:
        >>> parse_lockfile("# header\\nNumPy==2.4.6\\ntorch==2.1.0+cu121  # from the cu121 index\\n")
        {'numpy': '2.4.6', 'torch': '2.1.0+cu121'}
    """
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split(" #")[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        m = _PIN.fullmatch(line)
        if m is None:
            raise ValueError(f"lockfile line {n}: expected 'name==version', got {raw.strip()!r}")
        name = canonical_name(m.group(1))
        if name in out:
            raise ValueError(f"lockfile line {n}: {name} is pinned twice ({out[name]} and {m.group(2)})")
        out[name] = m.group(2)
    return out


def _check_repository(name: str) -> None:
    parts = name.split("/")
    first_is_domain = len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost")
    ok = len(name) <= 255 and (not first_is_domain or _DOMAIN.fullmatch(parts[0]) is not None)
    if not ok or not all(_NAME_PART.fullmatch(p) for p in parts[1 if first_is_domain else 0 :]):
        raise ValueError(
            f"image name {name!r} is not a valid Docker repository name: use lower-case letters, digits and "
            "'.', '_', '-' between them, '/' between path components (an optional registry host first), no tag"
        )


def _split_reference(ref: str) -> tuple[str, str | None]:
    """``repo:tag`` -> (repo, tag); a ``:`` before the last ``/`` is a registry port, not a tag."""
    head, _, last = ref.rpartition("/")
    if ":" in last:
        last, tag = last.split(":", 1)
        return (f"{head}/{last}" if head else last), tag
    return ref, None


def image_tag(manifest: Any, name: str, version: str) -> str:
    """An image reference that says what is inside: ``name:v2.3.1-cuda12.1-cudnn8.9-torch2.1.0``.

    CUDA and cuDNN appear as major.minor, torch without its local suffix (``+cu121``, ``+cpu``);
    without CUDA the stack part reads ``cpu``.

    Raises:
        ValueError: ``name`` is not a Docker repository name, or the tag is not a Docker tag.

    Example:
        >>> m = {"image": {"cuda": "12.1", "cudnn": "8.9.2", "torch": "2.1.0+cu121"}}
        >>> image_tag(m, "training", "2.3.1")
        'training:v2.3.1-cuda12.1-cudnn8.9-torch2.1.0'
        >>> image_tag({"image": {"torch": "2.13.0+cpu"}}, "training", "v2.3.1")
        'training:v2.3.1-cpu-torch2.13.0'
    """
    _check_repository(name)
    image = as_dict(manifest).get("image") or {}
    parts = [f"v{version.removeprefix('v')}"]
    if image.get("cuda"):
        parts.append(f"cuda{_major_minor(image['cuda'])}")
        if image.get("cudnn"):
            parts.append(f"cudnn{_major_minor(str(image['cudnn']))}")
    else:
        parts.append("cpu")
    if image.get("torch"):
        parts.append(f"torch{image['torch'].split('+')[0]}")
    tag = "-".join(parts)
    if not version.removeprefix("v"):
        raise ValueError(f"version={version!r} is empty: give the release, like '2.3.1'")
    if _TAG.fullmatch(tag) is None:
        raise ValueError(f"image tag {tag!r} (from version {version!r}) is not a Docker tag: [A-Za-z0-9_.-], <= 128")
    return f"{name}:{tag}"


def _context_path(what: str, path: str) -> str:
    if _CONTEXT_PATH.fullmatch(path) is None or ".." in PurePosixPath(path).parts:
        raise ValueError(f"{what}={path!r} must be a relative path inside the build context, without spaces")
    return path


def _pinned_base(base_image: str, base_digest: str | None) -> str:
    """``FROM`` operand: ``repo:tag``, ``repo@digest`` or ``repo:tag@digest``; refuses an unpinned base."""
    repo, base_tag = _split_reference(base_image.split("@")[0])
    digest = base_image.split("@", 1)[1] if "@" in base_image else None
    if base_digest is not None:
        m = _DIGEST.fullmatch(base_digest.strip())
        if m is None:
            raise ValueError(f"base_digest={base_digest!r} must be 'sha256:' followed by 64 lower-case hex digits")
        if digest is not None and digest != f"sha256:{m.group(1)}":
            raise ValueError(f"base_image {base_image!r} already carries a different digest than {base_digest!r}")
        digest = f"sha256:{m.group(1)}"
    if digest is None and base_tag in (None, "latest"):
        raise ValueError(
            f"base_image={base_image!r} is not pinned, so the image is not reproducible: "
            "name a tag (python:3.11.7-slim-bookworm) and preferably pass base_digest"
        )
    base = f"{repo}:{base_tag}" if base_tag else repo
    return f"{base}@{digest}" if digest else base


def _labels(commit: str | None, dirty: bool, tag: str | None) -> dict[str, str]:
    labels = {"org.opencontainers.image.revision": commit} if commit else {}
    if tag:
        repo, version = _split_reference(tag)
        _check_repository(repo)
        labels["org.opencontainers.image.title"] = repo.rsplit("/", 1)[-1]
        if version:
            labels["org.opencontainers.image.version"] = version
    if dirty:
        labels["steadytrain.git.dirty"] = "true"  # built from uncommitted changes: the revision is not all of it
    return labels


def dockerfile(
    manifest: Any,
    *,
    base_image: str,
    base_digest: str | None = None,
    lockfile_path: str = "requirements.lock",
    contract_path: str = "contract.yaml",
    tag: str | None = None,
    workdir: str = "/app",
) -> str:
    """A Dockerfile that rebuilds the manifest's image: pinned base, exact lockfile install, commit label.

    Args:
        manifest: an ``EnvManifest`` or its ``to_dict()`` form.
        base_image: ``repo:tag`` of the base (its Python must match the manifest's major.minor).
        base_digest: ``sha256:<64 hex>`` pinning the base byte for byte (recommended).
        lockfile_path: the lockfile in the build context (from :func:`lockfile`, project excluded).
        contract_path: the contract in the build context, checked at every container start.
        tag: the image reference (:func:`image_tag`), recorded in labels and ``STEADYTRAIN_IMAGE_TAG``.
        workdir: absolute directory in the image for the lockfile, project and contract.

    Raises:
        ValueError: an unpinned base (no tag, or ``latest``, and no digest), a malformed digest or path.

    Example:
        >>> m = {"image": {"python": "3.11.7"}, "code": {"git_commit": "abc123", "git_dirty": False}}
        >>> text = dockerfile(m, base_image="python:3.11.7-slim-bookworm")
        >>> [line for line in text.splitlines() if line.startswith(("FROM", "CMD"))]
        ['FROM python:3.11.7-slim-bookworm', 'CMD ["train"]']
    """
    d = as_dict(manifest)
    image, code = d.get("image") or {}, d.get("code") or {}
    base = _pinned_base(base_image, base_digest)
    if _CONTEXT_PATH.fullmatch(workdir.strip("/") or ".") is None or not workdir.startswith("/"):
        raise ValueError(f"workdir={workdir!r} must be an absolute path without spaces")
    lock, contract_src = _context_path("lockfile_path", lockfile_path), _context_path("contract_path", contract_path)
    contract_in_image = f"{workdir.rstrip('/')}/contract.yaml"
    py, torch, cuda, cudnn = (image.get(k) for k in ("python", "torch", "cuda", "cudnn"))
    commit, dirty = code.get("git_commit"), bool(code.get("git_dirty"))
    stack = f"python {py or 'unknown'}, torch {torch or 'none'}, cuda {cuda or 'none'}, cudnn {cudnn or 'none'}"
    captured = f" from a manifest captured {d['captured_at']}" if d.get("captured_at") else ""
    out = [
        f"# Generated by `steadytrain env dockerfile`{captured}.",
        f"# Inside the image: {stack}; code {commit or 'unknown'}{' (dirty tree)' if dirty else ''}.",
        "# NOT pinned by the image: the host's NVIDIA driver and kernel. The entrypoint's",
        f"# `steadytrain env check --contract {contract_in_image}` covers them at every container start.",
        "# Keep .venv/ and .git/ out of the build context with a .dockerignore.",
    ]
    if torch and "+" in torch:  # the local build (+cu121, +cpu) lives on PyTorch's own index
        index = f"https://download.pytorch.org/whl/{torch.split('+', 1)[1]}"
        out.append(f"# Build: docker build --build-arg PIP_EXTRA_INDEX_URL={index}{f' -t {tag}' if tag else ''} .")
    out.append(f"FROM {base}")
    if labels := _labels(commit, dirty, tag):
        out.append("LABEL " + " \\\n      ".join(f"{k}={json.dumps(v)}" for k, v in labels.items()))
    env = ["PYTHONDONTWRITEBYTECODE=1", "PIP_NO_CACHE_DIR=1", "PIP_DISABLE_PIP_VERSION_CHECK=1"]
    env += [f"STEADYTRAIN_IMAGE_TAG={json.dumps(tag)}"] if tag else []
    out += ["ENV " + " \\\n    ".join(env), "ARG PIP_EXTRA_INDEX_URL=", f"WORKDIR {workdir}"]
    if py:  # wheels are built per Python minor: fail the build, not the first import
        msg = f'"base image has Python " + v + ", the lockfile was captured on {py}"'
        check = f'sys.exit(0 if v.startswith("{_major_minor(py)}.") else {msg})'
        out.append(f"RUN python -c 'import platform, sys; v = platform.python_version(); {check}'")
    start = f'steadytrain env check --contract {contract_in_image} && exec steadytrain "$@"'
    out += [
        f"COPY {lock} requirements.lock",
        "RUN python -m pip install --no-deps -r requirements.lock"
        " ${PIP_EXTRA_INDEX_URL:+--extra-index-url $PIP_EXTRA_INDEX_URL}",
        "COPY . .",
        "RUN python -m pip install --no-deps .",
        f"COPY {contract_src} {contract_in_image}",
        # sh -c: the check runs first; "$@" (CMD or `docker run` arguments) reaches steadytrain intact.
        "ENTRYPOINT " + json.dumps(["/bin/sh", "-c", start, "steadytrain"]),
        'CMD ["train"]',
    ]
    return "\n".join(out) + "\n"
