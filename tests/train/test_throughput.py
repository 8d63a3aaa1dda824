"""Throughput figures (FLOPs per step, tokens/s, MFU, peak memory) and the ``run.profile`` trace.

Oracles: the closed form of a bias-free MLP's forward + backward FLOPs; the rows' own ``items_per_s``
(the rates are exact functions of it); the same run with the count switched off (identical losses);
the accelerator table read by hand."""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from steadytrain.train.observe.throughput import Throughput, accelerator, count_flops, peak_flops, summarize
from steadytrain.train.setup.models import TinyLM
from tests.dist_utils import cli_on_ranks
from tests.train_utils import TINY, metrics, run_cli, sets, write_text_dataset

SMALL = [*TINY, "run.log_every=2", "run.max_steps=6"]


class MLP(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b, bias=False), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, batch: dict) -> torch.Tensor:
        return self.net(batch["x"]).pow(2).sum(1)


@pytest.mark.parametrize(("widths", "n"), [([8, 16, 4], 1), ([8, 16, 4], 5), ([3, 32, 32, 7], 6)])
def test_mlp_flops_equal_the_closed_form_and_touch_nothing(widths, n):
    torch.manual_seed(0)
    model = MLP(widths)
    before = [p.detach().clone() for p in model.parameters()]
    batch = {"x": torch.randn(n, widths[0])}
    rng = torch.random.get_rng_state()
    flops = count_flops(model, batch)
    params = sum(a * b for a, b in itertools.pairwise(widths))
    first = widths[0] * widths[1]
    # forward 2PN, weight gradients 2PN, input gradients 2PN except the first layer's (data needs none)
    assert flops == 6 * params * n - 2 * first * n
    assert torch.equal(rng, torch.random.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_model_declared_figures_replace_the_count(caplog):
    class Declared(MLP):
        flops_per_example = 1000

        def tokens_per_example(self) -> int:
            return 7

        def forward(self, batch: dict) -> torch.Tensor:
            raise AssertionError("declared figures: the model is not run")

    meter = Throughput(torch.device("cpu"), 2, 32, 4, peak_flops=1e6)
    meter.measure(Declared([2, 2]), {"x": torch.zeros(4, 2), "tokens": torch.zeros(4, 9)}, True)
    assert (meter.flops_per_step, meter.tokens_per_example) == (1000 * 32, 7)
    assert meter.fields(8.0) == {"tokens_per_s": 56.0, "flops_per_s": 8000.0, "mfu": 8000.0 / 2e6}


def test_a_model_the_meta_device_cannot_run_is_one_warning_and_no_flops(caplog):
    class DataDependent(MLP):
        def forward(self, batch: dict) -> torch.Tensor:
            if batch["x"].sum().item() > 0:  # needs the values: meta tensors have none
                return self.net(batch["x"]).sum(1)
            return self.net(batch["x"]).pow(2).sum(1)

    meter = Throughput(torch.device("cpu"), 1, 4, 1, peak_flops=1e9)
    with caplog.at_level(logging.WARNING, logger="steadytrain.train"):
        meter.measure(DataDependent([2, 2]), {"x": torch.ones(4, 2)}, True)
    assert meter.flops_per_step is None
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "FLOPs not counted" in caplog.text
    assert meter.fields(10.0) == {}


@pytest.mark.parametrize(
    ("name", "entry"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA GH200 480GB", "H100 SXM"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L40S", "L40S"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("Tesla T4", "T4"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 3060", None),
        ("cpu", None),
    ],
)
def test_the_accelerator_table_matches_device_names(name, entry):
    found = accelerator(name)
    assert (found and found[0]) == entry


def test_peak_follows_the_precision():
    h100 = "NVIDIA H100 80GB HBM3"
    assert peak_flops(h100, "bf16") == peak_flops(h100, "fp16") == 989.4e12  # dense, not the sparse 1979
    assert peak_flops(h100, "fp32") == 66.9e12
    assert peak_flops(h100, "fp32", tf32=True) == 494.7e12
    assert peak_flops("Intel Xeon", "bf16") is None


# --- end to end: the rows of a short tiny-lm run ----------------------------------------------


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("text"), [90, 130, 70, 110])


def _train(run_dir: Path, data: Path, *items: str, **env: str) -> list[dict]:
    proc = run_cli("train", "--run-dir", str(run_dir), *sets(*SMALL, f"data.path={data}", *items), **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(run_dir)


def _flops_per_step(world: int) -> int:
    """The TINY model's count on one micro-batch (4 sequences of 33 bytes) x micro-batches per step x ranks."""
    per_micro = count_flops(TinyLM(dim=32, layers=1, heads=2, seq_len=32), {"tokens": torch.zeros(4, 33)})
    return per_micro * (16 // 4 // world) * world


def test_rows_carry_throughput_and_memory_and_counting_changes_no_loss(tmp_path, text_data):
    peak = 1e12
    rows = _train(tmp_path / "a", text_data, f"run.peak_flops={peak}", "run.profile={start_step: 2, steps: 2}")
    plain = _train(tmp_path / "b", text_data)
    off = _train(tmp_path / "c", text_data, f"run.peak_flops={peak}", STEADYTRAIN_FLOP_COUNT="0")
    expected = _flops_per_step(1)
    assert len(rows) == 6
    for r in rows:
        assert r["tokens_per_s"] == r["items_per_s"] * 32  # 33-byte windows: 32 predicted tokens each
        assert r["flops_per_s"] == r["items_per_s"] / 16 * expected
        assert r["mfu"] == r["flops_per_s"] / (peak * 1)
        assert r["peak_mem_mb"] > 0
    assert all("mfu" not in r and r["flops_per_s"] > 0 for r in plain)  # a CPU without run.peak_flops
    assert all("flops_per_s" not in r and "mfu" not in r and "tokens_per_s" in r for r in off)
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain] == [r["loss"] for r in off]
    assert summarize(rows)["flops_per_step"] == pytest.approx(expected, rel=1e-12)
    summary = (tmp_path / "a" / "summary.md").read_text()
    assert "tokens/s" in summary and "FLOPs per optimizer step" in summary and "MFU" in summary
    traces = sorted(p.name for p in (tmp_path / "a" / "profile").iterdir())
    assert traces == ["rank0-steps2-3.pt.trace.json"]
    assert json.loads((tmp_path / "a" / "profile" / traces[0]).read_text())["traceEvents"]


def test_a_profile_after_the_last_step_is_a_warning(tmp_path, text_data):
    proc = run_cli(
        "train", "--run-dir", str(tmp_path / "r"),
        *sets(*SMALL, f"data.path={text_data}", "run.max_steps=2", "run.profile={start_step: 5, steps: 1}"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run.profile.start_step=5 is after the run's last step (2)" in proc.stderr
    assert not (tmp_path / "r" / "profile").exists()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, text_data) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """A profiled 2-rank run (each rank runs ``main(argv)`` as under torchrun): its directory, each rank's exit."""
    root = tmp_path_factory.mktemp("two-ranks")
    run_dir = root / "two"
    items = sets(*SMALL, f"data.path={text_data}", "run.profile={start_step: 2, steps: 2}")
    (procs,) = cli_on_ranks(root, [["train", "--run-dir", run_dir, *items]])
    return run_dir, procs


@pytest.mark.distributed
def test_two_ranks_write_one_trace_each_and_count_the_global_flops(two_ranks):
    run_dir, procs = two_ranks
    for proc in procs:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    traces = sorted((run_dir / "profile").iterdir())
    assert [p.name for p in traces] == ["rank0-steps2-3.pt.trace.json", "rank1-steps2-3.pt.trace.json"]
    assert all(json.loads(p.read_text())["traceEvents"] for p in traces)
    expected = _flops_per_step(2)
    assert all(r["flops_per_s"] == r["items_per_s"] / 16 * expected for r in metrics(run_dir))
