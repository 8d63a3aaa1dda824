"""Runs with a planted cause on 2 gloo ranks that several test modules read, trained once per session on one spawned
pair (``planted`` in conftest.py): a faulty device (rank-selective NaN), a flipped replica (parity, stopped and
warned), a straggler, a rank that is slow but moves (no hang), and one clean run that names nobody in any of them.

The cause is planted by the test's own model (``planted:factory``), never by product code: on rank 1 its forward
numbers ``faulty_at`` return NaN losses whatever the data, its forward number ``flip_at`` flips one element of the
head's weight, and every forward sleeps ``slow_ms``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from subprocess import CompletedProcess

from tests.dist_utils import cli_on_ranks
from tests.train_utils import bigram_module, sets, write_text_dataset

PLANTED = bigram_module(
    doc="A bigram LM with planted faults on rank 1: NaN at ``faulty_at``, a flipped weight at ``flip_at``, "
    "``slow_ms`` of sleep in each forward.",
    hook="""
    rank1 = os.environ.get("RANK") == "1"
    if rank1 and self.calls == int(self.kw.get("flip_at", 0)):
        with torch.no_grad():
            self.head.weight[3, 5] = -self.head.weight[3, 5] + 1.0  # a silent corruption of this replica
    if rank1 and float(self.kw.get("slow_ms", 0)):
        time.sleep(float(self.kw["slow_ms"]) / 1e3)
    """,
    after="""
    at = {int(x) for x in str(self.kw.get("faulty_at", "")).split(",") if x}
    if rank1 and self.calls in at:
        return losses * float("nan")  # the device's fault, whatever the examples
    """,
)

COMMON = (
    "model.name=planted:factory",
    "data.seq_len=32",
    "batch.micro_batch_size=4",
    "batch.global_batch_size=16",
    "batch.base_batch_size=16",
)
"""2 micro-batches per rank per step on 2 ranks: rank 1's forward number ``2 * step - 1`` is its first of ``step``."""

RUNS = {
    # rank 1's first forward of steps 3, 5, 7 and 9; every step checkpointed for triage
    "faulty": ("run.max_steps=10", "run.log_every=1", "checkpoint.every_steps=1", "checkpoint.keep_last=20",
               "model.faulty_at=5,9,13,17"),
    # rank 1's first forward of step 11; parity checked every 5 steps
    "flipped": ("run.max_steps=20", "run.log_every=5", "checkpoint.every_steps=100",
                "distributed.parity_every_steps=5", "model.flip_at=21"),
    "warned": ("run.max_steps=20", "run.log_every=5", "checkpoint.every_steps=100",
               "distributed.parity_every_steps=5", "model.flip_at=21", "distributed.on_parity=warn"),
    # 2 x 25 ms a step on rank 1; a row per rank every 2 steps: 6 intervals
    "slow": ("run.max_steps=12", "run.log_every=2", "checkpoint.every_steps=100", "model.slow_ms=25"),
    # 2 x 0.4 s a step on rank 1, each forward well inside the watchdog's 3 s
    "moving": ("run.max_steps=8", "run.log_every=1", "checkpoint.every_steps=2", "distributed.watchdog_s=3",
               "model.slow_ms=400"),
    # what every planted run is checked against: the same data and model, nothing planted
    "clean": ("run.max_steps=12", "run.log_every=2", "checkpoint.every_steps=100",
              "distributed.parity_every_steps=5"),
}  # fmt: skip


@dataclass(frozen=True)
class Planted:
    """The model's package directory (for ``PYTHONPATH``), the dataset, and each run's directory and result per rank."""

    pkg: Path
    data: Path
    runs: dict[str, Path]
    results: dict[str, list[CompletedProcess]]


def train_planted(root: Path) -> Planted:
    """Train every run of :data:`RUNS` under ``root`` on one spawned pair of gloo ranks, in order."""
    pkg = root / "pkg"
    pkg.mkdir()
    (pkg / "planted.py").write_text(PLANTED)
    data = write_text_dataset(root / "data", [10] * 16)  # small shards: a micro-batch spans several
    runs = {name: root / name for name in RUNS}
    commands = [["train", "--run-dir", runs[n], *sets(*COMMON, f"data.path={data}", *RUNS[n])] for n in RUNS]
    done = cli_on_ranks(root, commands, PYTHONPATH=str(pkg))
    return Planted(pkg, data, runs, dict(zip(RUNS, done, strict=True)))
