"""``model.name: hf:...``: a ``transformers`` causal LM trained, distributed and exported by steadytrain.

Oracles: ``transformers``' own loss (``labels=input_ids``, shifted inside the model), the same job on one
rank (2-rank DDP and FSDP2), ``from_pretrained`` of the exported directory against the run's own
checkpoint loaded into a fresh model (logits), ``torch.utils.flop_counter`` on a real pass (FLOPs), and the
saved model's own weights (``hf:<directory>``), causality by changing token ``i + 1`` and watching position
``i`` (and transformers' own model of each refused encoder failing it), ``AutoTokenizer`` on the export
against the ingested dataset's own ids. Nothing downloads: models are built from configs or saved to a
temporary directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.flop_counter import FlopCounterMode

from steadytrain.errors import UserError
from steadytrain.train.hf.model import HFCausalLM, build_hf
from tests.cli_utils import assert_user_error
from tests.dist_utils import cli_on_ranks
from tests.train.test_train import assert_same_losses
from tests.train_utils import metrics, run_cli, sets, write_text_dataset

transformers = pytest.importorskip("transformers")  # the hf extra; installed with the dev extra (CI)

GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, "resid_pdrop": 0, "embd_pdrop": 0, "attn_pdrop": 0}
HF = [
    "model.name=hf:gpt2",
    *(f"model.{k}={v}" for k, v in GPT2.items()),
    "data.seq_len=32",
    "batch.micro_batch_size=4",
    "batch.global_batch_size=16",
    "batch.base_batch_size=16",
    "batch.base_lr=0.01",
    "run.log_every=2",
]
OFFLINE = {"HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("text"), [90, 130, 70, 110, 120, 80])


def train(run_dir: Path, data: Path, *extra: str, steps: int = 6) -> None:
    args = sets(*HF, f"data.path={data}", f"run.max_steps={steps}", *extra)
    proc = run_cli("train", "--run-dir", str(run_dir), *args, **OFFLINE)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_data) -> Path:
    run_dir = tmp_path_factory.mktemp("hf") / "run"
    train(run_dir, text_data, steps=24)
    return run_dir


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, text_data) -> Path:
    run_dir = tmp_path_factory.mktemp("one") / "run"
    train(run_dir, text_data, steps=6)
    return run_dir


def tokens(n: int = 4, t: int = 33, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def test_per_sequence_losses_average_to_transformers_own_loss():
    torch.manual_seed(0)
    model = build_hf("hf:gpt2", dict(GPT2), {"seq_len": 32})
    batch = tokens()
    ours = model({"tokens": batch})
    assert ours.shape == (4,)
    theirs = model.hf(input_ids=batch, labels=batch).loss  # equal lengths: the mean of means is the token mean
    torch.testing.assert_close(ours.mean(), theirs, rtol=1e-5, atol=1e-6)


def test_gpt2_trains_with_falling_loss(trained):
    losses = [m["loss"] for m in metrics(trained)]
    assert len(losses) == 24
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4, losses
    config = json.loads((trained / "hf_config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_layer"] == 2 and config["vocab_size"] == 256
    assert config["eos_token_id"] is None  # gpt2's 50256 does not exist in a 256-symbol vocabulary


def test_export_loads_with_from_pretrained_and_gives_the_runs_logits(trained, tmp_path):
    assert_exports_agree(trained, tmp_path)
    nested = tmp_path / "exported" / "gpt2-tiny"  # the README's example: its parent is new too
    assert run_cli("export", str(trained), "--format", "hf", "--out", str(nested)).returncode == 0
    assert (nested / "config.json").is_file()
    out = tmp_path / "hf-model"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    again = run_cli("export", str(trained), "--format", "hf", "--out", str(out))  # an earlier export is replaced
    assert again.returncode == 0, again.stderr


def test_export_refuses_what_it_cannot_write(trained, tmp_path, text_data):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert_user_error(run_cli("export", str(trained), "--format", "hf", "--out", str(busy)), "notes.txt")
    assert (busy / "notes.txt").read_text() == "mine" and len(list(busy.iterdir())) == 1
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert_user_error(run_cli("export", str(trained), "--format", "hf", "--out", str(a_file)), "a file")
    below = a_file / "model"
    assert_user_error(run_cli("export", str(trained), "--format", "hf", "--out", str(below)), "a file")
    plain = tmp_path / "plain"
    args = sets("model.dim=32", "model.layers=1", "model.heads=2", "data.seq_len=32", "run.max_steps=2")
    assert run_cli("train", "--run-dir", str(plain), *args, f"--set=data.path={text_data}").returncode == 0
    assert_user_error(
        run_cli("export", str(plain), "--format", "hf", "--out", str(tmp_path / "x")), "not a run of an hf: model"
    )


STRATEGIES = ("ddp", "fsdp")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, text_data) -> dict[str, tuple[Path, list]]:
    """Per strategy, the 6-step run on 2 ranks and each rank's exit: one spawn of 2 ranks runs both (each rank
    runs ``main(argv)`` as under torchrun)."""
    root = tmp_path_factory.mktemp("ranks")
    runs = {s: root / s for s in STRATEGIES}
    items = [*HF, f"data.path={text_data}", "run.max_steps=6"]
    commands = [["train", "--run-dir", run, *sets(*items, f"distributed.strategy={s}")] for s, run in runs.items()]
    results = cli_on_ranks(root, commands, **OFFLINE)
    return {s: (runs[s], procs) for s, procs in zip(runs, results, strict=True)}


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_equal_one_rank(tmp_path, two_ranks, one_rank, strategy):
    run_dir, procs = two_ranks[strategy]
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    out = "".join(proc.stdout + proc.stderr for proc in procs)  # what both ranks said
    assert "micro 4 x accumulation 2 x world 2" in out
    assert_same_losses(run_dir, one_rank, rtol=1e-4)
    assert_exports_agree(run_dir, tmp_path)  # a sharded checkpoint (fsdp) is gathered into one model


def assert_exports_agree(run_dir: Path, tmp_path: Path) -> None:
    """``export --format hf`` loads with ``from_pretrained`` and gives the logits of the run's checkpoint (its
    plain export) loaded into a freshly built model."""
    out, flat = tmp_path / "hf-model", tmp_path / "model.safetensors"
    proc = run_cli("export", str(run_dir), "--format", "hf", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert run_cli("export", str(run_dir), "--out", str(flat)).returncode == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    ours = build_hf("hf:gpt2", dict(GPT2), {"seq_len": 32})
    ours.load_state_dict(load_file(str(flat)), strict=True)
    ours.eval()
    batch = tokens(seed=3)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=batch).logits, ours.logits(batch), rtol=0, atol=0)
        fresh = build_hf("hf:gpt2", dict(GPT2), {"seq_len": 32}).eval()
        assert not torch.allclose(fresh.logits(batch), ours.logits(batch))  # the export is the trained model


def test_fsdp_shards_each_decoder_layer(tmp_path):
    model = build_hf("hf:gpt2", dict(GPT2), {"seq_len": 32})
    blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    assert [len(b) for b in blocks] == [2]  # the decoder layers: what wrap_model shards one by one
    assert blocks[0] is model.hf.transformer.h


def test_flops_per_example_equals_a_counted_pass():
    model = build_hf("hf:gpt2", dict(GPT2), {"seq_len": 32})
    model.hf.set_attn_implementation("eager")  # attention as matrix products, which the counter sees on a CPU
    with FlopCounterMode(display=False) as counter:
        model({"tokens": tokens()}).sum().backward()
    counted = counter.get_total_flops() / 4
    assert model.flops_per_example() == pytest.approx(counted, rel=1e-3)


def test_a_saved_directory_loads_its_weights(tmp_path):
    config = transformers.AutoConfig.for_model("gpt2", vocab_size=256, **GPT2)
    saved = transformers.AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(str(tmp_path / "m"))
    model = build_hf(f"hf:{tmp_path / 'm'}", {}, {"seq_len": 32})
    assert isinstance(model, HFCausalLM)
    for key, value in saved.state_dict().items():
        torch.testing.assert_close(model.hf.state_dict()[key], value, rtol=0, atol=0)


def test_a_saved_directory_trains(tmp_path, text_data):
    config = transformers.AutoConfig.for_model("gpt2", vocab_size=256, **GPT2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "m"))
    run_dir = tmp_path / "run"
    args = sets(f"model.name=hf:{tmp_path / 'm'}", "data.seq_len=32", f"data.path={text_data}", "run.max_steps=2")
    proc = run_cli("train", "--run-dir", str(run_dir), *args, **OFFLINE)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(metrics(run_dir)) == 2


@pytest.mark.parametrize(
    ("name", "kwargs", "context", "words"),
    [
        ("hf:gpt3", {}, {}, ["'gpt3' is not a model type", "never downloads", "did you mean hf:"]),
        ("hf:openai-community/gpt2", {}, {}, ["not a model type", "never downloads"]),
        ("hf:", {}, {}, ["names no model"]),
        ("hf:gpt2", {"n_layers": 2}, {}, ["model.n_layers is not a setting", "model.n_layer"]),
        ("hf:gpt2", {"n_layer": 1, "vocab_size": 100}, {"vocab_size": 300}, ["vocab_size=100", "300"]),
        ("hf:gpt2", {"n_layer": 1, "n_positions": 16}, {"seq_len": 32}, ["n_positions=16", "at least 32"]),
        ("hf:t5", {}, {}, ["transformers refused it"]),
        ("hf:gpt2", {"vocab_size": "abc"}, {}, ["refused the model section", "vocab_size"]),
    ],
)
def test_bad_names_and_settings_are_one_clear_error(name, kwargs, context, words):
    with pytest.raises(UserError) as err:
        build_hf(name, kwargs, context)
    text = str(err.value)
    assert "\n" not in text
    for word in words:
        assert word in text, (word, text)


def test_a_directory_without_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"has no config\.json"):
        build_hf(f"hf:{tmp_path / 'empty'}", {}, {})


def test_cli_errors_are_one_line(tmp_path, text_data):
    base = ["train", "--run-dir", str(tmp_path / "r"), *sets(f"data.path={text_data}", "data.seq_len=32")]
    assert_user_error(run_cli(*base, "--set", "model.name=hf:gpt-9", **OFFLINE), "never downloads")
    assert_user_error(run_cli(*base, *sets("model.name=hf:gpt2", "model.n_embdd=8"), **OFFLINE), "model.n_embd")
    assert not (tmp_path / "r").exists()


def test_records_data_is_refused_naming_the_column(tmp_path):
    import pyarrow as pa

    from steadytrain.data import DatasetWriter

    with DatasetWriter(tmp_path / "rec") as w:
        w.write_shard(pa.table({"x": [1.0] * 64, "label": [0] * 64}))
    args = sets("model.name=hf:gpt2", "model.n_layer=1", f"data.path={tmp_path / 'rec'}", "run.max_steps=1")
    proc = run_cli("train", "--run-dir", str(tmp_path / "r"), *args, **OFFLINE)
    assert_user_error(proc, "'tokens' column", "x, label")
    assert not (tmp_path / "r").exists()


# --- only causal models train: position i never sees token i + 1 (its own label) ---------------------------

LAYERS = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
BERT = {**LAYERS, "max_position_embeddings": 64}
XLM = {"n_layers": 2, "emb_dim": 32, "n_heads": 2, "max_position_embeddings": 64}
CAUSAL = [  # every family tested here that hf: builds
    ("gpt2", GPT2),
    ("llama", {**BERT, "num_key_value_heads": 1}),
    ("gpt_neox", BERT),  # its config says is_decoder=False, its attention is causal all the same
    ("bert", {**BERT, "is_decoder": True}),
    ("roberta", {**BERT, "is_decoder": True}),
    ("xlm", {**XLM, "causal": True}),
]
ENCODERS = [  # language-model heads over bidirectional attention: AutoModelForCausalLM builds them all
    ("bert", BERT, "model.is_decoder=true"),
    ("roberta", BERT, "model.is_decoder=true"),
    ("electra", BERT, "model.is_decoder=true"),
    ("xlm", XLM, "model.causal=true"),
    ("xlnet", {"n_layer": 2, "d_model": 32, "n_head": 2, "d_inner": 64}, "hf:gpt2"),
]


def assert_causal(model: HFCausalLM, t: int = 12) -> None:
    """Changing token ``i + 1`` leaves the logits of positions ``0..i`` as they were, for every ``i``, and
    changes those of position ``i + 1`` (so the check sees a change where there is one)."""
    model.eval()
    base = tokens(1, t, seed=5)
    with torch.no_grad():
        ref = model.logits(base)
        for i in range(t - 1):
            other = base.clone()
            other[0, i + 1] = (base[0, i + 1] + 7) % 256
            out = model.logits(other)
            torch.testing.assert_close(out[:, : i + 1], ref[:, : i + 1], rtol=0, atol=1e-6 * float(ref.abs().max()))
            assert not torch.allclose(out[:, i + 1], ref[:, i + 1])


@pytest.mark.parametrize(
    ("family", "kwargs"),
    CAUSAL,
    ids=["gpt2", "llama", "gpt_neox", "bert-is_decoder", "roberta-is_decoder", "xlm-causal"],
)
def test_every_family_that_builds_is_causal(family, kwargs):
    torch.manual_seed(0)
    assert_causal(build_hf(f"hf:{family}", dict(kwargs), {"seq_len": 32}))


@pytest.mark.parametrize(("family", "kwargs", "fix"), ENCODERS, ids=[e[0] for e in ENCODERS])
def test_an_encoder_is_refused_in_one_line(family, kwargs, fix):
    with pytest.raises(UserError) as err:
        build_hf(f"hf:{family}", dict(kwargs), {"seq_len": 32})
    text = str(err.value)
    assert "\n" not in text
    for word in (f"model.name='hf:{family}'", f"{family} (", "not a causal language model", "hf:gpt2", fix):
        assert word in text, (word, text)
    # the refusal is true: transformers' own model, built from the same settings, reads later tokens
    config = transformers.AutoConfig.for_model(family, vocab_size=256, **kwargs)
    with pytest.raises(AssertionError):
        assert_causal(HFCausalLM(transformers.AutoModelForCausalLM.from_config(config), 32))


def test_a_saved_encoder_is_refused_and_its_decoder_trains(tmp_path):
    config = transformers.AutoConfig.for_model("bert", vocab_size=256, **BERT)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "bert"))
    with pytest.raises(UserError, match=r"bert \(BertLMHeadModel\) is not a causal language model.*is_decoder=true"):
        build_hf(f"hf:{tmp_path / 'bert'}", {}, {"seq_len": 32})
    assert_causal(build_hf(f"hf:{tmp_path / 'bert'}", {"is_decoder": True}, {"seq_len": 32}))


def test_training_an_encoder_is_one_error_with_transformers_own_warning(cli, tmp_path, text_data, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = sets("model.name=hf:bert", *(f"model.{k}={v}" for k, v in BERT.items()), f"data.path={text_data}")
    r = cli("train", "--run-dir", str(tmp_path / "r"), *args, *sets("data.seq_len=32", "run.max_steps=1"))
    # transformers' own word on it (a warning, once hidden) is part of the one line
    assert_user_error(r, "model.name='hf:bert'", "not a causal language model", "hf:gpt2", "as a standalone")
    assert not (tmp_path / "r").exists()


# --- transformers' warnings are said, never silenced ----------------------------------------------------------


def test_transformers_warnings_about_the_model_are_shown(cli, tmp_path, text_data, monkeypatch):
    """A saved model missing a weight: transformers' load report (a warning) reaches the user."""
    import logging

    from safetensors.torch import save_file

    config = transformers.AutoConfig.for_model("gpt2", vocab_size=256, **GPT2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "m"))
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    del weights["transformer.h.1.mlp.c_fc.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    handlers = list(logging.getLogger("transformers").handlers)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = sets(f"model.name=hf:{tmp_path / 'm'}", "data.seq_len=32", f"data.path={text_data}", "run.max_steps=1")
    r = cli("train", "--run-dir", str(tmp_path / "run"), *args)
    assert r.returncode == 0, r.stderr[-2000:]
    said = [line for line in r.stderr.splitlines() if line.startswith("transformers:")]
    assert any("transformer.h.1.mlp.c_fc.weight" in line and "MISSING" in line for line in said), r.stderr[-2000:]
    assert logging.getLogger("transformers").handlers == handlers  # its own handler is back for what follows


# --- the model section's sizes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "key", "value"),
    [
        ("gpt2", "n_layer", -1),  # built a model without layers
        ("gpt2", "n_layer", 0),
        ("gpt2", "n_embd", 0),  # failed inside transformers without naming the key
        ("gpt2", "n_head", 0),
        ("gpt2", "n_inner", 0),
        ("gpt2", "n_positions", 0),
        ("gpt2", "vocab_size", 0),
        ("gpt2", "n_layer", True),
        ("llama", "num_key_value_heads", 0),
        ("llama", "intermediate_size", -4),
        ("llama", "head_dim", 0),
    ],
)
def test_a_size_below_one_is_refused_by_its_name(family, key, value):
    kwargs = dict(GPT2) if family == "gpt2" else {**BERT, "num_key_value_heads": 1}
    with pytest.raises(UserError) as err:
        build_hf(f"hf:{family}", {**kwargs, key: value}, {"seq_len": 32})
    text = str(err.value)
    assert "\n" not in text and f"model.{key}={value!r}" in text and f"set model.{key} to 1 or more" in text, text


