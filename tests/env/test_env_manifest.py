"""Environment manifest: scopes on this machine, secrets never recorded, diffs by scope, seeding."""

from __future__ import annotations

import importlib.metadata as md
import json
import platform

import numpy as np
import pytest
import torch

from steadytrain.env import EnvManifest, ManifestError, capture, compare_ranks, diff, seed_everything, summarize


@pytest.fixture(scope="module")
def manifest() -> EnvManifest:
    return capture()


def test_scopes_on_this_machine(manifest):
    d = manifest.to_dict()
    assert set(d) >= {"image", "host", "code", "settings"}
    assert d["image"]["python"] == platform.python_version()
    assert d["image"]["torch"] == torch.__version__
    assert d["image"]["cuda"] == torch.version.cuda
    assert d["host"]["kernel"] == platform.release()
    if not torch.cuda.is_available():
        assert d["host"]["nvidia_driver"] is None
        assert d["host"]["gpus"] is None
    assert d["settings"]["deterministic_algorithms"] == torch.are_deterministic_algorithms_enabled()


def test_every_installed_distribution_is_recorded(manifest):
    pkgs = manifest.image["packages"]
    for dist in md.distributions():
        name = dist.metadata["Name"].lower().replace("_", "-").replace(".", "-")
        assert name in pkgs, name
    assert pkgs["numpy"] == np.__version__


def test_json_round_trip(manifest, tmp_path):
    path = tmp_path / "env.json"
    manifest.save(path)
    again = EnvManifest.load(path)
    assert again.to_dict() == json.loads(json.dumps(manifest.to_dict()))
    assert diff(manifest, again) == []


def test_secrets_never_recorded(monkeypatch):
    planted = {
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_AUTH_TOKEN": "sekrit-1",
        "HF_TOKEN": "sekrit-2",
        "AWS_SECRET_ACCESS_KEY": "sekrit-3",
        "WANDB_API_KEY": "sekrit-4",
        "DB_PASSWORD": "sekrit-5",
        "TORCH_NCCL_PRIVATE_KEY_PATH": "sekrit-6",
        "GLOO_CREDENTIALS": "sekrit-7",
    }
    for k, v in planted.items():
        monkeypatch.setenv(k, v)
    text = json.dumps(capture().to_dict())
    assert "sekrit" not in text
    for name in planted:
        if name != "NCCL_SOCKET_IFNAME":
            assert name not in text
    assert '"NCCL_SOCKET_IFNAME": "eth0"' in text  # a real knob is recorded


def test_driver_only_difference_is_one_host_difference(manifest):
    other = EnvManifest.from_dict(json.loads(json.dumps(manifest.to_dict())))
    other.host["nvidia_driver"] = "550.90.07"
    diffs = diff(manifest, other)
    assert [(d.path, d.scope) for d in diffs] == [("host.nvidia_driver", "host")]
    assert not [d for d in diffs if d.scope == "image"]
    line = summarize(diffs)
    assert line.startswith("image identical; host differs: nvidia_driver")
    assert "550.90.07" in line


def test_package_difference_is_image_scope(manifest):
    other = EnvManifest.from_dict(json.loads(json.dumps(manifest.to_dict())))
    other.image["packages"]["numpy"] = "1.0.0"
    del other.image["packages"]["torch"]
    other.image["packages"]["newpkg"] = "0.1"
    paths = {d.path: (d.a, d.b) for d in diff(manifest, other)}
    assert paths["image.packages.numpy"] == (np.__version__, "1.0.0")
    assert paths["image.packages.torch"][1] is None
    assert paths["image.packages.newpkg"] == (None, "0.1")
    assert {d.scope for d in diff(manifest, other)} == {"image"}


def test_compare_ranks_flags_the_odd_host(manifest):
    base = manifest.to_dict()
    ranks = [EnvManifest.from_dict(json.loads(json.dumps(base))) for _ in range(3)]
    for r, m in enumerate(ranks):
        m.host["hostname"] = f"node{r}"  # identity, not a difference
    ranks[2].host["nvidia_driver"] = "535.104.05"
    report = compare_ranks(ranks)
    assert list(report) == [2]
    assert [d.path for d in report[2]] == ["host.nvidia_driver"]


@pytest.mark.parametrize(
    ("payload", "word"),
    [("[1, 2]", "JSON object"), ('{"image": {}, "host": {}, "code": {}}', "settings"), ("{oops", "not valid JSON")],
)
def test_malformed_manifest_names_file_and_field(tmp_path, payload, word):
    path = tmp_path / "bad.json"
    path.write_text(payload)
    with pytest.raises(ManifestError, match=word) as err:
        EnvManifest.load(path)
    assert "bad.json" in str(err.value)


def test_seeding_repeats():
    seed_everything(123)
    a = (torch.rand(3), np.random.rand(3), __import__("random").random())
    seed_everything(123)
    b = (torch.rand(3), np.random.rand(3), __import__("random").random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
    seed_everything(124)
    assert not torch.equal(a[0], torch.rand(3))


def test_deterministic_mode_is_recorded(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        record = seed_everything(0, deterministic=True)
        assert record["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        settings = capture().settings
        assert settings["deterministic_algorithms"] is True
        assert settings["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, True])
def test_bad_seed(bad):
    with pytest.raises(ValueError, match="seed"):
        seed_everything(bad)


def test_the_package_list_follows_an_install_in_the_same_process(tmp_path, monkeypatch):
    """The list is read once per state of the import path: a package installed (or upgraded) since is seen."""
    from steadytrain.env._probe import _packages

    def install(version: str) -> None:
        for old in tmp_path.glob("steadytrain_probe_pkg-*.dist-info"):
            (old / "METADATA").unlink()
            old.rmdir()
        info = tmp_path / f"steadytrain_probe_pkg-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: steadytrain-probe-pkg\nVersion: {version}\n")

    monkeypatch.syspath_prepend(str(tmp_path))
    assert "steadytrain-probe-pkg" not in _packages()
    install("1.0")
    assert _packages()["steadytrain-probe-pkg"] == "1.0"
    install("2.0")
    assert _packages()["steadytrain-probe-pkg"] == "2.0"
