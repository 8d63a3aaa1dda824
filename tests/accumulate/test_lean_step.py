"""A lean step: the device-to-host reads of an optimizer step, counted with a ``TorchFunctionMode``.

Every read of a tensor's value on the host (``.item()``, ``.tolist()``, ``bool()``, ``float()``,
``int()``, ``.cpu()``, ``.numpy()``) made by the training process between two optimizer steps is
counted, except reads of the micro-batch's own host columns (the data's ``shard``/``index``, which
never leave the host). A step that does not log, checkpoint or evaluate reads once: the non-finite
decision (with the gradient norm and, under a spike policy that decides, the spike flag). Loading
runs in a worker process (``data.num_workers=1``), outside the mode.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from steadytrain.train.job import loop
from steadytrain.train.setup.config import load_config
from tests.train_utils import TINY, write_text_dataset

READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"}
LOG_EVERY, STEPS = 5, 12


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values on the host; ``skip`` holds the ids of host data tensors. ``calls``: every
    torch function called (kernels, collectives, reads alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.calls = 0
        self.skip: set[int] = set()
        self.data: list[torch.Tensor] = []  # kept alive: a freed tensor's id could name a computed one

    def host_data(self, mb: dict) -> None:
        tensors = [v for v in mb.values() if isinstance(v, torch.Tensor)]
        self.data += tensors
        self.skip.update(map(id, tensors))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        self.calls += 1
        if name in READS and args and isinstance(args[0], torch.Tensor) and id(args[0]) not in self.skip:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("data") / "ds", [64] * 8)


def reads_per_step(tmp_path: Path, data: Path, monkeypatch, *extra: str, what: str = "reads") -> dict[int, int]:
    """Per optimizer step: the host reads it made (``what="reads"``), or every torch function it called
    (``what="calls"``)."""
    overrides = [
        *TINY, f"data.path={data}", f"run.max_steps={STEPS}", f"run.log_every={LOG_EVERY}",
        "checkpoint.every_steps=1000", "checkpoint.async=false", "data.num_workers=1",
        "eval.holdout_fraction=null", *extra,  # no evaluation: no step evaluates (the last would, by default)
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    mode, per_step = HostReads(), {}
    micro_batch, after_step = loop._micro_batch, loop._after_step

    def count() -> int:
        return len(mode.reads) if what == "reads" else mode.calls

    def counted_micro_batch(job, mb):
        per_step.setdefault(0, count())  # what the build read is not a step's
        mode.host_data(mb)
        return micro_batch(job, mb)

    def counted_after_step(job, result, loss):
        out = after_step(job, result, loss)
        per_step[job.state.step] = count()
        return out

    monkeypatch.setattr(loop, "_micro_batch", counted_micro_batch)
    monkeypatch.setattr(loop, "_after_step", counted_after_step)
    with mode:
        loop.train(cfg, run_dir=tmp_path / "run")
    counts, before = {}, per_step.pop(0)
    for step in sorted(per_step):
        counts[step], before = per_step[step] - before, per_step[step]
    return counts


@pytest.mark.parametrize("spike", ["off", "warn", "skip"])
def test_one_host_read_per_step_that_does_not_log(tmp_path, text_data, monkeypatch, spike):
    counts = reads_per_step(tmp_path, text_data, monkeypatch, f"spike.policy={spike}", "spike.window=4")
    assert sorted(counts) == list(range(1, STEPS + 1))
    quiet = {s: n for s, n in counts.items() if s % LOG_EVERY}
    assert quiet and all(n == 1 for n in quiet.values()), sorted(counts.items())
    logging_steps = {s: n for s, n in counts.items() if s % LOG_EVERY == 0}
    assert all(n >= 1 for n in logging_steps.values()), counts  # the interval's losses are read there


def test_the_layer_monitor_costs_nothing_on_other_steps_and_one_read_on_its_own(tmp_path, text_data, monkeypatch):
    """``monitor.layers: norms`` every 5 steps against ``off``: the steps in between call exactly the same torch
    functions (no kernel, collective or read added); a monitored step reads once more."""
    on = dict(reads=reads_per_step(tmp_path / "on", text_data, monkeypatch, "monitor.every_steps=5"))
    off = dict(reads=reads_per_step(tmp_path / "off", text_data, monkeypatch, "monitor.layers=off"))
    on["calls"] = reads_per_step(tmp_path / "on2", text_data, monkeypatch, "monitor.every_steps=5", what="calls")
    off["calls"] = reads_per_step(tmp_path / "off2", text_data, monkeypatch, "monitor.layers=off", what="calls")
    assert (tmp_path / "on" / "run" / "layers.jsonl").is_file() and not (
        tmp_path / "off" / "run" / "layers.jsonl"
    ).exists()
    quiet = [s for s in range(1, STEPS + 1) if s % 5]
    assert [on["calls"][s] for s in quiet] == [off["calls"][s] for s in quiet]
    assert all(on["calls"][s] > off["calls"][s] for s in (5, 10))
    assert [on["reads"][s] - off["reads"][s] for s in range(1, STEPS + 1)] == [
        1 if s % 5 == 0 else 0 for s in range(1, STEPS + 1)
    ]