def test_a_saved_config_with_no_layers_is_refused(tmp_path):
    config = transformers.AutoConfig.for_model("gpt2", vocab_size=256, **{**GPT2, "n_layer": 0})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "m"))
    with pytest.raises(UserError, match=r"config\.json: n_layer=0: the number of layers must be at least 1"):
        build_hf(f"hf:{tmp_path / 'm'}", {}, {"seq_len": 32})
    assert len(build_hf(f"hf:{tmp_path / 'm'}", {"n_layer": 1}, {"seq_len": 32}).hf.transformer.h) == 1


def test_a_bad_size_on_the_command_line_is_one_line(cli, tmp_path, text_data):
    args = sets(*HF, "model.n_layer=-1", f"data.path={text_data}", "run.max_steps=1")
    assert_user_error(cli("train", "--run-dir", str(tmp_path / "r"), *args), "model.n_layer=-1", "number of layers")
    assert not (tmp_path / "r").exists()


# --- the export carries the data's tokenizer and its end-of-document id -----------------------------------


def documents(folder: Path) -> list[str]:
    """Text files, one document each, written in the order ingest reads them (by name)."""
    from tests.data.test_ingest import sentences

    folder.mkdir()
    docs = ["Héllo, wörld!\n\ttabs, 東京 and <tags>\n", *("".join(sentences(25, i)) for i in range(3))]
    for i, doc in enumerate(docs):
        (folder / f"doc{i}.txt").write_text(doc, encoding="utf-8")
    return docs


