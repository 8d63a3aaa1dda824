"""``model.name: hf:<model_type>`` or ``hf:<local directory>``: a Hugging Face ``transformers`` causal LM.

``hf:gpt2`` builds a fresh model from ``AutoConfig.for_model("gpt2", **the model section's other keys)``;
``hf:./my-model`` loads a model saved with ``save_pretrained`` from disk. Nothing is ever downloaded:
a name that is neither a model type ``transformers`` knows nor an existing directory (``gpt2-medium``,
``org/name`` on the Hub) is one error saying so. Every key given is checked against the model's config
class, so a misspelt setting (``n_layers`` for ``n_layer``) is refused instead of silently ignored.

:class:`HFCausalLM` keeps steadytrain's model contract: ``forward(batch)`` reads the ``tokens`` column
(windows of ``seq_len + 1`` tokens), feeds the first ``seq_len`` as ``input_ids`` and scores each
position against the next token, as ``transformers`` shifts ``labels`` inside its own loss, and returns
one mean loss per sequence, so clipping, accumulation, non-finite attribution and evaluation work
unchanged. The model's decoder layers are an ``nn.ModuleList``: FSDP2 shards each of them.
``transformers`` is imported only for ``hf:`` names (the ``hf`` extra).

Only a causal model trains: one whose position ``i`` never sees token ``i + 1`` (its label), checked on the
built model (:mod:`~steadytrain.train.hf.check`), as are the sizes (at least 1). ``transformers``' own
warnings while the model is built (a misconfigured model, weights missing from a directory) are said
through steadytrain's log, or inside the error when the model is refused; never silenced. A fresh model's
``eos_token_id`` and ``bos_token_id`` are the data's end-of-document id (ingest's provenance), as GPT-2's
are its ``<|endoftext|>``: a document starts after one; ``pad_token_id`` is left alone (many families make it
an embedding's ``padding_idx``, which never learns).
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from steadytrain._text import error_text, one_line
from steadytrain.errors import UserError
from steadytrain.train.hf.check import check_causal, check_given, check_loaded
from steadytrain.train.hf.tokenizer import RUN_FILE as TOKENIZER_FILE
from steadytrain.train.hf.tokenizer import run_tokenizer

__all__ = [
    "CONFIG_FILE",
    "PREFIX",
    "TOKENIZER_FILE",
    "HFCausalLM",
    "build_hf",
    "hf_config_json",
    "hf_run_files",
    "is_hf",
]

PREFIX = "hf:"
BYTES = 256
"""The vocabulary of data without a tokenizer in its provenance (bytes), as tiny-lm assumes too."""
CONFIG_FILE = "hf_config.json"
"""The HF model's ``config.json``, kept in the run directory (``export --format hf`` writes it out)."""
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

log = logging.getLogger(__name__)


def is_hf(name: str) -> bool:
    return name.startswith(PREFIX)


