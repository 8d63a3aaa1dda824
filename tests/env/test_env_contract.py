"""Contract check against the CUDA -> driver facts table, inclusive ranges, and contract parsing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from steadytrain.env import contract as contract_module
from steadytrain.env.contract import (
    CUDA_MIN_DRIVER,
    Contract,
    ContractError,
    check,
    min_driver_for_cuda,
    parse_version,
)

# The project's reference data lives in shared/ beside the checkout (CI lays a copy there too).
FACTS = [Path(__file__).resolve().parents[3] / "shared" / "facts" / "cuda_driver_compat.md"]


def fake_manifest(
    *,
    driver: str | None = "550.90.07",
    cuda: str | None = "12.1",
    kernel: str | None = "6.1.0-18-amd64",
    python: str = "3.11.7",
    packages: dict[str, str] | None = None,
) -> dict:
    """A manifest dict in the ``EnvManifest.to_dict()`` schema, without calling capture()."""
    pkgs = {"numpy": "2.4.6", "torch": "2.1.0+cu121", "typing-extensions": "4.12.2"} if packages is None else packages
    return {
        "schema": 1,
        "captured_at": "2026-12-02T09:00:00+00:00",
        "image": {
            "os": {"id": "debian", "version_id": "12", "pretty_name": "Debian GNU/Linux 12 (bookworm)"},
            "python": python,
            "packages": pkgs,
            "torch": pkgs.get("torch"),
            "cuda": cuda,
            "cudnn": "8.9.2" if cuda else None,
            "nccl": "2.18.1" if cuda else None,
        },
        "host": {
            "hostname": "node-a",
            "kernel": kernel,
            "nvidia_driver": driver,
            "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559}] if driver else None,
            "cpu": {"model": None, "count": 16, "arch": "x86_64"},
            "container": None,
            "platform": "Linux-6.1.0-18-amd64-x86_64-with-glibc2.36",
        },
        "code": {"git_commit": "0" * 40, "git_dirty": False, "git_branch": "main"},
        "settings": {},
    }


# --- version parsing -------------------------------------------------------------------------------


def test_parse_version_is_numeric_not_lexicographic():
    assert parse_version("550.90.07") > parse_version("535.104.05")
    assert parse_version("10.0") > parse_version("9.2")
    assert parse_version("535.104.5") == parse_version("535.104.05")  # leading zeros do not count


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("6.1.0-18-amd64", (6, 1, 0, 18)),  # letters-bearing groups ("amd64") are dropped
        ("5.15.0-1050-azure", (5, 15, 0, 1050)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.1.0+cu121", (2, 1, 0)),
        ("580", (580,)),
    ],
)
def test_parse_version_rule(text, key):
    assert parse_version(text) == key


@pytest.mark.parametrize("bad", ["", "abc", "v1.2", "amd64-6.1"])
def test_parse_version_rejects_no_leading_number(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        parse_version(bad)


# --- the CUDA -> minimum driver table ---------------------------------------------------------------


def _facts_table() -> dict[str, str]:
    path = next((p for p in FACTS if p.exists()), None)
    if path is None:
        pytest.skip("facts/cuda_driver_compat.md not available")
    rows = re.findall(r"^\|\s*(\d+)\.x\s*\|\s*>=\s*([\d.]+)\s*\|", path.read_text(), flags=re.M)
    assert rows, "no table rows parsed from the facts file"
    return dict(rows)


def test_table_matches_facts_file():
    facts = _facts_table()
    assert facts == {"13": "580", "12": "525.60.13", "11": "450.80.02"}
    for family, driver in facts.items():
        assert CUDA_MIN_DRIVER[family] == driver
        assert min_driver_for_cuda(f"{family}.0") == driver


def test_table_older_exact_entries():
    assert min_driver_for_cuda("9.0") == "384.81"  # facts file
    assert min_driver_for_cuda("9.2") == "396.26"  # facts file
    assert min_driver_for_cuda("8.0") is None
    assert min_driver_for_cuda("14.0") is None


@pytest.mark.parametrize(
    ("driver", "cuda", "ok"),
    [
        ("520.61.05", "12.1", False),
        ("525.60.12", "12.1", False),
        ("525.60.13", "12.1", True),  # exactly the minimum
        ("550.90.07", "12.4", True),
        ("580", "13.0", True),
        ("580.65.06", "13.0", True),
        ("575.57.08", "13.0", False),
        ("450.80.02", "11.8", True),
        ("450.80.01", "11.0", False),
        ("525.60.13", "11.8", True),  # newer drivers keep running older families
        ("384.81", "9.0", True),
        ("384.80", "9.0", False),
    ],
)
def test_table_applied_without_contract(driver, cuda, ok):
    violations = check(fake_manifest(driver=driver, cuda=cuda))
    assert (violations == []) is ok
    if not ok:
        (v,) = violations
        need = min_driver_for_cuda(cuda)
        assert (v.field, v.scope, v.found, v.expected) == ("host.nvidia_driver", "host", driver, f">= {need}")
        assert cuda in v.message and need in v.message and driver in v.message


def test_table_message_names_cuda_and_minimum():
    (v,) = check(fake_manifest(driver="520.61.05", cuda="12.1"))
    assert "12.1" in v.message and "525.60.13" in v.message
    assert str(v) == v.message


def test_empty_contract_still_applies_table():
    m = fake_manifest(driver="520.61.05", cuda="12.1")
    for contract in (None, Contract(), Contract.from_dict({}), Contract.from_dict(None), {}):
        assert [v.field for v in check(m, contract)] == ["host.nvidia_driver"]


def test_accepts_object_with_to_dict():
    class Manifest:
        def to_dict(self):
            return fake_manifest(driver="520.61.05", cuda="12.1")

    assert len(check(Manifest())) == 1


# --- ranges, validated lists, absence ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("driver", "ok"),
    [("535.104.05", True), ("550.90.07", True), ("540", True), ("535.104.04", False), ("550.90.08", False)],
)
def test_driver_range_inclusive_both_ends(driver, ok):
    contract = Contract.from_dict({"driver": {"min": "535.104.05", "max": "550.90.07"}})
    violations = check(fake_manifest(driver=driver), contract)
    assert (violations == []) is ok
    if not ok:
        (v,) = violations
        assert v.field == "host.nvidia_driver" and v.found == driver
        assert "535.104.05" in v.message and "550.90.07" in v.message and driver in v.message


@pytest.mark.parametrize(
    ("kernel", "ok"),
    [("5.15.0", True), ("6.1.0", True), ("5.14.21", False), ("6.1.1", False), ("6.1.0-18-amd64", True)],
)
def test_kernel_range_inclusive_both_ends(kernel, ok):
    # A bound names a prefix: max "6.1.0" admits the distribution build 6.1.0-18, not 6.1.1.
    contract = Contract.from_dict({"kernel": {"min": "5.15.0", "max": "6.1.0"}})
    assert (check(fake_manifest(kernel=kernel), contract) == []) is ok


def test_max_prefix_admits_whole_series():
    contract = Contract.from_dict({"driver": {"max": "550"}})
    assert check(fake_manifest(driver="550.127.05"), contract) == []
    assert len(check(fake_manifest(driver="555.42.02"), contract)) == 1


def test_validated_driver_list():
    contract = Contract.from_dict({"driver": {"validated": ["535.104.05", "550.90.07"]}})
    assert check(fake_manifest(driver="535.104.05"), contract) == []
    assert check(fake_manifest(driver="550.90.07"), contract) == []
    (v,) = check(fake_manifest(driver="545.23.08"), contract)
    assert v.found == "545.23.08" and "535.104.05" in v.expected and "550.90.07" in v.expected


def test_cpu_manifest_with_empty_contract_is_clean():
    assert check(fake_manifest(driver=None, cuda=None), Contract()) == []


def test_absent_driver_is_a_violation_unless_allowed():
    cpu = fake_manifest(driver=None, cuda=None)
    (v,) = check(cpu, Contract.from_dict({"driver": {"min": "525.60.13"}}))
    assert (v.field, v.scope, v.found) == ("host.nvidia_driver", "host", None)
    assert "absent" in v.message and "525.60.13" in v.message
    assert check(cpu, Contract.from_dict({"driver": {"min": "525.60.13"}, "allow_missing": ["driver"]})) == []


def test_allow_missing_is_per_field():
    cpu = fake_manifest(driver=None, cuda=None)
    contract = {"driver": {"min": "525.60.13"}, "cuda": "12.1", "allow_missing": ["driver"]}
    assert [v.field for v in check(cpu, Contract.from_dict(contract))] == ["image.cuda"]
    contract["allow_missing"] = ["driver", "cuda"]
    assert check(cpu, Contract.from_dict(contract)) == []
    # allow_missing excuses absence only: a present value is still checked.
    assert len(check(fake_manifest(cuda="11.8"), Contract.from_dict(contract))) == 1


# --- python, cuda ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "python", "ok"),
    [
        ("3.11", "3.11.7", True),
        ("3.11", "3.11.0", True),
        ("3.11", "3.12.1", False),
        ("3.1", "3.11.7", False),  # numeric parts, not a string prefix
        ("3.11.7", "3.11.7", True),
        ("3.11.7", "3.11.8", False),
        (["3.10", "3.11"], "3.11.7", True),
    ],
)
def test_python_spec(spec, python, ok):
    violations = check(fake_manifest(python=python), Contract.from_dict({"python": spec}))
    assert (violations == []) is ok
    if not ok:
        assert violations[0].field == "image.python" and violations[0].scope == "image"


def test_cuda_allowed_list():
    contract = Contract.from_dict({"cuda": ["12.1", "12.4"]})
    assert check(fake_manifest(cuda="12.4"), contract) == []
    (v,) = check(fake_manifest(cuda="12.2"), contract)
    assert v.field == "image.cuda" and "12.2" in v.message and "12.1" in v.message and "12.4" in v.message


# --- packages ----------------------------------------------------------------------------------------


def test_packages_from_lockfile_relative_to_contract(tmp_path, monkeypatch):
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    (deploy / "requirements.lock").write_text("# pins\nnumpy==2.4.6\ntorch==2.1.0+cu121\n")
    (deploy / "contract.yaml").write_text("packages: requirements.lock\n")
    monkeypatch.chdir(tmp_path)  # the lockfile is found beside the YAML file, not in the cwd
    contract = Contract.load(deploy / "contract.yaml")
    assert dict(contract.packages) == {"numpy": "2.4.6", "torch": "2.1.0+cu121"}
    assert check(fake_manifest(), contract) == []  # typing-extensions installed extra: fine
    (v,) = check(fake_manifest(packages={"numpy": "2.4.5", "torch": "2.1.0+cu121"}), contract)
    assert (v.field, v.scope, v.found, v.expected) == ("image.packages.numpy", "image", "2.4.5", "==2.4.6")
    assert "2.4.5" in v.message and "2.4.6" in v.message


def test_packages_mapping_canonical_names_and_missing():
    contract = Contract.from_dict({"packages": {"Typing_Extensions": "4.12.2", "pyyaml": "6.0.2"}})
    (v,) = check(fake_manifest(), contract)
    assert (v.field, v.found) == ("image.packages.pyyaml", None)
    assert "not installed" in v.message and "6.0.2" in v.message


def test_package_versions_are_exact_pins():
    contract = Contract.from_dict({"packages": {"torch": "2.1.0"}})
    (v,) = check(fake_manifest(), contract)  # installed 2.1.0+cu121 is not the pin 2.1.0
    assert v.found == "2.1.0+cu121"


# --- malformed contracts -----------------------------------------------------------------------------


def _load(tmp_path: Path, text: str) -> Contract:
    path = tmp_path / "contract.yaml"
    path.write_text(text)
    return Contract.load(path)


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ("driver: {min: '525.60.13'}\ngpu: H100\n", "gpu", ["unknown"]),
        ("driver: {min: 535}\n", "driver.min", ["expected a version string like '535.104.05'", "got 535"]),
        ("cuda: 12.1\n", "cuda", ["quote it", "got 12.1"]),
        ("driver: {min: '1', validated: ['2']}\n", "driver", ["either"]),
        ("driver: {minimum: '535'}\n", "driver", ["min and/or max"]),
        ("kernel: {validated: ['6.1']}\n", "kernel", ["min and/or max"]),
        ("driver: {min: '550', max: '535'}\n", "driver", ["min <= max"]),
        ("python: []\n", "python", ["non-empty list"]),
        ("packages: {numpy: 2.0}\n", "packages.numpy", ["exact version"]),
        ("packages: missing.lock\n", "packages", ["cannot read lockfile", "missing.lock"]),
        ("allow_missing: [gpu]\n", "allow_missing", ["driver, kernel, cuda, python"]),
        ("- driver\n", "(top level)", ["mapping"]),
    ],
)
def test_malformed_contract_names_file_and_field(tmp_path, text, field, words):
    with pytest.raises(ContractError) as info:
        _load(tmp_path, text)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'contract.yaml'}: {field}:"), message
    for word in words:
        assert word in message
    assert isinstance(info.value, ValueError)


def test_bad_yaml_names_file(tmp_path):
    with pytest.raises(ContractError, match=re.escape(str(tmp_path / "contract.yaml")) + ".*not valid YAML"):
        _load(tmp_path, "driver: {min: '535'\n")


def test_malformed_lockfile_names_line(tmp_path):
    (tmp_path / "requirements.lock").write_text("numpy==2.4.6\ntorch>=2\n")
    with pytest.raises(ContractError, match=r"packages: .*line 2"):
        _load(tmp_path, "packages: requirements.lock\n")


def test_from_dict_default_source_in_message():
    with pytest.raises(ContractError, match=r"^<dict>: driver\.max: expected a version string"):
        Contract.from_dict({"driver": {"max": 550}})


def test_module_docstring_example_loads(tmp_path):
    doc = contract_module.__doc__
    block = doc.split("contract.yaml``::\n\n", 1)[1].split("\n\n", 1)[0]
    (tmp_path / "requirements.lock").write_text("numpy==2.4.6\n")
    contract = _load(tmp_path, "\n".join(line[4:] for line in block.splitlines()))
    assert contract.driver.min == "535.104.05" and contract.driver.max == "550"
    assert contract.cuda == ("12.1",) and contract.python == ("3.11",)
    assert dict(contract.packages) == {"numpy": "2.4.6"} and contract.allow_missing == {"driver", "cuda"}
    assert check(fake_manifest(), contract) == []
    assert check(fake_manifest(driver=None, cuda=None), contract) == []
