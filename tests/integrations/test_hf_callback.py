"""``SteadytrainCallback`` on a Hugging Face ``Trainer``: a tiny GPT-2 built here (no download, no tokenizer).

The oracles are the Trainer's own: its ``state.log_history`` (loss, learning rate, pre-clip gradient norm), and a
probe callback that reads the gradients and parameters at the Trainer's own events and undoes its clip with
torch's clip rule (``min(1, max_norm / (norm + 1e-6))``); which steps hold a planted example comes from the ids a
Trainer subclass saw in its ``training_step``, never from the callback's records.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

from steadytrain.errors import UserError

N, SEQ, SHARD, STEPS, CLIP = 96, 16, 20, 12, 0.5
PLANTED = range(40, 48)  # in shard 2 (ids 40-59); their token 63 has a NaN embedding
LAYERS = {"transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f"}


@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip("transformers")


class Tokens(torch.utils.data.Dataset):
    """Random token ids (0-62) with their ``example_id``; ``planted`` examples hold token 63."""

    def __init__(self, n: int = N, planted: range | tuple = ()) -> None:
        self.x = torch.randint(0, 63, (n, SEQ), generator=torch.Generator().manual_seed(0))
        self.x[list(planted), 5] = 63

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i], "example_id": i}


def _layer(name: str) -> str:
    """GPT-2's layers: each block of ``transformer.h``, each other module holding parameters."""
    parts = name.split(".")
    return ".".join(parts[:3]) if name.startswith("transformer.h.") else ".".join(parts[:-1])


