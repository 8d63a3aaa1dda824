"""A hostile or careless user against ``steadytrain env`` and ``steadytrain plan`` (issue 8, second pass).

Each test is one class of input that got past the first hardening pass: special files named as an
input (a FIFO hung forever, ``/dev/zero`` was read as 64 MiB of text) or as ``-o`` (a device node was
replaced by a regular file), output quirks (an empty name, a symlink, file modes), numbers too long
to compare, names that are not names, credentials without a URL scheme, duplicate keys that silently
overwrite each other, JSON numbers that overflow to infinity, and build-context paths that name a
directory. The bar everywhere: exit 2, one line on stderr naming the file or field, no traceback,
no hang, nothing written under the final name.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from steadytrain import _io
from steadytrain.env import Contract, ContractError, EnvManifest
from steadytrain.env._probe import redact
from steadytrain.env.build import dockerfile
from steadytrain.env.contract import parse_version
from steadytrain.env.lockfile import requirement_closure
from steadytrain.errors import UserError
from tests.cli_utils import EXE, in_process
from tests.env.test_env_build import fake_manifest

BASE = "python:3.11.7-slim-bookworm"


def run(*args: str) -> subprocess.CompletedProcess:
    """``steadytrain ARGS`` in this process; a command that would hang fails its test's ``timeout`` mark."""
    return in_process(*args)


def assert_refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2, exactly one line on stderr, no traceback, the key words present."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for word in words:
        assert word in proc.stderr, (word, proc.stderr)


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(fake_manifest()))
    return path


# --- special files named as an input ---------------------------------------------------------------


@pytest.mark.timeout(30)  # a hang fails the test
def test_fifo_without_a_writer_is_refused_not_a_hang(tmp_path, manifest):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    assert_refused(run("env", "diff", str(manifest), str(fifo)), "pipe.json")
    contract = tmp_path / "contract.yaml"
    os.mkfifo(contract)
    assert_refused(run("env", "check", "--contract", str(contract), "--manifest", str(manifest)))


@pytest.mark.timeout(30)  # a hang fails the test
def test_fifo_as_the_contracts_lockfile_is_not_a_hang(tmp_path, manifest):
    os.mkfifo(tmp_path / "requirements.lock")
    (tmp_path / "contract.yaml").write_text("packages: requirements.lock\n")
    proc = run("env", "check", "--contract", str(tmp_path / "contract.yaml"), "--manifest", str(manifest))
    assert_refused(proc, "contract.yaml", "packages", "requirements.lock", "FIFO")


