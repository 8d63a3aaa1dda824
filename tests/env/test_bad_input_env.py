"""Hostile and careless input to ``steadytrain.env`` and ``steadytrain env``: refused whole, never injected.

Classes (issue 8): values interpolated into a Dockerfile or a lockfile (section 2); malformed, mistyped,
non-UTF-8 or directory manifests, contracts and lockfiles, conflicting options, output into a missing
directory (section 6); code a repository configures running during capture, credentials in recorded
settings, versions a contract cannot compare, lockfile errors that quote a file (section 7). Generated
files are checked by parsing them back (dockerfile-parse, ``packaging.requirements.Requirement``).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement

from steadytrain.env import Contract, ContractError, EnvManifest, ManifestError, capture, check, diff
from steadytrain.env.build import dockerfile, image_tag, lockfile, parse_lockfile
from steadytrain.errors import UserError
from tests.cli_utils import in_process, launched
from tests.env.test_env_build import COMMIT, DIGEST, fake_manifest

BASE = "python:3.11.7-slim-bookworm"
# Appended to a valid value: line breaks of every kind, quotes, shell expansion, escapes, space, NUL, non-ASCII.
HOSTILE = [
    "\nRUN touch /tmp/pwned",
    "\rRUN touch /tmp/pwned",
    "\r\n--extra-index-url http://evil",
    "\u2028RUN x",
    "\u2029x",
    "\x85x",
    "\x0bx",
    "'",
    '"',
    "$(touch /tmp/pwned)",
    "`id`",
    "${HOME}",
    "\\",
    " x",
    "\tx",
    "\x00",
    ";rm -rf /",
    "\u017f",  # LATIN SMALL LETTER LONG S: matches [a-z] under re.IGNORECASE
    "\u0663",  # ARABIC-INDIC DIGIT THREE: matches \d
]
# "billion laughs": ten levels of nine aliases each, a few hundred bytes that expand to 9**10 values
ALIAS_BOMB = (
    "l0: &l0 [x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))
).encode()
EXPECTED = ["FROM", "LABEL", "ENV", "ARG", "WORKDIR", "RUN", "COPY", "RUN", "COPY", "RUN", "COPY", "ENTRYPOINT", "CMD"]


def parse(text: str, tmp_path: Path) -> DockerfileParser:
    parser = DockerfileParser(path=str(tmp_path))
    parser.content = text
    return parser


def kinds(text: str, tmp_path: Path) -> list[str]:
    """The instructions of a Dockerfile as dockerfile-parse reads them, comments left out."""
    return [i["instruction"] for i in parse(text, tmp_path).structure if i["instruction"] != "COMMENT"]


def with_field(path: str, value: object) -> dict:
    """fake_manifest() with the dotted ``path`` set to ``value``."""
    m = fake_manifest()
    *parents, last = path.split(".")
    node = m
    for p in parents:
        node = node[p]
    node[last] = value
    return m


def run(*args: str) -> subprocess.CompletedProcess:
    """``steadytrain env ARGS`` in this process (one test below launches the command itself)."""
    return in_process("env", *args)


def assert_refused(result: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2, one line on stderr, no traceback, the key words present."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)


def save(tmp_path: Path, manifest: object, name: str = "m.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(manifest))
    return path


# --- section 2: every interpolated value has a grammar --------------------------------------------


DOCKERFILE_TARGETS = {
    # field named in the message -> how to build the call with a hostile suffix h
    "base_image": lambda h: {"base_image": BASE + h},
    "base_digest": lambda h: {"base_digest": DIGEST + h},
    "tag": lambda h: {"tag": "training:v1" + h},
    "captured_at": lambda h: {"manifest": with_field("captured_at", "2026-12-02T09:00:00+00:00" + h)},
    "code.git_commit": lambda h: {"manifest": with_field("code.git_commit", COMMIT + h)},
    "image.torch": lambda h: {"manifest": with_field("image.torch", "2.1.0+cu121" + h)},
    "image.cuda": lambda h: {"manifest": with_field("image.cuda", "12.1" + h)},
    "image.cudnn": lambda h: {"manifest": with_field("image.cudnn", "8.9.2" + h)},
    "image.python": lambda h: {"manifest": with_field("image.python", "3.11.7" + h)},
    "lockfile_path": lambda h: {"lockfile_path": "requirements.lock" + h},
    "contract_path": lambda h: {"contract_path": "contract.yaml" + h},
    "workdir": lambda h: {"workdir": "/app" + h},
}


@pytest.mark.parametrize("hostile", HOSTILE, ids=repr)
@pytest.mark.parametrize("field", list(DOCKERFILE_TARGETS))
def test_dockerfile_refuses_hostile_value(field, hostile):
    kwargs = {"manifest": fake_manifest(), "base_image": BASE, **DOCKERFILE_TARGETS[field](hostile)}
    with pytest.raises(UserError) as err:
        dockerfile(kwargs.pop("manifest"), **kwargs)
    message = str(err.value)
    assert field in message, message
    assert hostile not in message or hostile.isprintable()  # shown escaped, never raw
    assert "\n" not in message and "\r" not in message and len(message) < 400


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"image.python": "3.13.0rc1", "image.torch": "2.5.0a0+git1234abc", "image.cuda": "12.10"},
        {"code.git_commit": "ab" * 32, "captured_at": "2026-12-02T09:00:00.123456Z"},
        {"image.torch": "1!2.0.0.post1+cu121.abc", "image.cudnn": None, "code.git_dirty": True},
    ],
)
@pytest.mark.parametrize("tag", [None, "training:v1", "registry.example.com:5000/ml/a__b:v2.3_1-rc.1", "localhost/x"])
def test_dockerfile_instructions_are_exactly_the_expected_ones(tmp_path, overrides, tag):
    m = fake_manifest()
    for path, value in overrides.items():
        scope, key = path.split(".") if "." in path else (None, path)
        (m[scope] if scope else m)[key] = value
    text = dockerfile(m, base_image=BASE, base_digest=DIGEST, tag=tag)
    expected = EXPECTED if tag or m["code"]["git_commit"] or m["code"]["git_dirty"] else [*EXPECTED[:1], *EXPECTED[2:]]
    assert kinds(text, tmp_path) == expected
    structure = [i["instruction"] for i in parse(text, tmp_path).structure]
    header = 6 if "+" in (m["image"]["torch"] or "") else 5  # the build hint needs a local torch build
    assert structure[:header] == ["COMMENT"] * header and "COMMENT" not in structure[header:]
    parser = parse(text, tmp_path)
    assert parser.baseimage == f"{BASE}@{DIGEST}"
    if tag:
        assert parser.envs["STEADYTRAIN_IMAGE_TAG"] == tag


def test_python_check_is_exec_form_and_runs(tmp_path):
    # The check is JSON exec form (no shell): its script is Python whose literals are the checked values.
    for python, rc in [(f"{sys.version_info.major}.{sys.version_info.minor}.0", 0), ("2.7.18", 1)]:
        text = dockerfile(with_field("image.python", python), base_image=BASE)
        value = next(i["value"] for i in parse(text, tmp_path).structure if i["instruction"] == "RUN")
        argv = json.loads(value)
        assert argv[:2] == ["python", "-c"]
        ast.parse(argv[2])
        result = subprocess.run([sys.executable, "-c", argv[2]], capture_output=True, text=True, timeout=30)
        assert result.returncode == rc
        if rc:
            assert "the lockfile was captured on 2.7.18" in result.stderr


def test_entrypoint_quotes_contract_path(tmp_path):
    text = dockerfile(fake_manifest(), base_image=BASE, workdir="/srv/my-app_1")
    entry = json.loads(next(i["value"] for i in parse(text, tmp_path).structure if i["instruction"] == "ENTRYPOINT"))
    assert entry[2].startswith("steadytrain env check --contract /srv/my-app_1/contract.yaml && ")


@pytest.mark.parametrize(
    ("base", "digest", "word"),
    [
        ("python:3.11@sha256:" + "AB" * 32, None, "digest"),  # upper-case hex
        ("python:3.11@md5:abc", None, "digest"),
        ("python:3.11:4", None, "tag"),
        ("Python:3.11", None, "repository"),
        ("-python:3.11", None, "repository"),
        ("python:.hidden", None, "tag"),
        ("python:" + "a" * 129, None, "tag"),
        ("a" * 300 + ":1", None, "repository"),
        ("python:3.11", "sha512:" + "ab" * 64, "base_digest"),
        ("python:3.11", "sha256:" + "ab" * 31, "base_digest"),
        ("python:3.11", 12, "base_digest"),
    ],
)
def test_dockerfile_refuses_malformed_references(base, digest, word):
    with pytest.raises(UserError, match=word):
        dockerfile(fake_manifest(), base_image=base, base_digest=digest)


def test_tag_with_digest_is_refused():
    with pytest.raises(UserError, match="digest"):
        dockerfile(fake_manifest(), base_image=BASE, tag=f"training:v1@{DIGEST}")


@pytest.mark.parametrize("hostile", HOSTILE, ids=repr)
@pytest.mark.parametrize(
    ("field", "manifest"),
    [
        ("image.torch", lambda h: with_field("image.torch", "2.1.0+cu121" + h)),
        ("image.cuda", lambda h: with_field("image.cuda", "12.1" + h)),
        ("image.cudnn", lambda h: with_field("image.cudnn", "8.9.2" + h)),
    ],
)
def test_image_tag_refuses_hostile_manifest_value(field, manifest, hostile):
    with pytest.raises(UserError, match=re.escape(field)):
        image_tag(manifest(hostile), "training", "2.3.1")


@pytest.mark.parametrize("hostile", HOSTILE, ids=repr)
def test_image_tag_refuses_hostile_version_and_name(hostile):
    with pytest.raises(UserError, match="version"):
        image_tag(fake_manifest(), "training", "2.3.1" + hostile)
    with pytest.raises(UserError, match="name"):
        image_tag(fake_manifest(), "training" + hostile, "2.3.1")


LOCK_TARGETS = {
    "image.packages.numpy": lambda h: with_field("image.packages", {"numpy": "2.4.6" + h}),
    "image.packages name": lambda h: with_field("image.packages", {"numpy" + h: "2.4.6"}),
    "image.torch": lambda h: with_field("image.torch", "2.1.0+cu121" + h),
    "image.cuda": lambda h: with_field("image.cuda", "12.1" + h),
    "image.python": lambda h: with_field("image.python", "3.11.7" + h),
}


@pytest.mark.parametrize("hostile", HOSTILE, ids=repr)
@pytest.mark.parametrize("field", list(LOCK_TARGETS))
def test_lockfile_refuses_hostile_value(field, hostile):
    with pytest.raises(UserError) as err:
        lockfile(LOCK_TARGETS[field](hostile))
    assert field in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "hostile", ["\n--extra-index-url http://evil", "\r", "\u2028", "\\", "\x00", "\u017f"], ids=repr
)
@pytest.mark.parametrize("field", ["image.os.pretty_name", "host.platform"])
def test_lockfile_comment_free_text_is_one_plain_line(field, hostile):
    m = fake_manifest()
    scope, *rest = field.split(".")
    node = m[scope]
    for key in rest[:-1]:
        node = node[key]
    node[rest[-1]] = "Debian GNU/Linux 12" + hostile
    with pytest.raises(UserError, match=re.escape(field)):
        lockfile(m)


@pytest.mark.parametrize(
    "version",
    ["1.0 ; python_version > '3'", "1.0 --hash=sha256:00", "1.0,<2", ">=1.0", "1.0 @ http://evil", "1.0#x"],
)
def test_lockfile_refuses_specifier_and_option_smuggling(version):
    with pytest.raises(UserError, match=re.escape("image.packages.numpy")):
        lockfile(with_field("image.packages", {"numpy": version}))


@pytest.mark.parametrize("name", ["numpy[extra]", "-e .", "--index-url", "numpy>=1", "./pkg", "a b", ""])
def test_lockfile_refuses_bad_distribution_names(name):
    with pytest.raises(UserError, match=re.escape("image.packages name")):
        lockfile(with_field("image.packages", {name: "1.0"}))


def test_lockfile_lines_are_exact_pins_by_an_independent_parser():
    m = with_field("image.os", {"pretty_name": "Weird 'OS' $(x) `y` ;z"})
    m["image"]["packages"].update({"Zope.Interface": "7.1.0", "typing_extensions": "4.12.2", "a": "1!2.0.post1+l.1"})
    text = lockfile(m)
    lines = text.splitlines()
    pins = [line for line in lines if not line.startswith("#")]
    assert len(lines) == 3 + len(m["image"]["packages"])
    for line in pins:
        req = Requirement(line)
        assert str(req) == line and req.marker is None and req.url is None and not req.extras
        (spec,) = req.specifier
        assert spec.operator == "=="
    assert parse_lockfile(text)["zope-interface"] == "7.1.0"


def test_lockfile_refuses_one_distribution_under_two_spellings():
    with pytest.raises(UserError, match="twice"):
        lockfile(with_field("image.packages", {"NumPy": "2.4.6", "numpy": "2.4.5"}))


# --- section 2 through the command line -------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "word"),
    [
        (["--base", BASE + "\nRUN touch /tmp/pwned"], "base_image"),
        (["--base", BASE, "--tag", "training:v1\nRUN touch /tmp/pwned"], "tag"),
        (["--base", BASE, "--digest", DIGEST + "\nRUN x"], "base_digest"),
        (["--base", BASE, "--lockfile", "requirements.lock\nRUN x"], "lockfile_path"),
        (["--base", BASE, "--tag", "training:v1$(id)"], "tag"),
    ],
)
def test_cli_dockerfile_refuses_hostile_flag_and_writes_nothing(tmp_path, args, word):
    out = tmp_path / "Dockerfile"
    result = run("dockerfile", *args, "--manifest", str(save(tmp_path, fake_manifest())), "-o", str(out))
    assert_refused(result, word)
    assert not out.exists() and not list(tmp_path.glob(".Dockerfile*"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("captured_at", "2026-12-02T09:00:00+00:00\nRUN touch /tmp/pwned"),
        ("code.git_commit", COMMIT + "\nRUN touch /tmp/pwned"),
        ("image.torch", "2.1.0+cu121\nRUN touch /tmp/pwned"),
        ("image.cuda", "12.1\nRUN touch /tmp/pwned"),
        ("image.python", "3.11.7'); import os; os.system('id'); ('"),
    ],
)
def test_cli_dockerfile_refuses_hostile_manifest_field(tmp_path, field, value):
    out = tmp_path / "Dockerfile"
    result = run(
        "dockerfile", "--base", BASE, "--manifest", str(save(tmp_path, with_field(field, value))), "-o", str(out)
    )
    assert_refused(result, field, "m.json")
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "word"),
    [
        (["--name", "training", "--version", "1\nx"], "version"),
        (["--name", "training\nRUN x", "--version", "1"], "name"),
    ],
)
def test_cli_tag_refuses_hostile_flag(tmp_path, args, word):
    result = run("tag", *args, "--manifest", str(save(tmp_path, fake_manifest())))
    assert_refused(result, word)
    assert result.stdout == ""


def test_cli_lock_refuses_newline_in_version_and_writes_nothing(tmp_path):
    m = with_field("image.packages", {"numpy": "2.4.6\n--extra-index-url http://evil"})
    out = tmp_path / "requirements.lock"
    assert_refused(run("lock", "--manifest", str(save(tmp_path, m)), "-o", str(out)), "image.packages.numpy")
    assert not out.exists()


# --- section 6: malformed manifests, contracts, options, outputs -----------------------------------


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ({**fake_manifest(), "image": None}, ["'image'", "object", "null"]),
        ({**fake_manifest(), "host": []}, ["'host'", "object"]),
        ({k: v for k, v in fake_manifest().items() if k != "code"}, ["'code'", "missing"]),
        (with_field("image.python", 3.11), ["image.python", "string", "3.11"]),
        (with_field("code.git_commit", 123), ["code.git_commit", "123"]),
        (with_field("code.git_dirty", "yes"), ["code.git_dirty", "true, false"]),
        (with_field("captured_at", 5), ["captured_at", "string"]),
        (with_field("schema", "abc"), ["schema", "integer", "'abc'"]),
        (with_field("schema", 2), ["schema 2", "not supported"]),
        (with_field("image.packages", ["numpy==1"]), ["image.packages", "object"]),
        (with_field("image.packages", {"numpy": 2.0}), ["image.packages.numpy", "version string"]),
        (with_field("image.os", ["debian"]), ["image.os", "object"]),
        (with_field("host.kernel", 6.1), ["host.kernel", "string"]),
        (with_field("host.gpus", [{"name": "H100", "memory_mib": "80G"}]), ["host.gpus.0.memory_mib", "integer"]),
        (with_field("host.cpu", "x86"), ["host.cpu", "object"]),
        (with_field("settings", {"env": {"NCCL_DEBUG": 1}}), ["settings.env.NCCL_DEBUG", "string"]),
        ([1, 2], ["JSON object"]),
        ("manifest", ["JSON object"]),
    ],
)
def test_manifest_shape_errors_name_file_and_field(tmp_path, payload, words):
    path = save(tmp_path, payload, "bad.json")
    with pytest.raises(ManifestError) as err:
        EnvManifest.load(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ")
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize(
    "consumer",
    [
        lambda m: lockfile(m),
        lambda m: dockerfile(m, base_image=BASE),
        lambda m: image_tag(m, "training", "1"),
        lambda m: check(m, {"python": "3.11"}),
        lambda m: diff(m, fake_manifest()),
    ],
)
@pytest.mark.parametrize(
    "bad",
    [
        with_field("image.python", 3.11),
        with_field("image.torch", ["2.1"]),
        with_field("host.kernel", 6.1),
        {"image": None},
    ],
)
def test_every_consumer_checks_the_shape_of_a_dict(consumer, bad):
    with pytest.raises(ManifestError):
        consumer(bad)


@pytest.mark.parametrize(
    ("write", "words"),
    [
        (lambda p: p.write_bytes(b"\xff\xfe{}"), ["not UTF-8"]),
        (lambda p: p.mkdir(), ["directory"]),
        (lambda p: p.write_text(""), ["not valid JSON"]),
        (lambda p: p.write_text('{"image": NaN}'), ["not valid JSON"]),
        (lambda p: None, ["no such manifest"]),
    ],
)
@pytest.mark.parametrize("command", ["lock", "tag", "dockerfile", "diff", "check"])
def test_cli_unreadable_manifest_is_one_line(tmp_path, write, words, command):
    path = tmp_path / "m.json"
    write(path)
    contract = tmp_path / "c.yaml"
    contract.write_text("python: '3.11'\n")
    args = {
        "lock": ["lock", "--manifest", str(path)],
        "tag": ["tag", "--name", "t", "--version", "1", "--manifest", str(path)],
        "dockerfile": ["dockerfile", "--base", BASE, "--manifest", str(path)],
        "diff": ["diff", str(save(tmp_path, fake_manifest(), "ok.json")), str(path)],
        "check": ["check", "--contract", str(contract), "--manifest", str(path)],
    }[command]
    result = run(*args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    if not path.is_dir():  # click itself refuses a directory for a dir_okay=False path, naming it
        assert "m.json" in result.stderr and all(w in result.stderr for w in words), result.stderr


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ({**fake_manifest(), "image": None}, ["'image'", "null"]),
        (with_field("image.python", 3.11), ["image.python", "3.11"]),
        (with_field("schema", "abc"), ["schema", "'abc'"]),
    ],
)
@pytest.mark.parametrize("command", ["lock", "check", "diff"])
def test_cli_malformed_manifest_field_is_one_line(tmp_path, payload, words, command):
    path = save(tmp_path, payload, "bad.json")
    contract = tmp_path / "c.yaml"
    contract.write_text("python: '3.11'\n")
    args = {
        "lock": ["lock", "--manifest", str(path)],
        "check": ["check", "--contract", str(contract), "--manifest", str(path)],
        "diff": ["diff", str(path), str(path)],
    }[command]
    assert_refused(run(*args), "bad.json", *words)


def test_cli_lock_manifest_and_for_conflict(tmp_path):
    out = tmp_path / "requirements.lock"
    result = run("lock", "--manifest", str(save(tmp_path, fake_manifest())), "--for", "steadytrain", "-o", str(out))
    assert_refused(result, "--for", "--manifest", "drop")
    assert not out.exists()


def test_cli_lock_for_unknown_distribution(tmp_path):
    assert_refused(run("lock", "--for", "no-such-dist"), "--for", "not installed")
    assert_refused(run("lock", "--for", "no-such-dist$(id)"), "--for", "not a distribution name")


@pytest.mark.parametrize(
    "args",
    [
        ["lock", "--manifest", "{m}"],
        ["dockerfile", "--base", BASE, "--manifest", "{m}"],
        ["capture"],
    ],
)
def test_cli_output_into_missing_directory(tmp_path, args):
    m = save(tmp_path, fake_manifest())
    out = tmp_path / "no" / "such" / "dir" / "out.txt"
    result = run(*[a.format(m=m) for a in args], "-o", str(out))
    assert_refused(result, "does not exist", str(out.parent))
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (b"python: '3.11'\n\xff", ["contract", "not UTF-8"]),
        (ALIAS_BOMB, ["expands"]),
        (b"driver: {min: '535'\n", ["not valid YAML"]),
        (b"- python\n", ["(top level)", "mapping"]),
    ],
)
def test_cli_bad_contract_file_is_one_line(tmp_path, text, words):
    contract = tmp_path / "contract.yaml"
    contract.write_bytes(text)
    result = run("check", "--contract", str(contract), "--manifest", str(save(tmp_path, fake_manifest())))
    assert_refused(result, "contract.yaml", *words)


def test_cli_contract_that_is_a_directory(tmp_path):
    (tmp_path / "contract.yaml").mkdir()
    # The installed command as its own process: its exit code and one stderr line (tests/cli/test_cli.py runs no env).
    result = launched(
        "env", "check", "--contract", tmp_path / "contract.yaml", "--manifest", save(tmp_path, fake_manifest())
    )
    assert_refused(result, "contract.yaml", "directory")


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: p.mkdir(), ["cannot read lockfile", "directory"]),
        (lambda p: p.write_bytes(b"numpy==2.4.6\n\xff\n"), ["cannot read lockfile", "not UTF-8"]),
        (lambda p: p.write_text("root:$6$SECRETHASH:19000:0:99999:7:::\n"), ["line 1", "not a pin"]),
        (lambda p: p.write_text("numpy==2.4.6\nnumpy==SECRETHASH\n"), ["line 2", "PEP 440"]),
        (lambda p: p.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nSECRETHASH\n"), ["line 1"]),
    ],
)
def test_cli_contract_lockfile_errors_never_quote_the_file(tmp_path, make, words):
    make(tmp_path / "requirements.lock")
    contract = tmp_path / "contract.yaml"
    contract.write_text("packages: requirements.lock\n")
    result = run("check", "--contract", str(contract), "--manifest", str(save(tmp_path, fake_manifest())))
    assert_refused(result, "contract.yaml", *words)
    assert "SECRETHASH" not in result.stderr and "BEGIN" not in result.stderr


@pytest.mark.parametrize(
    "text",
    ["root:x:0:0:SECRETHASH:/root:/bin/bash\n", "SECRETHASH\n", "a==b==SECRETHASH\n", "SECRET HASH==1.0\n"],
)
def test_parse_lockfile_message_says_what_is_wrong_without_quoting(text):
    with pytest.raises(UserError, match=r"^lockfile line 1: ") as err:
        parse_lockfile(text)
    assert "SECRET" not in str(err.value)


def test_cli_exit_1_only_for_found_problems(tmp_path):
    contract = tmp_path / "contract.yaml"
    contract.write_text("python: '2.7'\n")
    result = run("check", "--contract", str(contract), "--manifest", str(save(tmp_path, fake_manifest())))
    assert result.returncode == 1 and "violation: Python 3.11.7" in result.stdout


def test_cli_diff_summary_stays_one_line(tmp_path):
    a = save(tmp_path, fake_manifest(), "a.json")
    b = save(tmp_path, with_field("host.kernel", "6.1\nimage identical; host identical"), "b.json")
    result = run("diff", str(a), str(b))
    assert result.returncode == 1
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("image identical; host differs: kernel 6.1.0-18-amd64") and "\\n" in last


# --- section 7: capture runs nothing a repository configures; no credential recorded -------------


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def hostile_repo(tmp_path) -> tuple[Path, Path]:
    """A repository whose config runs programs during `git status`; each leaves a marker in ``marks``."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    repo, marks = tmp_path / "repo", tmp_path / "marks"
    repo.mkdir()
    marks.mkdir()
    git(repo, "init", "-q")
    (repo / "a.txt").write_text("hi\n")
    (repo / ".gitattributes").write_text("*.txt filter=evil\n")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "init")
    hook = tmp_path / "fsmonitor.sh"
    hook.write_text(f"#!/bin/sh\ntouch {marks}/fsmonitor\n")
    hook.chmod(0o755)
    git(repo, "config", "core.fsmonitor", str(hook))
    git(repo, "config", "filter.evil.clean", f"sh -c 'touch {marks}/filter; cat'")
    git(repo, "config", "filter.evil.required", "true")
    hooks = repo / ".git" / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "post-index-change").write_text(f"#!/bin/sh\ntouch {marks}/post-index-change\n")
    (hooks / "post-index-change").chmod(0o755)
    return repo, marks


