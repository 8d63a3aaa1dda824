"""The device mesh (``distributed.mesh``, ``distributed.strategy``), tensor-parallel plans and ``check-parallel`` used
carelessly and with hostile input.

Each test is a finding, or the refusal that stands beside one: a value read as another number (``tp=2_0`` as 20 ranks),
a refusal in pydantic's words, a traceback, a plan whose entries torch skips in silence (the model trained unsplit), a
tolerance under which every run agrees, a run that ``eval`` or ``--resume --set`` could not reach, a mistake said
once per rank after the ranks started, two checks interleaved in one directory. The oracles are the inputs each test
builds (which module a plan names, which layout the config gives) and the same checkpoint evaluated without a mesh.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from steadytrain.errors import UserError
from steadytrain.runs import parallel
from steadytrain.train.setup.distributed import DistInfo
from steadytrain.train.setup.mesh import mesh_shape
from steadytrain.train.setup.models import TinyLM, build_model
from steadytrain.train.setup.sections import DistributedConfig, parse_mesh
from steadytrain.train.setup.tensor_parallel import MeshSize, _check_keys, apply_tensor_parallel, check_plan, plan_of
from tests.cli_utils import assert_user_error, in_process
from tests.dist_utils import cli_on_ranks
from tests.train_utils import TINY, run_cli, sets, train, write_text_dataset

# --- the mesh as a value ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["tp=2_0", "tp=\uff12", "shard=\u0663", "tp=0x2", "tp=1e3"])
def test_a_dimension_is_written_in_ascii_digits_only(text):
    # int() reads "2_0" as 20 and full-width or Arabic-Indic digits as numbers: check-parallel launched 20 ranks
    with pytest.raises(ValueError, match="is not a whole number: write it in digits 0-9"):
        parse_mesh(text)
    assert parse_mesh("tp=+2, shard= 3 ") == {"tp": 2, "shard": 3}


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("4", ["distributed.mesh", "4 is not a mesh", "{replicate: R, shard: S, tp: T}", "replicate=R,shard=S,tp=T"]),
        ("true", ["distributed.mesh", "true is not a mesh", "replicate=R,shard=S,tp=T"]),
        ("1.5", ["distributed.mesh", "1.5 is not a mesh"]),
        ("[2, 2]", ["distributed.mesh", "[2, 2] is not a mesh"]),
        ("tp=2_0", ["distributed.mesh", "tp='2_0' is not a whole number"]),
        ("{tp: 0}", ["distributed.mesh.tp=0", "greater than or equal to 1"]),
        ("{tp: -2}", ["distributed.mesh.tp=-2", "greater than or equal to 1"]),
        ("{tp: 99999999999}", ["distributed.mesh.tp=99999999999", "less than or equal to"]),
        ("{tp: 2.5}", ["distributed.mesh.tp=2.5", "fractional part"]),
        ("{tp: true}", ["distributed.mesh.tp", "true is a flag, not a number"]),
        ("{tp: 2, pp: 2}", ["unknown key 'distributed.mesh.pp'"]),
        ("pp=2", ["distributed.mesh", "'pp=2' is not one of replicate=R, shard=S, tp=T"]),
        ("shard=2,shard=2", ["distributed.mesh", "shard is given twice"]),
        ("','", ["distributed.mesh", "no dimension given"]),
        ('"tp=2\\nshard=2"', ["distributed.mesh", "tp='2\\nshard=2' is not a whole number"]),
    ],
)
def test_a_bad_mesh_is_refused_in_one_line_naming_it(value, words):
    assert_user_error(in_process("config", "show", *sets(f"distributed.mesh={value}")), *words)


@pytest.mark.parametrize(
    ("strategy", "mesh", "fits"),
    [
        ("ddp", "tp=2", False),
        ("ddp", "shard=2", False),
        ("fsdp", "replicate=2,shard=2", False),
        ("hsdp", "replicate=2", False),
        ("hsdp", "shard=4", False),
        ("hsdp", None, False),
        ("ddp", "replicate=4", True),
        ("fsdp", "shard=2,tp=2", True),
        ("hsdp", "replicate=2,shard=2,tp=2", True),
        (None, "replicate=2,tp=2", True),
    ],
)
def test_a_strategy_must_be_the_meshs_own(strategy, mesh, fits):
    if fits:
        assert DistributedConfig(strategy=strategy, mesh=mesh).mesh is not None
    else:
        with pytest.raises(ValueError, match=f"strategy={strategy}"):
            DistributedConfig(strategy=strategy, mesh=mesh)


def test_hsdp_without_a_mesh_names_the_other_strategies():
    # a resume of an HSDP run with `--set distributed.mesh=null` lands here: the way out is another strategy too
    with pytest.raises(ValueError, match=r"strategy=hsdp needs mesh: .* or another strategy \(ddp, fsdp, or null\)"):
        DistributedConfig(strategy="hsdp")


def test_a_mesh_of_another_size_names_both_ways_out():
    d = DistributedConfig(mesh={"shard": 2, "tp": 2})
    assert mesh_shape(d, 4) == (1, 2, 2)
    with pytest.raises(UserError, match=r"needs 1 x 2 x 2 = 4 ranks, this job has 2: .* or set distributed.mesh=null"):
        mesh_shape(d, 2)


def test_a_dotted_mesh_key_starts_the_section_a_file_leaves_null(tmp_path):
    # every run saved without a mesh has `mesh: null` in its config.yaml: `--resume --set distributed.mesh.shard=2`
    # was refused as "'mesh' is not a section"
    (tmp_path / "c.yaml").write_text("distributed:\n  mesh: null\n")
    proc = in_process("config", "show", str(tmp_path / "c.yaml"), *sets("distributed.mesh.replicate=1"))
    assert proc.returncode == 0, proc.stderr
    assert "  mesh:\n    replicate: 1\n    shard: 1\n    tp: 1\n" in proc.stdout
    (tmp_path / "s.yaml").write_text("distributed:\n  mesh: shard=2\n")
    proc = in_process("config", "show", str(tmp_path / "s.yaml"), *sets("distributed.mesh.tp=2"))
    assert_user_error(proc, "distributed.mesh is 'shard=2', not a section", "--set distributed.mesh=")


# --- plans ------------------------------------------------------------------------------------------------------------


class _Mesh(MeshSize):
    """A 1-D mesh of ``n`` ranks as a plan sees it (``mesh["tp"]`` is itself)."""

    def __getitem__(self, name: str) -> _Mesh:
        return self


class _Exploding(ParallelStyle):
    def _apply(self, module, mesh):
        raise KeyError("weight_scale")


def _user(plan: object, raises: BaseException | None = None) -> nn.Module:
    class User(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def tp_plan(self, mesh):
            if raises is not None:
                raise raises
            return plan

    return User()


_INFO = DistInfo(0, 2, 0, torch.device("cpu"), "gloo", kind="mesh", tp=2, mesh=_Mesh(2), shape=(1, 1, 2))


@pytest.mark.parametrize(
    ("model", "words"),
    [
        (_user(None), "User.tp_plan(mesh) returned NoneType"),
        (_user(["lin"]), "User.tp_plan(mesh) returned list"),
        (_user({}), "User.tp_plan(mesh) returned an empty dict"),
        (_user({"lin": "colwise"}), "maps 'lin' to str, not a ParallelStyle instance"),  # torch: TypeError traceback
        (_user({"lin": None}), "maps 'lin' to NoneType"),  # torch: skipped with a warning, the layer unsplit
        (_user({"lin": ColwiseParallel}), "maps 'lin' to the class ColwiseParallel"),
        (_user({3: ColwiseParallel()}), "returned the key 3 (int), not a module path"),
        (_user({"nope": ColwiseParallel()}), "names 'nope', which matches no module of User"),
        (_user({"*.lin": ColwiseParallel()}), "names '*.lin', which matches no module of User"),  # torch: skipped
        (_user(None, KeyError("boom")), "User.tp_plan(mesh) raised KeyError: 'boom'"),
        (_user({"lin": _Exploding()}), "tensor-parallel plan of User does not apply: KeyError: 'weight_scale'"),
        (nn.Linear(2, 2), "model Linear has no tensor-parallel plan"),
    ],
)
def test_a_plan_that_is_not_one_is_refused_in_one_line(model, words):
    with pytest.raises(UserError) as caught:
        apply_tensor_parallel(model, _INFO)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_a_plan_attribute_that_is_not_a_method_is_named():
    class Attr(nn.Module):
        tp_plan: ClassVar = {"lin": ColwiseParallel()}

    with pytest.raises(UserError, match=r"Attr\.tp_plan is a dict, not a method: define tp_plan"):
        plan_of(Attr(), _Mesh(2))


def test_wildcards_that_match_modules_pass_the_key_check():
    model = TinyLM(dim=32, heads=2, layers=2, seq_len=8)
    plan = {"blocks.*.attn.q": ColwiseParallel(), "blocks.1.mlp.[0]": ColwiseParallel()}
    _check_keys(model, plan)  # both match (blocks.0/1.attn.q; blocks.1.mlp.0): no refusal


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"dim": 48, "heads": 3, "layers": 1}, "model.heads=3 does not split over distributed.mesh.tp=2: give"),
        ({"dim": 32, "heads": 2, "layers": 0}, "model.layers=0: no layers to split over distributed.mesh.tp=2"),
    ],
)
def test_tiny_lm_that_cannot_split_is_refused_before_any_rank(kwargs, words):
    with torch.device("meta"):
        model = TinyLM(seq_len=8, **kwargs)
    with pytest.raises(UserError, match=words):
        check_plan(model, 2)


def test_a_transformers_model_without_a_plan_is_refused_before_any_rank():
    with torch.device("meta"):
        gpt2 = build_model("hf:gpt2", {"n_layer": 1, "n_embd": 32, "n_head": 2}, context={"seq_len": 16})
    with pytest.raises(UserError, match="model hf:gpt2 has no tensor-parallel plan in transformers"):
        check_plan(gpt2, 2)
    check_plan(gpt2, 1)  # no tensor parallelism: nothing to refuse


@pytest.mark.parametrize(
    ("items", "words"),
    [
        (["model.heads=3", "model.dim=48", "distributed.mesh=tp=2"], ["model.heads=3", "distributed.mesh.tp=2"]),
        (["model.name=tabular", "distributed.mesh=tp=2"], ["distributed.mesh.tp=2", "model.name=tabular", "tp=1"]),
    ],
)
def test_config_show_refuses_a_model_its_mesh_cannot_split(items, words):
    assert_user_error(in_process("config", "show", *sets(*items)), *words)


def test_nproc_refuses_a_mesh_of_other_size_once_before_launching(tmp_path):
    # the ranks each said it (two lines, after torchrun's start-up); now once, before anything starts
    proc = in_process("train", "--nproc", "2", "--run-dir", str(tmp_path / "r"), *sets("distributed.mesh=tp=4"))
    assert_user_error(proc, "distributed.mesh replicate=1,shard=1,tp=4 needs", "this job has 2")
    proc = in_process("train", "--nproc", "2", "--run-dir", str(tmp_path / "r"), *sets("distributed.mesh={}"))
    assert_user_error(proc, "needs 1 x 1 x 1 = 1 ranks, this job has 2")
    assert not (tmp_path / "r").exists()


# --- a run's mesh after training: resume and eval ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    data = write_text_dataset(root / "data", [24] * 4)
    items = (*TINY, f"data.path={data}", "run.max_steps=2", "eval.holdout_shards=1", "checkpoint.every_steps=2")
    train(root / "run", *items)
    return root / "run"


def test_resume_sets_one_dimension_of_a_run_saved_without_a_mesh(one_rank_run, tmp_path):
    run = Path(shutil.copytree(one_rank_run, tmp_path / "run"))
    proc = run_cli("train", "--resume", str(run), *sets("distributed.mesh.tp=2", "run.max_steps=3"))
    assert_user_error(proc, "distributed.mesh replicate=1,shard=1,tp=2 needs", "this job has 1")
    train(run, "distributed.mesh.replicate=1", "run.max_steps=3", args=("--resume", str(run)))
    resumes = [json.loads(x) for x in (run / "resumes.jsonl").read_text().splitlines()]
    assert resumes[-1]["changes"]["distributed.mesh.replicate"] == [None, 1] and resumes[-1]["step"] == 2
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()][-1] == 3


def test_eval_takes_a_mesh_run_on_the_ranks_it_has(one_rank_run, tmp_path):
    # a run trained on {shard: 2, tp: 2} records that mesh: `eval RUN` alone refused it ("needs 4 ranks, this job has
    # 1") with no way to say otherwise, though its checkpoint reshards; the oracle is the same checkpoint without it
    run = Path(shutil.copytree(one_rank_run, tmp_path / "run"))
    alone = in_process("eval", str(run), "--json")
    assert alone.returncode == 0, alone.stderr
    config = run / "config.yaml"
    assert "  mesh: null\n" in config.read_text()
    config.write_text(config.read_text().replace("  mesh: null\n", "  mesh:\n    shard: 2\n    tp: 2\n"))
    meshed = in_process("eval", str(run), "--json")
    assert meshed.returncode == 0, meshed.stderr
    assert json.loads(meshed.stdout) == json.loads(alone.stdout)


# --- check-parallel -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--rtol", "nan"], ["'--rtol'", "'nan' is not a number"]),  # NaN: every difference "agreed"
        (["--mesh", "tp=2_0"], ["--mesh", "tp='2_0' is not a whole number"]),  # 20 ranks were launched
        (["--set", "distributed.mesh=tp=4"], ["--set 'distributed.mesh=tp=4'", "from --mesh and --against"]),
        (["--set", "distributed.mesh.shard=2"], ["--set 'distributed.mesh.shard=2'", "give the layouts there"]),
        (["--set", "distributed.strategy=ddp"], ["strategy=ddp does not fit mesh replicate=1,shard=1,tp=2"]),
        (["--set", "model.heads=3", "--set", "model.dim=48"], ["model.heads=3", "distributed.mesh.tp=2"]),
        (["--set", "model.name=tabular"], ["distributed.mesh.tp=2", "model.name=tabular"]),
        (["/nonexistent/c.yaml"], ["/nonexistent/c.yaml: no such config"]),
        (["--steps", "0"], ["--steps", "0 is not in the range"]),
    ],
)
def test_check_parallel_refuses_before_training(tmp_path, args, words):
    # the first seven launched the layouts' ranks first, then failed or misreported (the last two: refused as before)
    first = ["--mesh", "tp=2"] if "--mesh" not in args else []
    proc = in_process("check-parallel", *first, *args, "--out", str(tmp_path / "out"))
    assert_user_error(proc, *words)
    assert not (tmp_path / "out").exists()


def test_check_parallel_out_under_a_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    proc = in_process("check-parallel", "--mesh", "tp=2", "--json", "--out", str(tmp_path / "f" / "sub"))
    assert_user_error(proc, "--out", "cannot create it", "give a writable directory")  # was a NotADirectoryError
    assert json.loads(proc.stdout)["error"].startswith("--out")
    assert_user_error(in_process("check-parallel", "--mesh", "tp=2", "--out", str(tmp_path / "f")), "is a file")


def test_a_failing_layout_is_said_in_one_line_with_its_log(tmp_path):
    # the 1-rank layout trains first (in its own process) and fails: its own error line and the log's path
    out, bad = tmp_path / "out", tmp_path / "n\u00f6\ndata"
    proc = in_process(
        "check-parallel", "--mesh", "replicate=1", "--against", "tp=2", "--steps", "1", "--out", str(out),
        *sets(f"data.path={bad}"),
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    log = out / "replicate1_shard1_tp1.log"
    assert last.startswith("error: check-parallel: training on replicate=1,shard=1,tp=1 failed (exit 2): ")
    assert "n\u00f6" in last and "not a directory" in last and f"(whole log: {log})" in last
    assert not (out / "replicate1_shard1_tp2").exists()  # the other layout never started


def _two_checks(monkeypatch, out: Path) -> list[str]:
    """Two check-parallels into ``out`` at once, both past the look at ``out`` (held together where they create it);
    each trains by creating its layout's run directory. Returns what each did."""
    together, mkdir = threading.Barrier(2), Path.mkdir

    def held(self, *args, **kwargs):
        if self == out:
            together.wait(timeout=30)
        return mkdir(self, *args, **kwargs)

    def fake_train(config, overrides, shape, run_dir):
        run_dir.mkdir()  # `train --run-dir` refuses a directory that exists: the later of two fails here
        raise SystemExit("trained")

    monkeypatch.setattr(Path, "mkdir", held)
    monkeypatch.setattr(parallel, "_train", fake_train)
    said: list[str] = []

    def one() -> None:
        try:
            parallel.check_parallel(None, [], (1, 1, 2), (1, 1, 1), 1, out)
        except SystemExit as done:
            said.append(str(done))
        except (UserError, OSError) as err:
            said.append(f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return said


@pytest.mark.parametrize("exists", [False, True])
def test_two_checks_into_one_out_directory_never_both_train(tmp_path, monkeypatch, exists):
    out = tmp_path / "out"
    if exists:
        out.mkdir()  # an empty directory is a new one
    said = _two_checks(monkeypatch, out)
    assert sorted(s == "trained" for s in said) == [False, True], said
    refused = next(s for s in said if s != "trained")
    assert refused.startswith("UserError: --out") and "just claimed by another check-parallel" in refused, refused


# --- on two real ranks ------------------------------------------------------------------------------------------------

HOSTILE = """
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from steadytrain.train.setup.models import TinyLM


class Exploding(ParallelStyle):
    def _apply(self, module, mesh):
        raise KeyError("weight_scale")


class Hostile(TinyLM):
    def tp_plan(self, mesh):
        return {"blocks.0.attn.q": Exploding()}


class Plain(nn.Module):  # no tp_plan
    def __init__(self, **kw):
        super().__init__()
        self.lm = TinyLM(**kw)

    def forward(self, batch):
        return self.lm(batch)


def factory(kind, **kw):
    return (Hostile if kind == "hostile" else Plain)(**kw)
"""


@pytest.mark.distributed
def test_every_rank_refuses_a_layout_it_cannot_build_in_one_line(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "hostile_tp.py").write_text(HOSTILE)
    data = write_text_dataset(tmp_path / "data", [12] * 4)
    base = sets(
        "model.layers=1", "data.seq_len=32", "batch.micro_batch_size=2", "batch.global_batch_size=8",
        "batch.base_batch_size=8", "run.max_steps=2", f"data.path={data}",
    )  # fmt: skip
    user = ("model.name=hostile_tp:factory", "model.dim=32", "model.heads=2")
    cases = {
        "heads": (["model.dim=48", "model.heads=3", "distributed.mesh=tp=2"], ["model.heads=3", "mesh.tp=2"]),
        "style": (
            [*user, "model.kind=hostile", "distributed.mesh=tp=2"],
            ["tensor-parallel plan of Hostile does not apply: KeyError: 'weight_scale'"],
        ),
        "noplan": (
            [*user, "model.kind=plain", "distributed.mesh=shard=1,tp=2"],
            ["model Plain has no tensor-parallel plan", "distributed.mesh.tp=1"],
        ),
        "size": (["model.dim=32", "model.heads=2", "distributed.mesh=tp=4"], ["needs 1 x 1 x 4 = 4 ranks", "has 2"]),
    }
    commands = [["train", "--run-dir", tmp_path / name, *base, *sets(*items)] for name, (items, _) in cases.items()]
    done = cli_on_ranks(tmp_path, commands, world_size=2, PYTHONPATH=str(tmp_path / "pkg"))
    for (name, (_, words)), ranks in zip(cases.items(), done, strict=True):
        for proc in ranks:
            assert_user_error(proc, *words)
        assert not (tmp_path / name).exists(), name  # refused before the run directory