def tokenizer_file(kind: str, path: Path) -> Path | None:
    """None for bytes; else a byte-level BPE (GPT-2 style: its decoder gives the text back) with
    ``<|endoftext|>`` (``bpe``), without (``bpe-no-eod``: ingest adds one past the vocabulary), or with a
    post-processor that puts ``<s>`` before every text, as Llama's does (``bos``: ingest adds none)."""
    from tokenizers import Tokenizer, decoders, processors

    from tests.data.test_ingest import train_bpe

    if kind == "bytes":
        return None
    tok = Tokenizer.from_file(
        str(train_bpe(path, vocab_size=300, byte_level=True, eod=None if kind == "bpe-no-eod" else "<|endoftext|>"))
    )
    tok.decoder = decoders.ByteLevel()
    if kind == "bos":
        tok.add_special_tokens(["<s>"])
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    tok.save(str(path))
    return path


@pytest.mark.parametrize("kind", ["bytes", "bpe", "bpe-no-eod", "bos"])
def test_export_writes_the_tokenizer_the_data_was_ingested_with(cli, tmp_path, kind, monkeypatch):
    """``AutoTokenizer`` on the export gives the ids ingest wrote (the dataset itself), its end of document
    between documents; decoding gives the text back; the model's eos is that id, and ``generate`` runs."""
    from tests.data.test_ingest import flat_tokens

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    docs = documents(tmp_path / "txt")
    tok_file = tokenizer_file(kind, tmp_path / "tokenizer.json")
    ingest = ["data", "ingest", str(tmp_path / "txt"), "--out", str(tmp_path / "ds"), "--seq-len", "32"]
    assert cli(*ingest, *(["--tokenizer", str(tok_file)] if tok_file else [])).returncode == 0
    if tok_file is not None:
        assert (tmp_path / "ds" / "tokenizer.json").read_bytes() == tok_file.read_bytes()  # kept by ingest
    stream, index = flat_tokens(tmp_path / "ds")
    eod = index["provenance"]["tokenizer"]["eod"]
    size = index["provenance"]["tokenizer"]["vocab_size"]
    args = sets(*HF, f"data.path={tmp_path / 'ds'}", "run.max_steps=1", "batch.global_batch_size=4")
    assert cli("train", "--run-dir", str(tmp_path / "run"), *args).returncode == 0
    r = cli("export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-2000:]

    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    ids = [tok(doc)["input_ids"] for doc in docs]
    assert [x for seq in ids for x in (*seq, tok.eos_token_id)] == stream.tolist()
    assert [tok.decode(seq) for seq in ids] == docs
    assert tok.eos_token_id == eod == (256 if kind == "bytes" else tok.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == eod and config["vocab_size"] == size
    assert model.generation_config.eos_token_id == eod
    prompt = tok("Héllo", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out[0, : prompt["input_ids"].shape[1]].tolist() == prompt["input_ids"][0].tolist()
    assert isinstance(tok.decode(out[0]), str)


def test_an_export_without_a_tokenizer_removes_an_earlier_ones(cli, tmp_path, trained, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # an earlier export's, of another run
    (out / "tokenizer_config.json").write_text("{}")
    assert cli("export", str(trained), "--format", "hf", "--out", str(out)).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # its data names no tokenizer


def test_data_ingested_before_the_tokenizer_was_kept_trains_with_a_warning(cli, tmp_path, caplog):
    from steadytrain.train.hf.tokenizer import run_tokenizer
    from tests.data.test_ingest import train_bpe

    documents(tmp_path / "txt")
    tok_file = train_bpe(tmp_path / "tokenizer.json", vocab_size=300, byte_level=True)
    ingest = ["data", "ingest", str(tmp_path / "txt"), "--out", str(tmp_path / "ds"), "--seq-len", "32"]
    assert cli(*ingest, "--tokenizer", str(tok_file)).returncode == 0
    assert run_tokenizer(tmp_path / "ds") is not None
    (tmp_path / "ds" / "tokenizer.json").unlink()
    assert run_tokenizer(tmp_path / "ds") is None
    assert "will write no tokenizer" in caplog.text and "ingest it again" in caplog.text
