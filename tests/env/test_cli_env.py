"""``steadytrain env`` as a user runs it: exit codes, messages, no partial files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXE = shutil.which("steadytrain", path=str(Path(sys.executable).parent)) or "steadytrain"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, "env", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("env") / "env.json"
    result = run("capture", "-o", str(path))
    assert result.returncode == 0, result.stderr
    return path


def test_capture_to_stdout_is_json():
    result = run("capture")
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)) >= {"image", "host", "code", "settings"}


def test_diff_identical_then_driver_only(saved, tmp_path):
    same = run("diff", str(saved), str(saved))
    assert same.returncode == 0
    assert "image identical; host identical" in same.stdout
    other = json.loads(saved.read_text())
    other["host"]["nvidia_driver"] = "550.90.07"
    changed = tmp_path / "other.json"
    changed.write_text(json.dumps(other))
    result = run("diff", str(saved), str(changed))
    assert result.returncode == 1
    verdict = result.stdout.strip().splitlines()[-1]
    assert verdict.startswith("image identical; host differs: nvidia_driver None")
    assert "550.90.07" in verdict


def test_malformed_manifest_exit_2_names_file_and_field(saved, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"image": {}, "host": [], "code": {}, "settings": {}}))
    result = run("diff", str(saved), str(bad))
    assert result.returncode == 2
    assert "bad.json" in result.stderr and "'host'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_check_exit_codes(saved, tmp_path):
    ok = tmp_path / "ok.yaml"
    python = json.loads(saved.read_text())["image"]["python"]
    ok.write_text(f"python: '{python}'\n")
    result = run("check", "--contract", str(ok), "--manifest", str(saved))
    assert result.returncode == 0, result.stdout + result.stderr
    strict = tmp_path / "strict.yaml"
    strict.write_text("python: '2.7'\nkernel: {min: '99.0'}\n")
    result = run("check", "--contract", str(strict), "--manifest", str(saved))
    assert result.returncode == 1
    assert result.stdout.count("violation:") == 2
    broken = tmp_path / "broken.yaml"
    broken.write_text("driver: {minimum: '535'}\n")
    result = run("check", "--contract", str(broken), "--manifest", str(saved))
    assert result.returncode == 2 and "broken.yaml" in result.stderr


def test_lock_and_tag(saved, tmp_path):
    out = tmp_path / "requirements.lock"
    result = run("lock", "--manifest", str(saved), "-o", str(out))
    assert result.returncode == 0, result.stderr
    pins = dict(line.split("==") for line in out.read_text().splitlines() if line and not line.startswith("#"))
    assert pins == json.loads(saved.read_text())["image"]["packages"]
    tag = run("tag", "--name", "training", "--version", "2.3.1", "--manifest", str(saved))
    assert tag.returncode == 0 and tag.stdout.startswith("training:v2.3.1-")
    bad = run("tag", "--name", "Bad Name", "--version", "1", "--manifest", str(saved))
    assert bad.returncode == 2


def test_dockerfile_unpinned_base_leaves_no_file(saved, tmp_path):
    out = tmp_path / "Dockerfile"
    result = run("dockerfile", "--base", "python", "--manifest", str(saved), "-o", str(out))
    assert result.returncode == 2
    assert not out.exists() and not list(tmp_path.glob(".Dockerfile*"))
    result = run("dockerfile", "--base", "python:3.11.7-slim-bookworm", "--manifest", str(saved), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_text().startswith("#")
