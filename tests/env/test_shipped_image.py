"""The repository's own Dockerfile, lockfile and contract, made by `make image-files`, hold together."""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from steadytrain.env import Contract, parse_lockfile

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_is_pinned_and_checks_the_contract():
    parser = DockerfileParser()
    parser.content = (ROOT / "Dockerfile").read_text()
    assert re.fullmatch(r"[\w./-]+:[\w.-]+(@sha256:[0-9a-f]{64})?", parser.baseimage)
    assert not parser.baseimage.endswith(":latest")
    instructions = [(i["instruction"], i["value"]) for i in parser.structure]
    copy_lock = next(n for n, (ins, v) in enumerate(instructions) if ins == "COPY" and "requirements.lock" in v)
    install = next(
        n for n, (ins, v) in enumerate(instructions) if ins == "RUN" and "--no-deps -r requirements.lock" in v
    )
    assert copy_lock < install
    assert re.fullmatch(r"[0-9a-f]{40}", parser.labels["org.opencontainers.image.revision"])
    entrypoint = next(v for ins, v in instructions if ins == "ENTRYPOINT")
    assert "steadytrain env check --contract" in entrypoint
    assert next(v for ins, v in instructions if ins == "CMD") == '["train"]'


def test_lockfile_pins_every_runtime_dependency():
    pins = parse_lockfile((ROOT / "requirements.lock").read_text())
    deps = [Requirement(r) for r in md.requires("steadytrain") or []]
    for req in deps:
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra (dev, bench): not part of the image
        name = canonicalize_name(req.name)
        assert name in pins, name
        assert req.specifier.contains(pins[name].split("+")[0]), (name, pins[name])
    assert "steadytrain" not in pins  # the project is installed from the source copy, not an index


def test_contract_loads_and_uses_the_lockfile():
    contract = Contract.load(ROOT / "contract.yaml")
    assert contract.packages == parse_lockfile((ROOT / "requirements.lock").read_text())