def _stale(repo: Path) -> None:
    """Change a tracked file's stat data, not its content, so status must re-hash it through its filter."""
    path = repo / "a.txt"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


def test_plain_git_status_would_run_the_hooks(hostile_repo):
    # The control: the fixture is hostile, so the next test's silence means something.
    repo, marks = hostile_repo
    _stale(repo)
    subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, timeout=30)
    assert {p.name for p in marks.iterdir()} >= {"fsmonitor", "filter"}


def test_capture_runs_no_program_the_repository_configures(hostile_repo):
    repo, marks = hostile_repo
    _stale(repo)
    code = capture(code_path=repo).code
    assert list(marks.iterdir()) == []
    assert code["git_dirty"] is False and len(code["git_commit"]) == 40
    (repo / "a.txt").write_text("changed\n")
    assert capture(code_path=repo).code["git_dirty"] is True
    assert list(marks.iterdir()) == []


@pytest.mark.parametrize(
    ("value", "secret", "kept"),
    [
        ("tcp://admin:hunter2@10.0.0.1:29500", "hunter2", "tcp://***@10.0.0.1:29500"),
        ("https://ghp_TOKEN123@github.com/org/repo", "ghp_TOKEN123", "https://***@github.com/org/repo"),
        ("https://user:p@ss:w0rd@host/x", "w0rd", "https://***@host/x"),
        ("eth0,s3://AKIAX:sEcReT@bucket/p,https://u:pw2@h", "sEcReT", "eth0,s3://***@bucket/p,https://***@h"),
    ],
)
def test_url_credentials_in_recorded_settings_are_redacted(monkeypatch, value, secret, kept):
    monkeypatch.setenv("NCCL_NET_PLUGIN_URL", value)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", value)
    settings = capture().settings["env"]
    assert settings["NCCL_NET_PLUGIN_URL"] == kept and settings["GLOO_SOCKET_IFNAME"] == kept
    assert secret not in json.dumps(capture().to_dict())


