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
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from steadytrain._text import error_text
from steadytrain.errors import UserError

__all__ = ["CONFIG_FILE", "PREFIX", "HFCausalLM", "build_hf", "hf_config_json", "is_hf"]

PREFIX = "hf:"
BYTES = 256
"""The vocabulary of data without a tokenizer in its provenance (bytes), as tiny-lm assumes too."""
CONFIG_FILE = "hf_config.json"
"""The HF model's ``config.json``, kept in the run directory (``export --format hf`` writes it out)."""


def is_hf(name: str) -> bool:
    return name.startswith(PREFIX)


def _transformers(name: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise UserError(f"model.name={name!r} needs Hugging Face transformers: pip install 'steadytrain[hf]'") from None
    transformers.logging.set_verbosity_error()  # its notes about unused weights etc. are not the user's errors
    return transformers


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


def _check_keys(name: str, config_class: Any, kwargs: dict[str, Any]) -> None:
    known = _settings(config_class)
    for key in kwargs:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean model.{near[0]}?)" if near else ""
            raise UserError(
                f"model.{key} is not a setting of {name}'s config ({config_class.__name__}){hint}: "
                "remove it or check its spelling"
            )


def _config(
    tf: Any, name: str, target: str, where: Path | None, kwargs: dict[str, Any], context: dict[str, Any]
) -> Any:
    """The model's config: from a local directory's ``config.json`` (``where``), or a fresh one for a model type."""
    if where is not None:
        if not (where / "config.json").is_file():
            raise UserError(f"model.name={name!r}: {where} has no config.json (save the model with save_pretrained)")
        try:
            config = tf.AutoConfig.from_pretrained(str(where), local_files_only=True)
        except Exception as err:
            raise UserError(f"model.name={name!r}: cannot read {where / 'config.json'}: {error_text(err)}") from None
        _check_keys(name, type(config), kwargs)
        for key, value in kwargs.items():
            setattr(config, key, value)
        return config
    types = tf.CONFIG_MAPPING
    if target not in types:
        near = difflib.get_close_matches(target, list(types.keys()), n=1)
        hint = f" (did you mean hf:{near[0]}?)" if near else ""
        raise UserError(
            f"model.name={name!r}: {target!r} is not a model type transformers knows{hint} nor an existing directory; "
            "steadytrain never downloads: save the model with save_pretrained and give hf:<its directory>"
        )
    _check_keys(name, types[target], kwargs)
    settings = {"vocab_size": context.get("vocab_size", BYTES), **kwargs}
    config = tf.AutoConfig.for_model(target, **settings)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # gpt2's 50256 is outside a smaller vocabulary
        value = getattr(config, key, None)
        if key not in kwargs and isinstance(value, int) and value >= config.vocab_size:
            setattr(config, key, None)
    return config


def _check_fits(name: str, config: Any, context: dict[str, Any]) -> None:
    """A model smaller than its data fails inside the first forward (an index error): refuse it here."""
    vocab, seq_len = context.get("vocab_size", BYTES), context.get("seq_len")
    if getattr(config, "vocab_size", None) is not None and config.vocab_size < vocab:
        raise UserError(
            f"model {name}: vocab_size={config.vocab_size} is smaller than the data's vocabulary ({vocab}): "
            f"set model.vocab_size to at least {vocab}"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and seq_len is not None and positions < seq_len:
        key = getattr(type(config), "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")
        raise UserError(
            f"model {name}: {key}={positions} is shorter than the data's sequences ({seq_len} tokens): "
            f"set model.{key} to at least {seq_len}"
        )


def build_hf(name: str, kwargs: dict[str, Any], context: dict[str, Any]) -> HFCausalLM:
    """The model ``hf:<model_type>`` (fresh, from a config) or ``hf:<directory>`` (saved weights) names."""
    if "columns" in context and "tokens" not in context["columns"]:
        raise _tokens_error(name, context["columns"])
    tf = _transformers(name)
    target = name[len(PREFIX) :]
    if not target:
        raise UserError("model.name='hf:' names no model: give hf:<model_type> (e.g. hf:gpt2) or hf:<directory>")
    where = Path(target).expanduser()
    where = where if where.is_dir() else None
    try:
        config = _config(tf, name, target, where, kwargs, context)
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
    except Exception as err:  # not a causal LM (hf:bert), a config the model refuses, unreadable weights
        raise UserError(f"model.name={name!r}: transformers refused it: {error_text(err)}") from None
    return HFCausalLM(model.float(), int(context.get("seq_len", 128)))


def hf_config_json(model: nn.Module) -> str | None:
    """The ``config.json`` of an HF model (``from_pretrained`` reads it); None for any other model."""
    if not isinstance(model, HFCausalLM):
        return None
    config = model.config.to_dict()
    config["architectures"] = [type(model.hf).__name__]
    return json.dumps(config, indent=2, sort_keys=True) + "\n"