def _norms(named: dict[str, torch.Tensor]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, t in named.items():
        out[_layer(name)] = out.get(_layer(name), 0.0) + float(t.detach().double().norm()) ** 2
    return {k: math.sqrt(v) for k, v in out.items()}


def _train(hf, run: Path, *, planted=(), tie=True, eval_data=None, resume=None, every=4, **args):
    """Train 12 steps (batch 4, accumulation 2) with the callback and a probe; returns the trainer."""
    from steadytrain.integrations.hf import SteadytrainCallback, SteadytrainLossMixin

    class Probe(hf.TrainerCallback):
        """The gradients the optimizer gets and the parameters before and after its step, per layer."""

        def __init__(self) -> None:
            self.grads, self.before, self.after, self.update = {}, {}, {}, {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            step = state.global_step + 1
            self.grads[step] = _norms({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
            self.before = {n: p.detach().clone() for n, p in model.named_parameters()}

        def on_optimizer_step(self, args, state, control, model=None, **kw):
            step = state.global_step + 1
            self.after[step] = _norms(dict(model.named_parameters()))
            self.update[step] = _norms({n: p.detach() - self.before[n] for n, p in model.named_parameters()})

    class Recording(SteadytrainLossMixin, hf.Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            ids = inputs.get("example_id", torch.tensor([]))
            self.seen.setdefault(self.state.global_step + 1, []).extend(ids.tolist())
            return super().training_step(model, inputs, num_items_in_batch)

    torch.manual_seed(0)
    config = hf.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, tie_word_embeddings=tie,
                           bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = hf.GPT2LMHeadModel(config)
    if planted:
        with torch.no_grad():
            model.transformer.wte.weight[63] = float("nan")
    settings = {"max_steps": STEPS, "logging_steps": 1, "max_grad_norm": CLIP, "remove_unused_columns": False,
                "save_strategy": "no", **args}  # fmt: skip
    targs = hf.TrainingArguments(
        output_dir=str(run.parent / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        report_to=[], use_cpu=True, disable_tqdm=True, **settings
    )  # fmt: skip
    probe = Probe()
    callback = SteadytrainCallback(run, shard_size=SHARD, layers_every=every, config={"note": "tiny"})
    trainer = Recording(model=model, args=targs, train_dataset=Tokens(planted=planted), eval_dataset=eval_data,
                        callbacks=[probe, callback])  # fmt: skip
    trainer.seen, trainer.probe = {}, probe
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _rows(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def _logged(trainer) -> dict[int, dict]:
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


@pytest.fixture(scope="module")
def clean(hf, tmp_path_factory):
    run = tmp_path_factory.mktemp("hf") / "run"
    return run, _train(hf, run)


@pytest.fixture(scope="module")
def planted(hf, tmp_path_factory):
    run = tmp_path_factory.mktemp("hf") / "planted"
    return run, _train(hf, run, planted=PLANTED, tie=False)


def test_a_row_per_optimizer_step_with_the_trainers_numbers(clean):
    run, trainer = clean
    rows, logged = _rows(run), _logged(trainer)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) == sorted(logged)
    for r in rows:
        want = logged[r["step"]]
        assert r["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert r["lr"] == pytest.approx(want["learning_rate"], rel=1e-9)
        assert r["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
        assert r["clipped"] == (want["grad_norm"] > CLIP) and not r["skipped"]
        assert r["items"] == 4 * 2 and r["epoch"] == pytest.approx(want["epoch"])


def test_layer_norms_equal_a_hand_computation(clean):
    run, trainer = clean
    probe, logged = trainer.probe, _logged(trainer)
    rows = _rows(run, "layers.jsonl")
    assert sorted({r["step"] for r in rows}) == [4, 8, 12]  # layers_every=4, every step logged
    for step in (4, 8, 12):
        got = {r["layer"]: r for r in rows if r["step"] == step}
        assert set(got) == LAYERS
        norm = logged[step]["grad_norm"]
        coef = min(1.0, CLIP / (norm + 1e-6))  # torch's clip rule: the probe saw the clipped gradients
        assert coef < 1.0  # the Trainer did clip: the rows are the gradients before it
        for layer in LAYERS:
            assert got[layer]["grad_norm"] == pytest.approx(probe.grads[step][layer] / coef, rel=1e-4)
            assert got[layer]["param_norm"] == pytest.approx(probe.after[step][layer], rel=1e-5)
            assert got[layer]["update_norm"] == pytest.approx(probe.update[step][layer], rel=1e-3, abs=1e-9)
        assert math.hypot(*(r["grad_norm"] for r in got.values())) == pytest.approx(norm, rel=1e-4)


def test_records_and_report(clean, cli):
    run, trainer = clean
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["note"] == "tiny"
    args = config["training_arguments"]
    assert (args["gradient_accumulation_steps"], args["max_grad_norm"]) == (2, CLIP)
    assert args["optim"] == trainer.args.optim.value  # an enum there, its name here
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["micro_batch_size"], plan["accumulation_steps"], plan["global_batch_size"]) == (4, 2, 8)
    assert json.loads((run / "env.json").read_text())["image"]["python"]
    assert (run / "plots" / "loss.png").stat().st_size > 1000
    assert f"{STEPS}" in (run / "summary.md").read_text()
    res = cli("report", str(run))
    assert res.returncode == 0, res.stderr


def test_planted_examples_refuse_their_steps_and_nan_report_names_the_shard(planted, cli):
    run, trainer = planted
    expected = sorted(s for s, ids in trainer.seen.items() if set(ids) & set(PLANTED))
    assert expected
    rows, logged = _rows(run), _logged(trainer)
    assert [r["step"] for r in rows if r["skipped"]] == expected
    assert sorted({r["step"] for r in _rows(run, "nonfinite.jsonl")}) == expected
    for r in rows:
        if r["skipped"]:
            assert r["loss"] is None  # the Trainer's own log replaced the NaN by a running mean
        else:
            assert r["loss"] == pytest.approx(logged[r["step"]]["loss"], rel=1e-6)
    seen = torch.tensor([i for ids in trainer.seen.values() for i in ids])
    exposure = {str(k): v for k, v in enumerate(torch.bincount(seen // SHARD).tolist()) if v}
    assert json.loads((run / "exposure.json").read_text()) == exposure
    res = cli("nan", "report", str(run), "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert (rep["verdict"], rep["suspect_shards"]) == ("shard-selective", [PLANTED[0] // SHARD])


def test_a_refused_step_leaves_the_model_untouched(planted):
    """Without the skip, the NaN gradients of the first refused step would make every weight NaN."""
    _, trainer = planted
    for name, p in trainer.model.named_parameters():
        values = p.detach()[:63] if name == "transformer.wte.weight" else p.detach()  # row 63: the planted NaN
        assert torch.isfinite(values).all(), name


def test_rows_every_n_logged_steps_and_evaluations(hf, tmp_path):
    run = tmp_path / "every3"
    trainer = _train(hf, run, max_steps=6, logging_steps=3, eval_strategy="steps", eval_steps=3,
                     eval_data=Tokens(8))  # fmt: skip
    rows = _rows(run)
    train = [r for r in rows if "loss" in r]
    logged = _logged(trainer)
    assert [r["step"] for r in train] == [3, 6]
    for r in train:  # each row stands for 3 steps: the Trainer's mean loss over them, their items
        assert r["loss"] == pytest.approx(logged[r["step"]]["loss"], rel=1e-6) and r["items"] == 3 * 8
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    assert {r["step"]: r["val_loss"] for r in rows if "val_loss" in r} == pytest.approx(evals, rel=1e-6)
    assert not (run / "layers.jsonl").exists() or {r["step"] for r in _rows(run, "layers.jsonl")} <= {3, 6}
    # the time account: the Trainer's evaluations (its own eval_runtime, from its evaluate() call to its end) are
    # evaluation time, less the set-up before its first prediction step
    from steadytrain.runs.goodput import goodput

    account = goodput(run)
    runtime = sum(h["eval_runtime"] for h in trainer.state.log_history if "eval_runtime" in h)
    assert 0.5 * runtime <= account.badput["evaluation"] <= runtime + 0.5, (runtime, account.badput)
    assert account.productive_s > 0 and account.attempts[0]["how"] == "finished"


def test_a_trainer_resumed_from_its_checkpoint_goes_on_in_a_new_run(hf, tmp_path):
    _train(hf, tmp_path / "first", max_steps=6, save_strategy="steps", save_steps=6)
    trainer = _train(hf, tmp_path / "second", every=1, max_steps=STEPS, resume=str(tmp_path / "out" / "checkpoint-6"))
    rows, logged = _rows(tmp_path / "second"), _logged(trainer)
    assert [r["step"] for r in rows] == list(range(7, STEPS + 1))  # the Trainer's numbers, from its checkpoint on
    assert [r["loss"] for r in rows] == pytest.approx([logged[s]["loss"] for s in range(7, STEPS + 1)], rel=1e-6)
    assert sorted({r["step"] for r in _rows(tmp_path / "second", "layers.jsonl")}) == list(range(7, STEPS + 1))


def test_the_module_imports_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    monkeypatch.delitem(sys.modules, "steadytrain.integrations.hf", raising=False)
    module = importlib.import_module("steadytrain.integrations.hf")
    assert module.SteadytrainLossMixin
    with pytest.raises(UserError, match=r"pip install 'steadytrain\[hf\]'"):
        module.SteadytrainCallback  # noqa: B018


@pytest.mark.parametrize(("key", "value"), [("max_grad_norm", 1.0), ("accumulation_steps", 2), ("spike", "warn")])
def test_settings_the_trainer_owns_are_refused(hf, tmp_path, key, value):
    from steadytrain.integrations.hf import SteadytrainCallback

    with pytest.raises(UserError, match=key):
        SteadytrainCallback(tmp_path / "run", **{key: value})


def test_the_companion_needs_the_example_ids(hf, tmp_path):
    with pytest.raises(UserError, match="remove_unused_columns=False"):
        _train(hf, tmp_path / "run", max_steps=1, remove_unused_columns=True)
