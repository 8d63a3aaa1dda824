"""Lockfile, image tag and Dockerfile built from a manifest, checked by parsing them back."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
from dockerfile_parse import DockerfileParser

from steadytrain.env.build import canonical_name, dockerfile, image_tag, lockfile, parse_lockfile

COMMIT = "3f2c9a1e0b7d4c6a8e5f1b2d3c4a5e6f7a8b9c0d"
DIGEST = "sha256:" + "ab12" * 16


def fake_manifest(*, cuda: str | None = "12.1", dirty: bool = False, commit: str | None = COMMIT) -> dict:
    """A manifest dict in the ``EnvManifest.to_dict()`` schema, without calling capture()."""
    torch = "2.1.0+cu121" if cuda else "2.13.0+cpu"
    packages = {"torch": torch, "numpy": "2.4.6", "pyyaml": "6.0.2", "steadytrain": "0.1.0", "zipp": "3.21.0"}
    return {
        "schema": 1,
        "captured_at": "2026-12-02T09:00:00+00:00",
        "image": {
            "os": {"id": "debian", "version_id": "12", "pretty_name": "Debian GNU/Linux 12 (bookworm)"},
            "python": "3.11.7",
            "packages": packages,
            "torch": torch,
            "cuda": cuda,
            "cudnn": "8.9.2" if cuda else None,
            "nccl": "2.18.1" if cuda else None,
        },
        "host": {
            "hostname": "node-a",
            "kernel": "6.1.0-18-amd64",
            "nvidia_driver": "550.90.07" if cuda else None,
            "gpus": None,
            "cpu": {"model": None, "count": 16, "arch": "x86_64"},
            "container": None,
            "platform": "Linux-6.1.0-18-amd64-x86_64-with-glibc2.36",
        },
        "code": {"git_commit": commit, "git_dirty": dirty, "git_branch": "main"},
        "settings": {},
    }


# --- lockfile ----------------------------------------------------------------------------------------


def test_lockfile_pins_every_package_exactly_and_sorted():
    m = fake_manifest()
    text = lockfile(m)
    assert parse_lockfile(text) == m["image"]["packages"]
    pins = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert pins == sorted(pins) and len(pins) == len(m["image"]["packages"])
    assert all(re.fullmatch(r"[a-z0-9-]+==\S+", p) for p in pins)


def test_lockfile_header_from_manifest():
    header = [line for line in lockfile(fake_manifest(cuda=None)).splitlines() if line.startswith("#")]
    assert header[0] == "# steadytrain lockfile"
    assert header[1] == "# python 3.11.7, Linux-6.1.0-18-amd64-x86_64-with-glibc2.36 (Debian GNU/Linux 12 (bookworm))"
    assert header[2] == "# torch 2.13.0+cpu, cuda none"
    assert "cuda 12.1" in lockfile(fake_manifest())


def test_lockfile_only_and_exclude():
    m = fake_manifest()
    assert parse_lockfile(lockfile(m, only={"NumPy", "torch"})) == {"numpy": "2.4.6", "torch": "2.1.0+cu121"}
    excluded = parse_lockfile(lockfile(m, exclude={"steadytrain", "PyYAML"}))
    assert excluded.keys() == {"torch", "numpy", "zipp"}
    assert parse_lockfile(lockfile(m, only={"numpy", "zipp"}, exclude={"zipp"})) == {"numpy": "2.4.6"}
    with pytest.raises(ValueError, match="nonexistent"):
        lockfile(m, only={"nonexistent"})


def test_lockfile_accepts_object_with_to_dict():
    class Manifest:
        def to_dict(self):
            return fake_manifest()

    assert lockfile(Manifest()) == lockfile(fake_manifest())


def test_parse_lockfile_ignores_comments_and_canonicalizes():
    text = "# header\n\n  # indented comment\nTyping_Extensions==4.12.2\ntorch == 2.1.0+cu121  # cu121 index\n"
    assert parse_lockfile(text) == {"typing-extensions": "4.12.2", "torch": "2.1.0+cu121"}


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("numpy==2.4.6\ntorch>=2.1\n", 2),
        ("# c\n\nnumpy\n", 3),
        ("numpy==\n", 1),
        ("numpy==2.4.6\nNumPy==2.4.5\n", 2),  # pinned twice, under any spelling
        ("-r other.txt\n", 1),
    ],
)
def test_parse_lockfile_error_names_line(text, line):
    with pytest.raises(ValueError, match=rf"line {line}\b"):
        parse_lockfile(text)


def test_canonical_name():
    assert canonical_name("Foo__Bar.baz-Qux") == "foo-bar-baz-qux"


# --- image tag ---------------------------------------------------------------------------------------


def test_image_tag_seed_example():
    assert image_tag(fake_manifest(), "training", "2.3.1") == "training:v2.3.1-cuda12.1-cudnn8.9-torch2.1.0"
    assert image_tag(fake_manifest(), "training", "v2.3.1") == "training:v2.3.1-cuda12.1-cudnn8.9-torch2.1.0"


def test_image_tag_cpu():
    assert image_tag(fake_manifest(cuda=None), "training", "2.3.1") == "training:v2.3.1-cpu-torch2.13.0"


def test_image_tag_registry_and_path():
    tag = image_tag(fake_manifest(), "registry.example.com:5000/ml-team/training", "2.3.1")
    assert tag == "registry.example.com:5000/ml-team/training:v2.3.1-cuda12.1-cudnn8.9-torch2.1.0"


@pytest.mark.parametrize(
    "name", ["Training", "train ing", "-training", "training-", "training:latest", "a//b", "", "trä"]
)
def test_image_tag_rejects_bad_names(name):
    with pytest.raises(ValueError, match=re.escape(repr(name))):
        image_tag(fake_manifest(), name, "2.3.1")


@pytest.mark.parametrize("version", ["", "v", "2.3.1+local", "1" * 120])
def test_image_tag_rejects_bad_tags(version):
    with pytest.raises(ValueError, match=re.escape(repr(version))):
        image_tag(fake_manifest(), "training", version)


# --- Dockerfile --------------------------------------------------------------------------------------


def parse(text: str, tmp_path) -> DockerfileParser:
    parser = DockerfileParser(path=str(tmp_path))
    parser.content = text
    return parser


def instructions(parser: DockerfileParser) -> list[tuple[str, str]]:
    return [(i["instruction"], i["value"]) for i in parser.structure]


def index_of(items: list[tuple[str, str]], instruction: str, needle: str) -> int:
    return next(n for n, (ins, value) in enumerate(items) if ins == instruction and needle in value)


def test_dockerfile_pins_base_and_installs_lockfile_first(tmp_path):
    tag = image_tag(fake_manifest(), "training", "2.3.1")
    text = dockerfile(fake_manifest(), base_image="python:3.11.7-slim-bookworm", base_digest=DIGEST, tag=tag)
    parser = parse(text, tmp_path)
    assert parser.baseimage == f"python:3.11.7-slim-bookworm@{DIGEST}"
    items = instructions(parser)
    copy_lock = index_of(items, "COPY", "requirements.lock")
    install_lock = index_of(items, "RUN", "pip install --no-deps -r requirements.lock")
    copy_project = index_of(items, "COPY", ". .")
    install_project = next(n for n, (ins, v) in enumerate(items) if ins == "RUN" and v.endswith("--no-deps ."))
    assert copy_lock < install_lock < copy_project < install_project
    assert "$PIP_EXTRA_INDEX_URL" in items[install_lock][1]
    assert any(ins == "ARG" and value.startswith("PIP_EXTRA_INDEX_URL") for ins, value in items)


def test_dockerfile_labels_and_env(tmp_path):
    tag = image_tag(fake_manifest(), "training", "2.3.1")
    parser = parse(dockerfile(fake_manifest(), base_image="python:3.11.7-slim-bookworm", tag=tag), tmp_path)
    assert parser.labels["org.opencontainers.image.revision"] == COMMIT
    assert parser.labels["org.opencontainers.image.version"] == "v2.3.1-cuda12.1-cudnn8.9-torch2.1.0"
    assert parser.labels["org.opencontainers.image.title"] == "training"
    assert "steadytrain.git.dirty" not in parser.labels
    assert parser.envs["STEADYTRAIN_IMAGE_TAG"] == tag
    assert {k: parser.envs[k] for k in ("PYTHONDONTWRITEBYTECODE", "PIP_NO_CACHE_DIR")} == {
        "PYTHONDONTWRITEBYTECODE": "1",
        "PIP_NO_CACHE_DIR": "1",
    }
    dirty = parse(dockerfile(fake_manifest(dirty=True), base_image="python:3.11.7-slim-bookworm"), tmp_path)
    assert dirty.labels["steadytrain.git.dirty"] == "true"
    assert "STEADYTRAIN_IMAGE_TAG" not in dirty.envs


def test_dockerfile_entrypoint_checks_contract_then_runs(tmp_path):
    text = dockerfile(fake_manifest(), base_image="python:3.11.7-slim-bookworm", workdir="/srv/train")
    items = instructions(parse(text, tmp_path))
    entry = json.loads(next(v for ins, v in items if ins == "ENTRYPOINT"))
    assert json.loads(next(v for ins, v in items if ins == "CMD")) == ["train"]
    assert entry[:2] == ["/bin/sh", "-c"]
    assert "env check --contract /srv/train/contract.yaml" in entry[2]
    assert entry[2].index("env check") < entry[2].index('exec steadytrain "$@"')
    assert index_of(items, "COPY", "/srv/train/contract.yaml") < index_of(items, "ENTRYPOINT", "")
    header = text.split("\nFROM ")[0]
    assert "steadytrain env dockerfile" in header and "NOT pinned" in header and "driver" in header


@pytest.mark.skipif(sys.platform == "win32" or shutil.which("sh") is None, reason="needs a POSIX sh")
@pytest.mark.parametrize("check_rc", [0, 3])
def test_entrypoint_passes_arguments_through(tmp_path, check_rc):
    # Run the generated ENTRYPOINT with a stand-in `steadytrain` that records its arguments.
    text = dockerfile(fake_manifest(), base_image="python:3.11.7-slim-bookworm")
    entry = json.loads(next(v for ins, v in instructions(parse(text, tmp_path)) if ins == "ENTRYPOINT"))
    log = tmp_path / "calls"
    fake = tmp_path / "bin" / "steadytrain"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/sh\nprintf "%s|" "$@" >> "{log}"\necho >> "{log}"\n[ "$1" = env ] && exit {check_rc}\nexit 0\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([*entry, "train", "--config", "a b.yaml"], env=env, timeout=30, check=False)
    calls = log.read_text().splitlines()
    assert calls[0] == "env|check|--contract|/app/contract.yaml|"
    if check_rc == 0:
        assert proc.returncode == 0 and calls[1:] == ["train|--config|a b.yaml|"]
    else:
        assert proc.returncode == check_rc and calls[1:] == []  # a failed check stops the run


def test_dockerfile_digest_only_and_in_reference(tmp_path):
    m = fake_manifest()
    assert parse(dockerfile(m, base_image="python", base_digest=DIGEST), tmp_path).baseimage == f"python@{DIGEST}"
    pinned = f"python:3.11.7-slim@{DIGEST}"
    assert parse(dockerfile(m, base_image=pinned), tmp_path).baseimage == pinned
    with pytest.raises(ValueError, match="different digest"):
        dockerfile(m, base_image=pinned, base_digest="sha256:" + "cd34" * 16)


@pytest.mark.parametrize("base", ["python", "python:latest", "registry.example.com:5000/python"])
def test_dockerfile_unpinned_base_raises(base):
    with pytest.raises(ValueError, match="not pinned"):
        dockerfile(fake_manifest(), base_image=base)


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"base_digest": "sha256:abc"}, "base_digest"),
        ({"workdir": "app"}, "workdir"),
        ({"lockfile_path": "/abs/requirements.lock"}, "lockfile_path"),
        ({"contract_path": "../contract.yaml"}, "contract_path"),
        ({"contract_path": "deploy/../../contract.yaml"}, "contract_path"),
        ({"tag": "Bad Name:v1"}, "Bad Name"),
    ],
)
def test_dockerfile_rejects_bad_arguments(kwargs, word):
    with pytest.raises(ValueError, match=re.escape(word)):
        dockerfile(fake_manifest(), base_image="python:3.11.7-slim-bookworm", **kwargs)


def test_dockerfile_without_commit_has_no_revision_label(tmp_path):
    parser = parse(dockerfile(fake_manifest(commit=None), base_image="python:3.11.7-slim-bookworm"), tmp_path)
    assert "org.opencontainers.image.revision" not in parser.labels