def _transformers(name: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise UserError(f"model.name={name!r} needs Hugging Face transformers: pip install 'steadytrain[hf]'") from None
    return transformers


@contextmanager
def _heard(tf: Any) -> Iterator[list[str]]:
    """``transformers``' warnings (at its own verbosity: ``TRANSFORMERS_VERBOSITY`` holds) while a model is built,
    each as one line, caught from its logger instead of printed by it, for the caller to say; its progress
    bars (loading weights: noise) are off meanwhile."""
    heard: list[str] = []

    class Ear(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines = [ln.strip() for ln in _ANSI.sub("", record.getMessage()).splitlines()]
            heard.append(one_line(" | ".join(ln for ln in lines if ln)))

    tf.logging.get_logger()  # the library's logger, set up with its own handler, which is set aside here
    logger, bars = logging.getLogger("transformers"), tf.logging.is_progress_bar_enabled()
    handlers = logger.handlers[:]
    logger.handlers[:] = [Ear(logging.WARNING)]
    tf.logging.disable_progress_bar()
    try:
        yield heard
    finally:
        logger.handlers[:] = handlers
        if bars:
            tf.logging.enable_progress_bar()


def _tokens_error(name: str, columns: list[str]) -> UserError:
    have = ", ".join(c for c in columns if c not in ("shard", "index"))
    return UserError(
        f"model {name} reads a 'tokens' column (a dataset from 'steadytrain data ingest --kind text'); "
        f"this data has: {have}"
    )


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM behind steadytrain's contract: per-sequence next-token losses."""

    def __init__(self, model: nn.Module, seq_len: int) -> None:
        super().__init__()
        self.hf = model
        self.seq_len = seq_len

    def flops_per_example(self) -> float:
        """Forward + backward FLOPs of one sequence: the usual estimate (PaLM, appendix B), ``T (6 N + 12 L d T)``
        for ``T`` tokens, ``N`` weights of matrix products (embedding lookups, biases and norms left out, a tied
        output projection counted), ``L`` layers of width ``d`` (attention over all ``T`` positions, as a dense
        kernel computes it). ``transformers``' causal-mask code reads a tensor's value on the host, so the
        meta-device count other models get cannot run it."""
        seen, n = set(), 0
        for p in self.hf.parameters():
            if id(p) not in seen and p.dim() >= 2:
                seen.add(id(p))
                n += p.numel()
        lookups = {id(m.weight): m.weight.numel() for m in self.hf.modules() if isinstance(m, nn.Embedding)}
        n -= sum(lookups.values())
        out = self.hf.get_output_embeddings()
        if out is not None and id(out.weight) in lookups:
            n += out.weight.numel()  # tied: the lookup's table is also the output matmul
        c, t = self.config, self.seq_len
        return float(t * (6 * n + 12 * c.num_hidden_layers * c.hidden_size * t))

    @property
    def config(self) -> Any:
        return self.hf.config

    def logits(self, input_ids: Tensor) -> Tensor:
        return self.hf(input_ids=input_ids, use_cache=False).logits

    def forward(self, batch: dict[str, Any]) -> Tensor:
        if "tokens" not in batch:
            raise _tokens_error(f"{PREFIX}{self.config.model_type}", list(batch))
        tokens = batch["tokens"].long()
        logits = self.logits(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().transpose(1, 2), tokens[:, 1:], reduction="none")  # [B, T]
        return loss.mean(dim=1)


def _settings(config_class: Any) -> set[str]:
    """The keys ``config_class`` knows: its defaults' attributes and their aliases (``attribute_map``)."""
    known = set(config_class().to_dict())
    return known | set(getattr(config_class, "attribute_map", {}))


def _check_keys(name: str, config_class: Any, kwargs: dict[str, Any]) -> set[str]:
    """Refuse a key ``config_class`` does not know, or a size below 1; the keys it knows."""
    known = _settings(config_class)
    for key in kwargs:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean model.{near[0]}?)" if near else ""
            raise UserError(
                f"model.{key} is not a setting of {name}'s config ({config_class.__name__}){hint}: "
                "remove it or check its spelling"
            )
    check_given(config_class, kwargs)
    return known


def _special_ids(defaults: Any, kwargs: dict[str, Any], vocab: int, eod: int | None) -> dict[str, Any]:
    """A fresh model's special ids the model section leaves: ``bos`` and ``eos`` the data's end of document
    where it names one; else none for a default outside the vocabulary (gpt2's 50256 among 257 symbols)."""
    out: dict[str, Any] = {}
    for key in SPECIAL_IDS:
        value = getattr(defaults, key, None)
        if key in kwargs or not hasattr(defaults, key):
            continue
        if eod is not None and key != "pad_token_id":
            out[key] = eod
        elif isinstance(value, int) and value >= vocab:
            out[key] = None
    return out


def _saved_config(tf: Any, name: str, where: Path, kwargs: dict[str, Any], eod: int | None) -> tuple[Any, set[str]]:
    """The config of the directory ``where``, the model section over it; its ``eos_token_id`` the data's end
    of document (where the data names one and the model section does not)."""
    if not (where / "config.json").is_file():
        raise UserError(f"model.name={name!r}: {where} has no config.json (save the model with save_pretrained)")
    try:
        config = tf.AutoConfig.from_pretrained(str(where), local_files_only=True)
    except Exception as err:
        raise UserError(f"model.name={name!r}: cannot read {where / 'config.json'}: {error_text(err)}") from None
    known = _check_keys(name, type(config), kwargs)
    for key, value in kwargs.items():
        setattr(config, key, value)
    check_loaded(config, where / "config.json", kwargs)
    eos = getattr(config, "eos_token_id", None)
    if eod is not None and "eos_token_id" not in kwargs and eos != eod and not (isinstance(eos, list) and eod in eos):
        log.info("model %s: eos_token_id %s -> %d, the data's end-of-document id", name, eos, eod)
        config.eos_token_id = eod
    return config, known


def _config(
    tf: Any, name: str, target: str, where: Path | None, kwargs: dict[str, Any], context: dict[str, Any]
) -> tuple[Any, set[str]]:
    """The model's config, from a local directory's ``config.json`` (``where``) or fresh for a model type,
    and the settings its class knows."""
    if where is not None:
        return _saved_config(tf, name, where, kwargs, context.get("eod"))
    types = tf.CONFIG_MAPPING
    if target not in types:
        near = difflib.get_close_matches(target, list(types.keys()), n=1)
        hint = f" (did you mean hf:{near[0]}?)" if near else ""
        raise UserError(
            f"model.name={name!r}: {target!r} is not a model type transformers knows{hint} nor an existing directory; "
            "steadytrain never downloads: save the model with save_pretrained and give hf:<its directory>"
        )
    known = _check_keys(name, types[target], kwargs)
    settings = {"vocab_size": context.get("vocab_size", BYTES), **kwargs}
    vocab = settings["vocab_size"] if isinstance(settings["vocab_size"], int) else BYTES
    settings.update(_special_ids(types[target](), kwargs, vocab, context.get("eod")))
    return tf.AutoConfig.for_model(target, **settings), known


def _check_fits(name: str, config: Any, context: dict[str, Any]) -> None:
    """A model smaller than its data fails inside the first forward (an index error): refuse it here."""
    vocab, seq_len = context.get("vocab_size", BYTES), context.get("seq_len")
    if getattr(config, "vocab_size", None) is not None and config.vocab_size < vocab:
        raise UserError(
            f"model {name}: vocab_size={config.vocab_size} is smaller than the data's vocabulary ({vocab}): "
            f"set model.vocab_size to at least {vocab}"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and seq_len is not None and 0 < positions < seq_len:  # xlnet's -1: no limit
        key = getattr(type(config), "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")
        raise UserError(
            f"model {name}: {key}={positions} is shorter than the data's sequences ({seq_len} tokens): "
            f"set model.{key} to at least {seq_len}"
        )


def _build(tf: Any, name: str, where: Path | None, kwargs: dict[str, Any], context: dict[str, Any]) -> HFCausalLM:
    try:
        config, known = _config(tf, name, name[len(PREFIX) :], where, kwargs, context)
    except UserError:
        raise
    except Exception as err:  # a setting of the wrong type (transformers' configs check them)
        raise UserError(f"model.name={name!r}: transformers refused the model section: {error_text(err)}") from None
    _check_fits(name, config, context)
    try:
        if where is None or torch.empty(0).device.type == "meta":  # fresh weights (on meta: only the shapes)
            model = tf.AutoModelForCausalLM.from_config(config)
        else:
            model = tf.AutoModelForCausalLM.from_pretrained(str(where), config=config, local_files_only=True)
    except UserError:
        raise
    except Exception as err:  # not a causal LM (hf:t5), a config the model refuses, unreadable weights
        raise UserError(f"model.name={name!r}: transformers refused it: {error_text(err)}") from None
    wrapped = HFCausalLM(model.float(), int(context.get("seq_len", 128)))
    check_causal(name, wrapped, known)  # hf:bert: a language-model head over bidirectional attention
    return wrapped


def build_hf(name: str, kwargs: dict[str, Any], context: dict[str, Any]) -> HFCausalLM:
    """The model ``hf:<model_type>`` (fresh, from a config) or ``hf:<directory>`` (saved weights) names;
    ``transformers``' warnings meanwhile are logged, or are part of the error when the model is refused."""
    if "columns" in context and "tokens" not in context["columns"]:
        raise _tokens_error(name, context["columns"])
    tf = _transformers(name)
    if not name[len(PREFIX) :]:
        raise UserError("model.name='hf:' names no model: give hf:<model_type> (e.g. hf:gpt2) or hf:<directory>")
    where = Path(name[len(PREFIX) :]).expanduser()
    with _heard(tf) as heard:
        try:
            model = _build(tf, name, where if where.is_dir() else None, kwargs, context)
        except UserError as err:
            said = "; transformers warned: " + " | ".join(h[:300] for h in heard) if heard else ""
            raise UserError(f"{err}{said}") from None
    for text in heard:
        log.warning("transformers: %s", text)
    return model


def hf_config_json(model: nn.Module) -> str | None:
    """The ``config.json`` of an HF model (``from_pretrained`` reads it); None for any other model."""
    if not isinstance(model, HFCausalLM):
        return None
    config = model.config.to_dict()
    config["architectures"] = [type(model.hf).__name__]
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def hf_run_files(model: nn.Module, data: Path | None) -> dict[str, str]:
    """What a run of an HF model keeps for ``export --format hf``: its ``config.json`` and the tokenizer its
    data was ingested with (where the data names one); nothing for any other model."""
    config = hf_config_json(model)
    if config is None:
        return {}
    tokenizer = run_tokenizer(data)
    return {CONFIG_FILE: config, **({TOKENIZER_FILE: tokenizer} if tokenizer is not None else {})}
