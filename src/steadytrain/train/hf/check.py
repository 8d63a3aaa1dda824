"""What an ``hf:`` model is checked for before it trains: its sizes mean something, and it is causal.

* Sizes: a count or a width of the model section (``n_layer``, ``n_embd``, ``num_key_value_heads``...)
  below 1 builds a model without layers (``range(-1)`` is empty) or fails deep inside ``transformers``
  without naming the key. :func:`check_given` refuses such a setting by its name; :func:`check_loaded`
  refuses it in a saved directory's ``config.json``.
* Causality: steadytrain trains an ``hf:`` model on next-token targets, so position ``i`` must never see
  token ``i + 1`` (its own label). ``AutoModelForCausalLM`` also maps encoders (``bert``, ``roberta``,
  ``xlm``...) to a language-model head whose attention is bidirectional unless a setting
  (``is_decoder``, ``causal``) says otherwise; 200 model types cannot be vetted by name, so
  :func:`check_causal` asks the built model itself: it changes the second half of a short sequence and
  refuses the model if the logits of the first half move.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from steadytrain._text import brief, error_text
from steadytrain.errors import UserError

__all__ = ["check_causal", "check_given", "check_loaded"]

SIZES = {
    "vocab_size": "the vocabulary size",
    "hidden_size": "the model width",
    "num_hidden_layers": "the number of layers",
    "num_attention_heads": "the number of attention heads",
    "num_key_value_heads": "the number of key/value heads",
    "intermediate_size": "the MLP width",
    "max_position_embeddings": "the number of positions",
    "head_dim": "the width of an attention head",
    "n_inner": "the MLP width",
}
"""``transformers``' standard names (each family spells some its own way: ``attribute_map``) of what counts
or measures the model: at least 1 where given (None, where a config allows it, means its default)."""
COUNTS = re.compile(r"^(n|num)_|_(size|dim|layers|heads|positions|experts)$")
"""Other settings named as counts or sizes: never negative (some, like ``n_shared_experts``, may be 0)."""
PROBE = 8
"""Tokens of the causality probe: the logits of the first half must not move when the second half changes."""
LEAK = 1e-5
"""The largest change of those logits, relative to their size, put down to rounding (a leak is ~1e-3)."""


def _standard(config_class: Any) -> dict[str, str]:
    """A family's own spelling -> the standard name (``n_layer`` -> ``num_hidden_layers`` for gpt2)."""
    return {own: std for std, own in getattr(config_class, "attribute_map", {}).items()}


def _size_error(where: str, key: str, value: Any, what: str, least: int = 1) -> UserError:
    return UserError(
        f"{where}{key}={brief(value)}: {what} must be a whole number >= {least}; set {where}{key} to {least} or more"
    )


def check_given(config_class: Any, kwargs: dict[str, Any]) -> None:
    """Refuse a size or count of the model section below 1 (a bool is not a number), naming ``model.<key>``."""
    standard = _standard(config_class)
    for key, value in kwargs.items():
        std = standard.get(key, key)
        if std in SIZES:
            if value is not None and (isinstance(value, bool) or (isinstance(value, int) and value < 1)):
                raise _size_error("model.", key, value, SIZES[std])
        elif COUNTS.search(key) and isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise _size_error("model.", key, value, "a count or size", least=0)


def check_loaded(config: Any, path: Path, given: dict[str, Any]) -> None:
    """Refuse a size below 1 in a saved directory's ``config.json`` (``path``) that the model section leaves
    (a value the config computes rather than stores, like xlnet's -1 positions for "no limit", is not read)."""
    own = {std: own for own, std in _standard(type(config)).items()}
    stored = config.to_dict()
    for std, what in SIZES.items():
        key = own.get(std, std)
        value = stored.get(key)
        if key not in given and std not in given and isinstance(value, int) and value < 1:
            raise UserError(f"{path}: {key}={value}: {what} must be at least 1; set model.{key} (or fix the file)")


def _probe(model: nn.Module, vocab: int) -> tuple[float, float]:
    """The largest change of the first half's logits when the second half of the tokens changes, and their size."""
    gen = torch.Generator().manual_seed(0)
    half = PROBE // 2
    a = torch.randint(0, vocab, (1, PROBE), generator=gen)
    b = a.clone()
    b[0, half:] = (a[0, half:] + 1) % vocab
    device = next(model.parameters()).device
    training = model.training
    model.eval()  # no dropout: the two rows differ only by their tokens
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # the run's random stream is left as it was
            logits = model.logits(torch.cat([a, b]).to(device)).float()[:, :half]
    finally:
        model.train(training)
    return float((logits[0] - logits[1]).abs().max()), float(logits.abs().max())


def _knobs(config: Any, known: set[str]) -> str:
    """The settings that make this family causal, where its config has them (BERT-likes, XLM)."""
    found = [k for k in ("is_decoder", "causal") if k in known and getattr(config, k, None) is False]
    return "".join(f" (or set model.{k}=true to build it as a causal decoder)" for k in found[:1])


def check_causal(name: str, model: nn.Module, known: set[str]) -> None:
    """Refuse ``model`` (an :class:`~steadytrain.train.hf.model.HFCausalLM`) if a position's logits depend on the
    tokens after it; ``known`` are the settings its config class has (for the fix). Not on the meta device
    (nothing to compute: the real build checks)."""
    params = list(model.parameters())
    if not params or params[0].device.type == "meta":
        return
    embeddings = model.hf.get_input_embeddings()
    vocab = getattr(embeddings, "num_embeddings", None) or getattr(model.config, "vocab_size", None) or 2
    try:
        leak, size = _probe(model, int(vocab))
    except Exception as err:  # it would fail the same way at the first step: say so before the run directory
        raise UserError(f"model.name={name!r}: a forward pass of the built model failed: {error_text(err)}") from None
    if leak > LEAK * size:
        config = model.config
        raise UserError(
            f"model.name={name!r}: {config.model_type} ({type(model.hf).__name__}) is not a causal language model: "
            f"its logits at a position change with the tokens after it (by {leak:.2g}), so next-token training "
            "would show every position its own label; use a decoder-only model type such as hf:gpt2 or hf:llama"
            + _knobs(config, known)
        )
