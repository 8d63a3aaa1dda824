"""Reproducible images from a manifest: the image tag and the Dockerfile (the lockfile is in :mod:`.lockfile`).

The image pins what lives inside it: the base OS (by tag, and by digest when given), Python, every
distribution at its exact version (installed with ``--no-deps``, so nothing is re-resolved) and the
code at a commit. The host's NVIDIA driver and kernel cannot be pinned by an image; the generated
entrypoint runs ``steadytrain env check`` against the contract before anything else.

Nothing reaches the Dockerfile unchecked: every value from the manifest or an argument is matched
against its grammar (:mod:`.grammar`) first, shell commands are exec-form JSON or ``shlex``-quoted,
and comments carry only checked values, so no input can add an instruction.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from steadytrain._io import brief
from steadytrain.env import grammar
from steadytrain.env._schema import as_dict, source_of
from steadytrain.env.lockfile import canonical_name, lockfile, parse_lockfile
from steadytrain.errors import UserError

__all__ = ["canonical_name", "dockerfile", "image_tag", "lockfile", "parse_lockfile"]

_CONTEXT_PATH = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_./-]*")
_TAG_CHARS = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def image_tag(manifest: Any, name: str, version: str) -> str:
    """An image reference that says what is inside: ``name:v2.3.1-cuda12.1-cudnn8.9-torch2.1.0``.

    CUDA and cuDNN appear as major.minor, torch without its local suffix (``+cu121``, ``+cpu``);
    without CUDA the stack part reads ``cpu``.

    Raises:
        UserError: ``name`` is not a Docker repository name, the tag is not a Docker tag, or the
            manifest's torch/CUDA/cuDNN version breaks its grammar.

    Example:
        >>> m = {"image": {"cuda": "12.1", "cudnn": "8.9.2", "torch": "2.1.0+cu121"}}
        >>> image_tag(m, "training", "2.3.1")
        'training:v2.3.1-cuda12.1-cudnn8.9-torch2.1.0'
        >>> image_tag({"image": {"torch": "2.13.0+cpu"}}, "training", "v2.3.1")
        'training:v2.3.1-cpu-torch2.13.0'
    """
    grammar.repository("name", name)
    stack = grammar.image_stack(as_dict(manifest).get("image") or {}, source_of(manifest))
    if not isinstance(version, str):
        raise UserError(f"version={brief(version)} must be a string, like '2.3.1'")
    release = version.removeprefix("v")
    if not release:
        raise UserError(f"version={brief(version)} is empty: give the release, like '2.3.1'")
    if _TAG_CHARS.fullmatch(release) is None:
        raise UserError(f"version={brief(version)} is not part of a Docker tag: use [A-Za-z0-9_.-], like '2.3.1'")
    parts = [f"v{release}"]
    if stack["cuda"]:
        parts.append(f"cuda{_major_minor(stack['cuda'])}")
        if stack["cudnn"]:
            parts.append(f"cudnn{_major_minor(stack['cudnn'])}")
    else:
        parts.append("cpu")
    if stack["torch"]:
        parts.append(f"torch{stack['torch'].split('+')[0]}")
    tag = "-".join(parts)
    try:
        grammar.tag("tag", tag)
    except UserError:  # version is short and plain here (checked above): quote it whole
        raise UserError(
            f"image tag {tag!r} (from version {version!r}) is not a Docker tag: [A-Za-z0-9_.-], <= 128"
        ) from None
    return f"{name}:{tag}"


def _context_path(what: str, path: str) -> str:
    """A file in the build context: relative, no spaces, every part a name (not '.', '..', '' or a trailing '/')."""
    if (
        not isinstance(path, str)
        or _CONTEXT_PATH.fullmatch(path) is None
        or any(part in ("", ".", "..") for part in path.split("/"))
    ):
        raise UserError(
            f"{what}={brief(path)} must be a relative path to a file inside the build context "
            "(like 'requirements.lock' or 'deploy/contract.yaml'), without spaces, '.' or '..'"
        )
    return path


def _workdir(path: object) -> str:
    if not isinstance(path, str) or not path.startswith("/") or not _CONTEXT_PATH.fullmatch(path.strip("/") or "."):
        raise UserError(f"workdir={brief(path)} must be an absolute path without spaces")
    return path


def _pinned_base(base_image: str, base_digest: str | None) -> str:
    """``FROM`` operand: ``repo:tag``, ``repo@digest`` or ``repo:tag@digest``; refuses an unpinned base."""
    ref = grammar.image_reference("base_image", base_image)
    digest = ref.digest
    if base_digest is not None:
        given = base_digest.strip() if isinstance(base_digest, str) else base_digest
        given = grammar.digest("base_digest", f"sha256:{given}" if re.fullmatch("[0-9a-f]{64}", str(given)) else given)
        if digest is not None and digest != given:
            raise UserError(f"base_image {brief(base_image)} already carries a different digest than {given}")
        digest = given
    if digest is None and ref.tag in (None, "latest"):
        raise UserError(
            f"base_image={brief(base_image)} is not pinned, so the image is not reproducible: "
            "name a tag (python:3.11.7-slim-bookworm) and preferably pass base_digest"
        )
    return str(grammar.ImageReference(ref.repository, ref.tag, digest))


def _labels(commit: str | None, dirty: bool, tag: grammar.ImageReference | None) -> dict[str, str]:
    labels = {"org.opencontainers.image.revision": commit} if commit else {}
    if tag:
        labels["org.opencontainers.image.title"] = tag.repository.rsplit("/", 1)[-1]
        if tag.tag:
            labels["org.opencontainers.image.version"] = tag.tag
    if dirty:
        labels["steadytrain.git.dirty"] = "true"  # built from uncommitted changes: the revision is not all of it
    return labels


def _python_check(python: str) -> str:
    """``RUN`` in exec form (no shell) that fails the build when the base's Python minor is not ``python``'s."""
    want, note = f"{_major_minor(python)}.", f", the lockfile was captured on {python}"
    script = (
        "import platform, sys; v = platform.python_version(); "
        f"sys.exit(0 if v.startswith({want!r}) else 'base image has Python ' + v + {note!r})"
    )
    return "RUN " + json.dumps(["python", "-c", script])


def _checked(manifest: Any) -> dict[str, Any]:
    """What the Dockerfile takes from the manifest, each value checked against its grammar."""
    d, where = as_dict(manifest), source_of(manifest)
    code = d.get("code") or {}
    commit = code.get("git_commit")
    return {
        "stack": grammar.image_stack(d.get("image") or {}, where),
        "commit": None if commit is None else grammar.git_commit(f"{where}: code.git_commit", commit),
        "dirty": code.get("git_dirty") is True,
        "captured": grammar.timestamp(f"{where}: captured_at", d["captured_at"]) if d.get("captured_at") else None,
    }


def _header(stack: dict[str, Any], commit: str | None, dirty: bool, captured: str | None, contract: str) -> list[str]:
    """The comment block: only checked values (a timestamp, versions, a commit) appear in it."""
    inside = ", ".join(f"{k} {stack[k] or ('unknown' if k == 'python' else 'none')}" for k in stack)
    return [
        f"# Generated by `steadytrain env dockerfile`{f' from a manifest captured {captured}' if captured else ''}.",
        f"# Inside the image: {inside}; code {commit or 'unknown'}{' (dirty tree)' if dirty else ''}.",
        "# NOT pinned by the image: the host's NVIDIA driver and kernel. The entrypoint's",
        f"# `steadytrain env check --contract {contract}` covers them at every container start.",
        "# Keep .venv/ and .git/ out of the build context with a .dockerignore.",
    ]


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
        UserError: an unpinned base (no tag, or ``latest``, and no digest), a malformed reference,
            digest or path, or a manifest value (commit, versions, capture time) that breaks its grammar.

    Example:
        >>> m = {"image": {"python": "3.11.7"}, "code": {"git_commit": "abc123", "git_dirty": False}}
        >>> text = dockerfile(m, base_image="python:3.11.7-slim-bookworm")
        >>> [line for line in text.splitlines() if line.startswith(("FROM", "CMD"))]
        ['FROM python:3.11.7-slim-bookworm', 'CMD ["train"]']
    """
    m = _checked(manifest)
    stack, commit, dirty = m["stack"], m["commit"], m["dirty"]
    base = _pinned_base(base_image, base_digest)
    ref = grammar.image_reference("tag", tag, allow_digest=False) if tag is not None else None
    workdir = _workdir(workdir)
    lock, contract_src = _context_path("lockfile_path", lockfile_path), _context_path("contract_path", contract_path)
    contract_in_image = f"{workdir.rstrip('/')}/contract.yaml"
    out = _header(stack, commit, dirty, m["captured"], contract_in_image)
    if stack["torch"] and "+" in stack["torch"]:  # the local build (+cu121, +cpu) lives on PyTorch's own index
        index = f"https://download.pytorch.org/whl/{stack['torch'].split('+', 1)[1]}"
        out.append(f"# Build: docker build --build-arg PIP_EXTRA_INDEX_URL={index}{f' -t {ref}' if ref else ''} .")
    out.append(f"FROM {base}")
    if labels := _labels(commit, dirty, ref):
        out.append("LABEL " + " \\\n      ".join(f"{k}={json.dumps(v)}" for k, v in labels.items()))
    env = ["PYTHONDONTWRITEBYTECODE=1", "PIP_NO_CACHE_DIR=1", "PIP_DISABLE_PIP_VERSION_CHECK=1"]
    env += [f"STEADYTRAIN_IMAGE_TAG={json.dumps(str(ref))}"] if ref else []
    out += ["ENV " + " \\\n    ".join(env), "ARG PIP_EXTRA_INDEX_URL=", f"WORKDIR {workdir}"]
    if stack["python"]:  # wheels are built per Python minor: fail the build, not the first import
        out.append(_python_check(stack["python"]))
    start = f'steadytrain env check --contract {shlex.quote(contract_in_image)} && exec steadytrain "$@"'
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