def test_values_without_credentials_are_kept(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0,^lo")
    monkeypatch.setenv("NCCL_DEBUG_FILE", "/tmp/nccl.%h.%p@x")
    env = capture().settings["env"]
    assert env["NCCL_SOCKET_IFNAME"] == "eth0,^lo" and env["NCCL_DEBUG_FILE"] == "/tmp/nccl.%h.%p@x"


@pytest.mark.parametrize(
    "version", ["3.x", "550abc", "12.1.x", "v12", "12..1", "", " 12.1", "12.1\n", "\uff11\uff12", "1e3"]
)
@pytest.mark.parametrize(
    ("field", "contract"),
    [
        ("cuda", lambda v: {"cuda": v}),
        ("python", lambda v: {"python": ["3.11", v]}),
        ("driver.min", lambda v: {"driver": {"min": v}}),
        ("kernel.max", lambda v: {"kernel": {"max": v}}),
        ("driver.validated", lambda v: {"driver": {"validated": [v]}}),
    ],
)
def test_contract_refuses_versions_it_cannot_compare(field, contract, version):
    with pytest.raises(ContractError, match="^<dict>: " + re.escape(field) + ": expected a version string"):
        Contract.from_dict(contract(version))


def test_contract_accepts_numeric_versions_and_kernel_build_numbers():
    c = Contract.from_dict({"kernel": {"min": "6.1.0-18"}, "driver": {"max": "550"}, "python": "3"})
    assert c.kernel.admits("6.1.0-18-amd64") and not c.kernel.admits("6.1.0-17-amd64")


@pytest.mark.parametrize(
    ("packages", "field"),
    [
        ({"numpy": "2.0\n--extra-index-url x"}, "packages.numpy"),
        ({"numpy; os_name": "1"}, "packages"),
        ({"x": " 1.0"}, "packages.x"),
    ],
)
def test_contract_package_pins_have_a_grammar(packages, field):
    with pytest.raises(ContractError, match=rf"^<dict>: {re.escape(field)}: "):
        Contract.from_dict({"packages": packages})


def test_cli_file_named_as_contract_is_not_quoted(tmp_path):
    secret = tmp_path / "passwd"
    secret.write_text("root:SECRETHASH:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/:/bin/sh\n")
    result = run("check", "--contract", str(secret), "--manifest", str(save(tmp_path, fake_manifest())))
    assert_refused(result, "passwd", "(top level)", "mapping")
    assert "SECRETHASH" not in result.stderr