def test_a_pipe_with_a_writer_is_still_read(tmp_path, manifest):
    """Process substitution (``<(ssh host steadytrain env capture)``) keeps working: a live pipe is read to its end.
    The installed command, launched by a shell: the pipe's writer is another process."""
    proc = subprocess.run(
        ["bash", "-c", f'"{EXE}" env diff "$1" <(sleep 1; cat "$1")', "_", str(manifest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "image identical; host identical" in proc.stdout


@pytest.mark.timeout(30)  # reading a device without end fails the test
@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null", "/dev/urandom"])
def test_a_device_is_refused_without_reading_it(device, manifest):
    assert_refused(run("env", "diff", str(manifest), device), device, "not a regular file")
    assert_refused(run("env", "check", "--contract", device, "--manifest", str(manifest)), device)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs procfs")
def test_read_text_stops_at_the_limit_whatever_stat_says():
    """procfs reports size 0 for files that hold more: what is read is bounded, not what stat says."""
    assert Path("/proc/self/status").stat().st_size == 0
    with pytest.raises(UserError, match="too large"):
        _io.read_text("/proc/self/status", max_bytes=10)


# --- special files and odd names given as -o -------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a device node needs root")
def test_output_onto_a_device_never_replaces_the_device(tmp_path, manifest):
    node = tmp_path / "null"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    assert_refused(run("env", "lock", "--manifest", str(manifest), "-o", str(node)), "null", "not a regular file")
    assert stat.S_ISCHR(node.lstat().st_mode)


def test_output_onto_a_fifo_never_replaces_it(tmp_path, manifest):
    fifo = tmp_path / "out.lock"
    os.mkfifo(fifo)
    assert_refused(run("env", "lock", "--manifest", str(manifest), "-o", str(fifo)), "out.lock", "not a regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "out.lock"]


@pytest.mark.parametrize("name", ["", ".", "sub/..", "newdir/"])
def test_output_name_that_is_not_a_file_name(tmp_path, manifest, name, monkeypatch):
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)  # the name is relative to the working directory
    proc = run("env", "lock", "--manifest", str(manifest), "-o", name)
    assert_refused(proc, repr(name))
    assert "not a file name" in proc.stderr or "is a directory" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "sub"]


def test_output_through_a_symlink_updates_its_target(tmp_path, manifest):
    target = tmp_path / "real.lock"
    target.write_text("old\n")
    (tmp_path / "link.lock").symlink_to("real.lock")
    proc = run("env", "lock", "--manifest", str(manifest), "-o", str(tmp_path / "link.lock"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "link.lock").is_symlink()
    assert "==" in target.read_text()


def test_output_onto_a_symlink_loop_is_refused(tmp_path, manifest):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    assert_refused(run("env", "lock", "--manifest", str(manifest), "-o", str(tmp_path / "a")), "symbolic link")
    assert (tmp_path / "a").is_symlink()


def test_written_files_get_ordinary_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        _io.write_text_atomic(tmp_path / "new.txt", "x")
        assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o644
        (tmp_path / "kept.txt").write_text("old")
        os.chmod(tmp_path / "kept.txt", 0o640)
        _io.write_text_atomic(tmp_path / "kept.txt", "new")
        assert stat.S_IMODE((tmp_path / "kept.txt").stat().st_mode) == 0o640
    finally:
        os.umask(old)


def test_an_os_error_while_writing_is_a_user_error_and_leaves_nothing(tmp_path):
    def full(f):
        raise OSError(28, "No space left on device")

    with pytest.raises(UserError, match="No space left on device") as err:
        _io.write_atomic(tmp_path / "out.txt", full)
    assert "out.txt" in str(err.value)
    assert list(tmp_path.iterdir()) == []


# --- values a contract or the CLI takes ------------------------------------------------------------


@pytest.mark.parametrize("bounds", ['{min: "%s", max: "1"}', '{min: "1", max: "%s"}', '{validated: ["%s"]}'])
def test_contract_version_with_thousands_of_digits_is_refused(tmp_path, manifest, bounds):
    (tmp_path / "c.yaml").write_text("driver: " + bounds % ("9" * 5000) + "\n")
    assert_refused(run("env", "check", "--contract", str(tmp_path / "c.yaml"), "--manifest", str(manifest)), "driver")


def test_manifest_version_with_thousands_of_digits_is_not_comparable():
    m = fake_manifest()
    m["host"]["kernel"] = "6." + "1" * 5000
    with pytest.raises(ValueError, match="not a version"):
        parse_version(m["host"]["kernel"])
    from steadytrain.env import check

    (v,) = check(m, {"kernel": {"min": "5.15"}})
    assert "not a comparable version" in v.message and len(v.message) < 400


@pytest.mark.parametrize("root", ["", " ", "a b", "../../etc", "/", "x\ny", "[red]x[/]"])
def test_lock_for_a_name_that_is_not_a_distribution_name(root):
    with pytest.raises(UserError, match="distribution name"):
        requirement_closure([root])
    assert_refused(run("env", "lock", "--for", root), "--for")


def test_lock_for_an_empty_name_on_the_command_line():
    assert_refused(run("env", "lock", "--for", "steadytrain", "--for", ""), "--for", "distribution name")


@pytest.mark.parametrize("path", [".", "./", "ctx/", "ctx/.", "a/./b"])
@pytest.mark.parametrize("field", ["lockfile_path", "contract_path"])
def test_build_context_path_must_name_a_file(field, path):
    with pytest.raises(UserError, match=field):
        dockerfile(fake_manifest(), base_image=BASE, **{field: path})


# --- credentials in recorded settings --------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "secret"),
    [
        ("admin:hunter2@10.0.0.1:29500", "hunter2"),
        ("eth0,admin:hunter2@10.0.0.1", "hunter2"),
        ("https://h/x?token=abc123&sig=zz", "abc123"),
        ("https://h/x?X-Amz-Signature=deadbeef&a=1", "deadbeef"),
        ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI", "wJalrXUtnFEMI"),
        ("password=hunter2;host=h", "hunter2"),
    ],
)
def test_credentials_without_a_url_scheme_are_redacted(value, secret):
    assert secret not in redact(value)


@pytest.mark.parametrize("value", ["eth0", "mlx5_0:1,mlx5_1:1", "10.0.0.1:29500", "^docker0,lo", "INFO", "a=b"])
def test_ordinary_settings_are_kept(value):
    assert redact(value) == value


# --- parsed files: duplicate keys, overflowing numbers, deep nesting -------------------------------


def test_duplicate_key_in_a_contract_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('driver:\n  min: "535"\n  min: "540"\n')
    with pytest.raises(ContractError, match=r"min.*twice") as err:
        Contract.load(path)
    assert "line 3" in str(err.value)


def test_duplicate_key_in_a_manifest_is_refused(tmp_path):
    text = json.dumps(fake_manifest())
    path = tmp_path / "m.json"
    path.write_text(text[:-1] + ', "image": {}}')
    assert_refused(run("env", "diff", str(path), str(path)), "m.json", "image", "twice")


def test_json_number_that_overflows_to_infinity_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"a": 1e400}')
    with pytest.raises(UserError, match=r"x\.json.*1e400"):
        _io.load_json(path)


def test_deeply_nested_json_says_so(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserError, match="nests too deeply"):
        _io.load_json(path)


def test_manifest_load_rejects_fifo_too(tmp_path):
    os.mkfifo(tmp_path / "m.json")
    with pytest.raises(UserError, match="not a regular file"):
        EnvManifest.load(tmp_path / "m.json")
